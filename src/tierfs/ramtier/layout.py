"""Where a (job, rank) lives on the ramdisk, and who may serve it.

    <ramdisk>/<job>/rank-<N>/
        tree/           the files the mount shows, as a plain directory tree
        daemon.lock     flock()ed by the daemon serving this rank; holds its pid and mountpoint

Keeping the data as an ordinary tree on tmpfs means POSIX semantics come from the kernel,
the data outlives the daemon and the pod, and a restart only has to expose the tree again.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from pathlib import Path

from tierfs import linux
from tierfs.errors import UserError

class RankDir:
    """The on-ramdisk home of one (job, rank); :meth:`claim` makes this process its server."""

    def __init__(self, path: Path):
        self.path = path
        self.tree = path / "tree"
        self._lock_fd: int | None = None

    def prepare(self) -> None:
        """Create the directories (the tree root gets tmpfs' default root mode, 1777)."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            if not self.tree.exists():
                self.tree.mkdir()
                os.chmod(self.tree, 0o1777)
            probe = self.path / ".write-probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise UserError(
                f"ramdisk {self.path.parent.parent} is not writable ({e.strerror}): "
                "point --ramdisk at a writable tmpfs directory, e.g. /dev/shm/tierfs"
            ) from None
        if not stat.S_ISDIR(self.tree.lstat().st_mode):
            raise UserError(f"{self.tree} is not a directory: remove it or use another --ramdisk")

    def claim(self, mountpoint: Path) -> None:
        """Take the exclusive lock: two daemons must never serve the same rank's tree."""
        lock = self.path / "daemon.lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            holder = self.holder() or {}
            raise UserError(
                f"{self.path} is already served by tierfs pid {holder.get('pid', '?')} "
                f"mounted at {holder.get('mountpoint', '?')}: unmount it first"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "mountpoint": str(mountpoint)}).encode())
        self._lock_fd = fd

    def holder(self) -> dict | None:
        try:
            return json.loads((self.path / "daemon.lock").read_text() or "null")
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def is_tmpfs(self) -> bool:
        """Whether the tree is really in RAM (anything else works, but is not a RAM tier)."""
        return linux.fs_magic(self.tree) == linux.TMPFS_MAGIC
