"""Polling for the next FUSE request: only where the CPU is idle, and for about as long as
the next request took to come lately after the same kind of answer.

A pipe stands in for ``/dev/fuse`` (both hand over one message per read); a file stands in
for ``/proc/pressure/cpu``, to set the machine's load at will.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.helpers import cpu_latency_limit
from tierfs.fs import abi, poller
from tierfs.fs.poller import Poller


def pressure(avg10: float, stalled_us: int) -> bytes:
    """/proc/pressure/cpu as the kernel writes it."""
    return (
        f"some avg10={avg10:.2f} avg60=0.00 avg300=0.00 total={stalled_us}\n"
        f"full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
    ).encode()


IDLE = pressure(0.0, 1)
BUSY = pressure(63.2, 9)


@pytest.fixture
def device():
    r, w = os.pipe()
    os.set_blocking(r, False)
    try:
        yield r, w
    finally:
        os.close(r)
        os.close(w)


@pytest.fixture
def make_poller(tmp_path):
    made: list[Poller] = []

    def make(text: bytes | None = IDLE) -> Poller:
        path = tmp_path / "pressure"
        if text is not None:
            path.write_bytes(text)
        made.append(Poller(str(path)))
        return made[-1]

    try:
        yield make
    finally:
        for p in made:
            p.close()


def send_later(fd: int, delay: float, data: bytes = b"request") -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay), os.write(fd, data)))
    t.start()
    return t


class Clock:
    """The poller's clock, moved by hand."""

    def __init__(self):
        self.ns = 1

    def __call__(self) -> int:
        return self.ns


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(poller, "_clock", c)
    return c


def learn(p: Poller, clock: Clock, kind: int, gap_ns: int, times: int = poller.HISTORY) -> None:
    """Let ``times`` requests come ``gap_ns`` after answers of ``kind``."""
    for _ in range(times):
        p.idle(kind)
        clock.ns += gap_ns
        p.arrived()


def test_a_request_that_comes_while_polling_is_read_at_once(device):
    r, w = device
    buf = bytearray(64)
    started = time.perf_counter()  # before the sender's clock starts: the request cannot come sooner
    t = send_later(w, 0.01)
    try:
        n = Poller.poll(lambda b: os.readv(r, [b]), buf, 2_000_000_000)  # room for a thread on a busy machine
        waited = time.perf_counter() - started
    finally:
        t.join()
    assert n is not None and bytes(buf[:n]) == b"request"
    assert 0.01 <= waited < 1.9


def test_polling_gives_up_when_nothing_comes(device):
    r, _ = device
    started = time.perf_counter()
    assert Poller.poll(lambda b: os.readv(r, [b]), bytearray(64), 2_000_000) is None
    assert 0.002 <= time.perf_counter() - started < 1


def test_a_kind_not_seen_yet_gets_a_short_poll(make_poller):
    assert make_poller().idle(abi.LOOKUP) == poller.POLL_FIRST_NS


def test_a_busy_machine_never_polls(make_poller):
    assert make_poller(BUSY).idle(abi.LOOKUP) == 0


def test_a_load_that_has_ended_stops_polling_only_for_a_moment(make_poller, clock, tmp_path):
    p = make_poller(pressure(63.2, 9))  # the 10 s average still remembers a load
    assert p.idle(abi.LOOKUP) == 0
    clock.ns += poller.PRESSURE_SOON_NS - 1
    assert p.idle(abi.LOOKUP) == 0, "read again only a moment later"
    clock.ns += 1
    (tmp_path / "pressure").write_bytes(pressure(60.0, 9 + 100))  # 0.5 % of the time since
    assert p.idle(abi.LOOKUP) == poller.POLL_FIRST_NS


