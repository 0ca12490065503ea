"""Worker threads the event loop waits for, and the buffers they work on.

Sealing, opening, hashing and ``pwrite`` release the GIL; run in a worker thread they use
the second core while the loop goes on. A thread's work is waited for even when its waiter
is cancelled: the buffer it reads and the file it writes must outlive it.

The buffers come from a pool (:data:`BUFFERS`): a fresh 1 MiB buffer is fresh pages, and
faulting them in on every piece cost more CPU than sealing it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

import trio

if TYPE_CHECKING:
    import outcome

T = TypeVar("T")

INLINE = 64 << 10  # work on up to this many bytes is done on the loop: a thread hand-off costs more
BUFFER = (1 << 20) + 64  # a piece, with room for a sealed record's length field and tag
POOLED = 32  # buffers kept for the next transfer (32 MiB): two per transfer in flight


class BufferPool:
    """Buffers of :data:`BUFFER` bytes, reused: taken and given back on the event loop only."""

    def __init__(self, keep: int = POOLED):
        self._free: list[bytearray] = []
        self._keep = keep

    def take(self) -> bytearray:
        return self._free.pop() if self._free else bytearray(BUFFER)

    def give(self, *buffers: bytearray) -> None:
        for buf in buffers:
            if len(self._free) < self._keep:
                self._free.append(buf)


BUFFERS = BufferPool()


class InThread(Generic[T]):
    """``fn()`` started in a worker thread now, its result awaited later."""

    def __init__(self, fn: Callable[[], T]):
        self._done = trio.Event()
        self._outcome: outcome.Outcome[T] | None = None  # as trio delivers it, once the thread ended
        token = trio.lowlevel.current_trio_token()

        def deliver(result: outcome.Outcome[T]) -> None:
            token.run_sync_soon(self._finish, result)

        trio.lowlevel.start_thread_soon(fn, deliver)

    def _finish(self, result: outcome.Outcome[T]) -> None:
        self._outcome = result
        self._done.set()

    async def wait(self) -> None:
        """Until the thread ends; cancellable (then :meth:`settle` before freeing what it uses)."""
        await self._done.wait()

    def unwrap(self) -> T:
        """``fn``'s return value, or its exception, once the thread ended."""
        if self._outcome is None:
            raise RuntimeError("the worker thread has not ended yet")
        return self._outcome.unwrap()

    async def result(self) -> T:
        """``fn``'s return value, or its exception; waits for the thread even when cancelled."""
        try:
            await self._done.wait()
        finally:
            if not self._done.is_set():
                with trio.CancelScope(shield=True):
                    await self._done.wait()
        return self.unwrap()

    async def settle(self) -> None:
        """Wait for the thread and drop its result (an error is already on its way up)."""
        with trio.CancelScope(shield=True):
            await self._done.wait()


async def run_sync(fn: Callable[[], T], size: int) -> T:
    """``fn()``, which works on ``size`` bytes: in a worker thread above :data:`INLINE`, else on the loop.

    Small work is not a checkpoint: the I/O around it is.
    """
    if size > INLINE:
        return await InThread(fn).result()
    return fn()
