"""Which replicas a store lets go: those newer ones of their rank supersede, and a rollback's.

Apart from the store because it is a decision about (rank, step) numbers and ages, not
about files: the store (:class:`~tierfs.store.replicas.ReplicaStore`) says what it holds
and when each manifest was written, this module says what goes, and the store deletes it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from tierfs.core.milestones import Milestones

Held = tuple[int, int]  # (rank, step) of a replica's manifest


def superseded(
    held: Collection[Held], keep_newest: int, floor: int | None, milestone: Callable[[int, int], bool]
) -> dict[Held, int]:
    """The replicas to drop, each with the step of its rank that supersedes it.

    A replica goes once ``keep_newest`` newer ones of its rank are held, unless it is at or
    after ``floor``, the newest step the whole job can restore (None, unknown: nothing goes),
    since it may be the only copy of that step, or among the ``keep_newest`` newest
    milestones of its rank (``milestone(rank, step)``).
    """
    steps: dict[int, list[int]] = {}
    for r, s in held:
        steps.setdefault(r, []).append(s)
    newest = {r: sorted(ss)[-min(keep_newest, len(ss))] for r, ss in steps.items()}
    # The node's disk is every job's: its milestones are bounded as its steps are (the
    # plugin's max-keep bounds keep_newest); the bucket keeps them all (gcs_gc).
    milestones = {(r, s) for r, ss in steps.items() for s in sorted(s for s in ss if milestone(r, s))[-keep_newest:]}
    return {
        (r, s): newest[r]
        for r, s in held
        if s < newest[r] and floor is not None and s < floor and (r, s) not in milestones
    }


def is_milestone(milestones: Milestones, manifest: Path, step: int, now: float) -> bool:
    """Whether a replica is a milestone at ``now``, aged from its ``manifest`` file's mtime: it
    is written once, at the commit here, so a step that came late is kept longer, never shorter."""
    if not milestones:
        return False
    try:
        committed_at = os.stat(manifest).st_mtime if milestones.keep_for else None
    except OSError:
        committed_at = None  # unknown: kept rather than lost
    return milestones.is_milestone(step, committed_at, now)


def rolled_back(
    held: Iterable[Held], rank: int | None, above: int, before: float, written: Callable[[int, int], float]
) -> list[Held]:
    """The replicas a rollback to step ``above`` takes away: those of ``rank`` (None: every
    rank's) newer than ``above`` and written (``written(rank, step)``, unix time) no later
    than ``before``."""
    return [(r, s) for r, s in held if (rank is None or r == rank) and s > above and written(r, s) <= before]
