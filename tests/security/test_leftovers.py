"""What removing a job leaves behind, and limits that must not drift apart.

A rank given ``--capacity`` on the passthrough data path lives on a tmpfs of its own
(``tierfs-ram``) that outlives its daemon. Removing the job's RAM data must take that
mount away too, or the data, the mount and its directory stay on the node for good. And
the largest chunk is one number: the configuration that allows a chunk size and every
reader that bounds a chunk (GCS frames, peer bodies, manifests) must agree on it.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from tierfs_testing import TIERFS

from tests.csi.conftest import plugin, plugin_factory, pod_api  # noqa: F401 (the fixtures)
from tierfs.config import Config
from tierfs.core import chunks, mounts
from tierfs.core.errors import UserError
from tierfs.fs.engine import passthrough_obstacle
from tierfs.peers import wire
from tierfs.ramtier.tmpfs import SOURCE, own_tmpfs, unmount_beneath


def mounts_under(path) -> list[mounts.MountEntry]:
    top = os.path.realpath(path)
    return [e for e in mounts.mount_table() if e.mountpoint == top or e.mountpoint.startswith(top + "/")]


@pytest.mark.skipif(passthrough_obstacle() is not None, reason="a rank gets a tmpfs of its own only with passthrough")
def test_collecting_a_job_whose_rank_has_a_capacity_leaves_no_mount_behind(plugin):
    target = plugin.target()
    volume = plugin.publish(target, {"job": "llama", "rank": "0", "capacity": "64M"})
    with open(os.path.join(target, "weights"), "wb") as f:
        f.write(b"w" * 4096)
    home = plugin.ramdisk / "llama" / "rank-0"
    assert [(e.fstype, e.source) for e in mounts_under(home)] == [("tmpfs", SOURCE)]
    plugin.unpublish(volume, target)

    gc = [*TIERFS, "csi", "--state-dir", str(plugin.state_dir), "--ramdisk", str(plugin.ramdisk), "--gc", "llama"]
    proc = subprocess.run(gc, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert mounts_under(plugin.ramdisk) == [], "the rank's tmpfs is unmounted with its data"
    assert not (plugin.ramdisk / "llama").exists()


def test_only_tierfs_own_tmpfs_mounts_are_taken_away(small_tmpfs):
    """An operator's tmpfs beneath the removed directory (here the ramdisk itself) stays."""
    ramdisk = small_tmpfs(8 << 20)  # source tierfs-test: not ours
    homes = [ramdisk / "job" / f"rank-{i}" for i in (0, 1)]
    for home in homes:
        home.mkdir(parents=True)
        assert own_tmpfs(home, 1 << 20)
    try:
        (homes[0] / "data").write_bytes(b"x")
        assert sorted(unmount_beneath(ramdisk)) == sorted(str(h) for h in homes)
        assert [(e.mountpoint, e.source) for e in mounts_under(ramdisk)] == [(str(ramdisk), "tierfs-test")]
        assert not (homes[0] / "data").exists()  # the directory under the mount again
        assert unmount_beneath(ramdisk) == []
    finally:
        for home in homes:
            while mounts.find_mount(home) is not None:
                subprocess.run(["umount", "-l", str(home)], check=False)


def test_the_largest_chunk_size_is_one_number(monkeypatch):
    assert wire.MAX_CHUNK == chunks.MAX_CHUNK_SIZE
    assert Config.build(mountpoint="/tmp", chunk_size=str(chunks.MAX_CHUNK_SIZE)).chunk_size == chunks.MAX_CHUNK_SIZE
    monkeypatch.setattr(chunks, "MAX_CHUNK_SIZE", 32 << 20)  # a reader's bound: the config follows it
    with pytest.raises(UserError) as err:
        Config.build(mountpoint="/tmp", chunk_size="64M")
    assert "between 64K and 32M" in str(err.value)
