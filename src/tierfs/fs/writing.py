"""Whether the job is writing: what replication, backups and hashing give way to.

Background work waits while the job writes (:mod:`tierfs.pipeline.pacing`), so that a
checkpoint being written gets the node's cores and memory bandwidth. Only writes that need
them count: the job is writing from the moment it has written :data:`WRITING` bytes within
one :data:`WINDOW` (20 MiB/s), not whenever a byte arrives. A job that appends a log line
every few milliseconds would otherwise hold every chunk of a replication back for the
pacing's full deferral, one chunk per second.

Passthrough writes never reach the daemon, so the files open for them are watched: their
size and mtime are looked at, at most every :data:`LOOK_EVERY` seconds, from whichever
thread asks. Growth counts as written bytes. A new mtime at the same size (bytes rewritten
in place, a preallocated file being filled) counts as the file's size, up to
:data:`WRITING`: how many bytes were rewritten is not known, and a small file rewritten
over and over is no bulk write.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

WRITING = 1 << 20  # bytes within one WINDOW that make the job a writer
WINDOW = 0.05
LOOK_EVERY = 0.01  # seconds between looks at the files passthrough writers have open


class Writing:
    """The job's writes as the mount sees them; :attr:`last` is when they last came in bulk."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last = 0.0
        self._window_start = 0.0
        self._window_bytes = 0
        self._watched: dict[int, tuple[int, int]] = {}  # passthrough writer fd -> (size, mtime_ns) at the last look
        self._looked = 0.0
        self._lock = threading.Lock()  # writes are noted on the loop, looked for from hashing threads too

    @property
    def last(self) -> float:
        """``time.monotonic()`` when the job was last writing in bulk; 0.0 if never."""
        now = self._clock()
        if self._watched and now - self._looked >= LOOK_EVERY and self._lock.acquire(blocking=False):
            try:  # another thread looking meanwhile is as good as looking here
                self._looked = now
                for fd, seen in list(self._watched.items()):
                    try:
                        st = os.fstat(fd)
                    except OSError:
                        continue
                    self._watched[fd] = (st.st_size, st.st_mtime_ns)
                    self._note(_written(seen, st), now)
            finally:
                self._lock.release()
        return self._last

    def wrote(self, n: int) -> None:
        """``n`` bytes written (or allocated) through the daemon just now."""
        with self._lock:
            self._note(n, self._clock())

    def watch(self, fd: int, st: os.stat_result) -> None:
        """``fd`` was opened for passthrough writes; ``st``: its status at the open."""
        with self._lock:
            self._watched[fd] = (st.st_size, st.st_mtime_ns)

    def unwatch(self, fd: int, st: os.stat_result) -> None:
        """``fd`` is being released (before it is closed); ``st``: its status now. What it
        wrote since the last look counts now."""
        with self._lock:
            seen = self._watched.pop(fd, None)
            if seen is not None:
                self._note(_written(seen, st), self._clock())

    def _note(self, n: int, now: float) -> None:
        if not n:
            return
        if now - self._window_start >= WINDOW:
            self._window_start, self._window_bytes = now, 0
        self._window_bytes += n
        if self._window_bytes >= WRITING:
            self._last = now


def _written(seen: tuple[int, int], st: os.stat_result) -> int:
    """Bytes a watched file took since it was seen as ``seen``, as far as its status tells."""
    size, mtime = seen
    if st.st_size > size:
        return st.st_size - size
    return min(st.st_size, WRITING) if st.st_mtime_ns != mtime else 0
