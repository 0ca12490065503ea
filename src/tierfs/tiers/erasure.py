"""The erasure group's RAM as a tier: a step goes out as data parts to parity holders, and comes back rebuilt.

With ``--erasure D+P`` this is the peers lane's one tier (the peers themselves stay tiers
for surveys and coordination, but take no replicas). Putting a step sends each of this
rank's D data parts, window by window, to the P members holding its stripe's parity, which
sum them in (:mod:`tierfs.store.stripe_service`), then the step's manifest to every member.
A restore reads a chunk by rebuilding the byte range it covers in its rank's chunk stream
(``docs/formats.md``, "Erasure-coded stripes") from a chain of survivors, and checks it
against the chunk's name as every tier does: a parity summed wrong is refused there, and the
chunk comes from GCS instead.

A step counts as held by the group (:meth:`ErasureTier.holdings`) while D parts of every
stripe its rank gives data to are held by the other members, which is the rule the nodes'
reports follow too (:meth:`~tierfs.store.stripe_service.StripeService.claims`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import trio
import xxhash

from tierfs.core import stripes
from tierfs.core.erasure import Undecodable
from tierfs.core.keys import ManifestKeys
from tierfs.core.manifest import MAX_BYTES as MAX_MANIFEST
from tierfs.core.manifest import Manifest, ManifestError, split_seal
from tierfs.peers.network import PeerNetwork
from tierfs.peers.placement import PeerInfo
from tierfs.peers.pool import ConnectionPool
from tierfs.peers.wire import PeerError
from tierfs.store.erasure_member import ErasureMember
from tierfs.store.stripe_service import WINDOW, OwnShard, StripeService
from tierfs.tiers.base import (
    Address,
    Cost,
    Holdings,
    Lane,
    Location,
    NotHeld,
    Progress,
    Pushed,
    Put,
    Tier,
    TierError,
    TierUnavailable,
    _no_pause,
    check_chunk,
    first_leaf,
)

log = logging.getLogger(__name__)


class Members:
    """The addresses of the group's members and a pool of connections to each, learnt from the peers' ``info``."""

    def __init__(self, network: PeerNetwork):
        self.network = network
        self.by_rank: dict[int, Address] = {}
        self._pools: dict[Address, ConnectionPool] = {}

    async def dial(self, rank: int) -> ConnectionPool | None:
        """Connections to the member ``rank``; None while no peer answers as it."""
        if rank not in self.by_rank:
            self.by_rank.update({p.rank: p.address for p in await self.network.discover()})
        address = self.by_rank.get(rank)
        if address is None:
            return None
        if address not in self._pools:
            self._pools[address] = ConnectionPool(lambda timeout: self.network.connect(address, timeout))
        return self._pools[address]

    async def peers(self) -> list[PeerInfo]:
        """The peers answering now, with their labels and twins: what a grouping is formed from."""
        found = await self.network.discover()
        self.by_rank.update({p.rank: p.address for p in found})
        return found

    def names(self) -> set[str]:
        return {f"{host}:{port}" for host, port in self.by_rank.values()}

    async def aclose(self) -> None:
        for pool in self._pools.values():
            await pool.aclose()


class ErasureTier(Tier):
    kind = "erasure"
    lane = Lane.PEERS
    cost = Cost(read_gib_s=0.5)  # a rebuild: slower than reading a replica, far cheaper than the bucket
    volatile = True  # the members' RAM can be lost: the lane checks its parts are still held
    concurrency = 4  # windows in flight while a step goes out

    def __init__(self, member: ErasureMember, members: Members):
        super().__init__()
        self.member, self.members = member, members
        self.name = f"erasure {member.shape.d}+{member.shape.p}"
        self._index: dict[str, tuple[int, int, int]] = {}  # chunk -> (rank, step, offset in the rank's stream)
        self._lengths: dict[tuple[int, int], int] = {}  # (rank, step) -> its stream's length

    @property
    def service(self) -> StripeService:
        """The group's service: there is none until the nodes agree a grouping."""
        if self.member.service is None:
            raise TierUnavailable(f"{self.name}: {self.member.describe()}")
        return self.member.service

    @property
    def where(self) -> str:
        return self.member.describe()

    def stands_for(self, name: str) -> bool:
        """Whether what the tier named ``name`` reports holding is the group's to give (a member's peer tier)."""
        return name.removeprefix("peer ") in self.members.names()

    # -- putting a step -----------------------------------------------------------------

    async def put_step(
        self,
        manifest: Manifest,
        where: dict[str, Location],
        pace: Callable[[], Awaitable[None]] = _no_pause,
        progress: Progress | None = None,
        seal_with: ManifestKeys | None = None,
        twins: Sequence[int] = (),
    ) -> Pushed:
        """This rank's D parts to their parity holders, window by window, then the manifest to every member."""
        try:
            return await self._put_step(manifest, where, pace, progress, seal_with)
        except BaseExceptionGroup as group:  # of the windows' and members' nurseries: the lane takes one error
            leaf = first_leaf(group)
            raise (leaf if isinstance(leaf, TierError) else group) from None  # a cancellation stays a group

    async def _put_step(
        self,
        manifest: Manifest,
        where: dict[str, Location],
        pace: Callable[[], Awaitable[None]],
        progress: Progress | None,
        seal_with: ManifestKeys | None,
    ) -> Pushed:
        await self.member.settle()
        service, group, step = self.service, self.service.group, manifest.step
        shard = OwnShard(list(where.values()))
        pushed = Pushed(chunks=len(where), sent_chunks=len(where))
        limiter = trio.CapacityLimiter(self.concurrency)

        async def send(part: stripes.Part, offset: int) -> None:
            """One window of a part, read once, to each of its stripe's parity holders."""
            async with limiter:
                await pace()
                n = min(WINDOW, part.length - offset)
                data = await trio.to_thread.run_sync(shard.read, part.start + offset, part.start + offset + n)
                header = {
                    "op": "ec_put",
                    "step": step,
                    "stripe": part.stripe,
                    "slot": part.slot,
                    "part_length": part.length,
                    "offset": offset,
                }
                async with trio.open_nursery() as holders:
                    for j, holder in enumerate(group.parity_holders(part.stripe)):
                        what = f"step {step} stripe {part.stripe}"
                        holders.start_soon(self._ask, holder, {**header, "parity": j}, 0, data, what)
                pushed.sent_bytes += n * group.p

        async with trio.open_nursery() as nursery:
            for part in stripes.parts(group.layout, group.member(service.rank), shard.length):
                for offset in range(0, max(part.length, 1), WINDOW):  # an empty part still says it is empty
                    nursery.start_soon(send, part, offset)
        pushed.stored_bytes = pushed.sent_bytes
        data = manifest.sealed(seal_with)
        header = {"op": "ec_manifest", "rank": service.rank, "step": step}
        async with trio.open_nursery() as nursery:
            for rank in group.members:
                if rank != service.rank:
                    nursery.start_soon(self._ask, rank, header, 0, data, f"the manifest of step {step}")
        if progress is not None:
            progress.chunks_done = progress.chunks_total
        service.changed()
        return pushed

    async def list_manifests(self) -> list[tuple[int, int]]:
        """This rank's steps whose every part its parity holders summed in (or hold complete)."""
        if not await self.member.settle():
            return []
        service = self.service
        await service.poll()
        view, group, me = service.view, service.group, service.rank
        held = []
        for step in service.own_steps():
            shard = service.own(step)
            if shard is None:
                continue
            parts = stripes.parts(group.layout, group.member(me), shard.length)
            if all(
                self._summed(view.members.get(h), step, part, j)
                for part in parts
                for j, h in enumerate(group.parity_holders(part.stripe))
            ):
                held.append((me, step))
        return held

    @staticmethod
    def _summed(holder: Any, step: int, part: stripes.Part, j: int) -> bool:
        if holder is None:
            return False
        if (step, part.stripe, j) in holder.parity:
            return True
        counts = holder.received.get((step, part.stripe, j))
        return counts is not None and part.slot < len(counts) and counts[part.slot] >= part.length > 0

    # -- what the group holds ----------------------------------------------------------------

    async def holdings(self) -> Holdings:
        """Every member's step the others can rebuild now, asked of the members this moment."""
        if not await self.member.settle():
            return Holdings(())
        await self.service.poll()
        view = self.service.view
        copies = {m for held in view.members.values() for m in held.manifests}
        return Holdings(tuple(sorted((r, s) for r, s in copies if view.rebuildable(r, s))))

    async def lost(self, rank: int, step: int) -> str | None:
        if not await self.member.settle():
            return None
        await self.service.poll()
        view, group = self.service.view, self.service.group
        if rank not in group.members or not view.manifest_holders(rank, step) or view.rebuildable(rank, step):
            return None
        holding = [
            r
            for r, held in sorted(view.members.items())
            if r != rank and any(held.holds(group, step, s) for s in range(group.layout.size))
        ]
        return (
            f"rank {rank}'s step {step} was erasure-coded in {self.name} group {group.number}, but of its members "
            f"{list(group.members)} only {len(holding)} ({', '.join(map(str, holding)) or 'none'}) still hold their "
            f"parts, and a {group.d}+{group.p} group rebuilds a rank's step from {group.d} others"
        )

    async def get_manifest(self, rank: int, step: int) -> bytes:
        for member in self.service.view.manifest_holders(rank, step) or list(self.service.group.members):
            if member == self.service.rank:
                continue
            try:
                data = await self._ask(
                    member, {"op": "ec_get_manifest", "rank": rank, "step": step}, MAX_MANIFEST, b"", "a manifest"
                )
            except NotHeld:
                continue
            self._learn(rank, step, data)
            return data
        raise NotHeld(f"{self.name} holds no manifest of rank {rank} step {step}")

    def _learn(self, rank: int, step: int, data: bytes) -> None:
        """Where each chunk of the manifest sits in its rank's stream: what a read of the chunk rebuilds."""
        try:
            places = Manifest.from_json(split_seal(data)[0]).chunk_places()
        except (ManifestError, ValueError):
            return  # the caller refuses it, and nothing is read through it
        offset = 0
        for h, (_, _, length) in places.items():
            self._index.setdefault(h, (rank, step, offset))
            offset += length
        self._lengths[(rank, step)] = offset

    # -- chunks: rebuilt ----------------------------------------------------------------------

    async def has_chunks(self, hashes: Sequence[str]) -> list[bool]:
        return [h in self._index for h in hashes]

    async def get_chunk(self, h: str, length: int) -> bytes:
        check_chunk(self, h, length)
        place = self._index.get(h)
        if place is None:
            raise NotHeld(f"{self.name}: chunk {h} is in no manifest read through it")
        rank, step, start = place
        data = await self._rebuild(rank, step, start, start + length)
        if xxhash.xxh3_128_hexdigest(data) != h:
            raise TierError(f"{self.name}: the bytes rebuilt for chunk {h} are not it (a parity summed wrong)")
        return data

    async def _rebuild(self, rank: int, step: int, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``rank``'s stream of ``step``, window by window, each from a chain of survivors."""
        group, code = self.service.group, self.service.code
        parts = stripes.parts(group.layout, group.member(rank), self._lengths[(rank, step)])
        size = stripes.part_size(group.layout, self._lengths[(rank, step)])
        out = bytearray()
        position = start
        while position < end:
            part = parts[position // size]
            within = position - part.start
            n = min(end - position, part.end - position, WINDOW)
            for attempt in range(2):
                alive = self.service.view.alive_slots(step, part.stripe, [rank])
                try:
                    plan = code.repair_plan(alive, part.slot)
                except Undecodable as e:
                    raise TierUnavailable(f"{self.name}: rank {rank} step {step}: {e}") from None
                terms = [[t.slot, t.coefficient] for t in plan.terms]
                header = {"op": "ec_repair", "step": step, "stripe": part.stripe, "offset": within, "length": n}
                first = group.rank(group.layout.member(part.stripe, terms[-1][0]))
                try:
                    out += await self._ask(first, {**header, "terms": terms}, n, b"", f"a window of rank {rank}")
                    break
                except TierError:
                    if attempt:
                        raise
                    await self.service.poll()  # a link went down: plan again around it
            position += n
        return bytes(out)

    async def _ask(self, rank: int, header: dict[str, Any], length: int, body: bytes, what: str) -> bytes:
        try:
            return await self.service.ask(rank, header, length, body)
        except (PeerError, OSError, trio.TooSlowError) as e:
            if str(e).endswith(": not found"):
                raise NotHeld(f"{self.name}: rank {rank} does not hold {what}") from None
            raise TierUnavailable(f"{self.name}: rank {rank}: {e} ({what})") from None

    # -- what it does not do -----------------------------------------------------------------

    async def put_chunk(self, h: str, path: str | Path, offset: int, length: int) -> Put:
        raise TierError(f"{self.name} takes whole steps as parity, not chunks")

    async def put_manifest(self, rank: int, step: int, data: bytes) -> None:
        raise TierError(f"{self.name} takes whole steps as parity, not manifests")

    def report(self) -> dict[str, object]:
        record, service = self.member.record, self.member.service
        report = {
            **super().report(),
            "known": self.members.network.status(),
            "shape": f"{self.member.shape.d}+{self.member.shape.p}",
        }
        if record is None or service is None:
            none: dict[str, object] = {"members": [], "answering": [], "parity_bytes": 0, "steps": {}}
            return {**report, **none, "waiting_for": list(self.member.waiting)}
        view, group = service.view, service.group
        steps = {
            str(step): {
                "survives": view.survives(step),
                "rebuildable": [r for r in group.members if view.rebuildable(r, step)],
            }
            for step in view.steps()[-4:]
        }
        return {
            **report,
            "group": group.number,
            "grouping": record.digest,
            "members": list(group.members),
            "weak_spots": [[domain, list(m)] for n, domain, m in record.weak_spots if n == group.number],
            "twins_together": [list(t) for t in record.twins_together if set(t) <= set(group.members)],
            "answering": sorted(view.members),
            "parity_bytes": service.parity.held_bytes(),
            "steps": steps,
        }

    async def aclose(self) -> None:
        await self.members.aclose()
