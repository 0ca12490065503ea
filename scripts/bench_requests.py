#!/usr/bin/env python3
"""The daemon's own cost of each request a new file sends, measured in-process.

The 1,000-file row of ``bench_io.py`` is bound by round trips between the caller and the
daemon, and on a virtual machine those vary by 2x from minute to minute. This measures the
part that is the daemon's code alone, with no mount and no other process: a
:class:`~tierfs.fs.session.KernelSession` over an :class:`~tierfs.fs.operations.Operations`
on a fresh directory under /dev/shm is fed the requests the kernel sends for each file of a
checkpoint (``GETATTR`` of the step directory, the negative ``LOOKUP``, ``CREATE``,
``GETXATTR security.capability``, ``RELEASE`` and the release's bookkeeping), built as the
kernel builds them, and answers into /dev/null. Passthrough registration is left out (it
needs a mounted connection), so ``CREATE`` here lacks the one ioctl that registers the
backing file.

    PYTHONPATH=src .venv/bin/python scripts/bench_requests.py --files 3000

Prints the median microseconds per request kind and their sum per file. Compare it with
the daemon's CPU per file in ``bench_io.py`` (CPU-s per GiB x 1 ms for 1 MiB files): the
difference is the kernel's side of ``/dev/fuse``, trio's wake-ups and caches gone cold.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

from tierfs.fs import Operations, abi
from tierfs.fs.session import KernelSession
from tierfs.ramtier import SpaceAccount

KINDS = ("getattr", "lookup", "create", "getxattr", "release", "release bookkeeping")
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC


class Feeder:
    """Builds requests as the kernel does and serves them one at a time."""

    def __init__(self, session: KernelSession):
        self.session, self.unique = session, 0

    def serve(self, opcode: int, nodeid: int, body: bytes) -> int:
        """Nanoseconds the session took to serve (and answer) one request."""
        self.unique += 2
        req = memoryview(
            abi.IN_HEADER.pack(
                abi.IN_HEADER.size + len(body), opcode, self.unique, nodeid, os.getuid(), os.getgid(), os.getpid(), 0, 0
            )
            + body
        )
        t0 = time.perf_counter_ns()
        if self.session._serve(req) is not None:
            raise SystemExit(f"bench_requests: opcode {opcode} needs an await, not the inline path")
        return time.perf_counter_ns() - t0


def measure(files: int) -> dict[str, list[int]]:
    tree = tempfile.mkdtemp(prefix="bench-requests-", dir="/dev/shm")
    ops = Operations(tree, SpaceAccount(None, tree))
    session = KernelSession(ops)
    session.fd = os.open("/dev/null", os.O_WRONLY | os.O_CLOEXEC)  # where the answers go
    feed = Feeder(session)
    times: dict[str, list[int]] = {k: [] for k in KINDS}
    try:
        os.mkdir(os.path.join(tree, "step.tmp"))
        step, _ = ops.lookup(abi.ROOT_ID, b"step.tmp")
        for i in range(files):
            name = b"shard-%05d\0" % i
            times["getattr"].append(feed.serve(abi.GETATTR, step, abi.GETATTR_IN.pack(0, 0, 0)))
            times["lookup"].append(feed.serve(abi.LOOKUP, step, name))
            times["create"].append(
                feed.serve(abi.CREATE, step, abi.CREATE_IN.pack(CREATE_FLAGS, 0o100644, 0o022, 0) + name)
            )
            fh = max(ops.handles.files)  # the descriptor just opened is the highest one
            ino = ops.handles.files[fh]
            times["getxattr"].append(
                feed.serve(abi.GETXATTR, ino, abi.GETXATTR_IN.pack(0, 0) + b"security.capability\0")
            )
            times["release"].append(feed.serve(abi.RELEASE, ino, abi.RELEASE_IN.pack(fh, 0, 0, 0)))
            t0 = time.perf_counter_ns()
            session._finish_releases()
            times["release bookkeeping"].append(time.perf_counter_ns() - t0)
    finally:
        os.close(session.fd)
        session.fd = None
        ops.close()
        shutil.rmtree(tree, ignore_errors=True)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=3000, help="files created (default 3000)")
    args = p.parse_args()
    if args.files < 10:
        print("bench_requests: error: --files must be >= 10", file=sys.stderr)
        return 2
    times = measure(args.files)
    total = 0.0
    print(f"{'request':20} {'median us':>9} {'p10 us':>7} {'p90 us':>7}")
    for kind, ns in times.items():
        ns.sort()
        med = statistics.median(ns) / 1e3
        total += med
        print(f"{kind:20} {med:9.1f} {ns[len(ns) // 10] / 1e3:7.1f} {ns[9 * len(ns) // 10] / 1e3:7.1f}")
    print(f"{'per file':20} {total:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
