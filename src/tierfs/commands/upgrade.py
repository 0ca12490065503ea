"""``tierfs upgrade``: hand a live volume to the installed build; its jobs see a pause.

The mount's keeper (:mod:`tierfs.daemon.keeper`) asks its daemon to stop serving, executes
the ``tierfs`` installed now in its place, and that starts a daemon of the new build,
which takes the FUSE connection over: open files, the RAM tier, steps being replicated
and restores in progress go on where they were.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

from tierfs.core import control_client, mounts
from tierfs.core.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "upgrade", help="hand a mounted volume to the installed tierfs build", description=__doc__.splitlines()[0]
    )
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for the new daemon to serve (default 120)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    mountpoint = Path(args.mountpoint).absolute()
    entry = mounts.find_mount(mountpoint)
    if entry is None or entry.fstype != mounts.FSTYPE:
        raise UserError(f"{mountpoint} is not a tierfs mount: nothing to upgrade")
    reg = mounts.Registration(mountpoint)
    info = reg.read() or {}
    if "keeper" not in info or not mounts.process_alive(info["keeper"]):
        raise UserError(
            f"the daemon of {mountpoint} has no keeper to hand it over (mounted by an older "
            f"tierfs): unmount it and mount it again"
        )
    connection = control_client.request(reg.socket_path, {"op": "status"}).get("connection") or {}
    if not connection.get("kept"):
        raise UserError(
            f"{mountpoint} is served by pyfuse3, whose FUSE connection cannot be handed over: "
            f"unmount it and mount it again"
        )
    os.kill(info["keeper"], signal.SIGHUP)
    deadline = time.monotonic() + args.timeout
    while True:
        now = reg.read() or {}
        if now.get("pid") not in (None, info["pid"]):
            try:
                status = control_client.request(reg.socket_path, {"op": "status"}, timeout=5)
            except UserError:
                status = None  # registered, not answering yet
            if status is not None:
                print(
                    f"{mountpoint}: served by tierfs {status.get('version', '?')} (pid {now['pid']}), "
                    f"was pid {info['pid']}"
                )
                return 0
        if time.monotonic() > deadline:
            raise UserError(f"no new daemon serves {mountpoint} after {args.timeout:.0f}s: see {reg.log_path}")
        time.sleep(0.05)
