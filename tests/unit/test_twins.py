"""Twins sharing a step's upload (tierfs.tiers.twins), against a bucket in a dict, in mock time.

Each twin runs :func:`share` as the daemon does; an upload takes time in proportion to the
chunk's size, a dead twin stops in the middle of its uploads, and each twin "writes its
manifest" the moment its share returns, which must find every chunk of the step there.
"""

from __future__ import annotations

from collections import Counter

import pytest
import trio

from tierfs.tiers.twins import Patience, ShareResult, one_by_one, share, uploader_order

MiB = 1 << 20
BANDWIDTH = 100 * MiB  # bytes/s of one upload
PATIENCE = Patience(factor=1.0, floor=5.0, cap=60.0)


class Bucket:
    """Objects by chunk name; every upload and every look counted."""

    def __init__(self) -> None:
        self.objects: set[str] = set()
        self.uploads: Counter[str] = Counter()
        self.by: dict[int, list[str]] = {}
        self.looks = 0

    async def exists(self, h: str) -> bool:
        self.looks += 1
        await trio.sleep(0.01)
        return h in self.objects

    def uploader(self, rank: int, chunks: dict[str, int], dies_after: int | None = None):
        async def upload(h: str) -> bool:
            if dies_after is not None and len(self.by.get(rank, ())) >= dies_after:
                await trio.sleep_forever()  # killed: nothing more from this twin, ever
            await trio.sleep(0.01)
            if h in self.objects:  # a conditional create: the body never goes
                return False
            await trio.sleep(chunks[h] / BANDWIDTH)
            self.objects.add(h)
            self.uploads[h] += 1
            self.by.setdefault(rank, []).append(h)
            return True

        return upload


def step(n: int, size: int = 4 * MiB) -> dict[str, int]:
    return {f"{i:032x}": size for i in range(n)}


async def run_twins(
    chunks: dict[str, int],
    ranks: list[int],
    bucket: Bucket,
    *,
    dead: dict[int, int] | None = None,
    late: dict[int, float] | None = None,
) -> dict[int, tuple[ShareResult, float]]:
    """Every twin's share of one step; the result and the time each one's manifest went, by rank."""
    dead, late = dead or {}, late or {}
    out: dict[int, tuple[ShareResult, float]] = {}

    async def twin(rank: int) -> None:
        await trio.sleep(late.get(rank, 0.0))
        result = await share(
            chunks,
            rank,
            ranks,
            exists=bucket.exists,
            upload=one_by_one(bucket.uploader(rank, chunks, dead.get(rank))),
            workers=4,
            patience=PATIENCE,
        )
        missing = set(chunks) - bucket.objects
        assert not missing, f"rank {rank} would write its manifest before {len(missing)} of its chunks are there"
        out[rank] = (result, trio.current_time())

    async with trio.open_nursery() as nursery:
        for rank in ranks:
            nursery.start_soon(twin, rank)
        while len(out) < len(ranks) - len(dead):
            await trio.sleep(0.5)
        nursery.cancel_scope.cancel()  # the dead never finish
    return out


def test_every_twin_computes_the_same_order_and_the_leads_spread_evenly():
    ranks = [3, 7, 11, 15]
    for i in range(50):
        h = f"{i:032x}"
        order = uploader_order(h, ranks)
        assert sorted(order) == ranks
        assert uploader_order(h, list(reversed(ranks))) == order
    leads = Counter(uploader_order(f"{i:032x}", ranks)[0] for i in range(4000))
    assert all(900 < n < 1100 for n in leads.values()), leads
    # Without rank 7, only the chunks it led move, and they spread over all the others.
    moved = Counter()
    for i in range(4000):
        h = f"{i:032x}"
        full, without = uploader_order(h, ranks), uploader_order(h, [3, 11, 15])
        if full[0] != 7:
            assert without[0] == full[0]
        else:
            moved[without[0]] += 1
            assert without[0] == full[1]
    assert len(moved) == 3 and min(moved.values()) > 200, moved


