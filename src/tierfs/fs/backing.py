"""Backing files registered with the kernel for passthrough.

A module of its own because two parties share it: the kernel session registers files with
the kernel once INIT granted passthrough, and :class:`~tierfs.fs.operations.Operations`
decides at each open whether a file may pass through; the kernel's rules for the backing
files (one per inode, no mix with the page cache) are kept here, between them.
"""

from __future__ import annotations

import fcntl
import logging

from tierfs.fs import abi

log = logging.getLogger(__name__)


class BackingFiles:
    """Backing files registered with the kernel for passthrough, one per open inode.

    The kernel ties an inode in passthrough to one backing file until its last such open
    is released, and refuses another one meanwhile; so an inode's id is shared by all its
    passthrough opens and closed with the last of them.
    """

    def __init__(self, dev_fd: int):
        self._dev_fd = dev_fd
        self._inodes: dict[int, list[int]] = {}  # ino -> [backing id, passthrough opens]
        self._handles: dict[int, int] = {}  # fh -> ino
        self.failed: OSError | None = None  # the kernel refused to register a file

    def opens(self, ino: int) -> int:
        entry = self._inodes.get(ino)
        return entry[1] if entry else 0

    def attach(self, ino: int, fh: int) -> int | None:
        """Serve ``fh`` (a descriptor of ``ino``'s backing file) by passthrough, if the kernel
        lets us: the backing id it then has, else None."""
        entry = self._inodes.get(ino)
        if entry is None:
            arg = bytearray(abi.BACKING_MAP.pack(fh, 0, 0))
            try:
                backing_id = fcntl.ioctl(self._dev_fd, abi.DEV_IOC_BACKING_OPEN, arg, True)
            except OSError as e:
                if self.failed is None:
                    log.warning(
                        "the kernel refused a passthrough backing file (%s): files are served "
                        "by the daemon from now on",
                        e.strerror or e,
                    )
                self.failed = e
                return None
            entry = self._inodes[ino] = [backing_id, 0]
        entry[1] += 1
        self._handles[fh] = ino
        return entry[0]

    def adopt(self, ino: int, fh: int, backing_id: int) -> None:
        """Count ``fh``, an open a predecessor registered as ``backing_id``, as attached."""
        entry = self._inodes.setdefault(ino, [backing_id, 0])
        entry[1] += 1
        self._handles[fh] = ino

    def backing_id(self, fh: int) -> int | None:
        ino = self._handles.get(fh)
        return None if ino is None else self._inodes[ino][0]

    def detach(self, fh: int) -> None:
        """``fh`` was released: the inode's last passthrough open closes its backing id."""
        ino = self._handles.pop(fh, None)
        if ino is None:
            return
        entry = self._inodes[ino]
        entry[1] -= 1
        if entry[1] == 0:
            del self._inodes[ino]
            try:
                fcntl.ioctl(self._dev_fd, abi.DEV_IOC_BACKING_CLOSE, abi.BACKING_ID.pack(entry[0]))
            except OSError as e:  # the connection is gone: nothing to close
                log.debug("closing backing id %d: %s", entry[0], e)

    def __len__(self) -> int:
        return len(self._handles)
