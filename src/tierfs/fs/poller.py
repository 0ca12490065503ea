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
  ``/proc/pressure/cpu``, over the last quarter of a second): where tasks already wait for
  a CPU, a polling daemon takes the CPU from them, or from its own caller on the same CPU,
  and sleeping is the better choice.

The caller's side of each round trip, its wake-up when the answer comes, is the other half
of the cost; :class:`WakeLatency` takes care of it for as long as the daemon polls.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

POLL_MAX_NS = 1_000_000  # the longest the daemon polls for one request
POLL_MIN_NS = 50_000  # the shortest poll worth starting
POLL_FIRST_NS = 100_000  # after a kind of request not seen yet
HISTORY = 8  # gaps remembered per kind of request
PRESSURE = "/proc/pressure/cpu"
BUSY_PERCENT = 10.0  # "some" CPU pressure since the last reading above which the daemon never polls
PRESSURE_EVERY_NS = 250_000_000  # how often the pressure is read again
PRESSURE_SOON_NS = 20_000_000  # ... after a reading that had only the 10 s average to go by
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
        self._pressure_at = 0  # when to read the pressure next
        self._stalled: tuple[int, int] | None = None  # (clock, µs of stall in all) at the last reading

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
            self._read_pressure(now)
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
    def poll(receive: Callable[[bytearray], int], buf: bytearray, window_ns: int) -> int | None:
        """The length of the next request, read into ``buf`` by ``receive`` (which raises
        BlockingIOError while none is queued) as soon as it is queued; None if none came
        within ``window_ns`` or the read failed (the caller's own read sees the error)."""
        deadline = _clock() + window_ns
        while _clock() < deadline:
            try:
                return receive(buf)
            except BlockingIOError:
                continue
            except OSError:
                return None
        return None

    def _read_pressure(self, now: int) -> None:
        """Judges whether tasks waited for a CPU less than ``BUSY_PERCENT`` of the time since
        the last reading. The moment matters: a burst of requests often comes right after a
        load that the kernel's 10 s average still remembers. That average is the judge only
        where there is no recent reading (the first burst, or after a pause), and then only
        until a reading a moment later."""
        self._idle_cpu, self._pressure_at = False, now + PRESSURE_EVERY_NS
        if self._pressure_fd < 0:
            return
        try:
            some = os.pread(self._pressure_fd, 256, 0).split(b"\n", 1)[0]
            stalled = int(some[some.index(b"total=") + 6 :])
            if self._stalled is None or now - self._stalled[0] > 2 * PRESSURE_EVERY_NS:
                start = some.index(b"avg10=") + 6
                percent = float(some[start : some.index(b" ", start)])
                self._pressure_at = now + PRESSURE_SOON_NS
            else:
                then, stalled_then = self._stalled
                percent = (stalled - stalled_then) * 100_000 / (now - then)  # µs per ns, in %
            self._stalled = (now, stalled)
            self._idle_cpu = percent <= BUSY_PERCENT
        except (OSError, ValueError):
            pass


CPU_LATENCY = "/dev/cpu_dma_latency"
NO_CONSTRAINT = 2_000_000_000  # µs: the kernel's default, no limit on idle states


class WakeLatency:
    """Keeps idle CPUs out of deep idle states while the daemon polls.

    Polling keeps the daemon awake, but every answer must still wake its caller, which
    sleeps in the kernel, usually on another CPU; where idle CPUs halt (a virtual machine's
    do, unless its ``guest_halt_poll_ns`` says otherwise; a bare-metal one's enter C-states)
    that wake-up costs tens of microseconds, on every request. A PM QoS request of 0 µs on
    ``/dev/cpu_dma_latency`` (the interface tuned and DPDK use) makes idle CPUs poll
    instead, for as long as it is held: here, exactly while the daemon polls, so only in a
    burst of requests and only while the machine has CPU to spare. ``--wake-cpus off``
    leaves idle states alone.
    """

    def __init__(self, enabled: bool = True, path: str = CPU_LATENCY):
        self._fd = -1
        self.state = "off"  # what `tierfs status` shows: on, off, or why it is unavailable
        if enabled:
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                self.state = "on"
            except OSError as e:  # not root, or no such device (a container)
                self.state = f"unavailable ({path}: {e.strerror})"
        self.held = False

    def hold(self) -> None:
        if not self.held and self._fd >= 0:
            self.held = self._set(0)

    def release(self) -> None:
        if self.held:
            self._set(NO_CONSTRAINT)
            self.held = False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # drops the request
            self._fd = -1
        self.held = False

    def _set(self, microseconds: int) -> bool:
        try:
            return os.write(self._fd, microseconds.to_bytes(4, "little", signed=True)) == 4
        except OSError:
            return False
