"""Manifests: built from real trees, serialized deterministically, and refused when unsafe."""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest

from tierfs.core import chunks, describe, manifest
from tierfs.core.chunks import chunk_hash
from tierfs.core.describe import build
from tierfs.core.manifest import FORMAT_VERSION, Entry, Manifest, ManifestError

CS = 1024  # a small chunk size keeps the trees small


def hash_of(label: str) -> str:
    return chunk_hash(label.encode())


def sample() -> Manifest:
    return Manifest(
        job="llama",
        rank=3,
        step=500,
        chunk_size=4,
        roots=["ckpt/500"],
        created=1700000000.25,
        entries=[
            Entry("ckpt", "dir", 0o755, 1000, 1000, 0, 10),
            Entry("ckpt/500", "dir", 0o1777, 1000, 1000, 0, 11),
            Entry(
                "ckpt/500/a.bin", "file", 0o4755, 1000, 100, 9, 12, chunks=[hash_of("0"), hash_of("1"), hash_of("2")]
            ),
            Entry("ckpt/500/b.bin", "file", 0o644, 0, 0, 4, 13, chunks=[hash_of("0")]),
            Entry("ckpt/500/latest", "symlink", 0o777, 0, 0, 0, 14, target="a.bin"),
        ],
    )


def sample_dict() -> dict:
    return json.loads(sample().to_json())


def test_json_round_trip():
    m = sample()
    assert Manifest.from_json(m.to_json()) == m


def test_json_is_compact_and_deterministic():
    data = sample().to_json()
    assert data == sample().to_json()
    assert b" " not in data
    obj = json.loads(data)
    assert list(obj) == sorted(obj)
    assert all(list(e) == sorted(e) for e in obj["entries"])
    assert obj["format"] == FORMAT_VERSION


def test_chunk_accounting():
    m = sample()
    assert m.chunk_set() == {hash_of("0"), hash_of("1"), hash_of("2")}
    assert m.unique_chunk_count == 3
    assert m.total_bytes == 13


def drop(key):
    return lambda d: d.pop(key)


def set_entry(index, **fields):
    return lambda d: d["entries"][index].update(fields)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(format=2), r"^manifest format 2 is newer than this tierfs supports \(1\): upgrade tierfs$"),
        (lambda d: d.update(format=0), "format 0 does not exist"),
        (set_entry(2, path="ckpt/../../etc/passwd"), r"'ckpt/../../etc/passwd' has a '\.\.' component"),
        (set_entry(2, path="/etc/passwd"), "'/etc/passwd' is absolute"),
        (set_entry(2, path=""), "path '' is empty"),
        (set_entry(2, path="ckpt//500/a.bin"), "is not normalized"),
        (set_entry(2, path="ckpt/./500/a.bin"), "is not normalized"),
        (lambda d: d["entries"].insert(3, dict(d["entries"][2])), "duplicate path 'ckpt/500/a.bin'"),
        (
            lambda d: d["entries"].insert(2, d["entries"].pop(3)),
            "not sorted by path: 'ckpt/500/a.bin' after 'ckpt/500/b.bin'",
        ),
        (lambda d: d["entries"][2]["chunks"].pop(), r"2 chunks for 9 bytes, expected 3 of 4 bytes"),
        (set_entry(2, size=13), "3 chunks for 13 bytes, expected 4"),
        (set_entry(0, chunks=[hash_of("0")]), "1 chunks for 0 bytes, expected 0"),
        (drop("chunk_size"), "missing field 'chunk_size'"),
        (drop("entries"), "missing field 'entries'"),
        (lambda d: d["entries"][3].pop("mode"), r"entry 'ckpt/500/b.bin': missing field 'mode'"),
        (lambda d: d.update(rank="3"), "field 'rank' has the wrong type"),
        (lambda d: d.update(step=True), "field 'step' has the wrong type"),
        (set_entry(2, uid=None), "field 'uid' has the wrong type"),
        (lambda d: d.update(chunk_size=0), "chunk size 0"),
        (lambda d: d.update(roots=["ckpt/600"]), "root 'ckpt/600' has no entry"),
        (lambda d: d.update(roots=["../ckpt"]), "root path '../ckpt' has a"),
        (lambda d: d["entries"].pop(0), "parent 'ckpt' is not a directory entry"),
        (
            lambda d: d["entries"].append(dict(d["entries"][3], path="ckpt/500/latest/x")),
            "parent 'ckpt/500/latest' is not a directory entry",
        ),
        (set_entry(2, kind="fifo"), "unknown kind 'fifo'"),
        (set_entry(2, mode=0o100644), "is not permission bits"),
        (set_entry(2, target="b.bin"), "a symlink needs a target"),
        (set_entry(4, target=None), "a symlink needs a target"),
        (set_entry(1, size=4096), "a dir has no size"),
        (set_entry(3, chunks=["XYZ"]), "'XYZ' is not a chunk hash"),
        (set_entry(3, chunks=[hash_of("0").upper()]), "is not a chunk hash"),
    ],
)
def test_from_json_rejects(mutate, message):
    d = sample_dict()
    mutate(d)
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(json.dumps(d).encode())


