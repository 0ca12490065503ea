"""The daemon's side of GKE multi-tier checkpointing: what Orbax and MaxText ask of a node.

:mod:`tierfs.mtc.protocol` holds the protocol's rules and files; this module is the glue that
makes a daemon follow them: the job's ``replicator.yaml`` changes the job's shape (nodes,
data parallelism, the ranks holding the same data, the backup interval), which every part
that depends on it follows (:meth:`MultiTier.apply_spec`), and the job asks which step to
restore and where it is in the volume (:meth:`MultiTier.restore_target`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING

from tierfs.core.errors import UserError
from tierfs.mtc.protocol import MtcNode
from tierfs.mtc.spec import REPLICATOR, ReplicatorSpec, SpecError

if TYPE_CHECKING:
    from tierfs.daemon.daemon import Daemon

log = logging.getLogger("tierfs")


class MultiTier:
    def __init__(self, daemon: Daemon):
        self.d = daemon
        self.node: MtcNode | None = None

    def start(self) -> None:
        """Before the mount: clear an earlier pod's protocol files, and follow the spec it left."""
        d, cfg = self.d, self.d.cfg
        self.node = MtcNode(d.rank.tree, d.rank.path / "mtc.json", cfg.mountpoint, cfg.rank,
                            cfg.coordinator, self.apply_spec, self.restore_target)
        spec = self.node.prepare()
        if spec is not None:  # what the job said before this daemon started still holds
            try:
                self.apply_spec(spec)
            except SpecError as e:
                log.warning("the job's earlier %s no longer applies: %s", REPLICATOR, e)
                self.node.spec = None
        d.replicator.dropped = self.node.forget

    def apply_spec(self, spec: ReplicatorSpec) -> list[str]:
        """Follow the job's replicator.yaml: its shape drives placement, dedup and backups."""
        d, cfg, warnings = self.d, self.d.cfg, []
        if spec.node_rank != cfg.rank:
            raise SpecError(f"'node-rank' is {spec.node_rank} but this volume holds rank {cfg.rank}'s data "
                            "(tierfs --rank): give the pod the volume of its rank")
        if spec.job_name != cfg.job:
            warnings.append(f"job-name {spec.job_name!r} differs from the volume's job {cfg.job!r}; "
                            f"its data stays under {cfg.job!r}")
        if spec.backup_interval_steps is not None:
            interval = {"backup_interval": 0.0, "backup_interval_steps": spec.backup_interval_steps}
        else:
            interval = {"backup_interval": spec.backup_interval_s, "backup_interval_steps": 0}
        try:
            new = replace(cfg, nodes=spec.nodes, data_parallel=spec.data_parallelism,
                          peer_ranks=spec.peer_ranks, **interval)
            new._validate()
        except UserError as e:
            raise SpecError(str(e)) from None
        if cfg.gcs is None:
            warnings.append("this volume has no --gcs: nothing is backed up, whatever the interval")
        d.cfg = new
        d.view.nodes = new.nodes
        if d.coordinating is not None:
            d.coordinating.resize(new.nodes)
        if d.network is not None:
            d.network.cfg = new
        d.replicator.reconfigure(new)  # and every tier's configuration
        return warnings

    async def restore_target(self) -> tuple[int, str] | None:
        """The step the job should take, and its root in the volume."""
        d = self.d
        step = d.planner.announced_step()
        if step is None and d.steps.states:
            # The job moved on since this daemon started: the newest step every rank can restore.
            survey = await d.view.survey(wait=d.planner.survey_wait())
            step = survey.choose(d.cfg.rank)
        if step is None:
            return None
        if d.restore is not None and d.restore.step == step:
            roots = d.restore.manifest.roots
        elif step in d.steps.states:
            roots = d.steps.states[step].roots
        else:
            raise SpecError(f"step {step}, the newest every rank can restore, is not on this node; "
                            "restart the volume (tierfs mount) to restore it")
        return step, (str(step) if str(step) in roots else sorted(roots)[0])
