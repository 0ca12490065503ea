"""Polling ``/dev/fuse`` for the next request instead of sleeping until it comes.

A caller that creates a file sends its requests one after the other (the parent's
attributes, the name, the create, the first write's capability check), each a few tens of
microseconds after the answer to the one before. Between them the daemon would go to sleep,
and waking it again costs more than the request itself on a virtual machine whose idle
CPUs halt: the wake-up is an interrupt to another virtual CPU, which the host must
reschedule. Polling for a little while keeps the daemon's CPU awake, so such a request is
read the moment it is queued.

Polling pays only where the CPU is otherwise idle, so it is confined twice:

- per kind of request just answered, by what followed it lately: after a lookup another
  request nearly always comes within the window, after a write's capability check (the
  caller is now copying its data) it does not, and polling would only burn the time;
- to a machine with CPU to spare (Linux's pressure-stall information for the CPU,
  ``/proc/pressure/cpu``): where tasks already wait for a CPU, a polling daemon takes the
  CPU from them, or from its own caller on the same CPU, and sleeping is the better choice.
"""

from __future__ import annotations

import os
import time

POLL_NS = 100_000  # how long to poll for the next request after an answer
PRESSURE = "/proc/pressure/cpu"
BUSY_PERCENT = 10.0  # "some" CPU pressure (10 s average) above which the daemon never polls
PRESSURE_EVERY_NS = 250_000_000  # how often the pressure is read again
PROBE_EVERY = 32  # after a kind of request that stopped paying, poll again every so often
_SCORE_MAX, _SCORE_POLL, _MISS = 8, 4, 2


class Poller:
    """Decides whether to poll for the next request, and polls."""

    def __init__(self, pressure_path: str = PRESSURE):
        self._score = [_SCORE_POLL] * 64  # by opcode (all FUSE opcodes served are < 64)
        self._skipped = 0
        try:
            self._pressure_fd = os.open(pressure_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._pressure_fd = -1  # no pressure information: never poll
        self._idle_cpu = False
        self._pressure_at = 0

    def close(self) -> None:
        if self._pressure_fd >= 0:
            os.close(self._pressure_fd)
            self._pressure_fd = -1

    def expects(self, answered: int) -> bool:
        """Whether to poll for the request after one of opcode ``answered`` (now answered)."""
        now = time.perf_counter_ns()
        if now >= self._pressure_at:
            self._idle_cpu = self._cpu_to_spare()
            self._pressure_at = now + PRESSURE_EVERY_NS
        if not self._idle_cpu:
            return False
        if self._score[answered & 63] >= _SCORE_POLL:
            return True
        self._skipped += 1
        return self._skipped % PROBE_EVERY == 0  # now and then, see whether it pays again

    def poll(self, fd: int, buf: bytearray, answered: int) -> int | None:
        """The length of the next request, read into ``buf`` as soon as it is queued; None
        if none came within ``POLL_NS`` (the device is idle) or the read failed (the
        caller's own read sees the error)."""
        kind = answered & 63
        score = self._score[kind]
        deadline = time.perf_counter_ns() + POLL_NS
        while time.perf_counter_ns() < deadline:
            try:
                n = os.readv(fd, [buf])
            except BlockingIOError:
                continue
            except OSError:
                return None
            self._score[kind] = min(_SCORE_MAX, score + 1)
            return n
        self._score[kind] = max(0, score - _MISS)
        return None

    def _cpu_to_spare(self) -> bool:
        if self._pressure_fd < 0:
            return False
        try:
            text = os.pread(self._pressure_fd, 256, 0)
            start = text.index(b"avg10=") + 6
            return float(text[start:text.index(b" ", start)]) <= BUSY_PERCENT
        except (OSError, ValueError):
            return False