def test_a_load_that_starts_stops_polling_within_a_quarter_second(make_poller, clock, tmp_path):
    p = make_poller(pressure(0.0, 1_000))
    assert p.idle(abi.LOOKUP) == poller.POLL_FIRST_NS
    clock.ns += poller.PRESSURE_SOON_NS  # the first reading measured over a window
    assert p.idle(abi.LOOKUP) == poller.POLL_FIRST_NS
    clock.ns += poller.PRESSURE_EVERY_NS // 2
    (tmp_path / "pressure").write_bytes(pressure(0.5, 1_000 + 200_000))
    assert p.idle(abi.LOOKUP) == poller.POLL_FIRST_NS, "the last reading stands for a while"
    clock.ns += poller.PRESSURE_EVERY_NS // 2
    assert p.idle(abi.LOOKUP) == 0, "tasks waited for a CPU 80 % of the last 250 ms"
    clock.ns += poller.PRESSURE_EVERY_NS
    (tmp_path / "pressure").write_bytes(pressure(4.0, 1_000 + 200_000 + 2_000))
    assert p.idle(abi.LOOKUP) == poller.POLL_FIRST_NS, "and 0.8 % of the next: back to polling"
    clock.ns += 10 * poller.PRESSURE_EVERY_NS
    (tmp_path / "pressure").write_bytes(pressure(30.0, 1_000 + 200_000 + 2_000 + 1))
    assert p.idle(abi.LOOKUP) == 0, "after a pause, the 10 s average judges until the next reading"


def test_no_pressure_information_means_no_polling(make_poller):
    assert make_poller(None).idle(abi.LOOKUP) == 0


def test_the_poll_lasts_twice_the_usual_gap_after_that_kind(make_poller, clock):
    p = make_poller()
    learn(p, clock, abi.GETXATTR, 300_000)  # a caller copying its bytes between requests
    assert p.idle(abi.GETXATTR) == 600_000
    learn(p, clock, abi.LOOKUP, 10_000)  # followed at once
    assert p.idle(abi.LOOKUP) == poller.POLL_MIN_NS
    assert p.idle(abi.GETXATTR) == 600_000, "each kind keeps its own record"
    learn(p, clock, abi.CREATE, 800_000)
    assert p.idle(abi.CREATE) == poller.POLL_MAX_NS


def test_the_usual_gap_is_the_median_of_the_last_few(make_poller, clock):
    p = make_poller()
    learn(p, clock, abi.GETATTR, 200_000, times=poller.HISTORY // 2)
    learn(p, clock, abi.GETATTR, 5_000_000_000, times=poller.HISTORY // 2 - 1)  # a pause now and then
    assert p.idle(abi.GETATTR) == 400_000


def test_no_polling_after_a_kind_usually_followed_much_later(make_poller, clock):
    p = make_poller()
    learn(p, clock, abi.RELEASE, 3_000_000)
    assert p.idle(abi.RELEASE) == 0
    learn(p, clock, abi.RELEASE, 20_000, times=poller.HISTORY // 2 + 1)  # bursts again: polling comes back
    assert p.idle(abi.RELEASE) == poller.POLL_MIN_NS


def test_a_gap_is_counted_once_and_only_after_an_idle_moment(make_poller, clock):
    p = make_poller()
    p.arrived()  # no idle moment yet: nothing to learn
    assert p.idle(abi.GETATTR) == poller.POLL_FIRST_NS
    clock.ns += 20_000
    p.arrived()
    clock.ns += 3_000_000_000
    p.arrived()  # the next request of a burst: no gap of its own (counted, it would stop polling)
    assert p.idle(abi.GETATTR) == poller.POLL_MIN_NS
    assert p.idle(abi.LOOKUP) == poller.POLL_FIRST_NS


@pytest.mark.skipif(not os.access(poller.CPU_LATENCY, os.W_OK), reason="needs root and /dev/cpu_dma_latency")
def test_idle_cpus_are_kept_awake_only_while_the_hold_lasts():
    before = cpu_latency_limit()
    wake = poller.WakeLatency()
    try:
        assert wake.state == "on" and cpu_latency_limit() == before, "opening alone asks for nothing"
        wake.hold()
        assert wake.held and cpu_latency_limit() == 0
        wake.release()
        assert not wake.held and cpu_latency_limit() == before
        wake.hold()
    finally:
        wake.close()
    assert cpu_latency_limit() == before, "closing drops a hold still in place"


def test_without_the_device_or_when_off_nothing_is_held(tmp_path):
    missing = poller.WakeLatency(path=str(tmp_path / "cpu_dma_latency"))
    assert missing.state.startswith("unavailable (") and "No such file" in missing.state
    off = poller.WakeLatency(enabled=False)
    for wake in (missing, off):
        wake.hold()
        assert not wake.held
        wake.close()
    assert off.state == "off"
