"""Write-behind: FUSE writes leave the request loop at once and are copied into the RAM tier
by worker threads.

A write through FUSE is a round trip: the writer sleeps while the daemon copies the
request into tmpfs, so on its own each side leaves a core idle. Handing the copy to a worker
thread (``pwrite`` and ``splice`` release the GIL) lets the request loop read the next
request meanwhile. Two kinds of writes are queued:

- ``submit``: bytes already read from the kernel, answered by the request loop before they
  are copied (pyfuse3, whose handlers must answer before the next request is read). One
  worker applies them in the order they came, so the file ends up exactly as with
  synchronous writes (the kernel sends one file's writes one at a time).
- ``submit_job``: a callable that moves the bytes and answers the kernel itself, after they
  are in (tierfs' own engine, from a pipe the request was spliced into). The kernel never
  has two writes to one range in flight, so several workers may apply them in any order.

What the rest of the daemon keeps in exchange:

- anything that reads or changes a file's data or attributes first waits for the file's
  writes (:meth:`WriteBehind.wait`); commits and ``statfs`` wait for all of them;
- a failure of an answered write can no longer be its answer, so it is kept for the
  descriptor and reported by its next write, flush (``close``) or ``fsync``, as the kernel
  reports a failed page-cache writeback;
- a closed file is complete: flush and release wait, so a crash of the daemon after
  ``close`` returned loses nothing.

All methods but the workers' own are called from the trio thread. Waiting blocks that
thread rather than awaiting, so FUSE handlers still run to completion without yielding;
the wait is bounded by the queue depth (a few MiB of copying).
"""

from __future__ import annotations

import collections
import errno
import functools
import logging
import os
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

# Writes queued behind the ones being copied, per worker. Two are enough to keep both cores
# busy with one sequential writer; a few more absorb the jitter of several writers.
DEPTH = 4
# A queued write: inode, descriptor, bytes, and what applies it (None: a worker's cue to end).
_Job = tuple[int, int, int, Callable[[], None]]


class WriteBehind:
    """Applies queued writes on worker threads: in order on one, or in any order on several.

    Use as a context manager: the workers live exactly as long as the ``with`` block, and
    leaving it applies everything queued before the threads end. ``threads`` may be set
    until then (the engine knows which kind of writes it will queue).
    """

    def __init__(self, depth: int = DEPTH, threads: int = 1):
        self.depth = depth
        self.threads = threads
        self._queue: queue.Queue[_Job | None] = queue.Queue()  # made anew, to size, when the workers start
        self._cond = threading.Condition()
        self._in_flight: collections.Counter[int] = collections.Counter()  # inode -> writes not yet applied
        self._total = 0  # writes not yet applied, of all inodes (both under _cond)
        self._touched: set[int] = set()  # inodes written since the last wait for them
        # (fd, nbytes, error) from the workers
        self._finished: collections.deque[tuple[int, int, OSError | None]] = collections.deque()
        self._errors: dict[int, OSError] = {}  # fd -> first failure not yet reported
        self.queued_bytes = 0  # submitted and not yet collected by finished()
        self._workers: list[threading.Thread] = []

    def __enter__(self) -> WriteBehind:
        self._queue = queue.Queue(self.depth * self.threads)
        self._workers = [
            threading.Thread(target=self._work, name="tierfs-write-behind", daemon=True) for _ in range(self.threads)
        ]
        for worker in self._workers:
            worker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for _ in self._workers:
            self._queue.put(None)
        for worker in self._workers:
            worker.join()
        self._workers = []

    @property
    def running(self) -> bool:
        return bool(self._workers)

    def submit(self, ino: int, fd: int, offset: int, data: bytes) -> None:
        """Queue a write of ``data`` at ``offset``, answered already; blocks while the queue is full."""
        if self.threads != 1:
            raise RuntimeError("answered writes must be applied in order, by one worker")
        self.submit_job(ino, fd, len(data), functools.partial(_pwrite, fd, data, offset))

    def submit_job(self, ino: int, fd: int, nbytes: int, apply: Callable[[], None], now: bool = False) -> None:
        """Queue ``apply()``, which writes up to ``nbytes`` into ``fd`` (an OSError it raises
        is kept for ``fd``); blocks while the queue is full. Applied at once, on this
        thread, if asked ``now`` or without workers (outside the ``with`` block)."""
        with self._cond:
            self._in_flight[ino] += 1
            self._total += 1
        self._touched.add(ino)
        self.queued_bytes += nbytes
        if self._workers and not now:
            self._queue.put((ino, fd, nbytes, apply))
        else:
            self._apply(ino, fd, nbytes, apply)

    def pending(self, ino: int | None = None) -> bool:
        """Whether writes to ``ino`` (or any writes) are still to be applied."""
        return (self._total if ino is None else self._in_flight[ino]) > 0

    def unsettled(self, ino: int) -> bool:
        """Whether writes to ``ino`` were submitted since the last :meth:`wait` for it.

        Unlike :meth:`pending`, the answer does not change while the workers run, so it
        tells whether a status of the file taken earlier (on this thread, since that wait)
        may miss some of them: applied or not by now, they were queued when it was taken.
        """
        return ino in self._touched

    def wait(self, ino: int | None = None) -> None:
        """Block until every write submitted so far to ``ino`` (or to any file) is applied;
        returns at once when there is none."""
        if self.pending(ino):
            with self._cond:
                self._cond.wait_for(lambda: not self.pending(ino))
        if ino is None:
            self._touched.clear()
        else:
            self._touched.discard(ino)

    def finished(self) -> set[int]:
        """Collect applied writes: the descriptors whose files changed since the last call."""
        fds: set[int] = set()
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
            self._apply(*item)

    def _apply(self, ino: int, fd: int, nbytes: int, apply: Callable[[], None]) -> None:
        error: OSError | None = None
        try:
            apply()
        except OSError as e:
            error = e
        except Exception as e:  # never die: every wait would hang
            log.exception("write-behind failed")
            error = OSError(errno.EIO, f"internal error: {e}")
        self._finished.append((fd, nbytes, error))
        with self._cond:
            self._in_flight[ino] -= 1
            if not self._in_flight[ino]:
                del self._in_flight[ino]
            self._total -= 1
            self._cond.notify_all()


def _pwrite(fd: int, data: bytes, offset: int) -> None:
    if os.pwrite(fd, data, offset) != len(data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
