"""A whole job's data-parallel twins backing up one step to the simulated bucket.

A backup's cost grows with the job when every twin sends every chunk, and with the model
when each chunk goes up once; which of the two a job pays is a question of GCS bytes and
requests, and of the time until every rank's manifest is in. Answering it needs no
coordination messages (the twins of a shard know each other from the job's shape), only
the bucket of :mod:`tierfs_testing.sim`, which counts every byte up and down, so it lives
apart from the coordination scenarios of :mod:`tierfs_testing.scenarios`, on the same
MockClock and job model (:mod:`tierfs_testing.simjob`).

Two ways for a rank to put its step up:

- ``"today"``: a model of the code before twins shared the upload (``put_step`` over
  ``GcsTier`` and ``GcsStore.put_chunk``): a pending marker; every chunk touched (a
  metadata request, and a download to verify an object this node has not seen hold the
  chunk); every chunk still missing uploaded by a conditional create whose body goes out
  before GCS says the object exists, and each such lost race read back to verify it; then
  the manifest, and the marker deleted. Twins that commit together each send every chunk
  and all but one read it back: 2D-1 times the unique bytes.
- ``"twins"``: the code now: the same marker and touches (nothing downloaded), then the
  real :func:`tierfs.tiers.twins.share` with the simulated bucket's existence checks (a
  metadata request: GCS's MD5 proves an object) and uploads, on the simulator's clock;
  then the manifest.
"""

from __future__ import annotations

import random
import statistics
from collections import Counter

import trio

from tierfs.coordination.transport import Message
from tierfs.tiers import twins
from tierfs.tiers.gcs import THREADS
from tierfs_testing.sim import SimGcs, SimNetwork
from tierfs_testing.simjob import JobModel, MiB, Settings, on_mock_clock

MODES = ("today", "twins")
STEP = 100
COMMIT_SPREAD = 0.5  # s: the ranks of a job commit a step within this much of each other
CHUNKS, CHUNK_SIZE = 32, 4 * MiB  # per rank: 128 MiB in tierfs' default chunk size


def manifest_size(chunks: int) -> int:
    """About what a manifest of ``chunks`` chunks weighs (its header, a hash and sizes per chunk)."""
    return 256 + 80 * chunks


def backup(
    nodes: int,
    data_parallel: int = 16,
    mode: str = "twins",
    dead: int = 0,
    chunks: int = CHUNKS,
    chunk_size: int = CHUNK_SIZE,
    spread: float = COMMIT_SPREAD,
    s: Settings | None = None,
) -> dict:
    """Every rank commits step :data:`STEP` within ``spread`` s of the first and backs it up.

    ``dead``: twins of every data-parallel group that are gone before the backup starts,
    while the others still count them as holders of the step (the worst case: they learn
    it only by waiting).
    """
    if mode not in MODES:
        raise ValueError(f"unknown backup mode {mode!r}: one of {', '.join(MODES)}")
    if not 0 <= dead < data_parallel:
        raise ValueError(f"dead must leave a live twin in each group of {data_parallel}")
    model = JobModel(nodes, data_parallel=data_parallel, chunks=chunks, chunk_size=chunk_size)
    return on_mock_clock(_backup, model, s or Settings(), mode, dead, spread)


async def _silent(source: str, message: Message) -> Message:
    return {"error": "a backup sends no messages"}


