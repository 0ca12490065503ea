"""A daemon's death or upgrade never reaches the job: its keeper starts a successor that
takes the live FUSE connection over, and every descriptor the job holds keeps working."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

import tierfs
from tests.conftest import tierfs as tierfs_command
from tests.fuse.users import PYTHON
from tests.helpers import kill_daemon, wait_for, write_orbax_step
from tierfs.core import mounts
from tierfs.core.errors import UserError
from tierfs.daemon import host
from tierfs.ramtier.tmpfs import unmount_beneath

JOB = Path(__file__).with_name("takeover_job.py").read_text()
KILLED = r"tierfs.keeper: the daemon of .* was killed by SIGKILL"
USERS = {"root": {}, "user 1000": {"user": 1000, "group": 1000}}
TIERS = {"disk", "gcs"}


@pytest.fixture
def own_engine(engine):
    if engine == "pyfuse3":
        pytest.skip("pyfuse3 keeps its own /dev/fuse descriptor: its mounts die with their daemon")


def registered(vol) -> dict:
    return mounts.Registration(vol.mountpoint).read() or {}


def safe_steps(vol) -> set[int]:
    """The steps whose current version is on every tier (none while no daemon answers)."""
    try:
        steps = vol.status()["steps"]
    except (OSError, UserError):
        return set()
    return {s["step"] for s in steps if TIERS <= {t for t, c in s["copies"].items() if c["version"] == s["version"]}}


class Job:
    """tests/fuse/takeover_job.py running in ``vol`` as ``who``; told when a step is safe."""

    def __init__(self, vol, control: Path, who: str):
        uid = 0 if who == "root" else 1000
        root = vol.mountpoint / "job"
        root.mkdir()
        os.chown(root, uid, uid)
        os.chmod(control, 0o777)
        self.vol, self.control, self.acked = vol, control, set()
        self.proc = subprocess.Popen(
            [PYTHON, "-c", JOB, str(root), str(control)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **USERS[who],
        )

    def tick(self) -> None:
        """Fail if the job failed; let it commit its next step once the last is safe."""
        assert self.proc.poll() is None, self.proc.stderr.read()
        for step in safe_steps(self.vol) - self.acked:
            (self.control / str(step)).touch()
            self.acked.add(step)

    def finish(self) -> int:
        """Stop the job; check it ended well and that every step it committed is safe."""
        (self.control / "stop").touch()
        out, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, err
        steps = set(range(1, int(out.split("steps ")[-1]) + 1))
        wait_for(lambda: safe_steps(self.vol) >= steps, timeout=60, what="every committed step on the disk and in GCS")
        return len(steps)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def job(volumes, gcs_bucket, shm_dir, monkeypatch, own_engine):
    """Factory: a volume with a disk and a GCS tier, and a job running in it as ``who``."""
    monkeypatch.setenv("TIERFS_SECRET", "takeover-test-secret")
    started = []

    def start(who: str = "root", job_id: str = "takeover") -> Job:
        vol = volumes(
            job=job_id,
            disk=shm_dir("tierfs-disk"),
            gcs=f"gs://{gcs_bucket}/{job_id}",
            backup_interval="0s",
            keep=1000,
            keep_local=1000,
        )
        started.append(Job(vol, shm_dir("tierfs-control"), who))
        return started[-1]

    yield start
    for j in started:
        j.close()


@pytest.mark.root
@pytest.mark.expect_log(KILLED)
@pytest.mark.parametrize("who", list(USERS))
def test_a_job_never_sees_its_daemon_killed(job, who):
    """Five kill -9s at random moments while a job writes, commits, reads, maps and lists:
    no call fails, every byte is as written, and every step reaches every tier."""
    j = job(who)
    rng = random.Random()
    kills = sorted(rng.uniform(0.3, 5.0) for _ in range(5))
    start = time.monotonic()
    while kills or len(j.acked) < 10:
        j.tick()
        if kills and time.monotonic() - start > kills[0]:
            kills.pop(0)
            kill_daemon(j.vol.mountpoint)
        assert time.monotonic() - start < 120, f"steps safe so far: {sorted(j.acked)}"
        time.sleep(0.01)
    assert j.finish() >= 10


@pytest.mark.root
def test_upgrade_hands_a_live_mount_to_the_installed_build(job, shm_dir, monkeypatch):
    """``tierfs upgrade`` while a job runs: the new build serves, the job never notices."""
    build = shm_dir("tierfs-build")
    shutil.copytree(Path(tierfs.__file__).parent, build / "tierfs")
    monkeypatch.setenv("PYTHONPATH", str(build))  # the build the volume is mounted with
    j = job()
    keeper = registered(j.vol)["keeper"]
    assert j.vol.status()["version"] == tierfs.__version__
    wait_for(lambda: j.tick() or len(j.acked) >= 3, what="the job's first steps")
    init = build / "tierfs" / "__init__.py"  # the installed build changes under the running one
    init.write_text(init.read_text().replace(f'"{tierfs.__version__}"', '"99.0.0"'))
    out = tierfs_command("upgrade", j.vol.mountpoint).stdout
    assert "served by tierfs 99.0.0" in out
    assert registered(j.vol)["keeper"] == keeper, "the keeper executed the new build in place"
    assert j.vol.status()["connection"]["taken_over"]
    acked = len(j.acked)
    wait_for(lambda: j.tick() or len(j.acked) >= acked + 3, what="steps committed after the upgrade")
    j.finish()


@pytest.mark.root
def test_upgrade_refuses_what_it_cannot_hand_over_in_one_line(volumes, engine):
    vol = volumes(job="refused")
    out = tierfs_command("upgrade", vol.mountpoint, check=False)
    if engine == "pyfuse3":
        assert out.returncode == 1 and out.stderr.count("\n") == 1 and "cannot be handed over" in out.stderr
    else:
        assert out.returncode == 0, out.stderr
    missing = tierfs_command("upgrade", vol.mountpoint / "nowhere", check=False)
    assert missing.returncode == 1 and "is not a tierfs mount" in missing.stderr


@pytest.mark.root
@pytest.mark.expect_log(r"the keeper of .* is gone: starting another one", r"tierfs.keeper: the daemon of .* is gone")
def test_a_keeper_killed_is_replaced_and_the_mount_still_survives_its_daemon(volumes, own_engine):
    vol = volumes(job="orphan")
    path = vol.mountpoint / "held"
    with open(path, "wb", buffering=0) as held:
        held.write(b"before ")
        first = registered(vol)
        os.kill(first["keeper"], signal.SIGKILL)
        wait_for(
            lambda: registered(vol).get("keeper") not in (None, first["keeper"]),
            what="the daemon to start another keeper",
        )
        assert registered(vol)["pid"] == first["pid"]
        kill_daemon(vol.mountpoint)  # the new keeper, not the daemon's parent, starts a successor
        held.write(b"after")
    assert path.read_bytes() == b"before after"


def read_ahead_kb(vol) -> int:
    entry = mounts.find_mount(vol.mountpoint)
    return int(Path(f"/sys/class/bdi/0:{entry.minor}/read_ahead_kb").read_text())


@pytest.mark.expect_log(KILLED)
def test_the_raised_read_ahead_outlives_the_daemon_that_set_it(volumes, own_engine):
    """The kernel lowers read-ahead only at INIT, which a successor's connection never sees again."""
    vol = volumes(job="ahead")
    assert read_ahead_kb(vol) == host.READ_AHEAD_KB
    kill_daemon(vol.mountpoint)
    wait_for(lambda: vol.status()["connection"]["taken_over"], what="the successor to answer")
    assert read_ahead_kb(vol) == host.READ_AHEAD_KB


