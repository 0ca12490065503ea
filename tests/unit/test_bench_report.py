"""The I/O benchmark's report: medians and ratios per side, including reference sides."""

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_io

ROW = {"mode": bench_io.FILES_ROW, "op": "write", "bs": 1 << 20, "jobs": 1, "files": 10}


def _raw(side: str, *gib_s: float, cpu: float | None = None) -> list[dict]:
    out = []
    for rnd, v in enumerate(gib_s):
        r = dict(ROW, side=side, round=rnd, gib_s=v)
        if cpu is not None:
            r["daemon_cpu_s_per_gib"] = cpu
        out.append(r)
    return out


def test_a_reference_side_gets_its_ratio_and_no_cpu_column():
    raw = _raw("tmpfs", 2.0, 4.0, 3.0) + _raw("passthrough", 1.0, 1.5, 1.2, cpu=0.4) + _raw("hp", 0.6, 0.9, 0.75)
    rows = bench_io.summarize([ROW], raw, ("tmpfs", "passthrough", "hp"))
    (row,) = rows
    assert row["passthrough_ratio"] == pytest.approx(1.2 / 3.0)
    assert row["hp_ratio"] == pytest.approx(0.75 / 3.0)
    assert row["hp_cpu_s_per_gib"] is None
    assert row["meets_target"] is False  # judged on passthrough alone
    head = bench_io.render_table(rows).splitlines()[0]
    assert "hp ratio" in head and "passthrough CPU s/GiB" in head and "hp CPU" not in head


def test_the_daemon_path_is_judged_against_tmpfs_and_every_reference():
    io_row = {"mode": "psync", "op": "write", "bs": 1 << 20, "jobs": 1}

    def raw(row, side, v):
        return [dict(row, side=side, round=0, gib_s=v)]

    rows = bench_io.summarize(
        [io_row, ROW],
        raw(io_row, "tmpfs", 4.0)
        + raw(io_row, "daemon", 2.2)
        + raw(io_row, "hp", 2.0)
        + raw(ROW, "tmpfs", 4.0)
        + raw(ROW, "daemon", 1.0)
        + raw(ROW, "hp", 1.1),
        ("tmpfs", "daemon", "hp"),
    )
    assert rows[0]["daemon_vs_hp"] == pytest.approx(1.1) and rows[0]["daemon_meets_target"] is True
    assert rows[1]["daemon_vs_hp"] == pytest.approx(1.0 / 1.1) and rows[1]["daemon_meets_target"] is False
    rows = bench_io.summarize(
        [io_row],
        raw(io_row, "tmpfs", 4.0) + raw(io_row, "daemon", 1.9) + raw(io_row, "hp", 1.0),
        ("tmpfs", "daemon", "hp"),
    )
    assert rows[0]["daemon_meets_target"] is False  # twice passthrough_hp, but under half of tmpfs
    table = bench_io.render_table(rows).splitlines()
    assert "daemon/hp" in table[0] and "daemon met" in table[0] and table[2].endswith("**no** |")


@pytest.mark.parametrize("text", ["hp", "=/tmp", "tmpfs=/tmp", "a_b=/tmp", "hp=/nonexistent/dir"])
def test_a_bad_reference_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        bench_io.parse_reference(text)


def test_a_reference_names_a_directory(tmp_path):
    assert bench_io.parse_reference(f"hp={tmp_path}") == ("hp", str(tmp_path))


def test_two_references_of_one_name_are_refused(tmp_path, capsys):
    assert bench_io.main(["--files-only", "--reference", f"hp={tmp_path}", "--reference", f"hp={tmp_path}"]) == 2
    assert "names must differ" in capsys.readouterr().err


def test_a_preallocated_write_is_a_row_of_its_own_beside_the_plain_one():
    args = bench_io.build_parser().parse_args(["--modes", "psync", "--bs", "1M", "--jobs", "1", "--files", "0"])
    run = bench_io.Run.__new__(bench_io.Run)
    run.args = args
    rows = run.rows()
    assert [(r["op"], r["fallocate"]) for r in rows] == [
        ("write", "none"),
        ("write", "native"),
        ("read", "none"),
        ("cold", "none"),
    ]
    assert bench_io.row_label(rows[3]) == "psync read 1M, 1 job, cold"
    assert bench_io.row_label(rows[1]) == "psync write 1M, 1 job, preallocated"
    plain, pre = (dict(r, side="tmpfs", round=0, gib_s=v) for r, v in ((rows[0], 2.0), (rows[1], 5.0)))
    summary = bench_io.summarize(rows[:2], [plain, pre], ("tmpfs",))
    assert [r["tmpfs_gib_s"] for r in summary] == [2.0, 5.0]
    saved = {"mode": "psync", "op": "write", "bs": 1 << 20, "jobs": 1}  # a run saved before the rows existed
    assert bench_io.row_key(saved) == bench_io.row_key(rows[0])


@pytest.mark.parametrize("op, rw", [("read", "read"), ("cold", "read"), ("write", "write")])
def test_fio_never_drops_pages_inside_its_own_timing(tmp_path, op, rw):
    fio = tmp_path / "fio"  # records its arguments, answers as fio does
    fio.write_text(f"""#!/bin/sh
[ "$1" = --version ] && echo fio-3.33 && exit 0
echo "$@" > {tmp_path}/args
echo '{{"jobs": [{{"{rw}": {{"io_bytes": 4096, "runtime": 1}}}}]}}'
""")
    fio.chmod(0o755)
    res = bench_io.FioEngine(str(fio)).run("psync", op, str(tmp_path), "t", 4096, 4096, 1)
    args = (tmp_path / "args").read_text().split()
    assert f"--rw={rw}" in args and "--invalidate=0" in args and res["bytes"] == 4096


@pytest.mark.parametrize("op", ["read", "cold"])
def test_a_cold_read_is_timed_after_its_cached_pages_were_dropped(tmp_path, monkeypatch, op):
    events = []

    class Engine:  # stands in for fio: records when it was run
        def files(self, directory, tag, jobs):
            return [str(tmp_path / f"{tag}.{j}") for j in range(jobs)]

        def run(self, mode, op, directory, tag, bs, per_job, jobs, offset, fallocate):
            events.append(("timed", offset))
            return {"bytes": per_job * jobs, "seconds": 1.0}

    monkeypatch.setattr(bench_io, "warm_up", lambda *a: None)
    monkeypatch.setattr(
        bench_io,
        "drop_cached",
        lambda paths, offset, length: events.append(("dropped", [Path(p).name for p in paths], offset, length)),
    )
    run = bench_io.Run.__new__(bench_io.Run)
    run.args = argparse.Namespace(segment=8192, warmup=0)
    run.engine, run.dirs, run.mounts, run.warm_path, run.warm_buf = Engine(), {"tmpfs": str(tmp_path)}, {}, None, None
    for j in range(2):
        (tmp_path / f"t.{j}").write_bytes(bytes(8192))
    res = run.io("tmpfs", "psync", op, "t", 4096, 8192, 2)
    dropped = [("dropped", ["t.0", "t.1"], offset, 4096) for offset in (0, 4096)] if op == "cold" else []
    assert [e for e in events if e[0] == "dropped"] == dropped
    assert [e[0] for e in events] == (["dropped", "timed"] * 2 if op == "cold" else ["timed"] * 2)
    assert res["bytes"] == 16384 and res["segments"] == 2


def test_dropping_cached_pages_leaves_the_bytes(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10000)
    bench_io.drop_cached([str(path)], 0, 10000)
    assert path.read_bytes() == b"x" * 10000
