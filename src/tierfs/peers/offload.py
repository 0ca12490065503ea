"""Work on a body's pieces in a worker thread while the event loop moves the next piece.

A body arrives (or leaves) in pieces of up to 1 MiB. Moving a piece through the socket is
one system call on the loop; what is done with it (opening a sealed record, hashing,
writing into the RAM tier) is where the CPU goes, and xxhash, AES-GCM and ``pwrite`` all
release the GIL. So the loop receives piece k+1 while a thread works on piece k, on two
buffers, and several transfers at once use both cores instead of one.

Works run one at a time and in order, because a hash is fed in order. A piece's work is
waited for even under cancellation (a millisecond or so): the buffer it reads and the file
it writes must outlive it.

The buffers come from a pool (:data:`BUFFERS`): a fresh 1 MiB buffer is fresh pages, and
faulting them in on every piece cost more CPU than sealing it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import trio

T = TypeVar("T")

INLINE = 64 << 10  # pieces up to this size are worked on on the loop: a thread hand-off costs more
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
        self._outcome: Any = None  # an outcome.Outcome, as trio delivers it
        token = trio.lowlevel.current_trio_token()

        def deliver(result: Any) -> None:
            token.run_sync_soon(self._finish, result)

        trio.lowlevel.start_thread_soon(fn, deliver)

    def _finish(self, result: Any) -> None:
        self._outcome = result
        self._done.set()

    async def result(self) -> T:
        """``fn``'s return value, or its exception; waits for the thread even when cancelled."""
        try:
            await self._done.wait()
        finally:
            if not self._done.is_set():
                with trio.CancelScope(shield=True):
                    await self._done.wait()
        return self._outcome.unwrap()

    async def settle(self) -> None:
        """Wait for the thread and drop its result (an error is already on its way up)."""
        with trio.CancelScope(shield=True):
            await self._done.wait()


Work = Callable[[], None]


async def relay(fill: Callable[[int], Awaitable[Work | None]], size: int) -> None:
    """``fill(slot)`` on the loop, the work it returns in a thread, overlapped.

    ``fill`` fills buffer ``slot`` (0 or 1) and returns the work to do on it, or ``None``
    when the body is complete. Buffer ``slot`` is filled again only after its work ended;
    a work's exception (a hash mismatch, a full RAM tier) is raised here once the work
    before it has ended. A body of ``size`` up to :data:`INLINE` bytes is worked on on the
    loop.
    """
    previous: InThread[None] | None = None
    try:
        slot = 0
        while True:
            work = await fill(slot)
            if previous is not None:
                done, previous = previous, None
                await done.result()
            if work is None:
                return
            if size <= INLINE:
                work()
            else:
                previous = InThread(work)
                slot ^= 1
    finally:
        if previous is not None:
            await previous.settle()
