"""The daemon's side of GKE multi-tier checkpointing: what Orbax and MaxText ask of a node.

:mod:`tierfs.mtc.protocol` holds the protocol's rules and files; this module is the glue that
makes a daemon follow them: the job's ``replicator.yaml`` changes the job's shape (nodes,
data parallelism, the ranks holding the same data, the backup interval), which every part
that depends on it follows (:meth:`MultiTier.apply_spec`), and the job asks which step to
restore and where it is in the volume (:meth:`MultiTier.restore_target`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from tierfs.core.errors import UserError
from tierfs.mtc.protocol import MtcNode
from tierfs.mtc.spec import REPLICATOR, NextStart, ReplicatorSpec, SpecError
from tierfs.pipeline.rollback import made_here

if TYPE_CHECKING:
    from tierfs.config import Config
    from tierfs.pipeline.planning import RestorePlanner
    from tierfs.pipeline.restore import Restore
    from tierfs.pipeline.survey import ClusterView
    from tierfs.ramtier import RankDir
    from tierfs.ramtier.steps import Steps

log = logging.getLogger("tierfs")


class MultiTier:
    """The protocol's node, and what following the job asks of the rest of the daemon.

    ``reconfigure`` makes every part follow a new shape of the job; ``restore`` is the
    running restore, if any; the ``planner`` and the cluster ``view`` say which step the
    job should take.
    """

    def __init__(
        self,
        cfg: Config,
        rank: RankDir,
        steps: Steps,
        planner: RestorePlanner,
        view: ClusterView,
        restore: Callable[[], Restore | None],
        reconfigure: Callable[[Config], None],
    ):
        self.cfg, self.rank, self.steps, self.planner, self.view = cfg, rank, steps, planner, view
        self.restore, self.reconfigure = restore, reconfigure
        self.node: MtcNode | None = None

    def start(self) -> MtcNode:
        """Before the mount: clear an earlier pod's protocol files, and follow the spec it left."""
        cfg = self.cfg
        self.node = MtcNode(
            self.rank.tree,
            self.rank.path / "mtc.json",
            cfg.mountpoint,
            cfg.rank,
            cfg.coordinator,
            self.apply_spec,
            self.restore_target,
        )
        spec = self.node.prepare()
        if spec is not None:  # what the job said before this daemon started still holds
            try:
                self.apply_spec(spec)
            except SpecError as e:
                log.warning("the job's earlier %s no longer applies: %s", REPLICATOR, e)
                self.node.spec = None
        return self.node

    def apply_spec(self, spec: ReplicatorSpec) -> list[str]:
        """Follow the job's replicator.yaml: its shape drives placement, dedup and backups."""
        cfg, warnings = self.cfg, []
        if spec.node_rank != cfg.rank:
            raise SpecError(
                f"'node-rank' is {spec.node_rank} but this volume holds rank {cfg.rank}'s data "
                "(tierfs --rank): give the pod the volume of its rank"
            )
        if spec.job_name != cfg.job:
            warnings.append(
                f"job-name {spec.job_name!r} differs from the volume's job {cfg.job!r}; "
                f"its data stays under {cfg.job!r}"
            )
        if spec.backup_interval_steps is not None:
            interval, interval_steps = 0.0, spec.backup_interval_steps
        elif spec.backup_interval_s is not None:
            interval, interval_steps = spec.backup_interval_s, 0
        else:  # parse() refuses such a spec; a state file left from an earlier run could still say so
            raise SpecError(f"{REPLICATOR} gives neither 'backup-interval-minutes' nor 'backup-interval-steps'")
        try:
            new = replace(
                cfg,
                nodes=spec.nodes,
                data_parallel=spec.data_parallelism,
                peer_ranks=spec.peer_ranks,
                restore_step=cfg.restore_step if spec.restore_step is None else spec.restore_step,
                backup_interval=interval,
                backup_interval_steps=interval_steps,
            )
            new._validate()
        except UserError as e:
            raise SpecError(str(e)) from None
        if cfg.gcs is None:
            warnings.append("this volume has no --gcs: nothing is backed up, whatever the interval")
        self.cfg = new
        self.reconfigure(new)
        return warnings

    async def restore_target(self) -> tuple[int, str] | None:
        """The step the job should take, and its root in the volume.

        A rollback the job asks for in its spec (``restore-step``) is made when the volume
        starts, before it serves: the spec is kept, so the next start makes it; a volume
        serving another step until then says so rather than hand the job the wrong one.
        """
        wanted, made = self.cfg.restore_step, made_here(self.rank)
        if wanted is not None and wanted != self.planner.restore_step and (made is None or made[0] != wanted):
            now = "no step" if self.planner.restore_step is None else f"step {self.planner.restore_step}"
            raise NextStart(
                f"the job asks for step {wanted} (restore-step), but this volume started from {now}: "
                f"the rollback is made when it starts again (on Kubernetes, set the volume "
                f"attribute restore-step: \"{wanted}\" on every pod of the job)"
            )
        step = self.planner.announced_step()
        if step is None and self.steps.states:
            # The job moved on since this daemon started: the newest step every rank can restore.
            survey = await self.view.survey(wait=self.planner.survey_wait())
            step = survey.choose(self.cfg.rank)
        if step is None:
            return None
        restore = self.restore()
        if restore is not None and restore.step == step:
            roots = restore.manifest.roots
        elif step in self.steps.states:
            roots = self.steps.states[step].roots
        else:
            raise SpecError(
                f"step {step}, the newest every rank can restore, is not on this node; "
                "restart the volume (tierfs mount) to restore it"
            )
        return step, (str(step) if str(step) in roots else sorted(roots)[0])
