"""The cluster view: the newest step that every rank can restore, as any node sees it.

No node is special. Each node asks every tier it knows what it holds (:func:`survey`): each
peer its own committed steps, the replicas it keeps for other ranks, and the step it
restored at its last start; the disk and GCS their manifests. Then it computes the answer
itself. Nodes that see the same
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

The survey is one function of a list of tiers. A node with a peer service asks the job's
coordinators instead (:mod:`tierfs.pipeline.coordinating`), which apply these same rules to every
node's reports; the survey remains for a node without peers, and as the fallback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from tierfs.tiers.base import Holdings, Tier, TierError, first_line

if TYPE_CHECKING:
    from tierfs.config import Config

log = logging.getLogger(__name__)

POLL = 0.5  # seconds between attempts to reach tiers that have not answered yet
FAN_OUT = 64  # tiers asked at once: a survey of thousands of nodes stays within its sockets


@dataclass
class Survey:
    """Who holds which (rank, step) manifest, merged from every tier that answered."""

    holders: dict[int, dict[int, list[str]]] = field(default_factory=dict)  # rank -> step -> tier names
    decisions: dict[str, int] = field(default_factory=dict)  # tier (a node) -> step it restored and runs from
    topology: dict[str, tuple] = field(default_factory=dict)  # tier (a node) -> its topology labels
    missing: list[str] = field(default_factory=list)  # nodes' tiers that did not answer
    errors: dict[str, str] = field(default_factory=dict)  # tier -> why it did not answer
    shared: str | None = None  # the tier every rank shares (a bucket): its error is the status's gcs_error
    at: float = field(default_factory=time.time)

    def add(self, rank: int, step: int, tier: str) -> None:
        tiers = self.holders.setdefault(rank, {}).setdefault(step, [])
        if tier not in tiers:
            tiers.append(tier)

    def record(self, tier: str, holdings: Holdings) -> None:
        """Merge what ``tier`` answered."""
        for rank, step in holdings.manifests:
            self.add(rank, step, tier)
        if holdings.topology:
            self.topology[tier] = holdings.topology
        if holdings.restore_step is not None:
            self.decisions[tier] = holdings.restore_step
        else:
            self.decisions.pop(tier, None)

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
            log.info("adopting step %d, which peers already restored (newest complete here: %s)", adoptable[-1], newest)
            return adoptable[-1]
        return newest

    def closeness(self, tier: str, topology: tuple) -> int:
        """How many topology labels the node behind ``tier`` shares with ``topology``."""
        return len(set(self.topology.get(tier, ())) & set(topology))

    def tiers(self, rank: int, step: int) -> list[str]:
        return self.holders.get(rank, {}).get(step, [])

    def summary(self) -> dict:
        return {
            "at": self.at,
            "newest_complete": self.newest_complete(),  # over the writing ranks: what a restore picks
            "ranks": len(self.holders),
            "complete_steps": self.complete_steps()[-5:],
            "unreachable_peers": list(self.missing),
            "gcs_error": self.errors.get(self.shared) if self.shared is not None else None,
            "tier_errors": dict(self.errors),
        }


async def survey(tiers: Sequence[Tier], wait: float = 0.0) -> Survey:
    """Ask every tier what it holds; keep asking the nodes that do not answer for up to ``wait`` seconds.

    Tiers that are other nodes of the job (``Tier.awaited``) may be starting right now, so
    they are asked again until the deadline; any other tier that fails is recorded once.
    """
    result = Survey()
    limiter = trio.CapacityLimiter(FAN_OUT)
    deadline = trio.current_time() + wait
    pending = list(tiers)
    result.shared = next((t.name for t in tiers if t.shared), None)
    while True:
        answered: set[str] = set()

        async def ask(tier: Tier, answered: set[str]) -> None:
            try:
                async with limiter:
                    holdings = await tier.holdings()
            except Exception as e:  # a tier that cannot answer is left out of this survey
                result.errors[tier.name] = first_line(e)
                if not isinstance(e, TierError):
                    log.error("cluster view: %s failed unexpectedly", tier.name, exc_info=True)
                elif not tier.awaited:
                    log.warning("cluster view without %s: %s", tier.name, e)
                return
            result.errors.pop(tier.name, None)
            result.record(tier.name, holdings)
            answered.add(tier.name)

        async with trio.open_nursery() as nursery:
            for tier in pending:
                nursery.start_soon(ask, tier, answered)
        pending = [t for t in pending if t.name not in answered and t.awaited]
        left = deadline - trio.current_time()
        if not pending or left <= 0:
            break
        await trio.sleep(min(POLL, left))  # the last attempt comes at the deadline
    result.missing = [t.name for t in pending]
    return result


class ClusterView:
    """The last survey of the job's tiers, with this node's own holdings kept current.

    ``tiers`` is the list of the node's tiers its owner keeps current (peers a DNS name adds
    later join it); ``local``, if given, is this node's RAM: answered from memory, and again
    each time the retention floor is asked.
    """

    def __init__(self, nodes: int, tiers: Sequence[Tier], local=None):
        self.nodes, self.tiers, self.local = nodes, tiers, local
        self.last: Survey | None = None

    def reconfigure(self, cfg: Config) -> None:
        """The job's size changed: a complete step needs every one of its ranks."""
        self.nodes = cfg.nodes

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

    def _add_local(self, result: Survey) -> None:
        if self.local is not None:
            result.record(self.local.name, self.local.current())

    async def survey(self, wait: float = 0.0) -> Survey:
        """Ask every tier (this node's RAM first, as it is now); wait up to ``wait`` for silent nodes."""
        result = await survey([t for t in self.tiers if t is not self.local], wait)
        self._add_local(result)
        self.last = result
        return result
