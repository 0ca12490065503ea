"""Restore planning: which step the whole job restores at start, and from which tiers.

At start (before the mount exists) the daemon asks the job's coordinators
(:mod:`tierfs.pipeline.coordinating`), or else surveys every tier, for the step every rank
can restore (:mod:`tierfs.pipeline.survey`), and then either presents a step this node
already holds, or fetches this rank's manifest of it from the cheapest tier that holds it
and prepares a :class:`~tierfs.pipeline.restore.Restore` that reads the chunks from those tiers,
cheapest and closest first. Local steps newer than the chosen one are set aside, and an
interrupted restore of a step no longer chosen is taken out of the volume.

The per-chunk source order is :func:`tierfs.tiers.fetch.sources_for`; the tiers a restore may
read from are chosen once, here (:meth:`RestorePlanner.holders`).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tierfs.core.atomic import UnsafeFile, read_state
from tierfs.core.errors import UserError
from tierfs.core.manifest import MAX_BYTES as MAX_MANIFEST
from tierfs.core.manifest import Manifest, ManifestError
from tierfs.core.parse import format_size
from tierfs.pipeline.manifests import fetch_manifest
from tierfs.pipeline.namespace import link_into_tree, set_aside
from tierfs.pipeline.restore import Origin, Restore
from tierfs.pipeline.resume import restoring_steps
from tierfs.pipeline.rollback import Rollback, made_here
from tierfs.pipeline.survey import ClusterView, Survey
from tierfs.tiers.base import Tier
from tierfs.tiers.fetch import ChunkSources

if TYPE_CHECKING:
    from tierfs.config import Config
    from tierfs.coordination.decision import Decision
    from tierfs.pipeline.coordinating import NodeCoordination
    from tierfs.ramtier import RankDir, SpaceAccount
    from tierfs.ramtier.snapshots import Snapshots
    from tierfs.ramtier.steps import Steps

log = logging.getLogger("tierfs")

SELF_CHECK_NODES = 64  # up to this many nodes, a start holds the coordinators' answer against its own survey


class RestorePlanner:
    """The choice of the step to restore, and the restore that presents it.

    ``tiers`` is every tier of this node (a list the daemon keeps current); ``local`` is the
    one among them that is this node's RAM, where a restore looks for a chunk first.
    ``coordinating`` asks the job's coordinators (None: survey ``view`` instead).
    """

    def __init__(
        self,
        cfg: Config,
        *,
        rank: RankDir,
        steps: Steps,
        snapshots: Snapshots,
        space: SpaceAccount,
        tiers: Sequence[Tier],
        local: Tier,
        view: ClusterView,
        coordinating: NodeCoordination | None,
        started: float,
    ):
        self.cfg, self.rank, self.steps, self.snapshots, self.space = cfg, rank, steps, snapshots, space
        self.tiers, self.local, self.view, self.coordinating = tiers, local, view, coordinating
        self.started = started  # steps committed after this mean the job moved past the restored one
        self.restore_step: int | None = None  # the step chosen at start, announced to peers
        self.restored_files = False  # whether this rank has files in it (a rank that wrote none has not)
        self.missing: list[str] = []  # the nodes' tiers that had not answered when the step was chosen
        self.rolled_back: tuple[int, float] | None = None  # the rollback this node made (step, when), if asked

    def reconfigure(self, cfg: Config) -> None:
        """The job changed its shape: the next choice follows it."""
        self.cfg = cfg

    def announced_step(self) -> int | None:
        """The step chosen at start, until the job commits a newer one here (then it has moved on).

        A rank with no files in the step restored nothing that other ranks must agree with, and
        would never commit a newer step to end its word: it says nothing, lest a node restarting
        long after take the old step over the newer ones the writing ranks committed since.
        """
        chosen = self.restore_step
        if chosen is None or not self.restored_files:
            return None
        if any(s.step > chosen and s.committed_at > self.started for s in self.steps.states.values()):
            return None
        return chosen

    def survey_wait(self) -> float:
        """How long a survey waits for silent nodes: ``--restore-wait`` when other nodes are tiers."""
        return self.cfg.restore_wait if any(t.awaited for t in self.tiers) else 0.0

    async def plan(self) -> Restore | None:
        """Choose the step the whole job restores, and present this rank's files of it.

        Returns the restore to run once mounted, or None when the step is here already (or
        there is none). Raises UserError when the step cannot be restored here.
        """
        cfg, steps = self.cfg, self.steps
        survey, step = await self.choose()
        self.restore_step, self.missing, self.restored_files = step, survey.missing, step in steps.states
        for unfinished in restoring_steps(steps):
            if unfinished != step:
                self.abandon(unfinished)
        if step is None:
            log.info("no tier holds a step complete for every rank of %s: starting from what is here", cfg.job)
            return None
        for newer in sorted(s for s in steps.states if s > step):
            for root in steps.states[newer].roots:  # other ranks cannot restore it: hide it
                set_aside(self.rank, root, f"step {newer} is not complete on every rank; restoring step {step}")
        if step in steps.states:
            for root in steps.states[step].roots:
                link_into_tree(
                    self.rank, self.snapshots.step_tree(step), root, f"it is in the way of step {step}", keep=True
                )
            log.info("step %d, the newest complete for every rank, is here already", step)
            return None
        holders = await self.usable(self.holders(survey, step), step)
        if not holders:
            log.info("rank %d has nothing in step %d: nothing to restore", cfg.rank, step)
            return None
        self.restored_files = True
        manifest = await fetch_manifest(cfg, step, holders)
        needed = manifest.nonzero_bytes() - self.already_restored(step)
        if cfg.capacity is not None and self.space.used + needed > cfg.capacity:
            raise UserError(
                f"step {step} of rank {cfg.rank} needs {format_size(needed)} more, but only "
                f"{format_size(max(0, cfg.capacity - self.space.used))} of --capacity {format_size(cfg.capacity)} "
                "is free: raise the capacity"
            )
        if self.coordinating is not None:  # with twins restoring it from GCS too, a shared plan
            sources = self.coordinating.sources(step, manifest, holders, self.local)
        else:
            sources = ChunkSources([self.local, *holders])  # this node's own copies of a chunk come first
        restore = Restore(cfg, self.rank, steps, self.space, manifest, sources, Origin(holders))
        restore.prepare()
        for h in restore.done_chunks():  # written before a restart: twins may take them from here
            sources.arrived(h)
        return restore

    async def choose(self) -> tuple[Survey, int | None]:
        """Who holds what, and the step to restore: the coordinators' answer, else a survey of every tier.

        A rollback (``--restore-step``) this start makes asks every tier itself: the step must
        be complete for every rank, older than anything the coordinators would choose.
        """
        if self.cfg.restore_step is not None:
            rollback = Rollback(self.cfg, self.rank, self.steps, self.tiers, self.local)
            due = await rollback.due()
            if due:
                survey = await self.view.survey(wait=self.survey_wait())
                rollback.check(survey)
                await rollback.make(survey)
            self.rolled_back = made_here(self.rank)
            if due:
                return survey, rollback.step
        if self.coordinating is not None:
            answered = await self.coordinating.decide()
            if answered is not None:
                return await self.cross_check(*answered)
            log.warning("no coordinator answered: surveying every node instead")
        survey = await self.view.survey(wait=self.survey_wait())
        return survey, survey.choose(self.cfg.rank)

    async def cross_check(self, survey: Survey, step: int | None) -> tuple[Survey, int | None]:
        """Hold the coordinators' answer against what this node sees itself before following it.

        The node asks the tiers it reaches (its disk and replica store, its peers, GCS) and
        applies the same rules, with the steps the coordinator says nodes run from. If that
        finds a newer step than the answer, the answer is not followed silently: a second
        coordinator is asked, and the disagreement logged. If no answer accounts for the
        newer step, the start is refused rather than run from nothing or from an older step
        (``--start-fresh`` overrides). Jobs larger than SELF_CHECK_NODES skip the survey of
        every peer, which is what the coordinators exist to avoid.

        Then, whatever the job's size, an answer older than a step this node holds complete
        itself is not followed on one coordinator's word (:meth:`keep_newer_here`).
        """
        own = await self.view.survey() if self.cfg.nodes <= SELF_CHECK_NODES else None
        mine = own.choose(self.cfg.rank) if own is not None else None  # before the answer's claims count
        if own is not None:
            survey, step = await self._check_seen(own, survey, step)
        return await self.keep_newer_here(survey, step, mine)

    def _answer(self) -> tuple[NodeCoordination, Decision, str]:
        """The coordination whose answer is being checked, that answer, and the coordinator that gave it.

        Set by :meth:`~tierfs.pipeline.coordinating.NodeCoordination.decide`, which keeps only an
        answer a coordinator gave: what checks an answer runs only once there is one.
        """
        coordinating = self.coordinating
        decision = coordinating.decision if coordinating is not None else None
        if coordinating is None or decision is None or decision.coordinator is None:
            raise RuntimeError("no coordinator's answer to check")
        return coordinating, decision, decision.coordinator

    async def _check_seen(self, own: Survey, survey: Survey, step: int | None) -> tuple[Survey, int | None]:
        cfg = self.cfg
        coordinating, first, first_by = self._answer()
        seen = self._seen(own, first.summary)
        if seen is None or (step is not None and step >= seen):
            return survey, step
        where = ", ".join(own.tiers(cfg.rank, seen)) or "no tier (this rank wrote nothing)"
        log.warning(
            "coordinator %s chose step %s, but step %d is complete for every rank on the tiers this "
            "node reaches (rank %d's on %s): asking another coordinator",
            first_by,
            step,
            seen,
            cfg.rank,
            where,
        )
        second = await coordinating.decide(exclude=(first_by,))
        if second is not None and second[1] is not None and second[1] >= seen:
            second_by = self._answer()[2]
            log.warning(
                "coordinators disagree: %s chose step %s, %s chose step %s: following %s",
                first_by,
                step,
                second_by,
                second[1],
                second_by,
            )
            return second
        if cfg.start_fresh:
            log.warning(
                "step %d is complete for every rank (rank %d's on %s), but the coordinators chose "
                "step %s: starting from that, as --start-fresh asks",
                seen,
                cfg.rank,
                where,
                step,
            )
            return survey, step
        raise UserError(
            f"step {seen} is complete for every rank of job {cfg.job} (rank {cfg.rank}'s on {where}), but the "
            f"coordinators chose {'no step' if step is None else f'step {step}'}: not starting "
            f"{'empty' if step is None else 'from the older step'}; mount again to retry, "
            "or pass --start-fresh to start from what the coordinators chose"
        )

    async def keep_newer_here(self, survey: Survey, step: int | None, mine: int | None) -> tuple[Survey, int | None]:
        """Follow an answer older than a step this node holds complete only once it is confirmed.

        Following such an answer moves this rank's newer step out of the volume, so one
        coordinator (which a member holding the job's secret may be) must not decide it
        alone. The answer stands if this node's own survey gives the same step (``mine``,
        before any claim of the answer counts); else a second coordinator is asked, and
        the newer of the two answers is followed: a coordinator can never take the node
        further back than another one's answer. With no confirmation the start is refused
        (``--start-fresh`` overrides). The newer step is never deleted on the way: its files
        go to ``aside/``, its snapshot stays until retention, which keeps the newest step
        this node holds complete (:func:`tierfs.daemon.cluster.retention_floor`).
        """
        cfg = self.cfg
        here = max(self.steps.verifiable(), default=None)
        if here is None or step is None or step >= here or mine == step:
            return survey, step
        coordinating, _, first = self._answer()
        log.warning(
            "coordinator %s chose step %d, older than step %d that rank %d holds complete here: "
            "asking another coordinator before setting it aside",
            first,
            step,
            here,
            cfg.rank,
        )
        second = await coordinating.decide(exclude=(first,))
        if second is not None and second[1] is not None:
            if second[1] > step:
                second_by = self._answer()[2]
                log.warning(
                    "coordinators disagree: %s chose step %d, %s chose step %d: following %s",
                    first,
                    step,
                    second_by,
                    second[1],
                    second_by,
                )
                return second
            return survey, step
        if cfg.start_fresh:
            log.warning(
                "coordinator %s chose step %d, older than step %d held complete here, and no other "
                "confirmed it: starting from step %d, as --start-fresh asks",
                first,
                step,
                here,
                step,
            )
            return survey, step
        raise UserError(
            f"coordinator {first} chose step {step} for job {cfg.job}, older than step {here} that rank "
            f"{cfg.rank} holds complete here, and no other coordinator confirmed it: not setting step {here} "
            "aside; mount again to retry, or pass --start-fresh to start from the coordinator's step"
        )

    def _seen(self, own: Survey, summary: dict) -> int | None:
        """The step this node's own survey gives its rank, counting the steps nodes run from as the
        coordinator knows them."""
        decisions = summary.get("decisions") if isinstance(summary, dict) else None
        for s in decisions if isinstance(decisions, list) else ():
            if type(s) is int:
                own.decisions.setdefault(f"a node running step {s}", s)
        return own.choose(self.cfg.rank)

    async def usable(self, holders: list[Tier], step: int) -> list[Tier]:
        """``holders`` without those that know the step but cannot give it now (an erasure group with
        more members lost than its parity covers; the survey may predate the losses). If that
        leaves none, starting empty would lose the rank's step: refused, unless ``--start-fresh``."""
        candidates = holders or list(self.tiers)  # a rank no tier reports: does one know it was lost?
        reasons = {t.name: why for t in candidates if (why := await t.lost(self.cfg.rank, step)) is not None}
        usable = [t for t in holders if t.name not in reasons]
        if usable or not reasons:
            return usable
        why = "; ".join(reasons.values())
        if self.cfg.start_fresh:
            log.warning("%s: starting rank %d without it, as --start-fresh asks", why, self.cfg.rank)
            return []
        raise UserError(
            f"{why}: not starting rank {self.cfg.rank} without its step {step}; bring the lost nodes back "
            "and mount again, mount with --gcs to restore from the bucket, or pass --start-fresh"
        )

    def holders(self, survey: Survey, step: int) -> list[Tier]:
        """The tiers holding this rank's ``step``, in the order to read them: cheapest, then closest."""
        by_name = {t.name: t for t in self.tiers if t is not self.local}  # the local copies are read first anyway
        held: list[Tier] = []
        for name in survey.tiers(self.cfg.rank, step):
            tier = next((t for t in self.tiers if t.stands_for(name)), by_name.get(name))
            if tier is not None and tier not in held:
                held.append(tier)
        return sorted(held, key=lambda t: (t.cost.key(), -survey.closeness(t.name, self.cfg.topology)))

    def already_restored(self, step: int) -> int:
        """Bytes of ``step`` a previous, interrupted restore already wrote."""
        tree = self.snapshots.step_tree(step)
        return (
            sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(tree) for f in files)
            if tree.exists()
            else 0
        )

    def abandon(self, step: int) -> None:
        """An interrupted restore of a step no longer chosen: take its placeholders away.

        Its manifest says what to take out of the volume, so it is read like every state
        file: at most a manifest's size, never through a link, and only if the daemon wrote
        it (UnsafeFile, a one-line refusal, otherwise).
        """
        path = self.snapshots.step_dir(step) / "manifest.json"
        try:
            roots = Manifest.from_json(read_state(path, MAX_MANIFEST)).roots
        except UnsafeFile as e:
            raise UnsafeFile(f"unsafe ramdisk: {e}") from None
        except (OSError, ManifestError) as e:
            log.warning(
                "the unfinished restore of step %d has no usable manifest (%s): "
                "nothing of it is taken out of the volume",
                step,
                e,
            )
            roots = []
        for root in roots:
            set_aside(self.rank, root, f"the restore of step {step} was abandoned")
        trash = self.snapshots.drop(step)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        log.warning("abandoned the unfinished restore of step %d", step)
