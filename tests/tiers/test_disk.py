"""The --disk tier end to end, through real mounts: every committed step is written to the
disk in the background, a node that lost its RAM restores from its disk before any peer or
GCS, and when RAM is short committed steps leave it and stay restorable from the disk."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import uuid
from pathlib import Path

import pytest
import trio
from tierfs_testing.cluster import LocalCluster

from tests.conftest import tierfs
from tests.helpers import wait_for, write_orbax_step
from tierfs.core.manifest import Manifest
from tierfs.ramtier.tmpfs import unmount_beneath
from tierfs.tiers.disk import DiskTier

MiB = 1 << 20


def on_disk(status: dict, step: int) -> bool:
    return any(
        s["step"] == step and s["copies"].get("disk", {}).get("version") == s["version"] for s in status["steps"]
    )


def digest(files: dict[str, bytes]) -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


def sums(mnt: Path, step: int, names) -> dict[str, str]:
    return {n: hashlib.sha256((mnt / "ckpt" / str(step) / n).read_bytes()).hexdigest() for n in names}


@pytest.fixture
def disk_dir(tmp_path) -> Path:
    """A directory on a real disk (not tmpfs), as an NVMe drive would be."""
    return tmp_path / "nvme"


@pytest.fixture
def two_nodes(disk_dir, gcs_bucket):
    """Two real daemons on loopback that replicate to each other, back up to GCS and write to --disk."""
    c = LocalCluster(
        Path("/dev/shm") / f"tierfs-disk-{uuid.uuid4().hex[:10]}",
        2,
        "dj",
        replicas=1,
        capacity="256M",
        gcs=f"gs://{gcs_bucket}/d",
        disk=disk_dir,
    )
    try:
        yield c
    finally:
        c.close()


def test_a_node_that_lost_its_ram_restores_from_its_disk_before_peers_and_gcs(two_nodes, disk_dir):
    c = two_nodes
    c.start_all()
    files = {f"shard-{i}": os.urandom(3 * MiB + i) for i in range(4)}
    expected = digest(files)
    write_orbax_step(c.nodes[0].mountpoint, 5, files)
    write_orbax_step(c.nodes[1].mountpoint, 5, {"other": os.urandom(MiB)})

    def everywhere():
        s = next((s for s in c.status(0)["steps"] if s["step"] == 5), None)
        return s and s["backed_up"] and s["replicas"].get("peers") and on_disk(c.status(0), 5)

    wait_for(everywhere, what="step 5 on the peer, in GCS and on the disk")
    rank_dir = disk_dir / "dj" / "rank-0"
    for d in (disk_dir / "dj", rank_dir, rank_dir / "chunks", rank_dir / "manifests"):
        st = d.lstat()
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700, d

    c.kill(0)
    c.wipe(0)
    c.start(0)
    assert sums(c.nodes[0].mountpoint, 5, files) == expected
    restored = wait_for(lambda: (r := c.status(0)["restored"])["state"] == "done" and r, 30, "the restore")
    assert restored["tier"] == "disk" and restored["from"] == str(rank_dir)
    assert restored["bytes_from"] == {"disk": sum(map(len, files.values()))}, restored["bytes_from"]
    state = next(s for s in c.status(0)["steps"] if s["step"] == 5)
    assert state["source"] == "disk" and on_disk(c.status(0), 5)
    assert "disk" in tierfs("status", c.nodes[0].mountpoint).stdout


def test_when_ram_is_short_committed_steps_leave_it_and_stay_restorable_from_disk(volumes, disk_dir):
    # Two ranks, one mounted: the retention floor stays unknown, so without a disk every
    # committed step would stay in RAM, and the fourth 20 MiB step would not fit in 64 MiB.
    vol = volumes(job="short", nodes=2, capacity="64M", disk=disk_dir, keep=10)
    steps = {}
    for step in range(1, 5):
        files = {"w": os.urandom(20 * MiB)}
        write_orbax_step(vol.mountpoint, step, files)  # fails with ENOSPC if nothing left RAM
        steps[step] = files["w"]
        wait_for(lambda: on_disk(vol.status(), step), what=f"step {step} on the disk")
        shutil.rmtree(vol.mountpoint / "ckpt" / str(step))  # the job keeps one checkpoint
    status = vol.status()
    in_ram = [s["step"] for s in status["steps"]]
    assert 1 not in in_ram and 4 in in_ram, in_ram
    assert status["tiers"]["ram"]["used"] <= 48 * MiB
    assert status["tiers"]["disk"]["manifests"] == 4

    # Step 1 left RAM long ago; the disk gives it back whole, every chunk verified.
    disk = DiskTier(disk_dir, "short", 0)
    disk.open()

    async def read_back(step: int) -> bytes:
        manifest = Manifest.from_json(await disk.get_manifest(0, step))
        entry = next(e for e in manifest.entries if e.path.endswith("/w"))
        parts = []
        for i, h in enumerate(entry.chunks):
            parts.append(await disk.get_chunk(h, min(manifest.chunk_size, entry.size - i * manifest.chunk_size)))
        return b"".join(parts)

    assert trio.run(read_back, 1) == steps[1]

    # And a restart with RAM wiped restores the newest step from the disk.
    tierfs("unmount", vol.mountpoint)
    unmount_beneath(vol.ramdisk / "short" / "rank-0")
    shutil.rmtree(vol.ramdisk / "short" / "rank-0")
    again = volumes(job="short", nodes=2, capacity="64M", disk=disk_dir, keep=10, mountpoint=vol.mountpoint)
    assert (again.mountpoint / "ckpt" / "4" / "w").read_bytes() == steps[4]
    assert again.status()["restored"]["bytes_from"] == {"disk": 20 * MiB}


@pytest.mark.expect_log(r"unsafe --disk")
def test_an_unsafe_disk_directory_is_refused_in_one_line(volumes, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone could swap the job's directory for a link
    with pytest.raises(AssertionError) as err:
        volumes(job="unsafe", disk=shared)
    message = str(err.value).strip().splitlines()[-1]
    assert "unsafe --disk" in message and str(shared) in message and "Traceback" not in str(err.value)
