"""The mount's log: rotation under its two writers (keeper and daemon), the JSON format, bad values."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
from pathlib import Path

import pytest

from tests.conftest import tierfs
from tests.helpers import wait_for
from tierfs.core import mounts
from tierfs.core.logs import MIN_MAX_SIZE

RFC3339_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def commit(root: Path, step: int) -> None:
    """One step, committed as Orbax does (a renamed directory): a line or two in the log."""
    tmp = root / f"{step}.orbax-checkpoint-tmp"
    tmp.mkdir()
    (tmp / "w").write_bytes(b"x")
    tmp.rename(root / str(step))


def committed(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"committed step (\d+):", text)]


@pytest.mark.expect_log(r"was killed by SIGKILL")
def test_the_log_rotates_past_its_size_and_every_writer_follows(volumes):
    vol = volumes(job="logs", log_max_size="16K", log_level="debug")
    path = mounts.Registration(vol.mountpoint).log_path
    rotated = Path(f"{path}.1")
    step = 0
    while not rotated.exists():  # ten steps log ~2 KiB: at most one rotation between two checks
        for _ in range(10):
            step += 1
            commit(vol.mountpoint, step)
        assert step < 1000, "the log never rotated"
    assert not Path(f"{path}.2").exists()
    # The keeper writes to the log too: killed, its daemon is replaced, and the keeper's word
    # of it lands in the newest file, not in the one the daemon renamed.
    os.kill(vol.pid, signal.SIGKILL)
    wait_for(lambda: "took over" in path.read_text(), timeout=30, what="a successor")
    step += 1
    commit(vol.mountpoint, step)
    wait_for(lambda: f"committed step {step}:" in path.read_text(), timeout=10, what="the last commit's line")

    old, new = rotated.read_text(), path.read_text()
    assert committed(old)[0] == 1 and committed(old + new) == list(range(1, step + 1)), "a line was lost"
    assert "was killed by SIGKILL" in new and "was killed" not in old
    longest = max(len(line) + 1 for line in (old + new).splitlines())
    assert len(old.encode()) < MIN_MAX_SIZE + longest and len(new.encode()) < MIN_MAX_SIZE + longest
    for p in (path, rotated):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p


def test_json_lines_name_the_job_rank_and_event(volumes):
    vol = volumes(job="jsonlog", rank=1, nodes=2, log_format="json")
    commit(vol.mountpoint, 7)
    path = mounts.Registration(vol.mountpoint).log_path
    wait_for(lambda: "committed step 7" in path.read_text(), timeout=10, what="the commit's line")
    tierfs("unmount", vol.mountpoint)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines:
        assert {"time", "level", "logger", "message", "pid"} <= set(line), line
        assert (line["job"], line["rank"]) == ("jsonlog", 1) and RFC3339_UTC.match(line["time"]), line
    events = {line.get("event"): line for line in lines}
    assert events["committed"]["step"] == 7 and events["committed"]["level"] == "info"
    assert "mounted" in events and "stopped" in events


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--log-format", "xml"], "invalid --log-format 'xml': use text or json"),
        (["--log-max-size", "-1"], "invalid log-max-size '-1'"),
        (["--log-max-size", "1K"], "invalid --log-max-size 1024: use 0 (never rotate) or at least 16K"),
    ],
)
def test_bad_log_options_are_one_line(args, fragment, shm_dir):
    mp = shm_dir("tierfs-mnt")
    proc = tierfs("mount", mp, "--ramdisk", shm_dir(), *args, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("tierfs: "), proc.stderr
    assert fragment in lines[0]
    assert mounts.find_mount(mp) is None
