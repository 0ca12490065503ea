"""Capacity accounting for the RAM tier.

The ramdisk may be shared by several jobs or be larger than this volume may use, so the
tier counts its own allocation: the allocated bytes (``st_blocks * 512``) of every regular
file inode under the tree, keyed by inode number so hard links count once. Holes cost
nothing, exactly as on tmpfs. Writes that would pass the capacity fail with ENOSPC before
any byte is written, so nothing already stored is damaged.
"""

from __future__ import annotations

import errno
import os
import stat

PAGE = 4096


class SpaceAccount:
    def __init__(self, capacity: int | None, backing: os.PathLike[str] | str):
        self._capacity = capacity
        self._backing = backing
        self._allocated: dict[int, int] = {}
        self._charges: dict[str, int] = {}  # what the daemon holds outside the scanned trees, by name
        self.used = 0

    @property
    def capacity(self) -> int:
        """The configured capacity, or the backing filesystem's size when unbounded."""
        if self._capacity is not None:
            return self._capacity
        st = os.statvfs(self._backing)
        return st.f_blocks * st.f_frsize

    @property
    def bounded(self) -> bool:
        return self._capacity is not None

    def scan(self, *roots: os.PathLike[str] | str) -> None:
        """Count what is already stored (after a restart the tree is still there)."""
        self._allocated.clear()
        for root in roots:
            for _, _, filenames, dir_fd in os.fwalk(root):  # by descriptors: never through a link
                for name in filenames:
                    st = os.lstat(name, dir_fd=dir_fd)
                    if stat.S_ISREG(st.st_mode):
                        self._allocated[st.st_ino] = st.st_blocks * 512
        self.used = sum(self._allocated.values()) + sum(self._charges.values())

    def charge(self, name: str, nbytes: int) -> None:
        """Count ``nbytes`` held under ``name`` outside the scanned trees, instead of what it held before:
        for a store that knows its own size (the erasure group's parity) rather than its inodes."""
        self.used += nbytes - self._charges.get(name, 0)
        self._charges[name] = nbytes

    def check_growth(self, nbytes: int) -> None:
        """Raise ENOSPC if allocating ``nbytes`` more would pass the capacity."""
        if self._capacity is not None and nbytes > 0 and self.used + nbytes > self._capacity:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def fits(self, nbytes: int, fd: int) -> bool:
        """Whether ``nbytes`` more surely fit, in the capacity and in the tmpfs holding ``fd``."""
        if self._capacity is not None and self.used + nbytes > self._capacity:
            return False
        st = os.fstatvfs(fd)  # no path walk: this runs for every write
        return st.f_blocks == 0 or st.f_bavail * st.f_frsize >= nbytes  # 0 blocks: unlimited

    def check_write(self, fd: int, offset: int, length: int) -> None:
        """Check a write of ``length`` bytes at ``offset`` into the open file ``fd``."""
        if self._capacity is None or self.used + length <= self._capacity:
            return  # common case: plenty of room whatever the write allocates
        st = os.fstat(fd)
        end = -(-(offset + length) // PAGE) * PAGE
        start = offset // PAGE * PAGE
        if st.st_blocks * 512 >= -(-st.st_size // PAGE) * PAGE:
            # Not sparse: only bytes past the current end allocate.
            start = max(start, -(-st.st_size // PAGE) * PAGE)
        self.check_growth(end - start)

    def update(self, st: os.stat_result) -> None:
        """Record a regular file's current allocation."""
        if stat.S_ISREG(st.st_mode):
            new = st.st_blocks * 512
            self.used += new - self._allocated.get(st.st_ino, 0)
            self._allocated[st.st_ino] = new

    def drop(self, ino: int) -> None:
        """The inode is gone (last link removed and no longer open): its space is free."""
        self.used -= self._allocated.pop(ino, 0)
