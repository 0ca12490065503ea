"""Polling ``/dev/fuse`` for the next request instead of sleeping until it comes.

A caller that creates a file sends its requests one after the other (the parent's
attributes, the name, the create, the first write's capability check), each a few tens of
microseconds after the answer to the one before; a checkpointing framework then copies the
file's bytes (by passthrough, without the daemon) and starts the next file a few hundred
microseconds later. Between requests the daemon would go to sleep, and waking it again
costs more than the request itself on a virtual machine whose idle CPUs halt: the wake-up
is an interrupt to another virtual CPU, which the host must reschedule, and it lands on the
caller's path (the next file's first request finds the daemon still waking). Polling keeps
the daemon's CPU awake, so such a request is read the moment it is queued.

Polling pays only where the CPU is otherwise idle, so it is confined twice:

- per kind of request just answered, by how long the next request took to come after
  that kind lately (the median of the last few gaps, whether the daemon polled or slept
  through them): the daemon polls for twice that, within ``POLL_MAX_NS``, and not at all
  after kinds whose next request typically comes later than that (the last request of a
  burst, an idle mount);
- to a machine with CPU to spare (Linux's pressure-stall information for the CPU,
  ``/proc/pressure/cpu``): where tasks already wait for a CPU, a polling daemon takes the
  CPU from them, or from its own caller on the same CPU, and sleeping is the better choice.
"""

from __future__ import annotations

import os
import time

POLL_MAX_NS = 1_000_000  # the longest the daemon polls for one request
POLL_MIN_NS = 50_000  # the shortest poll worth starting
POLL_FIRST_NS = 100_000  # after a kind of request not seen yet
HISTORY = 8  # gaps remembered per kind of request
PRESSURE = "/proc/pressure/cpu"
BUSY_PERCENT = 10.0  # "some" CPU pressure (10 s average) above which the daemon never polls
PRESSURE_EVERY_NS = 250_000_000  # how often the pressure is read again
_clock = time.perf_counter_ns  # (the tests' to replace)


class Poller:
    """Decides how long to poll for the next request, learns from when it came, and polls."""

    def __init__(self, pressure_path: str = PRESSURE):
        self._gaps: list[list[int]] = [[] for _ in range(64)]  # by opcode (all served are < 64)
        self._idle_since = 0  # perf_counter_ns() when the device was found empty, 0 if not since
        self._idle_kind = 0  # the kind of request answered last before that
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

    def idle(self, answered: int) -> int:
        """The device is empty after an answer of opcode ``answered``: how many nanoseconds
        to poll for the next request (0: sleep). Starts the clock :meth:`arrived` reads."""
        now = _clock()
        kind = answered & 63
        self._idle_since, self._idle_kind = now, kind
        if now >= self._pressure_at:
            self._idle_cpu = self._cpu_to_spare()
            self._pressure_at = now + PRESSURE_EVERY_NS
        if not self._idle_cpu:
            return 0
        gaps = self._gaps[kind]
        if not gaps:
            return POLL_FIRST_NS
        window = 2 * sorted(gaps)[len(gaps) // 2]
        if window > 2 * POLL_MAX_NS:
            return 0  # typically followed much later, if at all
        return min(POLL_MAX_NS, max(POLL_MIN_NS, window))

    def arrived(self) -> None:
        """The first request since :meth:`idle` was read (by polling or after a sleep)."""
        if self._idle_since:
            gaps = self._gaps[self._idle_kind]
            if len(gaps) == HISTORY:
                del gaps[0]
            gaps.append(_clock() - self._idle_since)
            self._idle_since = 0

    @staticmethod
    def poll(fd: int, buf: bytearray, window_ns: int) -> int | None:
        """The length of the next request, read into ``buf`` as soon as it is queued; None
        if none came within ``window_ns`` or the read failed (the caller's own read sees
        the error)."""
        deadline = _clock() + window_ns
        while _clock() < deadline:
            try:
                return os.readv(fd, [buf])
            except BlockingIOError:
                continue
            except OSError:
                return None
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
