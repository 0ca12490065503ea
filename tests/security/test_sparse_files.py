"""Sparse files in the job's tree: a file's size is a number the job sets for free
(``truncate -s 1P`` stores nothing), so what root does with a committed step must cost what
the step holds, never what its sizes claim. Real daemons, mounts, peers and a GCS emulator."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import tierfs
from tests.fuse.conftest import SERVINGS
from tests.gcs.conftest import job_secret  # noqa: F401 (autouse: backups sealed with the job's secret)
from tests.gcs.test_backup_restore import objects, wait_backed_up, wait_restored, wipe
from tests.helpers import wait_for
from tests.multinode.conftest import cluster  # noqa: F401 (the fixture)
from tests.multinode.test_peers import replicated
from tierfs.core import mounts

MiB, GiB = 1 << 20, 1 << 30
PETABYTE = "1P"


def held(path: Path) -> int:
    """The bytes the files under ``path`` take in RAM (a hole takes none)."""
    return sum(os.lstat(Path(d, f)).st_blocks * 512 for d, _, files in os.walk(path) for f in files)


def generous_bound(step_dir: Path) -> float:
    """Seconds a step may take to be dealt with: a fixed allowance for a loaded machine and
    the daemons' polling, plus its data at 10 MiB/s, far below what hashing runs at."""
    return 30 + held(step_dir) / (10 * MiB)


def daemon_log(mountpoint: Path) -> str:
    return mounts.Registration(mountpoint).log_path.read_text(errors="replace")


def bytes_moved(pid: int) -> int:
    """What a process has read and written with read(2), write(2) and their kind so far (the kernel's count)."""
    with open(f"/proc/{pid}/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["rchar"]) + int(fields["wchar"])


def write_step(mnt: Path, step: int, files: dict[str, bytes], sparse: dict[str, tuple[str, dict[int, bytes]]]) -> Path:
    """Commit an Orbax step holding ``files`` and, per name in ``sparse``, a file made
    ``truncate -s SIZE`` long (the job's own tool, through the mount) with bytes at offsets."""
    tmp = mnt / "ckpt" / f"{step}.orbax-checkpoint-tmp"
    tmp.mkdir(parents=True)
    for name, data in files.items():
        (tmp / name).write_bytes(data)
    for name, (size, data) in sparse.items():
        subprocess.run(["truncate", "-s", size, tmp / name], check=True)
        fd = os.open(tmp / name, os.O_WRONLY)
        try:
            for offset, chunk in data.items():
                os.pwrite(fd, chunk, offset)
        finally:
            os.close(fd)
    final = mnt / "ckpt" / str(step)
    os.rename(tmp, final)
    return final


@pytest.mark.expect_log("ERROR tierfs.pipeline.replicator: step 2 cannot be replicated or backed up")
def test_a_petabyte_sparse_file_is_refused_at_once_and_never_holds_back_the_next_step(cluster, gcs_bucket):
    c = cluster(2, replicas=1, capacity="512M", gcs=f"gs://{gcs_bucket}/sparse")
    c.start_all()
    mnt = c.nodes[0].mountpoint
    write_step(mnt, 1, {"w": os.urandom(MiB)}, {})
    c.wait_safe(0, 1)

    step_dir = write_step(mnt, 2, {"w": os.urandom(MiB)}, {"huge": (PETABYTE, {})})
    assert (step_dir / "huge").stat().st_size == 1 << 50
    bound = generous_bound(c.nodes[0].ramdisk / c.job / "rank-0" / "steps" / "2")
    refused = wait_for(
        lambda: (s := next((s for s in c.status(0)["steps"] if s["step"] == 2), None)) and s.get("refused") and s,
        bound,
        "step 2 to be refused",
    )
    reason = refused["refused"]
    assert "'ckpt/2/huge'" in reason and f"{1 << 50} bytes" in reason and "\n" not in reason
    assert not refused["backed_up"] and not replicated(c, 0, 2)
    text = tierfs("status", mnt).stdout
    (line,) = [line for line in text.splitlines() if "no tier can take it" in line]
    print(line)
    assert line.startswith("  step  2  ckpt/2") and "'ckpt/2/huge'" in line
    wait_for(
        lambda: {(s := c.status(0))["gcs"]["state"], s["peers"]["state"]} <= {"ok", "idle"},
        bound,
        "the lanes to be idle again: the step is refused, not the lanes",
    )

    # The next step goes everywhere as usual, within the same bound: nothing waits for step 2.
    write_step(mnt, 3, {"w": os.urandom(MiB)}, {})
    c.wait_safe(0, 3, timeout=bound)
    assert c.status(0)["gcs"]["lag_s"] < bound, "a refused step is no backlog"
    assert daemon_log(mnt).count("step 2 cannot be replicated or backed up") == 1
    assert [n.rsplit("/", 1)[1] for n in objects(gcs_bucket, "sparse/job/manifests/")] == [
        "step-000000000001.json",
        "step-000000000003.json",
    ]


@pytest.fixture
def gcs_url(gcs_bucket) -> str:
    return f"gs://{gcs_bucket}/backups"


EIGHT_GIB = {
    0: os.urandom(MiB),  # the first chunk, partly data
    4 * GiB - MiB: os.urandom(2 * MiB),  # across a chunk boundary
    8 * GiB - 100: os.urandom(100),  # at the very end
}


def data_ranges(path: Path) -> list[tuple[int, int]]:
    """Where ``path`` holds data (the kernel's SEEK_DATA/SEEK_HOLE answers); the rest reads as zeros."""
    out = []
    fd = os.open(path, os.O_RDONLY)
    try:
        size, offset = os.fstat(fd).st_size, 0
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:
                break
            offset = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, offset))
    finally:
        os.close(fd)
    return out


