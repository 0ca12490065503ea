"""The daemons this plugin runs, one per job on the node, and what each says of itself.

The plugin's records know them: a job's record (``jobs/<job>.json``) names the job and its
rank, its daemon serves the job's staging mount (``mnt/<job>``) and answers on the control
socket its registration names (:class:`tierfs.core.mounts.Registration`, as ``tierfs status``
finds it), and the records of the published volumes (``volumes/<id>.json``) name the pods
that use it. Nothing here takes a lock: records are replaced whole, so a reader sees an old
one or a new one, and a look at the daemons never waits for a kubelet call, nor one for it.

A daemon is asked with a short timeout and never through its FUSE mount (``statfs`` on the
mount of a hung daemon would hang the asker with it), so one stuck daemon costs a look at
the node ``ASK_TIMEOUT`` seconds and nothing more; daemons are asked ``ASKERS`` at a time, so
several stuck ones cost no more than one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from tierfs.core import control_client, mounts
from tierfs.core.errors import UserError
from tierfs.csi.records import records

ASK_TIMEOUT = 2.0  # seconds: a daemon answers its control socket in milliseconds unless it is stuck
ASKERS = 16  # daemons asked at once
T = TypeVar("T")


class HasStateDir(Protocol):
    state_dir: Path


@dataclass(frozen=True)
class Daemon:
    job: str
    rank: int | None
    mountpoint: Path  # the job's staging mount, which the daemon serves
    pods: tuple[dict, ...] = ()  # {namespace, name[, uid]} of each pod using it, the latest published last

    @property
    def pod(self) -> dict | None:
        """The pod that published the job's volume last (usually its only one)."""
        return self.pods[-1] if self.pods else None


@dataclass(frozen=True)
class DaemonState:
    daemon: Daemon
    status: dict | None  # the daemon's answer to ``status`` (what ``tierfs status --json`` prints)
    error: str | None = None  # why there is none

    @property
    def job(self) -> str:
        return self.daemon.job

    @property
    def rank(self) -> int | None:
        return self.daemon.rank

    @property
    def pod(self) -> dict | None:
        return self.daemon.pod


def daemons(volumes: HasStateDir) -> list[Daemon]:
    """Every job the plugin holds on the node: those with a record, and any published volume's
    (a record lost by hand still leaves its pods' daemon to look at)."""
    state_dir = volumes.state_dir
    jobs = {r["job"]: r for r in records(state_dir / "jobs") if isinstance(r.get("job"), str)}
    published = sorted(
        (v for v in records(state_dir / "volumes") if isinstance(v.get("job"), str)),
        key=lambda v: v.get("published") or 0,
    )
    out = []
    for job in sorted(set(jobs) | {v["job"] for v in published}):
        mine = [v for v in published if v["job"] == job]
        rank = jobs[job].get("rank") if job in jobs else mine[-1].get("rank")
        pods = tuple(v["pod"] for v in mine if isinstance(v.get("pod"), dict))
        out.append(Daemon(job, rank if isinstance(rank, int) else None, state_dir / "mnt" / job, pods))
    return out


def ask(daemon: Daemon, message: dict, timeout: float = ASK_TIMEOUT) -> dict:
    """The daemon's reply to ``message`` on its control socket; a UserError says why there is none."""
    path = mounts.Registration(daemon.mountpoint).socket_path
    try:
        reply = control_client.request(path, message, timeout)
    except ValueError:  # the daemon went away in the middle of its reply
        raise UserError(f"the tierfs daemon of job {daemon.job} gave no whole answer at {path}") from None
    if not isinstance(reply, dict):
        raise UserError(f"the tierfs daemon of job {daemon.job} answered something that is not an object")
    return reply


def poll(volumes: HasStateDir, stop: threading.Event | None = None) -> list[DaemonState]:
    """Each daemon's status, or why it has none: not mounted, or not answering its socket.

    ``stop``: set, it ends the round early (a plugin on its way out waits for no daemon).
    """
    table = {e.mountpoint: e for e in mounts.mount_table()}  # the last entry at a path is the topmost

    def look(daemon: Daemon) -> DaemonState | None:
        if stop is not None and stop.is_set():
            return None
        entry = table.get(os.path.abspath(daemon.mountpoint))
        if entry is None or entry.fstype != mounts.FSTYPE:
            return DaemonState(daemon, None, f"job {daemon.job} is not mounted at {daemon.mountpoint}")
        try:
            return DaemonState(daemon, ask(daemon, {"op": "status"}))
        except UserError as e:
            return DaemonState(daemon, None, str(e))

    return [state for state in each(look, daemons(volumes)) if state is not None]


def each(fn: Callable[[Daemon], T], items: Iterable[Daemon]) -> list[T]:
    """``fn`` of every daemon, ``ASKERS`` at a time: hung daemons cost a look ``ASK_TIMEOUT`` in all, not each."""
    items = list(items)
    if len(items) <= 1:
        return [fn(d) for d in items]
    with ThreadPoolExecutor(min(ASKERS, len(items)), thread_name_prefix="csi-ask") as pool:
        return list(pool.map(fn, items))
