"""Data-parallel twins backing up one step to a bucket they share: one uploader per chunk.

Why. The D twins of a shard commit the same bytes. If each sent every chunk, a backup
would move D times the checkpoint up (a conditional create refuses a copy only after its
body went out) and, for each twin that lost the race, read it back to check it. Here every
chunk has one uploader, so a backup costs what the model weighs, not what the job weighs.

Who uploads a chunk is rendezvous hashing (:func:`uploader_order`): the twins sorted by a
hash of the chunk's name and the rank. Every twin computes the same order from facts it
already has (the chunk, the job's shape), so no message is needed; the chunks spread evenly
over the twins, so the upload runs on all D nodes' bandwidth; and when one twin is gone,
its chunks spread over the others by the same order instead of all landing on one.

What a twin does for a step is :func:`share`. It trusts nothing a twin promised: a chunk
counts once the bucket holds it (``exists``), and a chunk still missing after a bounded
wait is taken over by the next twin in its order, so one twin that dies or falls behind
delays the others by that wait, never leaves the step without a complete backup. The wait
adapts to the step (:class:`Patience`): shares are equal in expectation, so once this twin
has sent its own the others should be about done too.

Pure: the bucket is reached only through the callables a caller passes, and time through
``clock`` and ``sleep``, so the same procedure runs against GCS in the daemon, against a
dict in unit tests and in the scale simulation's mock time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import trio
import xxhash

T = TypeVar("T")


def uploader_order(h: str, twins: Iterable[int]) -> list[int]:
    """The twins in the order they upload chunk ``h``: the first sends it, the next takes over after one wait, ...

    Rendezvous hashing: each twin's place depends only on the chunk and its own rank, so
    removing a twin moves only the chunks it led, and those go to many twins.
    """
    return sorted(set(twins), key=lambda rank: (xxhash.xxh3_64_intdigest(f"{h}/{rank}".encode()), rank))


@dataclass(frozen=True)
class Patience:
    """How long a twin waits for the others before it takes over their chunks.

    The wait is ``floor`` plus ``factor`` times what this twin took for its own share, at
    most ``cap``: the floor covers twins that started the step a little later, the factor a
    twin whose uploads run slower, the cap a step so large that waiting on would hold its
    backup back too long. Chunks still missing are looked for every ``first_poll`` seconds
    at first, less often later (at most every ``max_poll``), so a step is complete soon
    after its last chunk lands without asking the bucket about every chunk all the time.
    """

    factor: float = 1.0
    floor: float = 5.0
    cap: float = 300.0
    first_poll: float = 0.1
    max_poll: float = 2.0

    def bound(self, own_seconds: float) -> float:
        return min(self.cap, self.floor + self.factor * max(0.0, own_seconds))


@dataclass
class ShareResult:
    """What one twin's :func:`share` of a step did, counted in chunks and raw bytes."""

    sent_chunks: int = 0  # uploaded by this twin (its own and those it took over)
    sent_bytes: int = 0
    twin_chunks: int = 0  # another twin was to upload them, and the bucket had them when looked for
    twin_bytes: int = 0
    taken_over: int = 0  # of sent_chunks: chunks another twin was to upload, still missing after the wait
    found_chunks: int = 0  # this twin was to upload them and the bucket had them already
    found_bytes: int = 0
    waited_s: float = 0.0  # from the end of its own share until every chunk was in the bucket


def one_each(hs: list[str]) -> list[list[str]]:
    """:func:`share`'s default ``batched``: every chunk on its own."""
    return [[h] for h in hs]


