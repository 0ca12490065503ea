"""The RAM tier on its own: layout, the serving lock, and space accounting on real tmpfs."""

from __future__ import annotations

import errno
import os

import pytest

from tierfs.core import holes
from tierfs.core.errors import UserError
from tierfs.ramtier import RankDir, SpaceAccount, layout
from tierfs.ramtier.snapshots import Snapshots

MiB = 1 << 20


def test_prepare_creates_tree_with_tmpfs_root_mode(shm_dir):
    rank = RankDir(shm_dir() / "job" / "rank-0")
    rank.prepare()
    assert oct(os.stat(rank.tree).st_mode & 0o7777) == oct(0o1777)
    assert rank.is_tmpfs()
    os.chmod(rank.tree, 0o755)  # a later prepare keeps what the user set
    rank.prepare()
    assert os.stat(rank.tree).st_mode & 0o7777 == 0o755


def test_claim_is_exclusive_and_names_the_holder(shm_dir, monkeypatch):
    # The holder's mountpoint serves nothing, so the claim first waits for it as for a dying daemon.
    monkeypatch.setattr(layout, "DYING_HOLDER_WAIT", 0.5)
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


# -- copies of sparse files keep their holes ------------------------------------------------


def sparse(path, size: int, data: dict[int, bytes]) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, chunk in data.items():
            os.pwrite(f.fileno(), chunk, offset)


def test_copy_data_keeps_holes_and_bytes(shm_dir):
    d = shm_dir()
    data = {0: b"head", 5 * MiB + 3: os.urandom(MiB), (1 << 40) - 3: b"end"}
    sparse(d / "src", 1 << 40, data)
    src, dst = os.open(d / "src", os.O_RDONLY), os.open(d / "dst", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        holes.copy_data(src, dst, 1 << 40)
    finally:
        os.close(src)
        os.close(dst)
    st = os.stat(d / "dst")
    assert st.st_size == 1 << 40 and st.st_blocks * 512 <= 4 * MiB
    with open(d / "dst", "rb") as f:
        for offset, chunk in data.items():
            f.seek(offset)
            assert f.read(len(chunk)) == chunk
        f.seek(4 << 30)
        assert f.read(MiB) == bytes(MiB)
        extents = list(holes.data_extents(f.fileno(), 0, 1 << 40))
    assert sum(end - start for start, end in extents) <= 4 * MiB and extents[0][0] == 0


@pytest.mark.parametrize("how", ["frozen while open for writing", "detached before a write"])
def test_a_snapshot_copy_of_a_sparse_file_costs_what_it_holds(small_tmpfs, how):
    """A job may make a file a petabyte long for free; the snapshot's copy must be as cheap."""
    rank = RankDir(small_tmpfs(64 * MiB) / "job" / "rank-0")
    rank.prepare()
    snapshots = Snapshots(rank.path, rank.tree, lambda st: None)
    snapshots.load()
    (rank.tree / "ckpt").mkdir()
    huge = rank.tree / "ckpt" / "huge"
    sparse(huge, 1 << 50, {1 << 40: b"weights"})
    ino = os.stat(huge).st_ino
    fd = os.open(huge, os.O_RDWR)
    try:
        if how == "frozen while open for writing":
            assert snapshots.freeze(1, "ckpt", writing={ino})
        else:
            assert snapshots.freeze(1, "ckpt", writing=set())
            assert snapshots.detach(ino, f"/proc/self/fd/{fd}") is not None
    finally:
        os.close(fd)
    copy = snapshots.step_tree(1) / "ckpt" / "huge"
    st = os.stat(copy)
    assert st.st_ino != ino and st.st_size == 1 << 50 and st.st_blocks * 512 <= MiB
    with open(copy, "rb") as f:
        f.seek(1 << 40)
        assert f.read(7) == b"weights"