@pytest.mark.parametrize(
    "data, message",
    [(b'{"format": 1,', "not valid JSON"), (b"\xff\xfe\xfa", "not valid JSON"), (b"[]", "not a JSON object")],
)
def test_from_json_rejects_non_manifests(data, message):
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(data)


# -- build, on real trees ----------------------------------------------------------------


@pytest.fixture
def snap(tmp_path) -> Path:
    """A frozen snapshot of a volume: one directory checkpoint, one single-file checkpoint."""
    root = tmp_path / "snap"
    step = root / "checkpoints" / "500"
    (step / "model" / "layers").mkdir(parents=True)
    (step / "optimizer").mkdir()
    (step / "model" / "layers" / "empty").write_bytes(b"")
    (step / "model" / "layers" / "exact").write_bytes(os.urandom(3 * CS))
    (step / "model" / "layers" / "plus-one").write_bytes(os.urandom(3 * CS + 1))
    (step / "optimizer" / "state").write_bytes(os.urandom(CS // 2))
    (step / "run.sh").write_bytes(b"#!/bin/sh\n")
    os.symlink("model/layers/exact", step / "latest")
    os.symlink("nonexistent/elsewhere", step / "dangling")
    os.symlink("/etc/passwd", step / "absolute")  # no restore would recreate it: not recorded
    os.symlink("../../escape", step / "climbing")  # nor this one
    os.mkfifo(step / "progress.fifo")
    os.chmod(step / "run.sh", 0o4755)
    os.chmod(step / "optimizer", 0o3775)
    os.chmod(step, 0o1777)
    os.chmod(root / "checkpoints", 0o750)
    (root / "model-100.pt").write_bytes(os.urandom(CS + 7))
    return root


def by_path(m: Manifest) -> dict[str, Entry]:
    return {e.path: e for e in m.entries}


def file_chunks(path: Path) -> list[str]:
    data = path.read_bytes()
    return [chunk_hash(data[i : i + CS]) for i in range(0, len(data), CS)]


def test_build_describes_a_directory_checkpoint(snap):
    m = build(snap, ["checkpoints/500"], job="llama", rank=2, step=500, chunk_size=CS)
    assert (m.job, m.rank, m.step, m.chunk_size, m.roots) == ("llama", 2, 500, CS, ["checkpoints/500"])
    entries = by_path(m)
    assert (
        [e.path for e in m.entries]
        == sorted(entries)
        == [
            "checkpoints",
            "checkpoints/500",
            "checkpoints/500/dangling",
            "checkpoints/500/latest",
            "checkpoints/500/model",
            "checkpoints/500/model/layers",
            "checkpoints/500/model/layers/empty",
            "checkpoints/500/model/layers/exact",
            "checkpoints/500/model/layers/plus-one",
            "checkpoints/500/optimizer",
            "checkpoints/500/optimizer/state",
            "checkpoints/500/run.sh",
        ]
    )  # the fifo, the absolute and the climbing symlink are skipped
    for path, e in entries.items():
        st = os.lstat(snap / path)
        assert (e.mode, e.uid, e.gid) == (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
        assert e.mtime_ns == st.st_mtime_ns
        if e.kind == "file":
            assert (e.size, e.chunks, e.target) == (st.st_size, file_chunks(snap / path), None)
        else:
            assert (e.size, e.chunks) == (0, [])
    assert entries["checkpoints"].kind == "dir" and entries["checkpoints"].mode == 0o750
    assert entries["checkpoints/500"].mode == 0o1777
    assert entries["checkpoints/500/optimizer"].mode == 0o3775
    assert entries["checkpoints/500/run.sh"].mode == 0o4755
    assert entries["checkpoints/500/latest"].kind == "symlink"
    assert entries["checkpoints/500/latest"].target == "model/layers/exact"
    assert entries["checkpoints/500/dangling"].target == "nonexistent/elsewhere"
    assert entries["checkpoints/500/model/layers/empty"].chunks == []
    assert len(entries["checkpoints/500/model/layers/exact"].chunks) == 3
    assert len(entries["checkpoints/500/model/layers/plus-one"].chunks) == 4
    assert m.total_bytes == 3 * CS + 3 * CS + 1 + CS // 2 + len(b"#!/bin/sh\n")
    assert Manifest.from_json(m.to_json()) == m


def test_build_single_file_root(snap):
    m = build(snap, ["model-100.pt"], job="j", rank=0, step=100, chunk_size=CS)
    assert [(e.path, e.kind, e.size) for e in m.entries] == [("model-100.pt", "file", CS + 7)]
    assert m.entries[0].chunks == file_chunks(snap / "model-100.pt")


def test_build_records_every_ancestor_of_a_deep_root(snap):
    m = build(snap, ["checkpoints/500/model/layers/exact"], job="j", rank=0, step=500, chunk_size=CS)
    assert [(e.path, e.kind) for e in m.entries] == [
        ("checkpoints", "dir"),
        ("checkpoints/500", "dir"),
        ("checkpoints/500/model", "dir"),
        ("checkpoints/500/model/layers", "dir"),
        ("checkpoints/500/model/layers/exact", "file"),
    ]
    assert by_path(m)["checkpoints/500"].mode == 0o1777


@pytest.mark.parametrize(
    "roots, same_as",
    [
        (["checkpoints/500", "checkpoints/500/model"], "checkpoints/500"),
        (["checkpoints/500/model", "checkpoints/500"], "checkpoints/500"),
        (["checkpoints/500/optimizer/state", "checkpoints", "checkpoints/500"], "checkpoints"),
    ],
)
def test_overlapping_roots_give_each_entry_once(snap, roots, same_as):
    m = build(snap, roots, job="j", rank=0, step=500, chunk_size=CS)
    assert m.entries == build(snap, [same_as], job="j", rank=0, step=500, chunk_size=CS).entries
    assert m.roots == roots
    assert Manifest.from_json(m.to_json()) == m


def test_symlink_root_is_not_followed(snap):
    os.symlink("checkpoints/500", snap / "latest")
    m = build(snap, ["latest"], job="j", rank=0, step=500, chunk_size=CS)
    assert [(e.path, e.kind, e.target) for e in m.entries] == [("latest", "symlink", "checkpoints/500")]


def test_root_below_a_symlink_is_refused(snap):
    os.symlink("checkpoints", snap / "link")
    with pytest.raises(ManifestError, match="'link' is not a directory"):
        build(snap, ["link/500"], job="j", rank=0, step=500, chunk_size=CS)


def test_special_file_root_is_refused(snap):
    with pytest.raises(ManifestError, match="is not a file, directory or symlink"):
        build(snap, ["checkpoints/500/progress.fifo"], job="j", rank=0, step=500, chunk_size=CS)


def test_unsafe_root_is_refused(snap):
    with pytest.raises(ManifestError, match="has a '..' component"):
        build(snap, ["checkpoints/../../etc"], job="j", rank=0, step=500, chunk_size=CS)


def test_hard_links_are_separate_files_with_the_same_chunks(snap):
    layers = snap / "checkpoints" / "500" / "model" / "layers"
    os.link(layers / "exact", layers / "exact-again")
    entries = by_path(build(snap, ["checkpoints/500"], job="j", rank=0, step=500, chunk_size=CS))
    again = entries["checkpoints/500/model/layers/exact-again"]
    assert again.kind == "file"
    assert again.chunks == entries["checkpoints/500/model/layers/exact"].chunks


def test_names_that_are_not_utf8_survive_json(snap):
    name = os.fsdecode(b"shard-\xff\xfe.bin")
    (snap / "checkpoints" / "500" / name).write_bytes(b"x" * 10)
    m = build(snap, ["checkpoints/500"], job="j", rank=0, step=500, chunk_size=CS)
    again = Manifest.from_json(m.to_json())
    assert again == m
    assert os.fsencode(f"checkpoints/500/{name}") in {os.fsencode(e.path) for e in again.entries}


@pytest.fixture
def hash_calls(monkeypatch) -> list[Path]:
    calls: list[Path] = []
    real = chunks.hash_file

    def counting(path, chunk_size, pace):
        calls.append(Path(path))
        return real(path, chunk_size, pace)

    monkeypatch.setattr(chunks, "hash_file", counting)
    return calls


def test_known_cache_skips_rehashing_unchanged_files(snap, hash_calls):
    known: dict = {}
    first = build(snap, ["checkpoints/500"], job="j", rank=0, step=500, chunk_size=CS, known=known)
    assert len(hash_calls) == 5  # every regular file, the empty one included
    assert len(known) == 5

    second = build(snap, ["checkpoints/500"], job="j", rank=0, step=600, chunk_size=CS, known=known)
    assert len(hash_calls) == 5
    assert second.entries == first.entries

    changed = snap / "checkpoints" / "500" / "optimizer" / "state"
    changed.write_bytes(os.urandom(CS + 1))
    third = build(snap, ["checkpoints/500"], job="j", rank=0, step=700, chunk_size=CS, known=known)
    assert hash_calls[5:] == [changed]
    assert by_path(third)["checkpoints/500/optimizer/state"].chunks == file_chunks(changed)


def test_every_chunk_read_is_paced_and_a_cached_file_is_not(snap):
    """Hashing a step in the background waits for the job's writes before each chunk it reads."""
    paced: list[str] = []

    def pace() -> None:
        paced.append(threading.current_thread().name)

    known: dict = {}
    build(snap, ["checkpoints/500"], job="j", rank=0, step=500, chunk_size=CS, known=known, pace=pace)
    assert len(paced) == 3 + 4 + 1 + 1  # exact, plus-one, state, run.sh; the empty file has none
    assert all(name.startswith("tierfs-hash") for name in paced)  # in the hashing threads, not the caller's
    paced.clear()
    build(snap, ["checkpoints/500"], job="j", rank=0, step=600, chunk_size=CS, known=known, pace=pace)
    assert paced == []


def test_hard_links_are_hashed_once_with_a_cache(snap, hash_calls):
    layers = snap / "checkpoints" / "500" / "model" / "layers"
    os.link(layers / "exact", layers / "exact-again")
    build(snap, ["checkpoints/500/model"], job="j", rank=0, step=500, chunk_size=CS, known={})
    assert len(hash_calls) == 3  # empty, plus-one, and one of the two names of exact


def test_without_a_cache_every_file_is_hashed(snap, hash_calls):
    build(snap, ["checkpoints/500"], job="j", rank=0, step=500, chunk_size=CS)
    build(snap, ["checkpoints/500"], job="j", rank=0, step=500, chunk_size=CS)
    assert len(hash_calls) == 10


# -- limits, checked before any byte is hashed ----------------------------------------------


@pytest.fixture
def shm_snap(shm_dir, snap) -> Path:
    """``snap`` on tmpfs, where a file may have any size up to 8 EiB (ext4 stops at 16 TiB)."""
    root = shm_dir() / "snap"
    shutil.copytree(snap, root, symlinks=True, ignore=lambda d, names: ["progress.fifo"])
    return root


def test_a_step_larger_than_a_manifest_can_name_is_refused_before_hashing(shm_snap, hash_calls):
    big = shm_snap / "checkpoints" / "500" / "optimizer" / "huge"
    with open(big, "wb") as f:
        f.truncate(1 << 50)  # truncate -s 1P: no byte is stored, the size is the job's to set
    with pytest.raises(ManifestError) as err:
        build(shm_snap, ["checkpoints/500"], job="j", rank=0, step=500, chunk_size=4 << 20)
    assert hash_calls == [], "nothing may be hashed before the step's size is checked"
    message = str(err.value)
    assert "'checkpoints/500/optimizer/huge'" in message and f"{1 << 50} bytes" in message
    assert "more than a manifest can name" in message and "\n" not in message


def test_the_chunk_limit_counts_every_file_of_the_step(shm_snap, hash_calls):
    per_file = (manifest.MAX_BYTES // 35) // 4 + 1  # four of them are one chunk name too many
    for i in range(4):
        with open(shm_snap / "checkpoints" / "500" / f"part-{i}", "wb") as f:
            f.truncate(per_file * CS)
    with pytest.raises(ManifestError, match="more than a manifest can name"):
        build(shm_snap, ["checkpoints/500"], job="j", rank=0, step=500, chunk_size=CS)
    assert hash_calls == []


def test_a_sparse_file_within_the_limits_is_described_without_reading_its_holes(shm_snap):
    big = shm_snap / "model.ckpt"
    size = 1 << 40  # 1 TiB apparent, 2^18 chunks of 4 MiB
    with open(big, "wb") as f:
        f.truncate(size)
        os.pwrite(f.fileno(), b"weights", 5 << 30)
    m = build(shm_snap, ["model.ckpt"], job="j", rank=0, step=1, chunk_size=4 << 20)
    (entry,) = m.entries
    assert entry.size == size and len(entry.chunks) == size >> 22
    data_chunk = (5 << 30) >> 22
    assert entry.chunks[data_chunk] == chunk_hash(chunks.read_chunk(big, data_chunk, 4 << 20))
    assert set(entry.chunks[:data_chunk] + entry.chunks[data_chunk + 1 :]) == {chunks.zero_hash(4 << 20)}
    assert Manifest.from_json(m.to_json()) == m  # what is backed up can be restored
    assert m.chunk_sizes() == {chunks.zero_hash(4 << 20): 4 << 20, entry.chunks[data_chunk]: 4 << 20}


@pytest.mark.parametrize("paths", ["counted before hashing", "known only once built"])
def test_a_manifest_whose_json_would_be_too_large_is_refused(snap, monkeypatch, hash_calls, paths):
    deep = snap / "checkpoints" / "500" / ("d" * 200)
    deep.mkdir()
    for i in range(8):
        (deep / (f"{i}" * 200)).write_bytes(b"x")
    m = build(snap, ["checkpoints/500"], job="j", rank=0, step=500, chunk_size=CS)
    lower_bound = sum(len(e.path) + 35 * len(e.chunks) for e in m.entries if e.path != "checkpoints")
    # Between the two: the JSON's other fields (and its creation time) make up the difference.
    limit = lower_bound - 1 if paths == "counted before hashing" else (lower_bound + len(m.to_json())) // 2
    monkeypatch.setattr(describe, "MAX_BYTES", limit)
    hash_calls.clear()
    with pytest.raises(ManifestError, match=f"would be larger than {limit} bytes"):
        build(snap, ["checkpoints/500"], job="j", rank=0, step=500, chunk_size=CS)
    assert bool(hash_calls) == (paths == "known only once built")


def test_nonzero_bytes_leaves_out_chunks_of_zeros_whole_and_short():
    z, zs = chunks.zero_hash(4), chunks.zero_hash(1)
    m = Manifest(
        job="j",
        rank=0,
        step=1,
        chunk_size=4,
        roots=["a"],
        created=0.0,
        entries=[
            Entry("a", "dir", 0o755, 0, 0, 0, 0),
            Entry("a/data", "file", 0o644, 0, 0, 9, 0, chunks=[hash_of("0"), z, hash_of("2")]),  # 4 + 0 + 1
            Entry("a/hole", "file", 0o644, 0, 0, 9, 0, chunks=[z, z, zs]),  # all hole
            Entry("a/short", "file", 0o644, 0, 0, 6, 0, chunks=[z, hash_of("3")]),  # 0 + 2
            Entry("a/empty", "file", 0o644, 0, 0, 0, 0),
        ],
    )
    assert m.nonzero_bytes() == 7 and m.total_bytes == 24
