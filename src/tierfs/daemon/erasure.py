"""The erasure group of a node mounted with ``--erasure D+P``: its membership, its part of the peer service, its tier.

The groups are agreed with the job's other nodes (:mod:`tierfs.store.erasure_member`), from
every rank's topology labels and twins; this node's own committed steps are read back as
chunk streams from their snapshots, through the manifest the replicator wrote beside each.
"""

from __future__ import annotations

from collections.abc import Callable

from tierfs.config import Config
from tierfs.core.errors import UserError
from tierfs.core.manifest import Manifest, ManifestError, split_seal
from tierfs.peers.network import PeerNetwork
from tierfs.ramtier import RankDir
from tierfs.ramtier.space import SpaceAccount
from tierfs.ramtier.steps import Steps
from tierfs.store.erasure_member import ErasureMember
from tierfs.store.stripe_service import OwnShard
from tierfs.tiers.erasure import ErasureTier, Members


class OwnSteps:
    """This node's committed steps as streams, each built once per version of its manifest."""

    def __init__(self, steps: Steps, manifest: Callable[[int], bytes | None]):
        """``manifest(step)``: the manifest the replicator wrote for a committed step, if it did."""
        self.steps, self.manifest = steps, manifest
        self._cache: dict[int, tuple[bytes, OwnShard]] = {}  # step -> (its manifest, its stream)

    def list(self) -> list[int]:
        return self.steps.verifiable()

    def shard(self, step: int) -> OwnShard | None:
        data = self.manifest(step)
        if data is None:
            return None
        cached = self._cache.get(step)
        if cached is not None and cached[0] == data:
            return cached[1]
        try:
            manifest = Manifest.from_json(split_seal(data)[0])
        except (UserError, ManifestError, ValueError):
            return None
        shard = OwnShard(list(self.steps.snapshots.chunk_locations(manifest).values()))
        self._cache = {s: c for s, c in self._cache.items() if s in self.steps.states}
        self._cache[step] = (data, shard)
        return shard


def erasure_group(
    cfg: Config,
    rank: RankDir,
    steps: Steps,
    network: PeerNetwork,
    manifest: Callable[[int], bytes | None],
    space: SpaceAccount,
) -> tuple[ErasureMember, ErasureTier]:
    """This node's part of its group (served to the members) and the group as a tier (the peers lane's)."""
    shape = cfg.erasure_shape
    if shape is None:
        raise ValueError("no --erasure")
    own = OwnSteps(steps, manifest)
    members = Members(network)
    member = ErasureMember(
        cfg.rank,
        cfg.nodes,
        shape,
        cfg.data_parallel,
        rank.state_dir("parity"),
        own.shard,
        own.list,
        members.dial,
        members.peers,
        labels=cfg.topology,
        twins=cfg.peer_ranks,
        space=space,
    )
    member.load()
    return member, ErasureTier(member, members)
