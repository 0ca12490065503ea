"""The daemon's answer to ``tierfs status``: what the volume holds, where, and how far each tier is.

Every tier reports itself (``Tier.report``) under ``tiers`` (the RAM tier as ``ram``), and
every replicator lane its state, lag and progress under its own name (``peers``, ``gcs``,
``disk``). Each step lists where its copies went, or why no tier can take it (``refused``);
``backup`` and ``replicas`` give the GCS and peer copies in the shape ``tierfs status`` has
always shown (:func:`legacy_copies`).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierfs.daemon.daemon import Daemon
    from tierfs.ramtier.steps import StepState

LEGACY_LANES = ("gcs", "peers")  # lanes ``tierfs status`` always names, None when absent


def report(d: Daemon) -> dict:
    cfg, ops = d.cfg, d.ops
    ops.writes_done()  # what is written now is what is used
    lanes = {lane: None for lane in LEGACY_LANES} | d.replicator.status()
    if lanes["peers"] is None and d.network is not None:  # peers named by DNS, none found yet
        lanes["peers"] = {"state": "no peers yet", "tiers": [], "replicas": cfg.replicas,
                          "known": d.network.status()}
    return {
        "mountpoint": str(cfg.mountpoint),
        "pid": os.getpid(),
        "job": cfg.job,
        "rank": cfg.rank,
        "nodes": cfg.nodes,
        "uptime_s": round(time.time() - d.started, 1),
        "tiers": {"ram": d.local.report(), **{t.name: t.report() for t in d.tiers}},
        "fuse": {"engine": d.engine.name, "data_path": d.engine.data_path, "transfer": d.engine.transfer,
                 "wake_cpus": d.engine.wake_cpus,
                 "inodes": len(ops.inodes), **ops.counters},
        "commit_rules": [str(r) for r in d.steps.rules.rules],
        "steps": [step_report(s) for s in sorted(d.steps.states.values(), key=lambda s: s.step)],
        "restored": d.restore.status() if d.restore is not None else None,
        "mtc": d.mtc.status() if d.mtc is not None else None,
        "cluster": _cluster(d),
        "lanes": list(d.replicator.lanes),
        **lanes,
        "replicas_held": d.local.replicas_report(),
    }


def _cluster(d: Daemon) -> dict | None:
    """The job as this node knows it: from the coordinators, else from its last survey."""
    if d.coordinating is not None and d.coordinating.coordination is not None:
        view = d.coordinating.status()
    elif d.view.last is not None:
        view = d.view.last.summary()
    else:
        return None
    return {**view, "restore_step": d.planner.restore_step, "retention_floor": d.retention_floor()}


def step_report(state: StepState) -> dict:
    """A step's state; ``refused`` is why no tier can take its current version (None if one can)."""
    backup, replicas = legacy_copies(state)
    return {**asdict(state), "backup": backup, "replicas": replicas, "backed_up": state.held_by("gcs"),
            "refused": state.refusal()}


def legacy_copies(state: StepState) -> tuple[dict, dict]:
    """The step's GCS and peer copies as ``backup`` and ``replicas`` (uploaded and deduplicated
    bytes; the peers' addresses)."""
    backup = dict(state.copies.get("gcs", {}))
    if backup:
        sent = backup.get("sent_bytes", 0)
        backup.update(uploaded_bytes=sent, dedup_bytes=backup.get("bytes", 0) - sent)
    replicas = dict(state.copies.get("peers", {}))
    if replicas:
        replicas["peers"] = [name.removeprefix("peer ") for name in replicas.get("tiers", ())]
    return backup, replicas
