"""Two kinds of health, kept apart on purpose.

:func:`can_serve` is the plugin's own: whether it can publish a new volume on this node now
(Identity.Probe answers it). It asks only what every publish needs: records written in
the state directory, the node-wide lock taken, a ramdisk to hold the RAM tier, ``/dev/fuse``
and the ``tierfs`` executable to start a daemon with. A job whose daemon is sick says
nothing about that: the plugin serves every other job as before, and restarting the plugin
(what an unready or failing probe leads to) would not heal the daemon either.

:func:`daemons_report` is the jobs': each daemon the plugin runs, serving or sick and why,
for people and for the plugin's ``/daemons`` page.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
import time
from pathlib import Path

from tierfs.csi.daemons import DaemonState, HasStateDir, poll
from tierfs.csi.settings import PluginConfig

FUSE_DEVICE = Path("/dev/fuse")
NODE_LOCK_WAIT = 1.0  # seconds: the node-wide lock is held for a few file reads and writes at a time
READY = "ready to serve volumes"
BAD_LANE_STATES = ("failing", "unavailable")


def can_serve(cfg: PluginConfig, fuse_device: Path | None = None) -> tuple[bool, str]:
    """Whether the plugin can serve new volumes, and if not, why (one line)."""
    for check in (_state_dir, _node_lock, _ramdisk, _executable):
        problem = check(cfg)
        if problem:
            return False, problem
    problem = _fuse(fuse_device or FUSE_DEVICE)
    return (False, problem) if problem else (True, READY)


def _state_dir(cfg: PluginConfig) -> str | None:
    """Every publish writes records here: write (and remove) a file, as they do."""
    try:
        fd, name = tempfile.mkstemp(prefix=".probe-", dir=cfg.state_dir)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as e:
        return f"the state directory {cfg.state_dir} is not writable: {e.strerror or e}"
    return None


def _node_lock(cfg: PluginConfig) -> str | None:
    """The node-wide lock can be taken (:mod:`tierfs.csi.locks`): nobody sits on it."""
    path = cfg.state_dir / "lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        return f"cannot open the node-wide lock {path}: {e.strerror}"
    try:
        deadline = time.monotonic() + NODE_LOCK_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return None  # released when fd closes
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    return f"cannot take the node-wide lock {path}: {e.strerror}"
            if time.monotonic() >= deadline:
                return (
                    f"the node-wide lock {path} stayed taken for {NODE_LOCK_WAIT:g}s: a call or another "
                    "process holding it is stuck, and no volume can be published meanwhile"
                )
            time.sleep(0.02)
    finally:
        os.close(fd)


def _ramdisk(cfg: PluginConfig) -> str | None:
    """Every daemon keeps its RAM tier under the ramdisk (the first one makes it if need be)."""
    if os.path.lexists(cfg.ramdisk) and not cfg.ramdisk.is_dir():
        return f"the ramdisk {cfg.ramdisk} is not a directory"
    where = cfg.ramdisk
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where)
    except OSError as e:
        return f"the ramdisk {cfg.ramdisk} cannot be reached: {e.strerror}"
    if st.f_flag & os.ST_RDONLY:
        return f"the ramdisk {cfg.ramdisk} is on a read-only file system"
    return None


def _executable(cfg: PluginConfig) -> str | None:
    """Daemons are started as ``cfg.tierfs mount ...``."""
    program = cfg.tierfs[0]
    found = shutil.which(program) if os.sep not in program else program
    if not found or not os.path.isfile(found) or not os.access(found, os.X_OK):
        return f"cannot start daemons: {program} (the tierfs command) is not an executable file"
    return None


def _fuse(device: Path) -> str | None:
    """A daemon mounts through the FUSE device; the plugin's container must have it."""
    try:
        os.close(os.open(device, os.O_RDWR | os.O_CLOEXEC))
    except OSError as e:
        return f"cannot open {device}: {e.strerror}; no FUSE mount can be made (does the container have it?)"
    return None


# -- the jobs' daemons ---------------------------------------------------------------------


def sick_because(state: DaemonState) -> str | None:
    """Why the daemon does not serve its job as it should; None when it does."""
    if state.status is None:
        return state.error or "no answer"
    status = state.status
    for lane in status.get("lanes") or ():
        report = status.get(lane)
        if isinstance(report, dict) and report.get("state") in BAD_LANE_STATES:
            return f"its {lane} lane is {report['state']}" + (f": {report['error']}" if report.get("error") else "")
    restored = status.get("restored")
    if (
        isinstance(restored, dict)
        and restored.get("state") != "done"
        and (restored.get("chunks_failing") or restored.get("error"))
    ):
        return f"its restore of step {restored.get('step')} is failing" + (
            f": {restored['error']}" if restored.get("error") else f" ({restored['chunks_failing']} chunks)"
        )
    return None


def daemons_report(volumes: HasStateDir) -> list[dict]:
    """Each daemon the plugin runs: job, rank, pod, state ``serving`` or ``sick``, and why."""
    out = []
    for state in poll(volumes):
        why = sick_because(state)
        out.append(
            {
                "job": state.job,
                "rank": state.rank,
                "pod": state.pod,
                "pods": list(state.daemon.pods),
                "state": "sick" if why else "serving",
                "why": why,
            }
        )
    return out
