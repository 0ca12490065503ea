"""A tmpfs of its own for a rank sized to ``--capacity``: the kernel enforces the bound.

With kernel passthrough the daemon no longer sees writes, so it cannot refuse the one
that passes the capacity; a tmpfs of exactly that size refuses it itself, with ENOSPC from
the very write, for every writer (the job, restores, replicas from peers). Hard links of
committed steps stay within one file system, since snapshots live beside the tree. The
mount outlives the daemon, as the data must; a restart with another capacity resizes it.
Whatever deletes a job's or a rank's RAM data therefore unmounts it first
(:func:`unmount_beneath`).

It stores files in pages of the size the ramdisk's own tmpfs uses: where the operator
mounted that one with large folios (``huge=within_size``, docs/operations.md), so is the
rank's, and writes and reads of large files go several times faster; otherwise it has
plain 4 KiB pages and exactly the behaviour of a default tmpfs (a sparse file's holes, its
``st_blocks``), which large folios coarsen.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from tierfs.core import linux, mounts
from tierfs.core.errors import UserError
from tierfs.core.parse import format_size

MS_NOSUID, MS_NODEV, MS_REMOUNT = 2, 4, 32
SOURCE = "tierfs-ram"
_MAX_LAYERS = 16  # tmpfs mounts stacked at one place that unmount_beneath takes away


def is_own_tmpfs(path: Path) -> bool:
    entry = mounts.find_mount(path)
    return entry is not None and entry.fstype == "tmpfs"


def own_tmpfs(path: Path, size: int) -> bool:
    """Make ``path`` a tmpfs of ``size`` bytes (mounting or resizing it).

    False, with nothing changed, if ``path`` already holds data on another file system
    (a rank first mounted without a capacity): that data cannot move under a new mount.
    """
    if is_own_tmpfs(path):
        try:
            linux.mount(SOURCE, str(path), "tmpfs", MS_REMOUNT | MS_NOSUID | MS_NODEV, f"size={size}")
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            raise UserError(
                f"capacity {format_size(size)} is below what {path} already holds: raise --capacity or remove files"
            ) from None
        return True
    with os.scandir(path) as entries:
        if any(entries):
            return False
    options = f"size={size},mode=0700,uid=0,gid=0"
    huge = mounts.large_folios(path.parent)
    linux.mount(SOURCE, str(path), "tmpfs", MS_NOSUID | MS_NODEV, options + (f",{huge}" if huge else ""))
    return True


def unmount_beneath(path: Path) -> list[str]:
    """Detach every tmpfs of tierfs' own (source ``tierfs-ram``) at or beneath ``path``.

    A rank's home may be such a tmpfs. Deleting the RAM data of a job or a rank must take
    it away first: ``rmtree`` would empty it but could not remove its mountpoint, so the
    directory and the mount (with its size reservation) would stay. The unmount is lazy
    (``MNT_DETACH``): a reader still inside, such as a daemon that is just exiting, keeps
    what it has open, and nothing new reaches the old data. Only tierfs' own tmpfs mounts
    are touched, never another mount an operator put beneath ``path``. Returns the
    mountpoints detached, deepest first.
    """
    top = os.path.realpath(path)
    detached: list[str] = []
    for _ in range(_MAX_LAYERS):  # one pass per layer: a mount may cover another at the same place
        topmost: dict[str, mounts.MountEntry] = {}
        for entry in mounts.mount_table():  # later entries cover earlier ones
            if entry.mountpoint == top or entry.mountpoint.startswith(top + "/"):
                topmost[entry.mountpoint] = entry
        ours = [m for m, e in topmost.items() if e.fstype == "tmpfs" and e.source == SOURCE]
        if not ours:
            break
        for mountpoint in sorted(ours, key=lambda m: m.count("/"), reverse=True):
            linux.umount(mountpoint, linux.MNT_DETACH)
            detached.append(mountpoint)
    return detached


def delete_ram_data(path: Path) -> None:
    """Delete a job's or a rank's RAM data for good: its own tmpfs detached first, then the
    rest, including files the job made append-only or immutable (``chattr``), which tmpfs
    refuses to remove until their flags are cleared."""
    unmount_beneath(path)

    def unfreeze_and_retry(
        func: Callable[[str], object], failed: str, exc_info: tuple[type[BaseException], BaseException, TracebackType]
    ) -> None:
        if not isinstance(exc_info[1], PermissionError):
            return  # what cannot be deleted otherwise is left, as rmtree(ignore_errors) would
        for p in (os.path.dirname(failed), failed):
            _clear_frozen(p)
        try:
            func(failed)
        except OSError:
            pass

    shutil.rmtree(path, onerror=unfreeze_and_retry)


def _clear_frozen(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        flags = linux.get_flags(fd)
        if flags & (linux.FS_APPEND_FL | linux.FS_IMMUTABLE_FL):
            linux.set_flags(fd, flags & ~(linux.FS_APPEND_FL | linux.FS_IMMUTABLE_FL))
    except OSError:
        pass
    finally:
        os.close(fd)
