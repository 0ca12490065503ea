"""The RAM tier on its own: layout, the serving lock, and space accounting on real tmpfs."""

from __future__ import annotations

import errno
import os

import pytest

from tierfs.errors import UserError
from tierfs.ramtier import RankDir, SpaceAccount

MiB = 1 << 20


def test_prepare_creates_tree_with_tmpfs_root_mode(shm_dir):
    rank = RankDir(shm_dir() / "job" / "rank-0")
    rank.prepare()
    assert oct(os.stat(rank.tree).st_mode & 0o7777) == oct(0o1777)
    assert rank.is_tmpfs()
    os.chmod(rank.tree, 0o755)  # a later prepare keeps what the user set
    rank.prepare()
    assert os.stat(rank.tree).st_mode & 0o7777 == 0o755


def test_claim_is_exclusive_and_names_the_holder(shm_dir):
    path = shm_dir() / "job" / "rank-0"
    first, second = RankDir(path), RankDir(path)
    first.prepare()
    first.claim("/mnt/first")
    try:
        with pytest.raises(UserError, match=f"already served by tierfs pid {os.getpid()} mounted at /mnt/first"):
            second.claim("/mnt/second")
    finally:
        first.release()
    second.claim("/mnt/second")
    second.release()


def test_scan_counts_allocation_once_per_inode(shm_dir):
    root = shm_dir()
    (root / "a").write_bytes(b"x" * MiB)
    os.link(root / "a", root / "b")
    (root / "d").mkdir()
    (root / "d" / "c").write_bytes(b"y" * 5000)  # two pages
    (root / "sparse").write_bytes(b"")
    os.truncate(root / "sparse", 100 * MiB)
    space = SpaceAccount(None, root)
    space.scan(root)
    assert space.used == MiB + 8192


def test_check_write_allows_overwrite_but_not_growth_when_full(shm_dir):
    root = shm_dir()
    space = SpaceAccount(2 * MiB, root)
    p = root / "f"
    p.write_bytes(b"x" * (2 * MiB))
    space.scan(root)
    fd = os.open(p, os.O_RDWR)
    try:
        space.check_write(fd, 0, MiB)  # rewriting allocated bytes: fine
        with pytest.raises(OSError) as e:
            space.check_write(fd, 2 * MiB, 1)
        assert e.value.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_update_and_drop(shm_dir):
    root = shm_dir()
    space = SpaceAccount(None, root)
    p = root / "f"
    p.write_bytes(b"x" * MiB)
    space.update(os.stat(p))
    assert space.used == MiB
    os.truncate(p, 4096)
    space.update(os.stat(p))
    assert space.used == 4096
    space.drop(os.stat(p).st_ino)
    assert space.used == 0
    assert space.capacity == os.statvfs(root).f_blocks * os.statvfs(root).f_frsize
