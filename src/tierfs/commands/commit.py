"""``tierfs commit PATH``: declare a checkpoint complete when no commit rule sees it.

PATH is a file or directory inside a mounted volume; it is frozen and backed up as part
of its step (the last number in its path, or ``--step``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tierfs.core import control_client, mounts
from tierfs.core.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("commit", help="commit a checkpoint explicitly", description=__doc__.splitlines()[0])
    p.add_argument("path", metavar="PATH")
    p.add_argument("--step", type=int, help="the step it belongs to (default: the last number in PATH)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = Path(os.path.abspath(args.path))
    if not os.path.lexists(path):
        raise UserError(f"{path} does not exist: commit a file or directory of a tierfs volume")
    mountpoint = next((p for p in path.parents if _is_tierfs(p)), None)
    if mountpoint is None:
        raise UserError(f"{path} is not inside a tierfs mount")
    rel = path.relative_to(mountpoint).as_posix()
    reply = control_client.request(
        mounts.Registration(mountpoint).socket_path, {"op": "commit", "path": rel, "step": args.step}
    )
    print(f"committed {rel} as step {reply['step']}")
    return 0


def _is_tierfs(path: Path) -> bool:
    entry = mounts.find_mount(path)
    return entry is not None and entry.fstype == mounts.FSTYPE