@pytest.mark.root
@pytest.mark.expect_log(KILLED)
def test_a_restore_in_progress_goes_on_in_the_successor(volumes, shm_dir, own_engine):
    """A step restored lazily from the disk tier (no prefetch): a file of it is open and half
    read when the daemon dies; the successor fetches the rest, and the bytes are the step's."""
    options = dict(job="lazy", capacity="256M", disk=shm_dir("tierfs-disk"), chunk_size="64K")
    vol = volumes(**options)
    data = random.randbytes(1 << 20)
    write_orbax_step(vol.mountpoint, 7, {"w": data})
    wait_for(
        lambda: any(
            s["step"] == 7 and s["copies"].get("disk", {}).get("version") == s["version"] for s in vol.status()["steps"]
        ),
        what="step 7 on the disk",
    )
    tierfs_command("unmount", vol.mountpoint)
    unmount_beneath(vol.ramdisk / "lazy" / "rank-0")
    shutil.rmtree(vol.ramdisk / "lazy" / "rank-0")
    again = volumes(mountpoint=vol.mountpoint, prefetch=0, **options)
    assert again.status()["restored"]["state"] == "on demand"
    with open(again.mountpoint / "ckpt" / "7" / "w", "rb", buffering=0) as f:
        first = f.read(256 << 10)
        kill_daemon(again.mountpoint)
        rest = f.read()
    assert first + rest == data
    restored = wait_for(
        lambda: (r := again.status()["restored"]) and r["state"] == "done" and r,
        what="the restore to finish in the successor",
    )
    assert restored["step"] == 7 and again.status()["connection"]["taken_over"]
