"""This rank's manifest of a step, fetched from the tiers that hold it and checked before use.

Apart from :mod:`tierfs.pipeline.restore` because it comes before any restore: planning
(:mod:`tierfs.pipeline.planning`) fetches the manifest of the step it chose and builds the
restore from it, and a rollback (:mod:`tierfs.pipeline.rollback`) reads the roots of the
steps it sets aside; neither needs the restore's machinery.
"""

from __future__ import annotations

import logging

from tierfs.config import Config
from tierfs.core.errors import UserError
from tierfs.core.manifest import Manifest, ManifestError, Unauthenticated, authenticate
from tierfs.tiers.base import Tier, TierError, first_line

# The name these lines have always had in the log (they were the restore's): filters keep working.
log = logging.getLogger("tierfs.pipeline.restore")


async def fetch_manifest(cfg: Config, step: int, tiers: list[Tier]) -> Manifest:
    """This rank's manifest of ``step`` from the first of ``tiers`` (in order) that gives a valid one.

    A manifest that is not this job's, this rank's and this step's is refused like a
    malformed one, and the next tier is asked; so is one the job's secret did not seal (a
    node with a secret uses no other).
    """
    errors = []
    for tier in tiers:
        try:
            data = await tier.get_manifest(cfg.rank, step)
            return _parse(data, tier.where, cfg, step)
        except Exception as e:  # whatever one tier does, the next one is asked
            if not isinstance(e, (TierError, UserError)):
                log.error(
                    "manifest of step %d from %s: unexpected %s", step, tier.name, type(e).__name__, exc_info=True
                )
            said = first_line(e)
            errors.append(said if said.startswith(f"{tier.name}: ") else f"{tier.name}: {said}")
    raise UserError(
        f"no tier could send the manifest of step {step} of rank {cfg.rank}: {'; '.join(errors) or 'none holds it'}"
    )


def _parse(data: bytes, where: str, cfg: Config, step: int) -> Manifest:
    try:
        body = authenticate(data, cfg.manifest_keys, cfg.rank, step)
        manifest = Manifest.from_json(body)
        manifest.check_identity(cfg.job, cfg.rank, step)
    except Unauthenticated as e:
        log.warning("ignoring the manifest of rank %d step %d from %s: %s", cfg.rank, step, where, e)
        raise UserError(f"the manifest from {where} is not this job's: {e}") from None
    except ManifestError as e:
        raise UserError(f"the manifest from {where} is unusable: {e}") from None
    return manifest
