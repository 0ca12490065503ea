"""The erasure group of a node mounted with ``--erasure D+P``: its parity store, its part of the peer service, its tier.

Every node computes the same groups from the job's shape alone (:func:`tierfs.peers.groups.form_groups`
over ``--nodes`` and ``--data-parallel``, so data-parallel twins are never in one group), and
its own committed steps are read back as chunk streams from their snapshots, through the
manifest the replicator wrote beside each.
"""

from __future__ import annotations

import os

from tierfs.config import Config
from tierfs.core.atomic import read_state
from tierfs.core.erasure import Code
from tierfs.core.errors import UserError
from tierfs.core.manifest import MAX_BYTES as MAX_MANIFEST
from tierfs.core.manifest import Manifest, ManifestError, split_seal
from tierfs.peers.groups import form_groups
from tierfs.peers.network import PeerNetwork
from tierfs.ramtier import RankDir
from tierfs.ramtier.steps import Steps
from tierfs.store.parity import ParityStore
from tierfs.store.stripe_service import OwnShard, StripeService
from tierfs.tiers.erasure import ErasureTier, Members


class OwnSteps:
    """This node's committed steps as streams, each read once per version of its manifest."""

    def __init__(self, steps: Steps):
        self.steps = steps
        self._cache: dict[int, tuple[int, OwnShard]] = {}  # step -> (manifest's mtime_ns, stream)

    def list(self) -> list[int]:
        return self.steps.verifiable()

    def shard(self, step: int) -> OwnShard | None:
        snapshots = self.steps.snapshots
        path = snapshots.step_dir(step) / "manifest.json"
        try:
            version = os.stat(path).st_mtime_ns
        except OSError:
            return None
        cached = self._cache.get(step)
        if cached is not None and cached[0] == version:
            return cached[1]
        try:
            manifest = Manifest.from_json(split_seal(read_state(path, MAX_MANIFEST))[0])
        except (OSError, UserError, ManifestError, ValueError):
            return None
        tree = snapshots.step_tree(step)
        shard = OwnShard([(str(tree / rel), offset, n) for rel, offset, n in manifest.chunk_places().values()])
        self._cache = {s: c for s, c in self._cache.items() if s in self.steps.states}
        self._cache[step] = (version, shard)
        return shard


def erasure_group(cfg: Config, rank: RankDir, steps: Steps, network: PeerNetwork) -> tuple[StripeService, ErasureTier]:
    """This node's part of its group (served to the members) and the group as a tier (the peers lane's)."""
    shape = cfg.erasure_shape
    if shape is None:
        raise ValueError("no --erasure")
    group = form_groups(cfg.nodes, shape.d, shape.p, data_parallel=cfg.data_parallel).group_of(cfg.rank)
    parity = ParityStore(rank.state_dir("parity"), Code(group.layout))
    parity.load()
    own = OwnSteps(steps)
    members = Members(network)
    service = StripeService(cfg.rank, group, parity, own.shard, own.list, members.dial)
    return service, ErasureTier(service, members)
