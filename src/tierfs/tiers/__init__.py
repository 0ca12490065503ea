"""The tiers a step lives on: one interface (:mod:`tierfs.tiers.base`), one module per tier.

``local`` (this node's RAM), ``disk`` (``--disk DIR``), ``peer`` (another node's RAM, one
tier per peer) and ``gcs`` (``--gcs``). The GCS modules import google-cloud-storage, which
is slow: import :mod:`tierfs.tiers.gcs` only when a mount has ``--gcs``.
"""

from tierfs.tiers.base import (
    Cost,
    Holdings,
    NotHeld,
    Pushed,
    SourceChanged,
    Tier,
    TierError,
    TierUnavailable,
    by_cost,
    put_step,
)

__all__ = [
    "Cost",
    "Holdings",
    "NotHeld",
    "Pushed",
    "SourceChanged",
    "Tier",
    "TierError",
    "TierUnavailable",
    "by_cost",
    "put_step",
]
