"""``tierfs unmount``: unmount a volume and wait for its daemon to finish.

The RAM tier keeps every file: the next mount of the same job and rank shows them again.
A mount whose daemon was killed is cleared too.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tierfs.core import mounts


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "unmount", aliases=["umount"], help="unmount a tierfs volume", description=__doc__.splitlines()[0]
    )
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    mounts.unmount(Path(args.mountpoint).absolute())
    return 0
