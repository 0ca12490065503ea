"""Where a (job, rank) lives on the ramdisk, and who may serve it.

    <ramdisk>/<job>/rank-<N>/
        tree/           the files the mount shows, as a plain directory tree
        daemon.lock     flock()ed by the daemon serving this rank; holds its pid and mountpoint

Keeping the data as an ordinary tree on tmpfs means POSIX semantics come from the kernel,
the data outlives the daemon and the pod, and a restart only has to expose the tree again.

Everything above ``tree/`` is the daemon's: ``<job>/`` and ``rank-<N>/`` are root-only
(0700), so no user of the node reaches the snapshots, the replicas or the state files
that steer the next start, nor another job's tree. Only ``tree/`` has the job's modes, and
the job reaches it through the mount alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tierfs.core import linux, mounts
from tierfs.core.atomic import UnsafeFile, check_private, private_dir, read_small
from tierfs.core.errors import UserError

DYING_HOLDER_WAIT = 15.0  # seconds a killed daemon may take to let go of its rank


def _serving(mountpoint: str | None) -> bool:
    """Whether a daemon's mount still answers (a dead FUSE mount answers ENOTCONN)."""
    return mountpoint is not None and mounts.find_mount(mountpoint) is not None and not mounts.is_dead(mountpoint)


class RankDir:
    """The on-ramdisk home of one (job, rank); :meth:`claim` makes this process its server."""

    def __init__(self, path: Path):
        self.path = path
        self.tree = path / "tree"
        self._lock_fd: int | None = None
        self._folios: tuple[int, bool] | None = None  # (device of the tree, large folios), as last looked up

    @contextlib.contextmanager
    def _as_user_errors(self) -> Iterator[None]:
        try:
            yield
        except UnsafeFile as e:
            raise UserError(f"unsafe ramdisk: {e}") from None
        except OSError as e:
            raise UserError(
                f"ramdisk {self.path.parent.parent} is not writable ({e.strerror}): "
                "point --ramdisk at a writable tmpfs directory, e.g. /dev/shm/tierfs"
            ) from None

    def prepare_home(self) -> None:
        """Create the daemon's root-only (0700) directories down to the rank's home, checked
        if they exist. Raises UserError if one is not safe."""
        with self._as_user_errors():
            private_dir(self.path.parent.parent, own=False)
            private_dir(self.path.parent)
            private_dir(self.path)

    def prepare(self) -> None:
        """Create the directories: the daemon's root-only (0700), checked if they exist; the
        tree root with tmpfs' default root mode (1777). Raises UserError if one is not safe."""
        self.prepare_home()
        with self._as_user_errors():
            if not os.path.lexists(self.tree):
                os.mkdir(self.tree, 0o1777)
                os.chmod(self.tree, 0o1777)  # explicit: mkdir's mode may lose the sticky bit
            probe = self.path / ".write-probe"
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
            probe.unlink()
        if not stat.S_ISDIR(self.tree.lstat().st_mode):
            raise UserError(f"{self.tree} is not a directory: remove it or use another --ramdisk")

    @property
    def session(self) -> Path:
        """Where the daemon keeps the record of its FUSE connection (:mod:`tierfs.fs.recovery`):
        beside the rank's home, not in it, so that a rank's own tmpfs filled to its capacity
        leaves the record writable."""
        return self.path.parent / f"{self.path.name}.session"

    def state_dir(self, name: str) -> Path:
        """A root-only directory of the daemon's in the rank's home (``replicas``, ...)."""
        try:
            return private_dir(self.path / name)
        except UnsafeFile as e:
            raise UserError(f"unsafe ramdisk: {e}") from None

    def claim(self, mountpoint: Path) -> None:
        """Take the exclusive lock: two daemons must never serve the same rank's tree."""
        lock = self.path / "daemon.lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise UserError(f"cannot open {lock} ({e.strerror}): remove it if it is not a file") from None
        try:
            check_private(os.fstat(fd), lock)
        except UnsafeFile as e:
            os.close(fd)
            raise UserError(f"unsafe ramdisk: {e}: remove it") from None
        deadline = time.monotonic() + DYING_HOLDER_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    os.close(fd)
                    raise
            holder = self.holder() or {}
            # A killed daemon keeps the lock until its last thread has exited; its mount is
            # already dead or gone, so wait for it rather than refuse the mount that replaces it.
            if not _serving(holder.get("mountpoint")) and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            os.close(fd)
            raise UserError(
                f"{self.path} is already served by tierfs pid {holder.get('pid', '?')} "
                f"mounted at {holder.get('mountpoint', '?')}: unmount it first"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "mountpoint": str(mountpoint)}).encode())
        self._lock_fd = fd

    def holder(self) -> dict[str, Any] | None:
        try:
            # What claim() wrote: {"pid": ..., "mountpoint": ...}, or nothing yet.
            holder: dict[str, Any] | None = json.loads(
                read_small(self.path / "daemon.lock", 4096, private=True) or b"null"
            )
            return holder
        except (OSError, ValueError, UnsafeFile):
            return None

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def is_tmpfs(self) -> bool:
        """Whether the tree is really in RAM (anything else works, but is not a RAM tier)."""
        return linux.fs_magic(self.tree) == linux.TMPFS_MAGIC

    def large_folios(self) -> bool:
        """Whether the tmpfs holding the tree stores files in large folios.

        Asked by every status; the mount table is read again only when the tree's device
        changed (on a node with many pods it is thousands of lines).
        """
        dev = os.stat(self.tree).st_dev
        if self._folios is None or self._folios[0] != dev:
            self._folios = dev, mounts.large_folios(self.tree) is not None
        return self._folios[1]
