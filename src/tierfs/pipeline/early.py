"""A step's chunks on their way to peers while the rest of the step is still being hashed.

A manifest names every chunk of a step, so a lane cannot put the step before it is hashed:
at 0.1-0.2 s per GiB, the peers would wait that long after every commit with nothing to
do. But each file's chunks are known as soon as that file is hashed, and a peer keeps the
chunks it is sent for as long as the connection lasts, manifest or not. So the builder
publishes each file's chunks in a :class:`StepFeed`, and :func:`send_early` puts them on the
lane's tiers meanwhile.

This is only a head start: once the manifest is complete the lane puts the step as always
(``put_step``: which chunks does the tier hold, send the others, then the manifest), so a
chunk sent early and lost, or never sent, is sent then. Nothing here can make a step look
replicated that is not.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import trio

from tierfs.tiers.base import Location, Tier, TierError, batches

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class StepFeed:
    """The chunks of one version of a step, in the order their files were hashed."""

    step: int
    version: int
    places: dict[str, Location] = field(default_factory=dict)  # chunk -> its first place in the snapshot
    order: list[str] = field(default_factory=list)  # the chunks, as they came
    done: bool = False  # the build ended (a manifest, or a failure): early sending stops
    grew: trio.Event = field(default_factory=trio.Event)

    def add(self, places: list[tuple[str, Location]]) -> None:
        for h, where in places:
            if h not in self.places:
                self.places[h] = where
                self.order.append(h)
        self.wake()

    def close(self) -> None:
        self.done = True
        self.wake()

    def wake(self) -> None:
        """Wake whoever waits for the feed to grow (to look again at what it waits for)."""
        self.grew.set()
        self.grew = trio.Event()


async def send_early(feed: StepFeed, tiers: Sequence[Tier], pace: Callable[[], Awaitable[None]]) -> dict[str, int]:
    """Put the feed's chunks on ``tiers`` (in parallel) until the build ends; bytes sent, by tier name.

    For each tier, one task asks which of the chunks published since its last question the
    tier lacks, and ``tier.concurrency`` workers put those, each taking the next batch (as
    many as the tier takes per request, :func:`~tierfs.tiers.base.batches`) as soon as it is
    done: files hashed one at a time (a step of many small files) keep every worker busy
    instead of going one chunk, and one question, at a time, and the chunks published while
    the workers were busy go many to a request. Never raises: a tier that fails is left
    alone here, and the lane's own put finds out.
    """
    sent: dict[str, int] = {}

    async def one(tier: Tier) -> None:
        stopped = False  # the tier failed: its head start ends
        lacking_in, lacking = trio.open_memory_channel(math.inf)

        async def ask() -> None:
            nonlocal stopped
            offered = 0
            async with lacking_in:
                while not (feed.done or stopped):
                    batch = feed.order[offered:]
                    if not batch:
                        await feed.grew.wait()
                        continue
                    offered += len(batch)
                    try:
                        held = await tier.has_chunks(batch)
                    except TierError as e:
                        stopped = True
                        log.debug("step %d: early chunks to %s stopped: %s", feed.step, tier.name, e)
                        return
                    missing = [(h, feed.places[h]) for h, there in zip(batch, held, strict=True) if not there]
                    for hs in batches(tier, missing):
                        lacking_in.send_nowait(hs)

        async def put() -> None:
            nonlocal stopped
            async for hs in lacking:
                if feed.done or stopped:
                    return
                await pace()
                try:
                    done = await tier.put_chunks([(h, feed.places[h]) for h in hs])
                except TierError as e:
                    stopped = True
                    feed.wake()  # the question asked next would be for nothing
                    log.debug("step %d: early chunks to %s stopped: %s", feed.step, tier.name, e)
                    return
                sent[tier.name] = sent.get(tier.name, 0) + sum(p.sent for p in done)

        async with lacking, trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            for _ in range(tier.concurrency):
                nursery.start_soon(put)

    async with trio.open_nursery() as nursery:
        for tier in tiers:
            nursery.start_soon(one, tier)
    return sent


class Feeds:
    """The feed of the build in progress (one at a time), for the lanes that follow it."""

    def __init__(self) -> None:
        self.current: StepFeed | None = None
        self._started = trio.Event()

    def begin(self, step: int, version: int) -> StepFeed:
        feed = self.current = StepFeed(step, version)
        self._started.set()
        self._started = trio.Event()
        return feed

    async def alongside(
        self,
        build: Callable[[], Awaitable[T]],
        step: int,
        version: int,
        tiers: Sequence[Tier],
        pace: Callable[[], Awaitable[None]],
        built: Callable[[], bool],
    ) -> tuple[T, dict[str, int]]:
        """``build()``'s result, with the chunks of that version's build sent to ``tiers`` meanwhile.

        The build may be another lane's, already under way; ``built()`` says the version
        was built before any feed of it was seen (then nothing is sent early). The chunk in
        flight when the build ends is finished, not cut off; ``build()``'s exception is
        raised as it is.
        """
        sent: dict[str, int] = {}
        following = False
        error: Exception | None = None

        async def follow() -> None:
            nonlocal following
            while (feed := self.current) is None or (feed.step, feed.version) != (step, version):
                if built():
                    return
                await self._started.wait()
            following = True
            sent.update(await send_early(feed, tiers, pace))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow)
            try:
                result = await build()
            except Exception as e:  # noqa: BLE001 (raised below, not in a group: the lane tells a refused step by its type)
                error = e
            if not following:
                nursery.cancel_scope.cancel()  # still waiting for a build that will not come
        if error is not None:
            raise error
        return result, sent
