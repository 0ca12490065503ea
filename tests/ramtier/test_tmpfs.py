"""A rank's tmpfs of its own takes the page size of its ramdisk: large folios where the
operator mounted the ramdisk with them, plain pages (a default tmpfs' behaviour) otherwise."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tierfs.core import linux, mounts
from tierfs.ramtier import RankDir, tmpfs

MiB = 1 << 20


def super_options(path: Path) -> tuple[str, ...]:
    entry = mounts.find_mount(path)
    assert entry is not None, f"{path} is not mounted"
    return entry.options


def rank_home(ramdisk: Path) -> Path:
    """A rank's home in ``ramdisk``, where a daemon would mount its tmpfs."""
    home = ramdisk / "job" / "rank-0"
    home.mkdir(parents=True)
    return home


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").exists(), reason="a kernel without transparent huge pages"
)
def test_a_rank_tmpfs_takes_the_large_folios_of_its_ramdisk(small_tmpfs):
    home = rank_home(small_tmpfs(64 * MiB, "huge=within_size"))
    assert tmpfs.own_tmpfs(home, 16 * MiB)
    assert "huge=within_size" in super_options(home)
    rank = RankDir(home)
    rank.prepare()
    assert rank.large_folios()
    assert tmpfs.own_tmpfs(home, 32 * MiB)  # a restart with another capacity keeps them
    assert "huge=within_size" in super_options(home)

    # The capacity stays exact: written in 1 MiB pieces, a file takes the whole tmpfs and no more.
    piece, written = os.urandom(MiB), 0
    fd = os.open(rank.tree / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError) as e:
            while True:
                written += os.write(fd, piece)
    finally:
        os.close(fd)
    assert e.value.errno == errno.ENOSPC
    assert written == 32 * MiB
    assert (rank.tree / "f").read_bytes() == piece * 32


def test_on_a_plain_ramdisk_a_rank_tmpfs_has_plain_pages(small_tmpfs):
    """So sparse files keep a default tmpfs' holes and block counts."""
    home = rank_home(small_tmpfs(64 * MiB))
    assert tmpfs.own_tmpfs(home, 16 * MiB)
    assert not [o for o in super_options(home) if o.startswith("huge=") and o != "huge=never"]
    rank = RankDir(home)
    rank.prepare()
    assert not rank.large_folios()
    with open(rank.tree / "sparse", "wb") as f:
        f.truncate(8 * MiB)
        f.seek(4 * MiB)
        f.write(b"x" * 4096)
    assert os.stat(rank.tree / "sparse").st_blocks * 512 == 4096


def test_deleting_ram_data_takes_files_the_job_froze(shm_dir):
    """chattr +i and +a files and directories, which tmpfs refuses to remove, go with the rest."""
    job = shm_dir("tierfs-job")
    rank = job / "rank-0" / "tree"
    (rank / "frozen-dir").mkdir(parents=True)
    (rank / "frozen-dir" / "inside").write_bytes(b"x")
    (rank / "append-only").write_bytes(b"y")
    (rank / "plain").write_bytes(b"z")
    for path, flags in (
        (rank / "frozen-dir" / "inside", linux.FS_IMMUTABLE_FL),
        (rank / "frozen-dir", linux.FS_IMMUTABLE_FL),
        (rank / "append-only", linux.FS_APPEND_FL),
    ):
        fd = os.open(path, os.O_RDONLY)
        try:
            linux.set_flags(fd, flags)
        finally:
            os.close(fd)
    with pytest.raises(PermissionError):
        os.unlink(rank / "append-only")
    tmpfs.delete_ram_data(job)
    assert not job.exists()
