"""This node's RAM as a tier: its own committed steps, and the replicas it keeps for others.

The job's files, snapshots and space account are :mod:`tierfs.ramtier`; the replicas other
nodes put here are a :class:`~tierfs.store.replicas.ReplicaStore` in the rank's directory.
As a tier, the RAM is what a restore reads first (an older step of this rank, or a
data-parallel twin's replica, with the same chunk) and what the cluster survey counts as
"local". Nothing puts steps on it from here: the job writes them, peers replicate into its
store. Everything runs on the trio thread, one chunk at a time, as the store does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tierfs.store.replicas import ReplicaStats, ReplicaStore
from tierfs.tiers.base import Cost, Holdings, Location, NotHeld, Put
from tierfs.tiers.stored import StoredTier


@dataclass
class OwnSteps:
    """What the RAM tier knows of this rank's own committed steps (the daemon fills it in)."""

    rank: int = 0
    steps: Callable[[], list[int]] = list  # committed steps held here
    find: Callable[[str], Location | None] = lambda h: None  # a chunk in one of them
    manifest: Callable[[int], bytes | None] = lambda step: None  # a step's manifest, if built
    restore_step: Callable[[], int | None] = lambda: None  # the step restored at start, while it is current
    report: Callable[[], Mapping[str, object]] = field(default=dict)  # the RAM tier's path, capacity, use


class LocalTier(StoredTier):
    kind = "local"
    name = "local"
    lane = None  # the source of every lane, never a destination
    cost = Cost(read_gib_s=4.0)

    def __init__(self, store: ReplicaStore | None, own: OwnSteps | None = None):
        super().__init__(store)  # None: no --listen, no replicas kept
        self.own = own or OwnSteps()

    @property
    def where(self) -> str:
        return str(self.own.report().get("path", "this node"))

    def _own_copy(self, h: str) -> Location | None:
        return self.own.find(h)

    async def has_chunks(self, hashes: Sequence[str]) -> list[bool]:
        if self.store is None:
            return [self.own.find(h) is not None for h in hashes]
        return await super().has_chunks(hashes)

    async def put_chunk(self, h: str, path: str | Path, offset: int, length: int) -> Put:
        self._need_store("chunks")
        return await super().put_chunk(h, path, offset, length)

    async def get_chunk(self, h: str, length: int) -> bytes:
        if self.store is None:
            where = self.own.find(h)
            if where is None or where[2] != length:
                raise NotHeld(f"{self.name} does not hold chunk {h}")
        return await super().get_chunk(h, length)

    def _read_stored(self, h: str, length: int) -> bytes | None:
        if self.store is None:
            raise NotHeld(f"{self.name} no longer holds chunk {h}")
        return super()._read_stored(h, length)

    async def put_manifest(self, rank: int, step: int, data: bytes) -> None:
        self._need_store("manifests")
        await super().put_manifest(rank, step, data)

    async def get_manifest(self, rank: int, step: int) -> bytes:
        if rank == self.own.rank and step in self.own.steps():
            data = self.own.manifest(step)
            if data is not None:
                return data
        if self.store is None:
            raise NotHeld(f"{self.name} does not hold the manifest of rank {rank} step {step}")
        return await super().get_manifest(rank, step)

    async def holdings(self) -> Holdings:
        return self.current()

    async def set_aside(self, rank: int | None, above: int, before: float) -> list[tuple[int, int]]:
        """The replicas held for other ranks (this rank's own steps are the daemon's to set aside)."""
        return [] if self.store is None else await super().set_aside(rank, above, before)

    def current(self) -> Holdings:
        """What this node holds right now (synchronous: the retention floor asks often)."""
        own = tuple((self.own.rank, s) for s in self.own.steps())
        replicas = tuple(self.store.manifests()) if self.store is not None else ()
        return Holdings(own + replicas, self.own.restore_step())

    def report(self) -> dict[str, object]:
        return {"name": self.name, "kind": self.kind, "where": self.where, **self.own.report()}

    def replicas_report(self) -> ReplicaStats | None:
        return self.store.stats() if self.store is not None else None