async def share(
    chunks: Mapping[str, int],
    me: int,
    twins: Sequence[int],
    *,
    exists: Callable[[str], Awaitable[bool]],
    upload: Callable[[list[str]], Awaitable[list[bool]]],
    batched: Callable[[list[str]], list[list[str]]] = one_each,
    workers: int = 1,
    patience: Patience = Patience(),
    settled: Callable[[str], None] = lambda h: None,
    clock: Callable[[], float] = trio.current_time,
    sleep: Callable[[float], Awaitable[None]] = trio.sleep,
) -> ShareResult:
    """Make the bucket hold every chunk of ``chunks`` (hash -> raw length), sharing the uploads with ``twins``.

    - ``me``: this twin's rank; ``twins``: the ranks that put the same step (``me`` among
      them or not). With no other twin every chunk is uploaded at once, and nothing waits.
    - ``exists(h)``: whether the bucket holds chunk ``h`` now, verified (a planted or
      damaged object under its name is not the chunk).
    - ``upload(hs)``: put the chunks ``hs``; for each, True if this call stored it, False
      if the bucket had it already (the upload must find that out itself: a conditional
      create). :func:`one_by_one` makes one of an upload of a single chunk.
    - ``batched(hs)``: the chunks due for upload, cut into the lists ``upload`` takes (one
      each by default; a tier that carries many chunks per request takes more).
    - ``workers``: chunks looked for, or lists uploaded, at once.
    - ``settled(h)``: called once chunk ``h`` is known to be in the bucket (progress).

    First this twin uploads the chunks it leads. Then it looks for the others until they
    are all there; a chunk still missing ``k`` waits after its own share ended, ``k``
    being this twin's place in the chunk's order, is looked for once more and uploaded. A
    twin that finishes early only waits: it never sends a chunk whose leader may be
    sending it right now. Returns once every chunk is in the bucket; any failure of
    ``exists`` or ``upload`` is raised, and then nothing may count the step as there.
    """
    result = ShareResult()
    group = sorted(set(twins) | {me})
    place = {h: uploader_order(h, group).index(me) for h in chunks} if len(group) > 1 else dict.fromkeys(chunks, 0)

    async def send(hs: list[str], owner: bool) -> None:
        for h, stored in zip(hs, await upload(hs), strict=True):
            if stored:
                result.sent_chunks += 1
                result.sent_bytes += chunks[h]
                result.taken_over += not owner
            elif owner:
                result.found_chunks += 1
                result.found_bytes += chunks[h]
            else:
                result.twin_chunks += 1
                result.twin_bytes += chunks[h]
            settled(h)

    started = clock()
    await each(batched([h for h in chunks if place[h] == 0]), lambda hs: send(hs, True), workers)
    own_done = clock()
    wait = patience.bound(own_done - started)
    waiting = [h for h in chunks if place[h] > 0]
    stage, poll = 1, patience.first_poll  # chunks whose place is below ``stage`` are due for takeover
    while waiting:
        while stage < len(group) and clock() >= own_done + stage * wait:
            stage += 1
        held = await look_for(waiting, exists, workers)
        for h in waiting:
            if held[h]:
                result.twin_chunks += 1
                result.twin_bytes += chunks[h]
                settled(h)
        missing = [h for h in waiting if not held[h]]
        await each(batched([h for h in missing if place[h] < stage]), lambda hs: send(hs, False), workers)
        waiting = [h for h in missing if place[h] >= stage]
        if waiting:
            next_stage = own_done + stage * wait
            await sleep(max(0.0, min(poll, next_stage - clock())))
            poll = min(poll * 2, patience.max_poll)
    result.waited_s = max(0.0, clock() - own_done)
    return result


async def look_for(hs: Sequence[str], exists: Callable[[str], Awaitable[bool]], workers: int) -> dict[str, bool]:
    """Whether the bucket holds each chunk of ``hs`` now, ``workers`` asked at a time."""
    held = dict.fromkeys(hs, False)

    async def look(h: str) -> None:
        held[h] = await exists(h)

    await each(hs, look, workers)
    return held


def one_by_one(upload: Callable[[str], Awaitable[bool]]) -> Callable[[list[str]], Awaitable[list[bool]]]:
    """:func:`share`'s ``upload`` from an upload of one chunk (True: this call stored it)."""

    async def each_of(hs: list[str]) -> list[bool]:
        return [await upload(h) for h in hs]

    return each_of


async def each(items: Sequence[T], fn: Callable[[T], Awaitable[None]], workers: int) -> None:
    """``fn`` on every item, ``workers`` at a time."""
    todo = iter(items)

    async def worker() -> None:
        for item in todo:
            await fn(item)

    async with trio.open_nursery() as nursery:
        for _ in range(max(1, min(workers, len(items)))):
            nursery.start_soon(worker)
