"""Write-behind: FUSE writes are answered at once and copied into the RAM tier by a worker.

A write through FUSE is a round trip: the writer sleeps while the daemon copies the
request into tmpfs, so on its own each side leaves a core idle. Answering first and letting
one worker thread do the copy (``pwrite`` releases the GIL) overlaps the copy of one
request with the delivery of the next; on two cores that makes 1 MiB writes about 1.5x
faster (docs/benchmarks.md).

The file still ends up exactly as with synchronous writes: the kernel sends one file's
writes one at a time, and the single worker applies every write in the order it came.
What the rest of the daemon keeps in exchange:

- anything that reads or changes a file's data or attributes first waits for the file's
  writes (:meth:`WriteBehind.wait`); commits and ``statfs`` wait for all of them;
- a failure can no longer be the write's answer, so it is kept for the descriptor and
  reported by its next write, flush (``close``) or ``fsync``, as the kernel reports a failed
  page-cache writeback;
- a closed file is complete: flush and release wait, so a crash of the daemon after
  ``close`` returned loses nothing.

All methods but the worker's own are called from the trio thread. Waiting blocks that
thread rather than awaiting, so FUSE handlers still run to completion without yielding;
the wait is bounded by the queue depth (a few MiB of copying).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import queue
import threading

log = logging.getLogger(__name__)

# Writes queued behind the one being copied. Two are enough to keep both cores busy
# with one sequential writer; a few more absorb the jitter of several writers.
DEPTH = 4


class WriteBehind:
    """Applies ``(fd, offset, bytes)`` writes in order on one worker thread.

    Use as a context manager: the worker lives exactly as long as the ``with`` block, and
    leaving it applies everything queued before the thread ends.
    """

    def __init__(self, depth: int = DEPTH):
        self._queue: queue.Queue = queue.Queue(depth)
        self._applied_cond = threading.Condition()
        self._applied = 0  # writes the worker has finished (written under _applied_cond)
        self._submitted = 0
        self._newest: dict[int, int] = {}  # inode -> sequence number of its newest write
        self._finished: collections.deque = collections.deque()  # (fd, nbytes, error) from the worker
        self._errors: dict[int, OSError] = {}  # fd -> first failure not yet reported
        self.queued_bytes = 0  # submitted and not yet collected by finished()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> WriteBehind:
        self._thread = threading.Thread(target=self._work, name="tierfs-write-behind", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._queue.put(None)
        self._thread.join()
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def submit(self, ino: int, fd: int, offset: int, data: bytes) -> None:
        """Queue a write of ``data`` at ``offset``; blocks while DEPTH writes wait ahead of it."""
        self._submitted += 1
        self._newest[ino] = self._submitted
        self.queued_bytes += len(data)
        self._queue.put((fd, offset, data))

    def pending(self, ino: int | None = None) -> bool:
        """Whether writes to ``ino`` (or any writes) are still to be applied."""
        target = self._submitted if ino is None else self._newest.get(ino, 0)
        return target > self._applied

    def unsettled(self, ino: int) -> bool:
        """Whether writes to ``ino`` were submitted since the last :meth:`wait` for it.

        Unlike :meth:`pending`, the answer does not change while the worker runs, so it
        tells whether a status of the file taken earlier (on this thread, since that wait)
        may miss some of them: applied or not by now, they were queued when it was taken.
        """
        return ino in self._newest

    def wait(self, ino: int | None = None) -> None:
        """Block until every write submitted so far to ``ino`` (or to any file) is applied;
        returns at once when there is none."""
        target = self._submitted if ino is None else self._newest.get(ino, 0)
        if target > self._applied:
            with self._applied_cond:
                self._applied_cond.wait_for(lambda: self._applied >= target)
        if ino is None:
            self._newest.clear()
        else:
            self._newest.pop(ino, None)

    def finished(self) -> set[int]:
        """Collect applied writes: the descriptors whose files changed since the last call."""
        fds = set()
        while self._finished:
            fd, nbytes, error = self._finished.popleft()
            self.queued_bytes -= nbytes
            if error is not None:
                self._errors.setdefault(fd, error)
            fds.add(fd)
        return fds

    def take_error(self, fd: int) -> OSError | None:
        """The first failed write on ``fd`` since the last call (collect with finished() first)."""
        return self._errors.pop(fd, None)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            fd, offset, data = item
            error = None
            try:
                if os.pwrite(fd, data, offset) != len(data):
                    error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError as e:
                error = e
            except Exception as e:  # never die: every wait would hang
                log.exception("write-behind failed")
                error = OSError(errno.EIO, f"internal error: {e}")
            self._finished.append((fd, len(data), error))
            with self._applied_cond:
                self._applied += 1
                self._applied_cond.notify_all()
