"""How the pipeline uses each lane's tiers: how many must hold a step, in what order they are
tried, how often a step goes, which ranks share the uploads, and what retention follows.

Apart from the tiers (:mod:`tierfs.tiers`), which only store: a tier answers the storage
verbs (chunks in and out, manifests, holdings), and a new kind of tier needs nothing else.
These rules are the job's configuration applied to a lane, so they follow it when the job
changes its shape (:meth:`LanePolicy.configure`, from ``replicator.yaml``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tierfs.config import Config
from tierfs.core.milestones import Milestones
from tierfs.peers.placement import choose, job_twins
from tierfs.tiers.base import Lane, Tier
from tierfs.tiers.disk import DiskTier
from tierfs.tiers.peer import PeerTier

log = logging.getLogger(__name__)


class LanePolicy:
    """The rules of a lane whose tiers are alternatives that each take every step at once."""

    keeps_milestones = False  # its retention keeps --keep-every's steps: a milestone must reach it

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def configure(self, cfg: Config) -> None:
        self.cfg = cfg

    def copies(self) -> int:
        """How many of the lane's tiers must hold each step."""
        return 1

    def schedule(self) -> tuple[float, int]:
        """(seconds, steps) to leave at least between two steps put on the lane; (0, 0): every commit."""
        return 0.0, 0

    def twins(self) -> list[int]:
        """The other ranks that put the same chunks on the lane's tiers and share the uploads
        (:mod:`tierfs.tiers.twins`); [] puts every chunk this node's step needs itself."""
        return []

    async def order(self, tiers: Sequence[Tier]) -> list[Tier]:
        """The lane's tiers in the order a step tries them."""
        return sorted(tiers, key=lambda t: t.cost.key())

    async def retain(self, tier: Tier) -> None:
        """Retention on ``tier``, once a step is on it."""

    def report(self, tiers: Sequence[Tier]) -> dict[str, object]:
        """What ``tierfs status`` shows of the lane besides its progress."""
        return {"label": tiers[0].where}


class PeerPolicy(LanePolicy):
    """``--replicas`` peers hold each step, placed by topology and data parallelism."""

    def copies(self) -> int:
        return self.cfg.replicas

    async def order(self, tiers: Sequence[Tier]) -> list[Tier]:
        """Placement (:func:`tierfs.peers.placement.choose`): data-parallel twins first, then one
        close peer, then distant ones, among the peers the network knows now."""
        peers = [t for t in tiers if isinstance(t, PeerTier)]
        if not peers:
            return []
        network = peers[0].network
        cfg = network.cfg  # with the peers known now: a DNS name gives more after the start
        by_address = {t.address: t for t in peers}
        candidates = choose(
            cfg.rank,
            cfg.topology,
            await network.discover(),
            len(cfg.peers),
            cfg.nodes,
            cfg.data_parallel,
            set(cfg.peer_ranks) if cfg.peer_ranks is not None else None,
        )
        return [by_address[p.address] for p in candidates if p.address in by_address]

    def report(self, tiers: Sequence[Tier]) -> dict[str, object]:
        peers = [t for t in tiers if isinstance(t, PeerTier)]
        known = peers[0].network.status() if peers else []
        return {"label": f"{self.cfg.replicas} replica(s)", "replicas": self.cfg.replicas, "known": known}


class ErasurePolicy(LanePolicy):
    """``--erasure D+P``: the lane's one tier is this rank's group, which takes every step as parity."""

    def report(self, tiers: Sequence[Tier]) -> dict[str, object]:
        group = tiers[0].report()
        return {"label": f"erasure {self.cfg.erasure}", "known": group.pop("known", []), "erasure": group}


class BackupPolicy(LanePolicy):
    """The bucket: at the backup interval, uploads shared with data-parallel twins, and one
    collector per job (rank 0's), which covers every rank's manifests and milestones."""

    keeps_milestones = True

    def schedule(self) -> tuple[float, int]:
        return self.cfg.backup_interval, self.cfg.backup_interval_steps

    def twins(self) -> list[int]:
        return job_twins(self.cfg)  # as the job's shape says now: replicator.yaml may change it

    async def retain(self, tier: Tier) -> None:
        from tierfs.tiers.gcs import GcsTier  # noqa: PLC0415 (the GCS client loads only with a bucket)

        cfg = self.cfg
        if cfg.rank == 0 and isinstance(tier, GcsTier):
            result = await tier.collect(cfg.keep, cfg.gc_grace, cfg.nodes, Milestones.from_config(cfg))
            log.info("GCS retention: %s", result)

    def report(self, tiers: Sequence[Tier]) -> dict[str, object]:
        bucket = tiers[0].report()
        return {
            "label": tiers[0].where,
            "url": bucket.get("url"),
            "sealed": bucket.get("sealed"),
            "backup_interval_s": self.cfg.backup_interval,
        }


class DiskPolicy(LanePolicy):
    """This node's disk: each rank's ``--keep`` newest steps and milestones."""

    keeps_milestones = True

    async def retain(self, tier: Tier) -> None:
        if isinstance(tier, DiskTier):
            await tier.retain(self.cfg.keep, Milestones.from_config(self.cfg))

    def report(self, tiers: Sequence[Tier]) -> dict[str, object]:
        return {"label": tiers[0].where, "path": tiers[0].where}


POLICIES: dict[str, type[LanePolicy]] = {Lane.PEERS: PeerPolicy, Lane.GCS: BackupPolicy, Lane.DISK: DiskPolicy}


def policy_for(lane: str, cfg: Config) -> LanePolicy:
    """The rules of the lane named ``lane`` (a :class:`~tierfs.tiers.base.Lane`), following ``cfg``."""
    if lane == Lane.PEERS and cfg.erasure is not None:
        return ErasurePolicy(cfg)
    return POLICIES.get(lane, LanePolicy)(cfg)
