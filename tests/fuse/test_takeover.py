"""A daemon's death never reaches the job: its keeper starts a successor that takes the
live FUSE connection over, and every descriptor the job holds keeps working."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.fuse.users import PYTHON
from tests.helpers import wait_for
from tierfs.core import mounts
from tierfs.core.errors import UserError

JOB = Path(__file__).with_name("takeover_job.py").read_text()
KILLED = r"tierfs.keeper: the daemon of .* was killed by SIGKILL"
USERS = {"root": {}, "user 1000": {"user": 1000, "group": 1000}}
TIERS = {"disk", "gcs"}


@pytest.fixture(autouse=True)
def own_engine(engine):
    if engine == "pyfuse3":
        pytest.skip("pyfuse3 keeps its own /dev/fuse descriptor: its mounts die with their daemon")


def registered(vol) -> dict:
    return mounts.Registration(vol.mountpoint).read() or {}


def kill_daemon(vol) -> None:
    """kill -9 the volume's daemon; return once a successor serves the mount."""
    before = registered(vol)
    os.kill(before["pid"], signal.SIGKILL)
    wait_for(lambda: registered(vol).get("pid") not in (None, before["pid"]), timeout=30,
             what="a successor to take the mount over")
    assert registered(vol)["keeper"] == before["keeper"]


def safe_steps(vol) -> set[int]:
    """The steps whose current version is on every tier (none while no daemon answers)."""
    try:
        steps = vol.status()["steps"]
    except (OSError, UserError):
        return set()
    return {s["step"] for s in steps
            if TIERS <= {t for t, c in s["copies"].items() if c["version"] == s["version"]}}


@pytest.mark.root
@pytest.mark.expect_log(KILLED)
@pytest.mark.parametrize("who", list(USERS))
def test_a_job_never_sees_its_daemon_killed(volumes, gcs_bucket, shm_dir, monkeypatch, who):
    """Five kill -9s at random moments while a job writes, commits, reads, maps and lists:
    no call fails, every byte is as written, and every step reaches every tier."""
    monkeypatch.setenv("TIERFS_SECRET", "takeover-test-secret")
    vol = volumes(job="takeover", disk=shm_dir("tierfs-disk"), gcs=f"gs://{gcs_bucket}/p",
                  backup_interval="0s", keep=1000, keep_local=1000)
    uid = 0 if who == "root" else 1000
    root = vol.mountpoint / "job"
    root.mkdir()
    os.chown(root, uid, uid)
    control = shm_dir("tierfs-control")
    os.chmod(control, 0o777)
    job = subprocess.Popen([PYTHON, "-c", JOB, str(root), str(control)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, **USERS[who])
    rng = random.Random()
    kills = sorted(rng.uniform(0.3, 5.0) for _ in range(5))
    acked: set[int] = set()
    try:
        start = time.monotonic()
        while kills or len(acked) < 10:
            assert job.poll() is None, job.stderr.read()
            for step in safe_steps(vol) - acked:  # the job commits the next step once told
                (control / str(step)).touch()
                acked.add(step)
            if kills and time.monotonic() - start > kills[0]:
                kills.pop(0)
                kill_daemon(vol)
            assert time.monotonic() - start < 120, f"steps safe so far: {sorted(acked)}"
            time.sleep(0.01)
        (control / "stop").touch()
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
        job.wait()
    assert job.returncode == 0, err
    steps = int(out.split("steps ")[-1])
    wait_for(lambda: safe_steps(vol) >= set(range(1, steps + 1)), timeout=60,
             what="every committed step on the disk and in GCS")
