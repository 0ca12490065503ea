"""This node in the job's cluster while it serves: the peer service it runs and what it tells
there, the peers it follows, the survey that keeps its view of the job fresh, and the
retention floor that view gives.

Apart from the composition root because these are tasks and rules of their own, each
handed the few parts it uses: retention on every tier depends on the view they keep (the
newest step every rank holds), and a DNS name can add peers long after the start.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import cast

import trio

from tierfs.config import Config
from tierfs.peers.claim import Identity
from tierfs.peers.network import PeerNetwork
from tierfs.peers.tls import for_config as peer_tls
from tierfs.pipeline.coordinating import NodeCoordination
from tierfs.pipeline.replicator import Replicator
from tierfs.pipeline.survey import ClusterView
from tierfs.ramtier import SpaceAccount
from tierfs.ramtier.steps import Steps
from tierfs.store import server as peer_server
from tierfs.store.erasure_member import ErasureMember
from tierfs.store.replicas import ReplicaStore
from tierfs.tiers.base import NodeTiers, Tier
from tierfs.tiers.peer import PeerTier

log = logging.getLogger("tierfs")


def retention_floor(
    coordinating: NodeCoordination | None, view: ClusterView, steps: Steps, tiers: Sequence[Tier], rank: int
) -> int | None:
    """The newest step every rank holds somewhere: retention on every tier keeps it and newer ones.

    Other nodes tell it (the coordinators' summary, checked as it arrived, or a survey of
    the peers), and a member holding the job's secret could name any step. So it never
    passes the newest step this node holds complete itself, and is unknown (everything
    is kept) while it holds none: another node's word alone deletes no step this node
    could still restore from.
    """
    summary = coordinating.summary() if coordinating is not None else None
    floor = summary.get("floor") if summary is not None else view.retention_floor()
    here = newest_complete_here(steps, tiers, rank)
    return None if floor is None or here is None else min(floor, here)


def newest_complete_here(steps: Steps, tiers: Sequence[Tier], rank: int) -> int | None:
    """This rank's newest step held complete on this node: in RAM with its manifest, or on a spill tier."""
    spilled = (s for t in tiers if t.spill for r, s in t.held() if r == rank)
    return max([*steps.verifiable(), *spilled], default=None)


def peer_info(cfg: Config, space: SpaceAccount, steps: Steps, restore_step: int | None, identity: Identity) -> dict:
    """What the peer service's ``info`` tells of this rank: its place in the job, its free RAM,
    its steps, the step it restores (if announced), and who serves it."""
    return {
        "rank": cfg.rank,
        "topology": [list(t) for t in cfg.topology],
        "data_parallel": cfg.data_parallel,
        "twins": list(cfg.peer_ranks) if cfg.peer_ranks is not None else None,
        "free": max(0, space.capacity - space.used),
        "steps": sorted(steps.states),
        "restore_step": restore_step,
        **identity.info(),
    }


async def serve_peers(
    cfg: Config,
    listen: tuple[str, int],
    store: ReplicaStore,
    info: Callable[[], dict],
    coordinating: NodeCoordination | None,
    erasure: ErasureMember | None = None,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The peer service on ``listen``: the replicas this node keeps, its RAM's steps, ``info``
    about this rank, and the coordinators' messages (when the job has coordinators)."""
    await peer_server.serve(
        listen,
        job=cfg.job,
        secret=cast(bytes, cfg.secret),  # Config refuses --listen without the job's secret
        store=store,
        info=info,
        task_status=task_status,
        tls=peer_tls(cfg),
        messages=coordinating.handle if coordinating is not None else None,
        erasure=erasure,
        # a coordinator keeps one pooled connection per member, and long polls
        max_connections=max(peer_server.MAX_CONNECTIONS, 2 * cfg.nodes + 64),
    )


class ClusterWatch:
    """Keeps the view of the newest complete step fresh, and the node's tiers following its peers.

    ``tiers`` is the node's list of tiers, which the parts built at start share: peers join
    it in place. ``interval`` is the survey interval of the configuration in force.
    """

    def __init__(
        self,
        interval: Callable[[], float],
        view: ClusterView,
        tiers: NodeTiers,
        replicator: Replicator,
        *,
        network: PeerNetwork | None,
        coordinating: NodeCoordination | None,
        replica_store: ReplicaStore | None,
    ):
        self.interval, self.view, self.tiers, self.replicator = interval, view, tiers, replicator
        self.network, self.coordinating, self.replica_store = network, coordinating, replica_store

    def follow_peers(self) -> None:
        """Give each peer the network knows a tier: a DNS name can add peers after the start."""
        if self.network is None:  # peers come only through the network
            return
        known = {t.address for t in self.tiers if t.address is not None}
        new: list[Tier] = [PeerTier(self.network, a) for a in self.network.cfg.peers if a not in known]
        if new:
            self.tiers.add(new)
            self.replicator.add_tiers(new)
        if self.coordinating is not None:
            self.coordinating.follow()

    async def run(self) -> None:
        """Survey (unless the coordinators keep the view, from reports), follow the peers, apply retention."""
        while True:
            await trio.sleep(self.interval())
            try:
                if self.coordinating is None:
                    await self.view.survey()
            except Exception as e:  # noqa: BLE001 (a survey is advisory; the next one may work)
                log.warning("cluster survey failed: %s", e)
                continue
            self.follow_peers()
            self.replicator.retain_local()
            if self.replica_store is not None:
                self.replica_store.retain()
