"""``tierfs secret``: print a new random job secret (256 bits, 64 hex digits).

A secret people choose can be guessed; one of these cannot, even by someone who holds a
manifest from the bucket or the job's TLS certificate to test guesses against.
"""

from __future__ import annotations

import argparse

from tierfs.core.keys import new_secret


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("secret", help="print a new random job secret", description=__doc__.splitlines()[0])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(new_secret())
    return 0
