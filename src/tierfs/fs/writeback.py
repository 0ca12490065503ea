"""Writes answered before they are in the RAM tier, and what is owed for each.

The queue (:class:`~tierfs.fs.writebehind.WriteBehind`) applies them; this part keeps the
rules around it: a write near a full ``--capacity`` is applied at once and after the queued
ones, so that ENOSPC is its own; the space account learns what was written, the daemon's
writes and the kernel's passthrough writes alike; a write that failed after its answer is
reported at the next write, flush or fsync of its handle, as a failed writeback is; and a
write by a caller other than root drops set-id bits, as on tmpfs.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from tierfs.fs.caller import drop_privs
from tierfs.fs.handles import Handles
from tierfs.fs.inodes import InodeTable
from tierfs.fs.writebehind import WriteBehind
from tierfs.fs.writing import Writing
from tierfs.ramtier.space import SpaceAccount


class WriteBack:
    """The write path's rules, over the queue ``writes``."""

    def __init__(
        self, writes: WriteBehind, space: SpaceAccount, inodes: InodeTable, handles: Handles, writing: Writing
    ) -> None:
        self.writes = writes
        self.space = space
        self.inodes = inodes
        self.handles = handles
        self.writing = writing
        self.bytes_written = 0

    def write(self, fh: int, off: int, buf: bytes) -> int:
        ino = self.before(fh)
        if self.writes.running and self.space.fits(self.writes.queued_bytes + len(buf), fh):
            self.writes.submit(ino, fh, off, buf)
            n = len(buf)
        else:  # near full: apply it now, after the queued ones, so that ENOSPC is this write's
            self.done(ino)
            self.space.check_write(fh, off, len(buf))
            n = os.pwrite(fh, buf, off)
            self.space.update(os.fstat(fh))
        self.wrote(fh, ino, n)
        return n

    def write_by(self, fh: int, off: int, size: int, apply: Callable[[], None], now: bool = False) -> None:
        """A write of ``size`` bytes at ``off`` that ``apply()`` makes and answers itself,
        queued, or made ``now``; near a full ``--capacity``, only after the queued ones and
        waited for (ENOSPC before anything is written). Raises only before ``apply`` is queued."""
        ino = self.before(fh)
        near_full = not self.space.fits(self.writes.queued_bytes + size, fh)
        if near_full:
            self.done(ino)
            self.space.check_write(fh, off, size)
        self.writes.submit_job(ino, fh, size, apply, now)  # from here on, nothing may fail: apply answers
        if near_full:
            self.writes.wait(ino)
        self.wrote(fh, ino, size)

    def done(self, ino: int | None = None) -> None:
        """Wait until the writes to ``ino`` (or to every file) are in the RAM tier, and account them."""
        self.writes.wait(ino)
        self.account()

    def account(self) -> None:
        for fd in self.writes.finished():
            self.space.update(os.fstat(fd))
        for fd in self.handles.passthrough_writers:  # the kernel writes these without telling us
            self.space.update(os.fstat(fd))

    def raise_error(self, fh: int) -> None:
        """Report a write of ``fh`` that failed after it was answered (as a failed writeback)."""
        error = self.writes.take_error(fh)
        if error is not None:
            self.handles.failed_writes.add(fh)
            raise error

    def before(self, fh: int) -> int:
        """What comes before a write of ``fh`` (or a change of its file as by one): its inode."""
        ino = self.handles.ino(fh)
        self.account()
        self.raise_error(fh)
        if fh in self.handles.kill_privs:
            self.handles.kill_privs.discard(fh)
            drop_privs(f"/proc/self/fd/{fh}")
        return ino

    def wrote(self, fh: int, ino: int, n: int) -> None:
        if fh in self.handles.direct:  # the kernel's cached pages of the file may be stale now
            self.inodes[ino].cache_valid = False
        self.bytes_written += n
        self.writing.wrote(n)
