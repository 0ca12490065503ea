"""What the benchmark scripts share: sizes on the command line, CPU time, mounts, cleanup."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
CLK_TCK = os.sysconf("SC_CLK_TCK")
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def parse_size(text: str) -> int:
    """An argparse type: bytes, or a number with a binary K/M/G/T suffix (``256M``)."""
    m = _SIZE_RE.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use bytes or e.g. 256M, 2G (> 0)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (all its threads); of this one without a pid."""
    if pid is None:
        return time.process_time()
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # fields from 3 (state) on
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5)


def is_mounted(path: str | os.PathLike) -> bool:
    target = os.path.abspath(path)
    with open("/proc/self/mountinfo") as f:
        return any(len(p := line.split()) > 4 and p[4] == target for line in f)


@contextlib.contextmanager
def no_interruptions() -> Iterator[None]:
    """Ignore Ctrl-C and friends meanwhile: a half-done cleanup leaves mounts behind."""
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def interrupt_on_signals() -> None:
    """SIGTERM and SIGHUP end a run as Ctrl-C does, so its cleanup runs."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    for sig in _STOP_SIGNALS:
        signal.signal(sig, interrupt)
