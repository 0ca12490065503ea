"""Running tierfs on one machine: the demo, the benchmarks and the tests use these.

A cluster of real daemons on loopback addresses (:mod:`tierfs_testing.cluster`), a real GCS
API on loopback (:mod:`tierfs_testing.gcs_emulator`) with a byte-counting proxy in front
(:mod:`tierfs_testing.gcs_proxy`), and a real CSI plugin on a unix socket driven as kubelet
drives it (:mod:`tierfs_testing.csi`); and, for jobs too large for one machine, the real
coordination on a simulated network and GCS (:mod:`tierfs_testing.sim`, whose job and
scenarios are :mod:`tierfs_testing.simjob`, :mod:`tierfs_testing.scenarios` and
:mod:`tierfs_testing.backups`).

Nothing here is imported by the daemon, the CLI or the plugin: it is a development
distribution of its own (``testing/pyproject.toml``, installed into the dev venv by
``scripts/setup.sh``) and never ships in the tierfs wheel or the CSI image. What it needs
beyond tierfs' own dependencies (the fake-gcs-server binary) is looked up only when it is
used.

Below: the few process and mount chores they share.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tierfs.core import mounts

TIERFS = [sys.executable, "-m", "tierfs"]
LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port nobody listens on at ``host`` right now (the caller takes it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_gone(pid: int, timeout: float = 10) -> None:
    """Wait until process ``pid`` has exited, at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while mounts.process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def crash(info: dict) -> None:
    """What a node's crash does to a mount: its keeper and its daemon (a registration's
    ``keeper`` and ``pid``) killed with SIGKILL at once, so that neither starts a successor
    or a new keeper for the other; returns once both are gone and the mount is dead."""
    pids = [pid for pid in (info.get("keeper"), info.get("pid")) if pid]
    keeper = info.get("keeper")
    try:
        if keeper and os.getpgid(keeper) == keeper:  # a detached keeper leads its daemons' group:
            os.killpg(keeper, signal.SIGKILL)  # all of them at once, so none sees another die first
    except ProcessLookupError:
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        wait_gone(pid)


def unmount_all_beneath(path: Path) -> None:
    """Lazily unmount whatever is mounted under ``path`` (e.g. a rank's tmpfs of its own), deepest first."""
    prefix = str(path) + "/"
    points = {entry.mountpoint for entry in mounts.mount_table()}
    for point in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def cleanup_mount(mountpoint: Path) -> None:
    """Unmount whatever is left at ``mountpoint`` and stop its daemon."""
    info = mounts.Registration(mountpoint).read() or {}
    for attempt in range(50):
        if mounts.find_mount(mountpoint) is None:
            break
        if attempt:
            time.sleep(0.1)  # still there: give the kernel a moment before asking again
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True)
    for pid in filter(None, (info.get("pid"), info.get("keeper"))):
        wait_gone(pid)
        if mounts.process_alive(pid):
            os.kill(pid, signal.SIGKILL)
    mounts.Registration(mountpoint).remove()
