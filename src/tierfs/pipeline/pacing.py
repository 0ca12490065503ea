"""The job's writes go first: background work waits for a pause in them.

Replication, backups and the hashing of a committed step share the node's cores with the
training job. Before each chunk they send or read, they wait until the job has not been
writing for :data:`WRITER_QUIET`, at most :data:`MAX_DEFER` per chunk: a checkpoint being
written gets the CPU, and background work still progresses during a long write. What
counts as writing is the mount's to say (``last_write``, :mod:`tierfs.fs.writing`): bulk
writes, not a log line.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")

WRITER_QUIET = 0.05
MAX_DEFER = 1.0


class Pacing:
    def __init__(self, last_write: Callable[[], float]):
        self._last_write = last_write  # time.monotonic() when the job was last writing in bulk

    async def yield_to_writers(self) -> None:
        """Wait (at most MAX_DEFER) until the job has not written for WRITER_QUIET seconds."""
        deadline = time.monotonic() + MAX_DEFER
        while (wait := self._until_quiet(deadline)) > 0:  # noqa: ASYNC110 (a time the clock says, no event to wait for)
            await trio.sleep(wait)

    async def in_thread(self, fn: Callable[[Callable[[], None]], T], limiter: trio.CapacityLimiter) -> T:
        """``fn(pace)`` in a worker thread, ``pace()`` being :meth:`yield_to_writers` for it.

        The thread is always waited for, so once the caller is cancelled ``pace()`` stops
        waiting and the thread ends soon.
        """
        stopping = threading.Event()

        def pace() -> None:
            deadline = time.monotonic() + MAX_DEFER
            while (wait := self._until_quiet(deadline)) > 0 and not stopping.wait(wait):
                pass

        async def stop_when_cancelled() -> None:
            try:
                await trio.sleep_forever()
            finally:
                stopping.set()

        failure: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_when_cancelled)
            try:
                result = await trio.to_thread.run_sync(fn, pace, limiter=limiter)
            except Exception as e:  # noqa: BLE001 (raised below, outside the nursery: as itself, not in a group)
                failure = e
            finally:
                nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure
        return result

    def _until_quiet(self, deadline: float) -> float:
        """Seconds until the job may have paused its writes (0: it has, or the deferral is over)."""
        now = time.monotonic()
        return 0.0 if now >= deadline else min(max(0.0, WRITER_QUIET - (now - self._last_write())), deadline - now)
