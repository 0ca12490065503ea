"""The kernel's open handles, and what each one owes the files it writes.

A file handle is the backing descriptor itself, so a handler reaches the file with no
lookup; this table keeps what the descriptor cannot say: the inode it was opened as, how
the kernel writes through it (passthrough, direct I/O), and the debts of its writes (set-id
bits to drop, a write that failed after it was answered). A successor daemon learns the
handles from the ``record`` (:class:`~tierfs.fs.recovery.SessionState`), written here at
every open and close.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierfs.fs.recovery import SessionState

log = logging.getLogger(__name__)


class Handles:
    """File and directory handles, by handle (the backing descriptor)."""

    def __init__(self) -> None:
        self.files: dict[int, int] = {}  # fh -> FUSE inode
        self.dirs: dict[int, list[bytes] | None] = {}  # fh -> the listing readdir walks
        self.writable: set[int] = set()  # open for writing
        self.direct: set[int] = set()  # direct I/O: their writes bypass the page cache
        self.passthrough_writers: set[int] = set()  # written by the kernel itself
        self.unprivileged_writers: set[int] = set()  # open for writing by callers other than root
        self.kill_privs: set[int] = set()  # their next write must drop set-id bits
        self.failed_writes: set[int] = set()  # a write failed after it was answered
        self.record: SessionState | None = None  # what a successor needs: set with the engine's

    def __contains__(self, fh: int) -> bool:
        return fh in self.files or fh in self.dirs

    def ino(self, fh: int) -> int:
        return self.files[fh]

    def add_dir(self, fh: int, ino: int | None = None, flags: int = 0, kind: int = 0) -> None:
        """A directory handle; written into the record when ``ino`` is given (not one taken over)."""
        self.dirs[fh] = None
        if ino is not None:
            self.recorded(fh, ino, flags, kind)

    def recorded(self, fh: int, ino: int, flags: int, kind: int, backing_id: int = 0) -> None:
        """Write an open handle into the record for a successor; the open serves on if it cannot be."""
        if self.record is None:
            return
        try:
            self.record.opened(fh, ino, flags, kind, backing_id)
        except OSError as e:
            log.warning("a successor will not know file handle %d (its record cannot grow: %s)", fh, e.strerror or e)

    def remove_file(self, fh: int) -> int:
        """Forget ``fh`` (its writes already released) and return its inode; the caller closes it."""
        ino = self.files.pop(fh)
        if self.record is not None:
            self.record.closed(fh)
        self.kill_privs.discard(fh)
        self.unprivileged_writers.discard(fh)
        self.direct.discard(fh)
        return ino

    def remove_dir(self, fh: int) -> bool:
        """Forget a directory handle; False if it was not open (a release sent again)."""
        if self.dirs.pop(fh, False) is False:
            return False
        if self.record is not None:
            self.record.closed(fh)
        return True

    def privileged(self, ino: int) -> None:
        """``ino`` was just given set-id bits: the next write of each handle a caller other
        than root has open for writing on the daemon path drops them, as on tmpfs. (One that
        is passed through writes beside the daemon: its writes keep them.)"""
        for fh in self.unprivileged_writers:
            if self.files[fh] == ino and fh not in self.passthrough_writers:
                self.kill_privs.add(fh)

    def writers_through_daemon(self, ino: int) -> list[int]:
        """The handles writing ``ino`` on the daemon path."""
        return [fh for fh in self.writable - self.passthrough_writers if self.files[fh] == ino]

    def close_all(self) -> None:
        """Close every descriptor still held (after the kernel let go of the mount)."""
        for fh in list(self.files) + list(self.dirs):
            os.close(fh)
        self.files.clear()
        self.dirs.clear()
