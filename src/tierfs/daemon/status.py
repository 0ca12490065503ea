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
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING

from tierfs import __version__
from tierfs.tiers.base import Lane

if TYPE_CHECKING:
    from tierfs.config import Config
    from tierfs.daemon.connection import Engine
    from tierfs.daemon.metrics import Telemetry
    from tierfs.fs import Operations
    from tierfs.mtc.protocol import MtcNode
    from tierfs.peers.network import PeerNetwork
    from tierfs.pipeline.coordinating import NodeCoordination
    from tierfs.pipeline.planning import RestorePlanner
    from tierfs.pipeline.replicator import Replicator
    from tierfs.pipeline.restore import Restore
    from tierfs.pipeline.survey import ClusterView
    from tierfs.ramtier import RankDir, SpaceAccount
    from tierfs.ramtier.steps import Steps, StepState
    from tierfs.tiers.base import Tier
    from tierfs.tiers.local import LocalTier

# The lanes ``tierfs status`` has always shown, None when absent, and whose copies of a
# step it shows as ``backup`` and ``replicas``.
BACKUP, REPLICAS = Lane.GCS, Lane.PEERS


def report(
    cfg: Config,
    *,
    started: float,
    ops: Operations,
    engine: Engine,
    steps: Steps,
    local: LocalTier,
    tiers: Sequence[Tier],
    replicator: Replicator,
    network: PeerNetwork | None,
    restore: Restore | None,
    mtc: MtcNode | None,
    cluster: dict | None,
    connection: dict | None = None,
    telemetry: Telemetry | None = None,
    settle: bool = True,
) -> dict:
    """The whole status: ``tiers`` is every tier of the node, ``local`` (its RAM, shown as ``ram``) among them.

    ``settle``: first wait for queued writes, so that what is written now is what is used
    (``tierfs status``); a scrape every few seconds does not hold the job's writes up for that.
    """
    if settle:
        ops.writes_done()
    lanes = {BACKUP: None, REPLICAS: None} | replicator.status()
    if lanes[REPLICAS] is None and network is not None:  # peers named by DNS, none found yet
        lanes[REPLICAS] = {"state": "no peers yet", "tiers": [], "replicas": cfg.replicas, "known": network.status()}
    step_reports = [step_report(s) for s in sorted(steps.states.values(), key=lambda s: s.step)]
    observed = (
        telemetry.report(step_reports, list(replicator.lanes), steps.commits, steps.recent)
        if telemetry is not None
        else {}
    )
    return {
        "mountpoint": str(cfg.mountpoint),
        "pid": os.getpid(),
        "version": __version__,
        "connection": connection,
        "job": cfg.job,
        "rank": cfg.rank,
        "nodes": cfg.nodes,
        "uptime_s": round(time.time() - started, 1),
        "tiers": {"ram": local.report(), **{t.name: t.report() for t in tiers if t is not local}},
        "fuse": {
            "engine": engine.name,
            "data_path": engine.data_path,
            "transfer": engine.transfer,
            "wake_cpus": engine.wake_cpus,
            "inodes": len(ops.inodes),
            **ops.counters,
            # what background transfers give way to (None: the job has not written yet)
            "since_write_s": round(time.monotonic() - last, 3) if (last := ops.last_write) else None,
        },
        "commit_rules": [str(r) for r in steps.rules.rules],
        "steps": step_reports,
        "restored": restore.status() if restore is not None else None,
        "mtc": mtc.status() if mtc is not None else None,
        "cluster": cluster,
        "lanes": list(replicator.lanes),
        **lanes,
        "replicas_held": local.replicas_report(),
        **observed,  # the metrics endpoint, commits, failures and goodput
    }


def ram(rank: RankDir, space: SpaceAccount, bounded: bool) -> dict:
    """The RAM tier's own part (``tiers.ram``): its tree, what backs it, its capacity (``bounded``:
    as ``--capacity`` set it, else the ramdisk's size) and what is used of it."""
    return {
        "path": str(rank.tree),
        "tmpfs": rank.is_tmpfs(),
        "large_folios": rank.large_folios(),
        "capacity": space.capacity,
        "capacity_bounded": bounded,
        "used": space.used,
    }


def cluster(
    coordinating: NodeCoordination | None,
    view: ClusterView,
    planner: RestorePlanner,
    retention_floor: Callable[[], int | None],
) -> dict | None:
    """The job as this node knows it: from the coordinators, else from its last survey; the
    step it started from, and the rollback it made (when asked for one)."""
    if coordinating is not None and coordinating.coordination is not None:
        known = coordinating.status()
    elif view.last is not None:
        known = view.last.summary()
    else:
        return None
    rollback = planner.rolled_back
    return {
        **known,
        "restore_step": planner.restore_step,
        "retention_floor": retention_floor(),
        "rollback": None if rollback is None else {"step": rollback[0], "at": rollback[1]},
    }


def step_report(state: StepState) -> dict:
    """A step's state; ``refused`` is why no tier can take its current version (None if one can)."""
    backup, replicas = legacy_copies(state)
    return {
        **asdict(state),
        "backup": backup,
        "replicas": replicas,
        "backed_up": state.held_by(BACKUP),
        "refused": state.refusal(),
    }


def legacy_copies(state: StepState) -> tuple[dict, dict]:
    """The step's GCS and peer copies as ``backup`` and ``replicas`` (uploaded and deduplicated
    bytes; the peers' addresses)."""
    backup = dict(state.copies.get(BACKUP, {}))
    if backup:
        sent = backup.get("sent_bytes", 0)
        backup.update(uploaded_bytes=sent, dedup_bytes=backup.get("bytes", 0) - sent)
    replicas = dict(state.copies.get(REPLICAS, {}))
    if replicas:
        replicas["peers"] = [name.removeprefix("peer ") for name in replicas.get("tiers", ())]
    return backup, replicas