async def test_four_twins_upload_each_chunk_once_and_all_write_their_manifests(autojump_clock):
    chunks, bucket = step(64), Bucket()
    out = await run_twins(chunks, [0, 1, 2, 3], bucket)
    assert set(bucket.uploads) == set(chunks) and set(bucket.uploads.values()) == {1}
    assert all(len(bucket.by[r]) >= 8 for r in range(4)), {r: len(v) for r, v in bucket.by.items()}
    for rank, (result, _) in out.items():
        assert result.sent_chunks == len(bucket.by[rank]) and result.taken_over == 0
        assert result.sent_chunks + result.twin_chunks == 64
        assert result.sent_bytes + result.twin_bytes == 64 * 4 * MiB
    # Nobody waited for a takeover: the step is complete soon after the slowest share.
    assert max(t for _, t in out.values()) < PATIENCE.floor


async def test_without_twins_every_chunk_goes_up_at_once_and_nothing_waits(autojump_clock):
    chunks, bucket = step(16), Bucket()
    start = trio.current_time()
    result = await share(chunks, 5, [], exists=bucket.exists, upload=one_by_one(bucket.uploader(5, chunks)), workers=4)
    assert bucket.looks == 0 and result.sent_chunks == 16 and result.waited_s == 0
    assert trio.current_time() - start == pytest.approx(4 * (0.01 + 4 * MiB / BANDWIDTH))
    bucket.objects.discard(next(iter(chunks)))
    again = await share(chunks, 5, [5], exists=bucket.exists, upload=one_by_one(bucket.uploader(5, chunks)), workers=4)
    assert (again.sent_chunks, again.found_chunks, again.twin_chunks) == (1, 15, 0)


async def test_a_dead_twins_chunks_are_taken_over_after_the_bound_split_among_the_survivors(autojump_clock):
    chunks, bucket = step(96), Bucket()
    out = await run_twins(chunks, [0, 1, 2, 3], bucket, dead={2: 3})
    assert set(bucket.objects) == set(chunks)
    assert set(bucket.uploads.values()) == {1}, "each chunk still goes up once"
    left = [h for h in chunks if uploader_order(h, [0, 1, 2, 3])[0] == 2 and h not in bucket.by[2]]
    assert len(left) > 10, "the twin died in the middle of its uploads"
    taken = {r: out[r][0].taken_over for r in out}
    assert sum(taken.values()) == len(left)
    assert sum(1 for n in taken.values() if n) >= 2, f"the takeover is split, not done by one: {taken}"
    for h in left:
        (uploader,) = [r for r, hs in bucket.by.items() if h in hs]
        assert uploader == uploader_order(h, [0, 1, 2, 3])[1], "the next in the chunk's order takes it"
    own = max(t for _, t in out.values())
    assert own < PATIENCE.floor + 2 * 16 * 4 * MiB / BANDWIDTH + 3, "delayed by about one bound, not more"


async def test_a_twin_that_starts_late_within_the_bound_loses_no_chunk_to_a_duplicate(autojump_clock):
    chunks, bucket = step(48), Bucket()
    out = await run_twins(chunks, [0, 1, 2], bucket, late={1: 3.0})
    assert set(bucket.uploads.values()) == {1}
    assert all(result.taken_over == 0 for result, _ in out.values())


async def test_a_twin_falling_behind_past_the_bound_is_overtaken_and_never_duplicated(autojump_clock):
    chunks, bucket = step(48), Bucket()
    out = await run_twins(chunks, [0, 1, 2], bucket, late={1: 30.0})
    assert set(bucket.objects) == set(chunks)
    late = out[1][0]
    assert late.sent_chunks == 0 and late.found_chunks + late.twin_chunks == 48, "the late twin finds every chunk there"
    assert sum(result.taken_over for result, _ in out.values()) == late.found_chunks
    assert set(bucket.uploads.values()) == {1}
