"""The job's manifests in GCS, listed in parallel prefix shards.

A coordinator lists every manifest of the job each round, and a restart decision waits
for a listing begun after the question. One paged listing of 10,000 ranks is a long chain
of requests, one page after another; split by the leading digits of the rank into shards
of at most 111 ranks, the shards are listed at once (at most 32 at a time) and merged,
and every rank falls in exactly one shard. The listing itself is the caller's (a GCS
client, or the simulation's): this only shards and merges, free of I/O like the rest of
the package.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import trio

LISTINGS_AT_ONCE = 32  # prefix listings of GCS in flight at once


def listing_prefixes(nodes: int) -> list[str]:
    """Prefixes under ``manifests/`` that split a listing of ``rank-<R>/...`` into shards.

    Ranks are not zero-padded, so ``rank-57`` also covers ranks 570-579 and 5700-5799; the
    ranks too short for a shard of their own get an exact ``rank-<R>/``. With shards of
    ``digits`` = (digits of the largest rank) - 2 leading digits, each covers at most 111
    ranks of the job, and every rank number, in the job or not, falls in exactly one.
    """
    digits = max(1, len(str(max(nodes - 1, 0))) - 2)
    exact = [f"rank-{r}/" for r in range(10 ** (digits - 1))]
    shared = [f"rank-{p}" for p in range(10 ** (digits - 1), 10**digits)]
    return exact + shared


async def list_sharded(
    list_prefix: Callable[[str], Awaitable[dict[int, list[int]]]],
    prefixes: Sequence[str],
    at_once: int = LISTINGS_AT_ONCE,
) -> dict[int, list[int]]:
    """One listing from many prefix listings run concurrently (any failure fails the listing)."""
    merged: dict[int, list[int]] = {}
    limit = trio.CapacityLimiter(at_once)

    async def one(prefix: str) -> None:
        async with limit:
            for rank, steps in (await list_prefix(prefix)).items():
                merged.setdefault(rank, []).extend(steps)

    async with trio.open_nursery() as nursery:
        for prefix in prefixes:
            nursery.start_soon(one, prefix)
    return {r: sorted(set(s)) for r, s in merged.items()}
