"""Every tier of one node, built once from its configuration, in cost order.

The daemon is the one place that knows which tiers a configuration asks for; everything
else gets the list as values and asks their capabilities. This node's RAM is one of them,
the cheapest, so it leads the list.
"""

from __future__ import annotations

from collections.abc import Callable

from tierfs.config import Config
from tierfs.core.errors import UserError
from tierfs.peers.network import PeerNetwork
from tierfs.tiers.base import Tier, by_cost
from tierfs.tiers.disk import DiskTier
from tierfs.tiers.peer import peer_tiers


def node_tiers(
    cfg: Config,
    ram: Tier,
    network: PeerNetwork | None,
    *,
    keep_from: Callable[[], int | None],
    restorable_without_gcs: bool,
    warn: Callable[[str], None],
) -> list[Tier]:
    """``ram`` and every other tier ``cfg`` asks for, cheapest first.

    ``keep_from`` is the retention floor the disk keeps steps from; ``restorable_without_gcs``
    says whether a bucket that does not answer at start may only delay backups (else the
    start fails: there is nothing else to restore from). ``warn`` reports what start-up
    should repeat to whoever mounted.
    """
    tiers = [ram]
    if cfg.disk is not None:
        tiers.append(DiskTier.open_for(cfg, keep_from=keep_from))
    if network is not None:
        tiers += peer_tiers(network)
    if cfg.gcs is not None:
        tiers.append(open_gcs(cfg, cfg.gcs, restorable_without_gcs, warn))
    return by_cost(tiers)


def open_gcs(cfg: Config, url: str, restorable_without: bool, warn: Callable[[str], None]) -> Tier:
    """Reach the bucket at ``url`` (``cfg.gcs``): a missing one is a start-up error, an unreachable one only delays."""
    # The GCS client and its libraries load only for a node that uses a bucket.
    from tierfs.tiers.gcs import GcsTier  # noqa: PLC0415
    from tierfs.tiers.gcs_http import GcsUnavailable  # noqa: PLC0415

    sealing = cfg.manifest_keys
    if sealing is None:
        warn(
            f"GCS objects in {url} are neither encrypted nor authenticated without the job's secret: "
            "whoever can read the bucket reads the checkpoints, and whoever can write it chooses what "
            "restores; set TIERFS_SECRET or --secret-file"
        )
    client = None
    if cfg.gcs_token_file is not None:  # the job's own identity, not the node's
        from tierfs.tiers.gcs_http import make_client  # noqa: PLC0415 (as above)
        from tierfs.tiers.gcs_identity import job_credentials  # noqa: PLC0415 (and google-auth's)

        client = make_client(job_credentials(cfg))
    tier = GcsTier(url, cfg.job, keys=sealing, seals=cfg.bucket_seals, client=client)
    try:
        tier.check()
    except GcsUnavailable as e:
        if not restorable_without:
            raise UserError(
                f"cannot reach {url} to restore rank {cfg.rank} ({e}): "
                "check the network or STORAGE_EMULATOR_HOST, or mount without --gcs"
            ) from None
        warn(f"GCS {url} is unreachable ({e}): backups wait until it answers")
    return tier
