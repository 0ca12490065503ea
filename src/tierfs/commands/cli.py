"""The ``tierfs`` command.

Every failure the user can act on is one line on stderr and a non-zero exit; only a bug
prints a traceback.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from tierfs import __version__
from tierfs.commands import commit, csi, mount, secret, status, steps, unmount, upgrade
from tierfs.core.errors import UserError

COMMANDS = (mount, unmount, upgrade, status, steps, commit, csi, secret)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not usage + error
        self.exit(2, f"tierfs: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    return _build()[0]


def _build() -> tuple[argparse.ArgumentParser, set[str]]:
    """The parser, and the names of its commands (a first argument naming none is the mount helper's form)."""
    parser = _Parser(prog="tierfs", description="RAM-speed checkpoint volume with peer and GCS tiers.")
    parser.add_argument("--version", action="version", version=f"tierfs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser, set(sub.choices)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Google's client libraries warn, at import, about the Python and grpcio they run on:
    # advice for whoever installs them, not for a user of the command, whose stderr carries
    # one line per error. (PYTHONWARNINGS still shows them.)
    if not sys.warnoptions:
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"google\.")
    parser, known = _build()
    try:
        if argv and not argv[0].startswith("-") and argv[0] not in known:
            return mount.run_helper(argv)  # fuse3's helper form: tierfs JOB MOUNTPOINT -o ...
        args = parser.parse_args(argv)
        return args.func(args)
    except UserError as e:
        print(f"tierfs: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # an environment problem we did not foresee: still one line
        where = f" ({e.filename})" if e.filename else ""
        print(f"tierfs: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
