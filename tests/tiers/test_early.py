"""Chunks sent to a peer while the rest of their step is still being hashed (pipeline/early.py).

The tier is the real peer tier against a real peer service (``conftest.py``); the "build"
is a stand-in that publishes files' chunks one at a time, as the hashing threads do, so a
test can look at the peer between two files.
"""

from __future__ import annotations

import os

import pytest
import trio

from tierfs.core.chunks import chunk_hash
from tierfs.pipeline.early import Feeds

pytestmark = pytest.mark.parametrize("kind", ["peer"], indirect=True)
MiB = 1 << 20


async def no_pause() -> None:
    await trio.lowlevel.checkpoint()


def chunk_files(files, n: int) -> list[tuple[str, tuple[str, int, int]]]:
    out = []
    for i in range(n):
        data = os.urandom(MiB + i)
        out.append((chunk_hash(data), (str(files(data)), 0, len(data))))
    return out


async def test_a_file_s_chunks_reach_the_peer_before_the_step_is_hashed(subject, files):
    tier, feeds = subject.tier, Feeds()
    places = chunk_files(files, 3)
    seen_before_the_end = []

    async def build() -> str:
        feed = feeds.begin(5, 1)
        try:
            for place in places:
                feed.add([place])
                with trio.fail_after(10):  # the file's chunk is on the peer while the "hashing" goes on
                    while not (await tier.has_chunks([place[0]]))[0]:
                        await trio.sleep(0.01)
                seen_before_the_end.append(place[0])
            return "the manifest"
        finally:
            feed.close()

    result, sent = await feeds.alongside(build, 5, 1, [tier], no_pause, built=lambda: False)
    assert result == "the manifest"
    assert seen_before_the_end == [h for h, _ in places]
    assert sent == {tier.name: sum(length for _, (_, _, length) in places)}


async def test_a_failed_build_is_raised_as_it_is_and_nothing_waits(subject, files):
    feeds = Feeds()

    class Refused(Exception):
        pass

    async def build() -> str:
        feed = feeds.begin(5, 2)
        try:
            feed.add(chunk_files(files, 1))
            raise Refused("no manifest can describe it")
        finally:
            feed.close()

    with trio.fail_after(10), pytest.raises(Refused):
        await feeds.alongside(build, 5, 2, [subject.tier], no_pause, built=lambda: False)


async def test_a_step_hashed_already_sends_nothing_early(subject):
    feeds = Feeds()

    async def cached() -> str:
        return "the manifest"

    with trio.fail_after(5):
        assert await feeds.alongside(cached, 5, 3, [subject.tier], no_pause, built=lambda: True) == ("the manifest", {})


async def test_a_tier_that_fails_only_ends_its_head_start(subject, files, tmp_path):
    """A chunk whose bytes changed under it (a detached snapshot) is refused: the build goes on regardless."""
    feeds = Feeds()
    ((h, (path, offset, length)),) = chunk_files(files, 1)
    with open(path, "r+b") as f:
        f.write(b"not the bytes it was hashed from")

    async def build() -> str:
        feed = feeds.begin(5, 4)
        try:
            feed.add([(h, (path, offset, length))])
            await trio.sleep(0.5)  # the failed put happens meanwhile
            return "the manifest"
        finally:
            feed.close()

    result, sent = await feeds.alongside(build, 5, 4, [subject.tier], no_pause, built=lambda: False)
    assert result == "the manifest" and sent == {}
    assert not (await subject.tier.has_chunks([h]))[0]


class Gated:
    """The real tier, with each put held at a gate once it has started: how many are in flight shows."""

    def __init__(self, tier):
        self.tier, self.name, self.concurrency = tier, tier.name, tier.concurrency
        self.batch_bytes, self.batch_chunks = tier.batch_bytes, tier.batch_chunks
        self.in_flight = self.most = 0
        self.sizes: list[int] = []  # chunks per put, in the order the puts started
        self.gate = trio.Event()

    async def has_chunks(self, hashes):
        return await self.tier.has_chunks(hashes)

    async def put_chunks(self, chunks):
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        self.sizes.append(len(chunks))
        try:
            await self.gate.wait()
            return await self.tier.put_chunks(chunks)
        finally:
            self.in_flight -= 1


async def test_files_hashed_one_at_a_time_keep_every_worker_busy(subject, files):
    """A step of many small files publishes one chunk at a time: each is put while the others are in flight,
    and what was published while every worker was busy goes in one request."""
    feeds, gated = Feeds(), Gated(subject.tier)
    places = chunk_files(files, gated.concurrency + 2)

    async def build() -> str:
        feed = feeds.begin(5, 5)
        try:
            for n, place in enumerate(places[: gated.concurrency], 1):
                feed.add([place])
                with trio.fail_after(10):  # its put starts while the ones before it are still under way
                    while gated.in_flight < n:
                        await trio.sleep(0.01)
            feed.add(places[gated.concurrency :])  # queued behind the busy workers
            gated.gate.set()
            with trio.fail_after(10):
                while not all(await subject.tier.has_chunks([h for h, _ in places])):
                    await trio.sleep(0.01)
            return "the manifest"
        finally:
            gated.gate.set()  # also when a check above failed: nothing is left waiting at the gate
            feed.close()

    result, sent = await feeds.alongside(build, 5, 5, [gated], no_pause, built=lambda: False)
    assert result == "the manifest" and gated.most == gated.concurrency
    assert gated.sizes == [1] * gated.concurrency + [2]
    assert sent == {gated.name: sum(length for _, (_, _, length) in places)}