class _Rank:
    """One rank's side of the backup: what it sent, and when its manifest was in."""

    def __init__(self, model: JobModel, rank: int, gcs: SimGcs):
        self.model, self.rank, self.gcs = model, rank, gcs
        self.address = model.address(rank)
        self.chunks = model.chunks_of(rank, STEP)
        self.uploaded = 0  # chunks whose create this rank won
        self.done: float | None = None

    async def upload(self, h: str) -> bool:
        """A conditional create: its body goes out whether or not the object is there by then."""
        created = await self.gcs.write(self.address, h, self.model.chunk_size)
        self.uploaded += created
        return created

    async def run(self, start: float, mode: str, group: list[int]) -> None:
        await trio.sleep_until(start)
        marker = f"pending/rank-{self.rank}/step-{STEP}"
        await self.gcs.write(self.address, marker, 40 * len(self.chunks))
        if mode == "today":
            await self._today()
        else:
            await self._twins(group)
        await self.gcs.write(self.address, f"manifests/rank-{self.rank}/step-{STEP}", manifest_size(len(self.chunks)))
        await self.gcs.delete(marker)
        self.done = trio.current_time()

    async def _touch(self, limiter: trio.CapacityLimiter, verify: bool) -> list[str]:
        """Every chunk looked up (the touch that keeps it from the collector); those the bucket lacks.

        ``verify``: an object found is downloaded to check it (the code before; the code
        now proves it by its MD5, which the same metadata request gives).
        """
        missing = []

        async def touch(h: str) -> None:
            async with limiter:
                if not await self.gcs.exists(h):
                    missing.append(h)
                elif verify:
                    await self.gcs.read(self.address, h, self.model.chunk_size)

        async with trio.open_nursery() as nursery:
            for h in self.chunks:
                nursery.start_soon(touch, h)
        return missing

    async def _today(self) -> None:
        limiter = trio.CapacityLimiter(THREADS)

        async def put(h: str) -> None:
            async with limiter:
                if not await self.upload(h):  # the body went; the precondition failed: read it back
                    await self.gcs.exists(h)
                    await self.gcs.read(self.address, h, self.model.chunk_size)

        missing = await self._touch(limiter, verify=True)
        async with trio.open_nursery() as nursery:
            for h in missing:
                nursery.start_soon(put, h)

    async def _twins(self, group: list[int]) -> None:
        """As ``put_step`` over ``GcsTier`` does now: an object a touch found is not proven yet
        (no download), so it goes to :func:`~tierfs.tiers.twins.share` too, where one metadata
        request proves it by its MD5; a chunk last seen missing is created without a look first."""
        absent = set(await self._touch(trio.CapacityLimiter(THREADS), verify=False))

        async def present(h: str) -> bool:
            found = await self.gcs.exists(h)
            if not found:
                absent.add(h)
            return found

        async def put(h: str) -> bool:
            if h not in absent and await self.gcs.exists(h):
                return False
            absent.discard(h)
            created = await self.upload(h)
            if not created:  # a twin's copy came first: proven by its MD5
                await self.gcs.exists(h)
            return created

        await twins.share(
            dict.fromkeys(self.chunks, self.model.chunk_size),
            self.rank,
            group,
            exists=present,
            upload=twins.one_by_one(put),
            workers=THREADS,
        )


async def _backup(model: JobModel, s: Settings, mode: str, dead: int, spread: float) -> dict:
    net = SimNetwork(s.net, seed=s.seed)
    gcs = SimGcs(net, s.gcs)
    rng = random.Random(s.seed)
    d, g = model.data_parallel, model.group
    for r in range(model.nodes):
        net.listen(model.address(r), _silent)
    victims = {i + g * j for i in range(g) for j in rng.sample(range(d), dead)}
    ranks = {r: _Rank(model, r, gcs) for r in range(model.nodes) if r not in victims}
    async with trio.open_nursery() as outer:
        await outer.start(net.run)
        async with trio.open_nursery() as nursery:
            for r, rank in ranks.items():
                holders = sorted([r, *model.twins(r)])  # the dead ones included: nobody has said otherwise
                nursery.start_soon(rank.run, rng.uniform(0, spread), mode, holders)
        outer.cancel_scope.cancel()
    unique_chunks = {h for rank in ranks.values() for h in rank.chunks}
    unique = len(unique_chunks) * model.chunk_size
    done = [rank.done for rank in ranks.values()]
    per_twin = Counter({r: rank.uploaded for r, rank in ranks.items()})
    return {
        "nodes": model.nodes,
        "mode": mode,
        "data_parallel": d,
        "dead_per_group": dead,
        "commit_spread_s": spread,
        "rank_bytes": model.chunks * model.chunk_size,
        "chunk_size": model.chunk_size,
        "unique_bytes": unique,
        "bytes_up": gcs.bytes_written,
        "bytes_down": gcs.bytes_read,
        "up_per_unique": round(gcs.bytes_written / unique, 3),
        "down_per_unique": round(gcs.bytes_read / unique, 3),
        "gcs_per_unique": round((gcs.bytes_written + gcs.bytes_read) / unique, 3),
        "requests": gcs.requests,
        "requests_per_rank": round(gcs.requests / len(ranks), 1),
        "backed_up_s_max": round(max(done), 3),
        "backed_up_s_median": round(statistics.median(done), 3),
        "complete": unique_chunks <= gcs.objects
        and all(f"manifests/rank-{r}/step-{STEP}" in gcs.objects for r in ranks),
        "chunks_uploaded_max": max(per_twin.values()),
        "chunks_uploaded_mean": round(statistics.mean(per_twin.values()), 2),
    }
