"""A rollback (``--restore-step N``): the whole job goes back to step N on purpose, once.

A job that diverged is restarted from an earlier step, and then commits steps N+1, N+2...
again. The abandoned timeline's steps newer than N must leave every place a restore
chooses from: left there, they would be complete steps again (a restart would pick the
old newest one), retention would count them as the newest, and the new commits would meet
old manifests under the same numbers. So each rank *sets them aside*:

- RAM: their files leave the volume for ``aside/`` (as a restore moves anything in its
  way), and their snapshots go, which frees their numbers;
- GCS: their manifests move under ``aside/to-<N>/``, which no listing counts and GC keeps
  with every chunk they use, until the operator discards them (``tierfs steps --discard-set-aside``);
- ``--disk`` and the replicas this node holds for other ranks: dropped, being copies.

A flag left in the job's spec must not roll the job back again after it has moved on, so
the rollback is made once and remembered: by the node (``rollback.json`` in the rank's
directory) and, for every node of the job, by the bucket (``rollbacks/to-<N>.json``, made
by the first rank; GCS's time of it is the rollback's time). A start with ``--restore-step N``:

1. this node rolled back to N already: it starts as any other start does;
2. the bucket recorded the rollback, and this rank's manifests there show a step newer than
   N committed since: the job moved on (this node lost its RAM since); only what this node
   still holds of the old timeline (newer than N, committed before the rollback) goes;
3. otherwise the rollback is this start's: N must be complete for every writing rank, or
   the start is refused naming the ranks that lack it; then the old timeline is set aside.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import trio

from tierfs.core.atomic import UnsafeFile, read_state, write_atomically
from tierfs.core.errors import UserError
from tierfs.pipeline.manifests import fetch_manifest
from tierfs.pipeline.namespace import set_aside
from tierfs.tiers.base import Tier, TierError, by_cost

if TYPE_CHECKING:
    from tierfs.config import Config
    from tierfs.pipeline.survey import Survey
    from tierfs.ramtier import RankDir
    from tierfs.ramtier.steps import Steps
    from tierfs.tiers.gcs import GcsTier

log = logging.getLogger("tierfs")

RECORD = "rollback.json"  # in the rank's directory: the rollback this node made last
LISTED = 8  # ranks named in a refusal


class Rollback:
    """The rollback a start was asked for (``cfg.restore_step``) on this node's ``tiers``."""

    def __init__(self, cfg: Config, rank: RankDir, steps: Steps, tiers: Sequence[Tier], local: Tier):
        assert cfg.restore_step is not None
        self.cfg, self.rank, self.steps, self.tiers, self.local = cfg, rank, steps, tiers, local
        self.step: int = cfg.restore_step
        # The one shared tier is the bucket (its class is a slow import, left to the daemon's tiers).
        self.bucket = cast("GcsTier | None", next((t for t in tiers if t.shared), None))

    async def due(self) -> bool:
        """Whether this start rolls the job back (rule 3); a rule 2 start clears what is left first.

        This node's record counts while the bucket's is the same one: a rollback discarded
        there (``tierfs steps --discard-set-aside``) may be made again. A bucket that does not
        answer refuses a rollback not made here yet, rather than guess.
        """
        mine = made_here(self.rank)
        done_here = mine is not None and mine[0] == self.step
        try:
            at = await self.bucket.rollback_at(self.step) if self.bucket is not None else None
        except TierError as e:
            if done_here:
                log.warning(
                    "the bucket did not say whether job %s's rollback to step %d stands (%s): this node "
                    "made it, and starts as any start",
                    self.cfg.job,
                    self.step,
                    e,
                )
                return False
            raise UserError(
                f"cannot roll job {self.cfg.job} back to step {self.step}: {e}; mount again once the bucket answers"
            ) from None
        if done_here and mine is not None and (self.bucket is None or at == mine[1]):
            return False
        if at is None or not await self._moved_on(at):
            return True
        gone = await self._set_aside(at)
        self._remember(at)
        log.info(
            "job %s was rolled back to step %d at %s and has moved on since: %s",
            self.cfg.job,
            self.step,
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)),
            f"set aside what was left here of the old timeline ({_steps(gone)})" if gone else "nothing left here",
        )
        return False

    def check(self, survey: Survey) -> None:
        """Refuse, in one line, a step not complete for every rank that wrote any."""
        cfg, step = self.cfg, self.step
        if not survey.holders:
            raise UserError(
                f"cannot roll job {cfg.job} back to step {step}: no tier holds any step of it" + _unreached(survey)
            )
        lacking = sorted(r for r, held in survey.holders.items() if step not in held)
        if lacking:
            named = ", ".join(map(str, lacking[:LISTED])) + (
                f" and {len(lacking) - LISTED} more" if len(lacking) > LISTED else ""
            )
            raise UserError(
                f"cannot roll job {cfg.job} back to step {step}: rank(s) {named} hold no copy of it on "
                f"any tier{_unreached(survey)}; pick a step 'tierfs steps' shows complete for every rank"
            )

    async def make(self, survey: Survey) -> None:
        """Record the rollback (the bucket's record first: its time is the rollback's) and set the
        old timeline aside."""
        await self._clear_volume(survey)
        at = await self.bucket.rollback_at(self.step, record=True) if self.bucket is not None else None
        at = time.time() if at is None else at
        gone = await self._set_aside(at)
        self._remember(at)
        log.warning(
            "rolling job %s back to step %d: newer steps set aside: %s",
            self.cfg.job,
            self.step,
            _steps(gone) or "none here",
            extra={"event": "rolled_back", "step": self.step},
        )

    def _remember(self, at: float) -> None:
        write_atomically(self.rank.path / RECORD, json.dumps({"step": self.step, "at": at}))

    async def _moved_on(self, at: float) -> bool:
        """Whether this rank committed a step newer than the rollback's since it was made."""
        if any(s > self.step and state.committed_at > at for s, state in self.steps.states.items()):
            return True
        if self.bucket is None:  # never so: only a bucket's record gives a rollback's time to ask about
            return False
        return bool(await self.bucket.committed_since(self.cfg.rank, self.step, at))

    async def _clear_volume(self, survey: Survey) -> None:
        """Move this rank's newer steps that RAM no longer tracks out of the volume too.

        A job keeps its last few checkpoints in the volume (Orbax's ``max_to_keep``) after
        RAM retention let go of all but the newest; left there, the job's own listing would
        restore the newest of them. Their roots are in their manifests, which the tiers
        that held them give (before they are set aside).
        """
        rank, step = self.cfg.rank, self.step
        by_name = {t.name: t for t in self.tiers}
        for s in sorted(s for s in survey.holders.get(rank, {}) if s > step and s not in self.steps.states):
            holders = by_cost([by_name[n] for n in survey.tiers(rank, s) if n in by_name])
            try:
                roots = (await fetch_manifest(self.cfg, s, holders)).roots
            except UserError as e:
                log.warning("step %d of rank %d stays in the volume, if it is there: %s", s, rank, e)
                continue
            for root in roots:
                set_aside(self.rank, root, f"the job is rolled back to step {step}")

    async def _set_aside(self, at: float) -> list[tuple[int, int]]:
        """The old timeline (newer than the step, committed before ``at``) out of every tier of this node."""
        rank, step = self.cfg.rank, self.step
        gone = []
        for s, state in sorted(self.steps.states.items()):
            if s > step and state.committed_at <= at:
                for root in state.roots:
                    set_aside(self.rank, root, f"the job is rolled back to step {step}")
                trash = self.steps.drop(s)
                if trash is not None:
                    await trio.to_thread.run_sync(shutil.rmtree, trash, True)
                gone.append((rank, s))
        for tier in self.tiers:  # a peer's tier sets nothing aside: each node does its own
            gone += await tier.set_aside(None if tier is self.local else rank, step, at)
        return gone


def made_here(rank: RankDir) -> tuple[int, float] | None:
    """The step this node last rolled the job back to, and the rollback's time; None if it never did."""
    try:
        record = json.loads(read_state(rank.path / RECORD, 4096))
    except UnsafeFile as e:
        raise UnsafeFile(f"unsafe ramdisk: {e}") from None
    except (OSError, ValueError):
        return None
    if (
        not isinstance(record, dict)
        or type(record.get("step")) is not int
        or not isinstance(record.get("at"), (int, float))
    ):
        return None
    return record["step"], float(record["at"])


def _steps(gone: list[tuple[int, int]]) -> str:
    return ", ".join(f"rank {r} step {s}" for r, s in sorted(set(gone))[: LISTED * 2])


def _unreached(survey: Survey) -> str:
    return f" reached (not answering: {', '.join(survey.missing[:LISTED])})" if survey.missing else ""