def same_bytes(a: Path, b: Path) -> bool:
    """Whether two sparse files hold the same bytes, read only where either holds data."""
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        for start, end in data_ranges(a) + data_ranges(b):
            fa.seek(start)
            fb.seek(start)
            if fa.read(end - start) != fb.read(end - start):
                return False
    return True


@pytest.fixture(params=list(SERVINGS))
def serving(request, monkeypatch) -> str:
    """Each way the mount can carry the job's writes into the RAM tier, as tests/fuse runs them."""
    path, engine = SERVINGS[request.param]
    monkeypatch.setenv("TIERFS_DATA_PATH", path)
    monkeypatch.setenv("TIERFS_ENGINE", engine)
    return request.param


def test_a_sparse_file_within_the_limits_is_backed_up_and_restored_at_the_cost_of_its_data(
    volumes, gcs_url, shm_dir, serving
):
    vol = volumes(job="sparse", capacity="1G", gcs=gcs_url)
    pid = vol.pid
    before = bytes_moved(pid)
    write_step(vol.mountpoint, 1, {"meta": b"{}"}, {"model.ckpt": ("8G", EIGHT_GIB)})
    backup = wait_backed_up(vol, 1, timeout=generous_bound(vol.tree / "ckpt" / "1"))["backup"]
    holding = sum(map(len, EIGHT_GIB.values()))
    assert backup["bytes"] == 8 * GiB + 2
    # The four chunks that touch data, the chunk of zeros once for its 2043 places, and "{}".
    assert backup["uploaded_bytes"] == 5 * 4 * MiB + 2
    moved = bytes_moved(pid) - before
    print(f"backup: the daemon read and wrote {moved} bytes")
    assert moved < 256 * MiB, f"the daemon read or wrote {moved} bytes for a step holding {holding}"
    original = shm_dir("tierfs-orig") / "model.ckpt"
    with open(original, "wb") as f:  # what the job wrote, kept aside to compare with
        f.truncate(8 * GiB)
        for offset, chunk in EIGHT_GIB.items():
            os.pwrite(f.fileno(), chunk, offset)

    tierfs("unmount", vol.mountpoint)
    wipe(vol)
    again = volumes(job="sparse", capacity="1G", gcs=gcs_url, mountpoint=vol.mountpoint)
    restored = wait_restored(again)["restored"]
    assert (restored["step"], restored["bytes"]) == (1, 8 * GiB + 2)
    moved = bytes_moved(again.pid)  # since it started: the restore is all it did
    print(f"restore: the daemon read and wrote {moved} bytes")
    assert moved < 256 * MiB, f"the daemon read or wrote {moved} bytes to restore a step holding {holding}"
    in_ram = again.tree / "ckpt" / "1" / "model.ckpt"
    assert held(in_ram) <= 4 * 4 * MiB, "the holes stay holes"
    assert same_bytes(in_ram, original)
    through_mount = again.mountpoint / "ckpt" / "1" / "model.ckpt"
    assert through_mount.stat().st_size == 8 * GiB
    with open(through_mount, "rb") as f:
        for offset, chunk in EIGHT_GIB.items():
            f.seek(offset)
            assert f.read(len(chunk)) == chunk
        f.seek(6 * GiB)
        assert f.read(MiB) == bytes(MiB)
