"""This node's part in its job's coordination: the daemon side of :mod:`tierfs.coordination`.

With a peer service (``--listen``) and peers, a node no longer asks every other node what
it holds. It reports its holdings to a few coordinators every ``--survey-interval`` and,
at start, asks them which step to restore (:meth:`NodeCoordination.decide`); it is itself
a coordinator when the job's hash order puts it among the first few (see
:mod:`tierfs.coordination.protocol`). The answer becomes the same
:class:`~tierfs.pipeline.survey.Survey` of holders the restore planner used before, so the choice
of tiers and the restore itself do not change.

When this rank's step is held by no node but GCS, and its data-parallel twins restore it
too (a whole job restarting with every RAM lost), the twins split the download: each
chunk is read from GCS by one of them and passed on between them
(:mod:`tierfs.coordination.broadcast`). The twins compute the same plan from the same
answer, so nothing is sent to agree on it; the peer service answers ``await_chunk``
from :attr:`NodeCoordination.board` and serves the chunks of the running restore once
they are written and verified.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import trio

from tierfs.coordination import broadcast
from tierfs.coordination.decision import Decision
from tierfs.coordination.gcs_listing import list_sharded, listing_prefixes
from tierfs.coordination.node import Coordination
from tierfs.coordination.protocol import candidates
from tierfs.coordination.transport import Message, Unreachable
from tierfs.coordination.view import GCS, Holdings
from tierfs.core.errors import UserError
from tierfs.core.linux import pwrite_all
from tierfs.core.manifest import Manifest
from tierfs.peers.messages import STARTING, PeerTransport
from tierfs.peers.placement import job_twins
from tierfs.pipeline.survey import Survey
from tierfs.tiers.base import Address, Tier, TierError, TierUnavailable
from tierfs.tiers.fetch import ChunkSources
from tierfs.tiers.peer import peer_name

if TYPE_CHECKING:
    from tierfs.config import Config
    from tierfs.peers.network import PeerNetwork
    from tierfs.ramtier.steps import Steps

log = logging.getLogger("tierfs")

JOIN_WAIT = 2.0  # a request that comes while this node is still joining waits this long for it
CHANGES = 0.5  # seconds between looks at this node's holdings: a change is reported at once


class NodeCoordination:
    """Reporting, coordinating and broadcast restores for one node (built when it has a peer service).

    What it reports comes from ``steps`` (this rank's committed steps), ``tiers`` (every tier
    of this node, a list the daemon keeps current), ``replicas`` (the (rank, step) manifests
    it keeps for others) and ``restore_step`` (the step it restored and runs from).
    """

    def __init__(
        self,
        cfg: Config,
        network: PeerNetwork,
        steps: Steps,
        tiers: Sequence[Tier],
        replicas: Callable[[], Iterable[tuple[int, int]]],
        restore_step: Callable[[], int | None],
    ):
        self.cfg, self.network, self.steps, self.tiers = cfg, network, steps, tiers
        self.replicas, self.restore_step = replicas, restore_step
        if cfg.listen is None:
            raise ValueError("coordination needs this node's peer service (--listen)")
        self.address = peer_name(cfg.listen)
        self.transport = PeerTransport(self.address, network.connect)
        self.board = broadcast.ChunkBoard()  # the running restore's chunks, for twins that wait on them
        self.coordination: Coordination | None = None
        self.decision: Decision | None = None
        self._joined = trio.Event()
        self._peers: tuple[tuple[Address, ...], dict[str, Address]] = ((), {})  # the peers as last seen, by name

    def _joined_coordination(self) -> Coordination:
        """The coordination :meth:`join` built: what needs it runs only once the node has joined."""
        if self.coordination is None:
            raise RuntimeError("this node has not joined its job's coordination yet")
        return self.coordination

    # -- joining and serving -------------------------------------------------------------

    async def join(self, nursery: trio.Nursery) -> None:
        """Start reporting and coordinating, once the peers are known (after PeerNetwork.join)."""
        cfg = self.cfg
        bucket = next((t for t in self.tiers if t.shared), None)
        list_gcs = None
        if bucket is not None:
            prefixes = listing_prefixes(cfg.nodes)
            list_gcs = lambda: list_sharded(bucket.list_manifests_under, prefixes)  # noqa: E731
        self.coordination = Coordination(
            self.address,
            candidates(cfg.job, self.members()),
            self.transport,
            self.holdings,
            nodes=cfg.nodes,
            list_gcs=list_gcs,
            interval=cfg.survey_interval,
        )
        await nursery.start(self.coordination.run)
        nursery.start_soon(self._report_changes)
        self._joined.set()

    async def _report_changes(self) -> None:
        """Report as soon as what this node holds changes (a commit, a replica, a restore done).

        A coordinator's answer is then what a survey of every node would see now, not
        what nodes held at their last round.
        """
        last = None
        while True:
            await trio.sleep(CHANGES)
            h = self.holdings()
            now = (h.steps, h.replicas, h.restore_step, h.backed)
            if last is not None and now != last:
                await self._joined_coordination().member.report()
            last = now

    def members(self) -> list[str]:
        return [peer_name(a) for a in self.network.cfg.peers] + [self.address]

    def follow(self) -> None:
        """The peers changed (a DNS name found more): every node orders the new set the same way."""
        if self.coordination is not None:
            members = self.members()
            if set(members) != self.coordination.coordinator.members:
                self.coordination.set_order(candidates(self.cfg.job, members))

    def reconfigure(self, cfg: Config) -> None:
        """The job's shape changed (replicator.yaml): reports are checked, and the floor counted, over its nodes."""
        self.cfg = cfg
        if self.coordination is not None:
            self.coordination.coordinator.view.set_nodes(cfg.nodes)

    async def handle(self, source: str, message: Message) -> Message:
        """The peer service's coordination requests (``source``: the sender's listen address)."""
        self._heard(source, message)
        if message.get("op") == "await_chunk":
            return await self.board.handle(source, message)
        with trio.move_on_after(JOIN_WAIT):
            await self._joined.wait()
        if self.coordination is None:
            return {"error": STARTING}
        return await self.coordination.handle(source, message)

    def _heard(self, source: str, message: Message) -> None:
        """A peer that sends requests is up (for ``tierfs status``; no survey asks it any more)."""
        peers = self.network.cfg.peers
        if self._peers[0] is not peers:
            self._peers = (peers, {peer_name(a): a for a in peers})
        address = self._peers[1].get(source)
        if address is not None:
            report = message.get("report")
            rank = report.get("rank") if isinstance(report, dict) else None
            self.network.mark(address, "up", rank=rank if type(rank) is int else None)

    def holdings(self) -> Holdings:
        """What this node reports: its own steps (in RAM or on a tier beside it), replicas, the step it runs from."""
        rank, states = self.cfg.rank, self.steps.states
        own = set(states)
        for tier in self.tiers:
            if tier.spill:
                own.update(s for r, s in tier.held() if r == rank)
        # A step on a shared tier counts for the whole job at once.
        shared = {t.lane for t in self.tiers if t.shared and t.lane is not None}
        backed = tuple(sorted(s for s, state in states.items() if any(state.held_by(lane) for lane in shared)))
        return Holdings(
            rank,
            tuple(sorted(own)),
            tuple(self.replicas()),
            self.restore_step(),
            tuple(self.cfg.topology),
            backed=backed,
        )

    # -- the decision at start -------------------------------------------------------------

    def twins(self) -> list[int]:
        return job_twins(self.cfg)

    async def decide(self, exclude: tuple[str, ...] = ()) -> tuple[Survey, int | None] | None:
        """The step to restore and who holds it, as a coordinator (not in ``exclude``) answers; None if none did."""
        cfg = self.cfg
        member = self._joined_coordination().member
        decision = await member.decide(cfg.rank, self.twins(), wait=cfg.restore_wait, exclude=exclude)
        if decision.coordinator is None:
            return None
        self.decision = decision
        log.info(
            "coordinator %s: restore step %s (%d of %d nodes reported, %d down%s)",
            decision.coordinator,
            decision.step,
            decision.reported,
            decision.members,
            len(decision.down),
            "" if decision.ready else f"; not ready, silent: {', '.join(decision.silent) or 'none named'}",
        )
        if decision.down:
            log.info("members found down while deciding: %s", ", ".join(decision.down))
        survey = Survey(missing=[f"peer {a}" for a in decision.silent + decision.down])
        for rank, view in decision.ranks.items():
            for step, holders in view.steps.items():
                for holder in holders:
                    for name in self._tier_names(holder):
                        survey.add(rank, step, name)
        return survey, decision.step

    def _tier_names(self, holder: str) -> list[str]:
        """The tiers of this node that reach what the coordinators say ``holder`` (a node, or GCS) holds."""
        if holder == GCS:
            return [t.name for t in self.tiers if t.shared]
        if holder == self.address:  # a step of this node's own: on a tier beside its RAM
            return [t.name for t in self.tiers if t.spill]
        return [t.name for t in self.tiers if t.address is not None and peer_name(t.address) == holder]

    def settled(self, nursery: trio.Nursery) -> None:
        """The restore is planned: twins waiting for chunks this node does not plan to fetch stop
        waiting, and the step chosen is reported at once, for nodes that start later to adopt."""
        self.board.set_plan([])
        nursery.start_soon(self._joined_coordination().member.report)

    def summary(self) -> dict | None:
        """The job as the coordinators last answered (newest complete step, retention floor), or None."""
        return self.coordination.member.summary if self.coordination is not None else None

    def status(self) -> dict:
        """The job as the coordinators last answered, in the keys of a survey's summary, and who answered."""
        coordination = self._joined_coordination()
        member, coordinator = coordination.member, coordination.coordinator
        summary = member.summary or {}
        down = coordinator.down_members() if coordinator.coordinating() else []
        return {
            "newest_complete": summary.get("newest"),
            "complete_steps": summary.get("complete", []),
            "ranks": summary.get("ranks"),
            "unreachable_peers": down,
            "coordination": {
                "address": self.address,
                "reported_to": list(member.reported_to),
                "answered_by": member.summary_from,
                "coordinating": coordinator.coordinating(),
            },
        }

    # -- broadcast restores ----------------------------------------------------------------

    def sources(self, step: int, manifest: Manifest, holders: list[Tier], local: Tier) -> ChunkSources:
        """Where the restore of ``step`` reads its chunks: planned with the twins when only GCS holds it."""
        decision, rank = self.decision, self.cfg.rank
        if decision is None or decision.step != step or not all(t.shared for t in holders):
            return ChunkSources([local, *holders])
        group = [rank, *self.twins()]
        needing = decision.needing(group, step)
        sizes = manifest.chunk_sizes()
        order = list(sizes)  # each chunk once, in the order the files need them
        needs = {a: order for nodes in needing.values() for a in nodes}
        if self.address not in needs or len(needs) < 2:
            return ChunkSources([local, *holders])
        held_by = [a for r in group for a in decision.holders(r, step) if a != GCS]
        in_gcs = any(GCS in decision.holders(r, step) for r in group)
        plan = broadcast.plan(needs, sizes, dict.fromkeys(sizes, held_by), in_gcs, dead=decision.down)
        mine = plan[self.address]
        log.info(
            "step %d: restoring with %d twin(s); %d of %d chunks from GCS here, the rest from twins",
            step,
            len(needs) - 1,
            len(mine.from_gcs()),
            len(mine.order),
        )
        bucket = next(t for t in holders if t.shared)
        return PlannedSources([local, *holders], self, mine, bucket, dead=decision.down)

    def peer_tier(self, address: str) -> Tier:
        for tier in self.tiers:
            if tier.address is not None and peer_name(tier.address) == address:
                return tier
        raise Unreachable(f"{address} is not a peer of this node")


