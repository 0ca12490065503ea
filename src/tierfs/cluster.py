"""The cluster view: the newest step that every rank can restore, as any node sees it.

No node is special. Each node asks every peer what it holds (its own committed steps, the
replicas it keeps for other ranks, and the step it restored at its last start) and lists
the job's manifests in GCS, then computes the answer itself. Nodes that see the same
holdings compute the same step, so when the node that answered before is gone, any other
gives the same answer.

A step is *complete* when the manifest of every writing rank is on some tier. A writing
rank is one with at least one manifest anywhere: jobs where only some ranks write files
(rank 0 saving a whole model) are complete without the silent ranks. A rank whose every
copy is lost cannot be restored at any step, so ignoring it never picks a worse step.

Agreement. Views differ only when some node sees less (a peer not yet up, a network
split). Two rules keep ranks together: a start waits (``--restore-wait``) until every
configured peer has answered; and a node adopts a step that a peer has already restored
and not moved past (it is announced until that peer commits a newer step), because that
peer's job may already be running from it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import trio

from tierfs.errors import UserError
from tierfs.fetch import gcs_call, peer_name

log = logging.getLogger(__name__)

POLL = 0.5  # seconds between attempts to reach peers that have not answered yet


@dataclass
class Survey:
    """Who holds which (rank, step) manifest, merged from every tier that answered."""

    holders: dict[int, dict[int, list[str]]] = field(default_factory=dict)  # rank -> step -> tiers
    decisions: dict[str, int] = field(default_factory=dict)  # peer -> step it restored and runs from
    topology: dict[str, tuple] = field(default_factory=dict)  # peer -> its topology labels
    missing: list[str] = field(default_factory=list)  # peers that did not answer
    gcs_error: str | None = None
    at: float = field(default_factory=time.time)

    def add(self, rank: int, step: int, tier: str) -> None:
        tiers = self.holders.setdefault(rank, {}).setdefault(step, [])
        if tier not in tiers:
            tiers.append(tier)

    def complete_steps(self, ranks: Iterable[int] | None = None) -> list[int]:
        """Steps whose manifest is on some tier for each of ``ranks`` (default: the writing ranks)."""
        ranks = list(self.holders if ranks is None else ranks)
        if not ranks:
            return []
        common = set.intersection(*(set(self.holders.get(r, ())) for r in ranks))
        return sorted(common)

    def newest_complete(self, ranks: Iterable[int] | None = None) -> int | None:
        complete = self.complete_steps(ranks)
        return complete[-1] if complete else None

    def choose(self, rank: int) -> int | None:
        """The step ``rank`` should restore: a step peers already run from, else the newest complete."""
        newest = self.newest_complete()
        mine = self.holders.get(rank)
        adoptable = sorted({d for d in self.decisions.values() if mine is None or d in mine})
        if adoptable and adoptable[-1] != newest:
            log.info("adopting step %d, which peers already restored (newest complete here: %s)",
                     adoptable[-1], newest)
            return adoptable[-1]
        return newest

    def closeness(self, peer: str, topology: tuple) -> int:
        """How many topology labels ``peer`` shares with ``topology``."""
        return len(set(self.topology.get(f"peer {peer}", ())) & set(topology))

    def tiers(self, rank: int, step: int) -> list[str]:
        return self.holders.get(rank, {}).get(step, [])

    def summary(self) -> dict:
        return {
            "at": self.at,
            "newest_complete": self.newest_complete(),  # over the writing ranks: what a restore picks
            "ranks": len(self.holders),
            "complete_steps": self.complete_steps()[-5:],
            "unreachable_peers": list(self.missing),
            "gcs_error": self.gcs_error,
        }


@dataclass
class LocalHoldings:
    """What this node itself holds: its rank's committed steps and its replicas of others."""

    rank: int
    steps: list[int]
    replicas: list[tuple[int, int]] = field(default_factory=list)
    restore_step: int | None = None  # the step this node restored and runs from, if any


class ClusterView:
    def __init__(self, nodes: int, peers=None, gcs=None, local: Callable[[], LocalHoldings] | None = None):
        self.nodes, self.peers, self.gcs, self._local = nodes, peers, gcs, local
        self.last: Survey | None = None

    def retention_floor(self) -> int | None:
        """The newest step complete on *every* rank of the job (None while unknown).

        Retention keeps everything from this step on. Unlike the restore choice it counts
        ranks that have written nothing yet: early in a job a slow rank has not committed
        its first step, and the steps it will need must not go meanwhile. The last survey
        is used, with this node's own holdings as they are now.
        """
        if self.last is None:
            return None
        self._add_local(self.last)
        return self.last.newest_complete(range(self.nodes))

    def _add_local(self, survey: Survey) -> None:
        if self._local is None:
            return
        here = self._local()
        for step in here.steps:
            survey.add(here.rank, step, "local")
        for rank, step in here.replicas:
            survey.add(rank, step, "local")
        if here.restore_step is not None:
            survey.decisions["local"] = here.restore_step

    async def survey(self, wait: float = 0.0) -> Survey:
        """Ask every tier; keep asking peers that do not answer for up to ``wait`` seconds."""
        survey = Survey()
        self._add_local(survey)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._ask_gcs, survey)
            if self.peers is not None:
                nursery.start_soon(self._ask_peers, survey, wait)
        self.last = survey
        return survey

    async def _ask_peers(self, survey: Survey, wait: float) -> None:
        deadline = trio.current_time() + wait
        pending = list(self.peers.cfg.peers)
        while True:
            reports = await self.peers.reports(pending)
            for address, report in reports.items():
                name = f"peer {peer_name(address)}"
                survey.topology[name] = report.topology
                for step in report.steps:
                    survey.add(report.rank, step, name)
                for rank, step in report.manifests:
                    survey.add(rank, step, name)
                if report.restore_step is not None:
                    survey.decisions[name] = report.restore_step
            pending = [a for a in pending if a not in reports]
            left = deadline - trio.current_time()
            if not pending or left <= 0:
                break
            await trio.sleep(min(POLL, left))  # the last attempt comes at the deadline
        survey.missing = [peer_name(a) for a in pending]

    async def _ask_gcs(self, survey: Survey) -> None:
        if self.gcs is None:
            return
        try:
            listing = await gcs_call(self.gcs.list_manifests)
        except UserError as e:
            survey.gcs_error = str(e)
            log.warning("cluster view without GCS: %s", e)
            return
        for rank, steps in listing.items():
            for step in steps:
                survey.add(rank, step, "gcs")
