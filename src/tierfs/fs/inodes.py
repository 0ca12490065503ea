"""Inodes the kernel knows about, each pinned by an ``O_PATH`` descriptor.

Holding a descriptor per inode (as libfuse's passthrough_hp and virtiofsd do) instead of a
path makes every operation immune to renames of any ancestor: the kernel resolves names
relative to the descriptor, so a directory renamed while files inside it are open or
cached never leaves the table pointing at a stale path.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyfuse3

if TYPE_CHECKING:
    from tierfs.fs.recovery import SessionState

log = logging.getLogger(__name__)

O_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
TAKEN_OVER = 1 << 62  # the lookup count of a node a predecessor gave the kernel: unknown


@dataclass(slots=True)
class Inode:
    fd: int  # O_PATH descriptor of the backing file
    kind: int  # stat.S_IFMT of the backing file
    nlookup: int = 0  # lookups the kernel holds; forgotten at zero
    opens: int = 0  # open file handles
    orphaned: bool = False  # last link removed while open: free space at last release
    cache_valid: bool = False  # kernel page cache still matches the backing file
    open_fd: int = -1  # a handle's descriptor of the file while one is open (xattrs need no /proc walk)

    @property
    def proc_path(self) -> str:
        """A path that reopens this very inode, whatever its name is now."""
        return f"/proc/self/fd/{self.fd}"


class InodeTable:
    """Maps FUSE inode numbers to backing inodes.

    The FUSE inode number is the backing inode number, except that the tree's root is
    ``pyfuse3.ROOT_INODE``. Hard links therefore share one FUSE inode, as they must.

    With a ``record`` (:class:`~tierfs.fs.recovery.SessionState`), every node given to
    the kernel is written down, and a node id the table does not know (one a dead
    predecessor gave the kernel) is reopened from it: a successor meets the nodes the
    kernel holds lazily, as their requests come. Such a node's lookup count is unknown;
    the kernel forgets a node with one FORGET of its whole count, so the first FORGET of
    a taken-over node drops it.
    """

    def __init__(self, root: str | os.PathLike[str], record: SessionState | None = None):
        fd = os.open(root, O_PATH_FLAGS | os.O_DIRECTORY)
        self._root_ino = os.fstat(fd).st_ino
        self._nodes: dict[int, Inode] = {pyfuse3.ROOT_INODE: Inode(fd, stat.S_IFDIR, nlookup=1)}
        self.record = record

    def fuse_ino(self, st: os.stat_result) -> int:
        if st.st_ino == self._root_ino:
            return pyfuse3.ROOT_INODE
        if st.st_ino == pyfuse3.ROOT_INODE:  # cannot happen on tmpfs (ino 1 is its root)
            raise OSError(errno.EIO, "backing inode number collides with the FUSE root")
        return st.st_ino

    def __getitem__(self, ino: int) -> Inode:
        node = self._nodes.get(ino)
        if node is None and self.record is not None:
            node = self._taken_over(self.record, ino)
        if node is None or node.fd < 0:
            raise OSError(errno.ESTALE, "unknown inode")
        return node

    def _taken_over(self, record: SessionState, ino: int) -> Inode | None:
        """A node a predecessor gave the kernel, reopened from the ``record``."""
        fd = record.reopen(ino)
        if fd is None:
            return None
        node = self._nodes[ino] = Inode(fd, stat.S_IFMT(os.fstat(fd).st_mode), nlookup=TAKEN_OVER)
        return node

    def get(self, ino: int) -> Inode | None:
        return self._nodes.get(ino)

    def __len__(self) -> int:
        return len(self._nodes)

    def lookup(self, dirfd: int, name: bytes) -> tuple[int, os.stat_result]:
        """Resolve ``name`` in the directory ``dirfd`` and count one kernel lookup of it."""
        fd = os.open(name, O_PATH_FLAGS, dir_fd=dirfd)
        return self.adopt(fd)

    def adopt(self, fd: int, st: os.stat_result | None = None) -> tuple[int, os.stat_result]:
        """Count one lookup of the inode ``fd`` (an O_PATH descriptor, consumed) refers to
        (whose status is ``st``, if the caller has it)."""
        try:
            st = st or os.fstat(fd)
            ino = self.fuse_ino(st)
        except OSError:
            os.close(fd)
            raise
        node = self._nodes.get(ino)
        if node is None and self.record is not None:
            node = self._taken_over(self.record, ino)
        if node is None:
            node = self._nodes[ino] = Inode(fd, stat.S_IFMT(st.st_mode))
            self._recorded(ino, fd)
        elif node.fd < 0:  # tmpfs reused the number of an unpinned inode the kernel still knows
            node.fd, node.kind, node.orphaned, node.cache_valid = fd, stat.S_IFMT(st.st_mode), False, False
            node.open_fd = -1
            self._recorded(ino, fd)
        else:
            os.close(fd)
        node.nlookup += 1
        return ino, st

    def _recorded(self, ino: int, fd: int) -> None:
        if self.record is not None:
            try:
                self.record.node_added(ino, fd)
            except OSError as e:  # the node still serves; only a successor could not reopen it
                log.warning("could not record node %d for a successor: %s", ino, e)

    def unpin(self, ino: int) -> None:
        """The inode's last link is gone and nothing has it open: close its descriptor.

        The kernel may still hold lookups of it (and forget them later); any other request
        for it gets ESTALE, as nothing can reach an unlinked, unopened inode.
        """
        node = self._nodes.get(ino)
        if node is not None and node.fd >= 0 and ino != pyfuse3.ROOT_INODE:
            os.close(node.fd)
            node.fd = -1

    def forget(self, ino: int, n: int, undo: bool = False) -> Inode | None:
        """Drop ``n`` lookups (the kernel's FORGET, or ``undo`` of one never answered);
        returns the node if the kernel no longer knows it."""
        node = self._nodes.get(ino)
        if node is None or ino == pyfuse3.ROOT_INODE:
            return None
        node.nlookup = 0 if node.nlookup >= TAKEN_OVER and n and not undo else node.nlookup - n
        if node.nlookup > 0 or node.opens > 0:
            return None
        del self._nodes[ino]
        if self.record is not None:
            self.record.node_gone(ino)
        if node.fd >= 0:
            os.close(node.fd)
        return node

    def close_all(self) -> None:
        for node in self._nodes.values():
            if node.fd >= 0:
                os.close(node.fd)
        self._nodes.clear()
