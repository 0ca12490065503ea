"""The RAM tier's tree as the commit rules and the space account see it.

A file of a committed step has extra hard links (its snapshot's), which users must not
see in ``st_nlink`` and which must not change under it: the file is detached from them
before it changes. Space is the account's, not tmpfs': a file's goes when its last link
and its last open do, and the volume's size is the account's when ``--capacity`` bounds
it. The commit rules speak of tree-relative paths, which only the kernel can give for a
descriptor (a name may have moved since the inode was looked up).
"""

from __future__ import annotations

import os
import stat

import pyfuse3

from tierfs.fs.inodes import Inode, InodeTable
from tierfs.ramtier.snapshots import Snapshots
from tierfs.ramtier.space import PAGE, SpaceAccount


class Tree:
    """Links, paths and space of the files under the volume's root."""

    def __init__(
        self, root: str | os.PathLike[str], inodes: InodeTable, space: SpaceAccount, snapshots: Snapshots | None
    ):
        self.inodes = inodes
        self.space = space
        self.snapshots = snapshots
        self._prefix = os.fsencode(os.path.abspath(root)) + b"/"
        self._proc_fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def nlink(self, st: os.stat_result) -> int:
        """The link count users see: without the snapshots' links."""
        return st.st_nlink - (self.snapshots.pins(st.st_ino) if self.snapshots else 0)

    def relpath(self, fd: int, name: bytes = b"") -> str | None:
        """The tree-relative path of ``fd`` (joined with ``name``), as the commit rules see it."""
        path = os.readlink(b"%d" % fd, dir_fd=self._proc_fds)
        if name:
            path = path + b"/" + name
        if not path.startswith(self._prefix) or path.endswith(b" (deleted)"):
            return None  # the root itself, or unlinked meanwhile
        return os.fsdecode(path[len(self._prefix) :])

    def detach(self, node: Inode) -> None:
        """Before a committed file changes, give its snapshots a copy of their own."""
        if self.snapshots is None or node.kind != stat.S_IFREG:
            return
        st = os.fstat(node.fd)
        if not self.snapshots.pins(st.st_ino):
            return
        self.space.check_growth(st.st_blocks * 512)
        copy = self.snapshots.detach(st.st_ino, node.proc_path)
        if copy is not None:
            self.space.update(copy)

    def link_removed(self, st: os.stat_result) -> None:
        """A link of ``st`` (a name in the tree or a snapshot) is gone: if it was the last, its
        space is free (at last close)."""
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            return
        ino = self.inodes.fuse_ino(st)
        node = self.inodes.get(ino)
        if node is not None and node.opens:
            node.orphaned = True
            return
        self.space.drop(st.st_ino)
        # Nothing can reach the inode any more but our pin, which the kernel would release
        # only with its FORGET, some requests later: let tmpfs free it now.
        self.inodes.unpin(ino)

    def statvfs(self) -> pyfuse3.StatvfsData:
        """The volume's size: the space account's when ``--capacity`` bounds it, else the backing tmpfs'."""
        backing = os.statvfs(self.inodes[pyfuse3.ROOT_INODE].proc_path)
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = PAGE
        if self.space.bounded:
            s.f_blocks = self.space.capacity // PAGE
            s.f_bfree = s.f_bavail = max(0, self.space.capacity - self.space.used) // PAGE
        else:
            scale = backing.f_frsize / PAGE
            s.f_blocks = int(backing.f_blocks * scale)
            s.f_bfree = int(backing.f_bfree * scale)
            s.f_bavail = int(backing.f_bavail * scale)
        s.f_files, s.f_ffree, s.f_favail = backing.f_files, backing.f_ffree, backing.f_favail
        s.f_namemax = backing.f_namemax
        return s

    def close(self) -> None:
        if self._proc_fds >= 0:
            os.close(self._proc_fds)
            self._proc_fds = -1
