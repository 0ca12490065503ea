"""When the job counts as writing: bulk writes do, a log line every few milliseconds does not."""

from __future__ import annotations

import os

import pytest

from tierfs.fs.writing import LOOK_EVERY, WINDOW, WRITING, Writing


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def writing(clock) -> Writing:
    return Writing(clock)


def test_small_writes_never_make_a_writer_however_many(writing, clock):
    for _ in range(10_000):  # a log line every 5 ms for 50 s: 200 bytes per second
        writing.wrote(100)
        clock.advance(0.005)
    assert writing.last == 0.0


def test_a_bulk_write_makes_a_writer_at_once(writing, clock):
    writing.wrote(WRITING)
    assert writing.last == clock.now


def test_writes_add_up_within_a_window_only(writing, clock):
    half = WRITING // 2
    writing.wrote(half)
    clock.advance(WINDOW * 1.5)  # the first half is in a window gone by
    writing.wrote(half)
    assert writing.last == 0.0
    clock.advance(WINDOW / 2)
    writing.wrote(half)  # two halves within one window: 20 MiB/s
    assert writing.last == clock.now


def test_a_watched_file_counts_what_it_grew_by(writing, clock, tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        writing.watch(fd, os.fstat(fd))
        for _ in range(50):  # appended lines, looked at between them
            os.write(fd, b"step 7 loss 0.25\n")
            clock.advance(LOOK_EVERY)
            assert writing.last == 0.0
        os.write(fd, b"x" * WRITING)
        assert writing.last == 0.0  # not looked at yet: the last look was just now
        clock.advance(LOOK_EVERY)
        assert writing.last == clock.now
    finally:
        os.close(fd)


def test_a_watched_file_rewritten_in_place_counts_as_its_size(writing, clock, tmp_path):
    small, large = (os.open(tmp_path / name, os.O_RDWR | os.O_CREAT) for name in ("progress", "preallocated"))
    try:
        os.ftruncate(large, 4 * WRITING)
        for fd in (small, large):
            writing.watch(fd, os.fstat(fd))
        for _ in range(20):  # a progress file rewritten over and over: never more than its size per look
            os.pwrite(small, b"step 7\n", 0)
            os.utime(small, ns=(0, int(clock.now * 1e9)))  # a new mtime each time, whatever the file system's clock
            clock.advance(LOOK_EVERY)
            assert writing.last == 0.0
        os.pwrite(large, b"y" * 4096, 0)  # a preallocated file being filled: no growth, a new mtime
        os.utime(large, ns=(0, 1))
        clock.advance(LOOK_EVERY)
        assert writing.last == clock.now
    finally:
        os.close(small)
        os.close(large)


def test_a_released_file_counts_what_it_wrote_since_the_last_look(writing, clock, tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        writing.watch(fd, os.fstat(fd))
        os.write(fd, b"z" * WRITING)
        writing.unwatch(fd, os.fstat(fd))
        assert writing.last == clock.now
        clock.advance(1.0)
        os.write(fd, b"z" * WRITING)  # no longer watched
        clock.advance(LOOK_EVERY)
        assert writing.last == clock.now - 1.0 - LOOK_EVERY
    finally:
        os.close(fd)


def test_a_file_closed_under_a_look_is_skipped(writing, clock, tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    writing.watch(fd, os.fstat(fd))
    os.close(fd)
    clock.advance(LOOK_EVERY)
    assert writing.last == 0.0