class PlannedSources(ChunkSources):
    """A restore's chunks as the twins' broadcast plan says: one seed reads each from GCS, the others pass it on."""

    def __init__(
        self, tiers: list[Tier], node: NodeCoordination, plan: broadcast.NodePlan, gcs: Tier, *, dead: Iterable[str]
    ):
        """``dead``: the nodes the decision found down, which the plan does not wait for."""
        super().__init__(tiers)
        self.node, self.gcs = node, gcs
        self.planned = broadcast.PlannedFetch(
            plan, node.transport, self._read_peer, self._read_gcs, node.board, dead=dead, announce=False
        )

    def order(self, hashes: list[str]) -> list[str]:
        """What this node seeds comes first, so the twins below it find it there soon."""
        wanted = set(hashes)
        first = [h for h in self.planned.plan.order if h in wanted]
        planned = set(first)
        return first + [h for h in hashes if h not in planned]

    def batch(self) -> tuple[int, int]:
        """One chunk at a time: the plan says where each one comes from."""
        return 0, 1

    async def fetch_into(self, h: str, length: int, fd: int, offset: int, prefer: int = 0) -> None:
        if h not in self.planned.plan.sources:
            await super().fetch_into(h, length, fd, offset, prefer)
            return
        try:
            data = await self.planned.fetch(h, length)
        except broadcast.NoSource as e:
            raise UserError(str(e)) from None
        await trio.to_thread.run_sync(pwrite_all, fd, data, offset)

    def arrived(self, h: str) -> None:
        self.node.board.arrived(h)

    async def _read_peer(self, address: str, h: str, length: int) -> bytes:
        tier = self.node.peer_tier(address)
        return await self._read(tier, h, length)

    async def _read_gcs(self, h: str, length: int) -> bytes:
        return await self._read(self.gcs, h, length)

    async def _read(self, tier: Tier, h: str, length: int) -> bytes:
        try:
            data = await tier.get_chunk(h, length)
        except TierUnavailable as e:
            raise Unreachable(str(e)) from None
        except TierError as e:
            raise broadcast.SourceFailed(str(e)) from None
        self.bytes_from[tier.name] = self.bytes_from.get(tier.name, 0) + len(data)
        return data
