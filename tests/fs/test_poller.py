"""Polling for the next FUSE request: only where the CPU is idle, only after kinds of
requests that are followed at once.

A pipe stands in for ``/dev/fuse`` (both hand over one message per read); a file stands in
for ``/proc/pressure/cpu``, to set the machine's load at will.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from tierfs.fs import abi, poller
from tierfs.fs.poller import Poller

IDLE = b"some avg10=0.00 avg60=0.00 avg300=0.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
BUSY = b"some avg10=63.20 avg60=40.00 avg300=30.00 total=9\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"


@pytest.fixture
def device():
    r, w = os.pipe()
    os.set_blocking(r, False)
    try:
        yield r, w
    finally:
        os.close(r)
        os.close(w)


def make_poller(tmp_path, pressure: bytes) -> Poller:
    path = tmp_path / "pressure"
    path.write_bytes(pressure)
    return Poller(str(path))


def send_later(fd: int, delay: float, data: bytes = b"request") -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay), os.write(fd, data)))
    t.start()
    return t


def test_a_request_that_comes_while_polling_is_read_at_once(tmp_path, device, monkeypatch):
    monkeypatch.setattr(poller, "POLL_NS", 2_000_000_000)  # room for a thread on a busy machine
    r, w = device
    p = make_poller(tmp_path, IDLE)
    buf = bytearray(64)
    assert p.expects(abi.LOOKUP)
    t = send_later(w, 0.01)
    try:
        started = time.perf_counter()
        n = p.poll(r, buf, abi.LOOKUP)
        waited = time.perf_counter() - started
    finally:
        t.join()
        p.close()
    assert n is not None and bytes(buf[:n]) == b"request"
    assert 0.01 <= waited < 1.9


def test_polling_gives_up_when_nothing_comes(tmp_path, device, monkeypatch):
    monkeypatch.setattr(poller, "POLL_NS", 2_000_000)
    r, _ = device
    p = make_poller(tmp_path, IDLE)
    started = time.perf_counter()
    assert p.poll(r, bytearray(64), abi.LOOKUP) is None
    assert 0.002 <= time.perf_counter() - started < 1
    p.close()


def test_a_busy_machine_never_polls(tmp_path):
    p = make_poller(tmp_path, BUSY)
    assert not p.expects(abi.LOOKUP)
    p.close()


def test_no_pressure_information_means_no_polling(tmp_path):
    p = Poller(str(tmp_path / "missing"))
    assert not p.expects(abi.LOOKUP)
    p.close()


def test_polling_stops_after_a_kind_of_request_that_is_not_followed(tmp_path, device, monkeypatch):
    monkeypatch.setattr(poller, "POLL_NS", 100_000)
    r, _ = device
    p = make_poller(tmp_path, IDLE)
    try:
        assert p.expects(abi.GETXATTR)
        assert p.poll(r, bytearray(64), abi.GETXATTR) is None  # a miss takes it below the threshold
        assert [p.expects(abi.GETXATTR) for _ in range(poller.PROBE_EVERY)] == [False] * (poller.PROBE_EVERY - 1) + [True]
        assert p.expects(abi.LOOKUP), "other kinds keep their own record"
    finally:
        p.close()
