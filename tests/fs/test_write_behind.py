"""Write-behind on real tmpfs files: order, waiting, failures, and the handlers that report them."""

from __future__ import annotations

import errno
import os
import random
import threading
import time

import pyfuse3
import pytest

from tests.helpers import wait_for
from tierfs.fs import abi
from tierfs.fs.messages import SetattrFields
from tierfs.fs.operations import Operations
from tierfs.fs.pyfuse3_faces import Pyfuse3Volume
from tierfs.fs.writebehind import WriteBehind
from tierfs.ramtier import SpaceAccount

MiB = 1 << 20


def worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tierfs-write-behind"]


def test_overlapping_writes_land_in_the_order_they_came(shm_dir):
    path = shm_dir() / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    rng = random.Random(7)
    model = bytearray()
    try:
        with WriteBehind() as writes:
            for i in range(300):
                off, n = rng.randrange(0, 2 * MiB), rng.randrange(1, 256 << 10)
                data = bytes([i % 251]) * n
                writes.submit(1, fd, off, data)
                model[len(model) :] = bytes(max(0, off + n - len(model)))
                model[off : off + n] = data
            writes.wait(1)
            assert not writes.pending(1)
            assert os.pread(fd, len(model) + 1, 0) == bytes(model)
    finally:
        os.close(fd)


def test_waiting_for_one_file_and_for_all(shm_dir):
    d = shm_dir()
    fds = [os.open(d / name, os.O_WRONLY | os.O_CREAT, 0o644) for name in "ab"]
    try:
        with WriteBehind() as writes:
            for _ in range(16):
                writes.submit(1, fds[0], os.fstat(fds[0]).st_size, b"a" * MiB)
                writes.submit(2, fds[1], 0, b"b" * MiB)
            writes.wait(1)
            assert os.path.getsize(d / "a") > 0 and not writes.pending(1)
            writes.wait()
            assert not writes.pending() and not writes.pending(2)
            assert (d / "b").read_bytes() == b"b" * MiB
            assert writes.finished() == set(fds)
            assert writes.queued_bytes == 0
    finally:
        for fd in fds:
            os.close(fd)


def test_several_workers_apply_jobs_side_by_side_and_waits_cover_each_file():
    """Jobs (a write that answers the kernel itself) run on any worker; a wait for one
    file returns while another file's job is still running; ``now`` runs on the caller."""
    gate, running = threading.Event(), threading.Event()
    order = []

    def slow():
        running.set()
        assert gate.wait(10)
        order.append("slow")

    with WriteBehind(threads=2) as writes:
        writes.submit_job(1, 10, 100, slow)
        assert running.wait(10)
        writes.submit_job(2, 11, 50, lambda: order.append("quick"))
        writes.wait(2)  # the second worker took it: no waiting on file 1
        assert order == ["quick"] and writes.pending(1) and not writes.pending(2) and writes.pending()
        callers = []
        writes.submit_job(2, 11, 10, lambda: callers.append(threading.current_thread()), now=True)
        assert callers == [threading.current_thread()]
        with pytest.raises(RuntimeError, match="in order"):
            writes.submit(3, 12, 0, b"x")  # answered writes need one worker
        gate.set()
        writes.wait()
        assert order == ["quick", "slow"] and not writes.pending()
        assert writes.finished() == {10, 11} and writes.queued_bytes == 0
        assert len(worker_threads()) == 2
    assert worker_threads() == []


def test_a_failed_write_is_kept_for_its_descriptor_and_reported_once(small_tmpfs):
    d = small_tmpfs(MiB)
    full = os.open(d / "full", os.O_WRONLY | os.O_CREAT, 0o644)
    wrong = os.open(d / "ro", os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        with WriteBehind() as writes:
            writes.submit(1, full, 0, b"x" * (2 * MiB))  # the tmpfs holds only 1 MiB
            writes.submit(2, wrong, 0, b"y")
            writes.wait()
            assert writes.finished() == {full, wrong}
            assert writes.take_error(full).errno == errno.ENOSPC
            assert writes.take_error(wrong).errno == errno.EBADF
            assert writes.take_error(full) is None and writes.take_error(wrong) is None
    finally:
        os.close(full)
        os.close(wrong)


def test_leaving_the_block_applies_everything_and_ends_the_worker(shm_dir):
    path = shm_dir() / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with WriteBehind() as writes:
            assert len(worker_threads()) == 1
            for i in range(32):
                writes.submit(1, fd, i * MiB, bytes([i]) * MiB)
        assert not writes.running and worker_threads() == []
        assert path.read_bytes() == b"".join(bytes([i]) * MiB for i in range(32))
    finally:
        os.close(fd)


# -- the handlers around it: Operations called directly, as the FUSE loop would ------------


@pytest.fixture
def tree(shm_dir):
    return shm_dir()


@pytest.fixture
def ops(tree, monkeypatch):
    """Operations on a tmpfs tree whose write-behind copies each take 20 ms.

    The delay makes sure the answered writes are still queued when the next handler runs,
    so every assertion below depends on that handler waiting for them.
    """
    real_pwrite = os.pwrite

    def slow_pwrite(fd, data, offset):
        if threading.current_thread().name == "tierfs-write-behind":
            time.sleep(0.02)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", slow_pwrite)
    ops = Operations(tree, SpaceAccount(None, tree))
    with ops.writes:
        yield ops
    ops.close()


async def create(ops: Operations, name: bytes, flags: int) -> tuple[int, int]:
    """Create ``name`` in the root as the kernel would: (file handle, inode)."""
    fi, ino, _ = ops.create(pyfuse3.ROOT_INODE, name, 0o644, flags | os.O_CREAT, pyfuse3.RequestContext())
    return fi.fh, ino


def reply_size(ops: Operations, ino: int) -> int:
    """The size a GETATTR of ``ino`` replies with."""
    return ops.fuse_attr(*ops.getattr(ino))[1]


async def write_all(ops: Operations, fh: int, data: bytes, block: int = MiB) -> None:
    for off in range(0, len(data), block):
        assert ops.write(fh, off, data[off : off + block]) == len(data[off : off + block])


async def test_answered_writes_are_visible_to_reads_and_attributes(ops):
    fh, ino = await create(ops, b"f", os.O_RDWR)
    data = os.urandom(3 * MiB + 5)
    await write_all(ops, fh, data)
    assert ops.writes.pending(ino)
    assert reply_size(ops, ino) == len(data)
    await write_all(ops, fh, data[::-1])
    assert bytes(ops.read(fh, MiB, MiB)) == data[::-1][MiB : 2 * MiB]
    assert ops.space.used >= len(data)
    ops.release(fh)


async def test_a_closed_file_is_complete_in_the_ram_tier(ops, tree):
    fh, _ = await create(ops, b"f", os.O_WRONLY)
    data = os.urandom(4 * MiB)
    await write_all(ops, fh, data)
    ops.flush(fh)  # close(2): what follows may be a kill -9 of the daemon
    assert (tree / "f").read_bytes() == data
    ops.release(fh)


async def test_truncating_open_comes_after_the_queued_writes(ops):
    fh, ino = await create(ops, b"f", os.O_WRONLY)
    await write_all(ops, fh, b"a" * 4 * MiB)
    fh2 = (await ops.open(ino, os.O_WRONLY | os.O_TRUNC, pyfuse3.RequestContext())).fh
    assert reply_size(ops, ino) == 0
    ops.release(fh2)
    ops.release(fh)


async def test_a_write_that_failed_after_its_answer_fails_flush_and_fsync(ops):
    # The kernel never sends a write for a read-only open; here that is how the copy is
    # made to fail after the write was answered.
    fh, _ = await create(ops, b"f", os.O_RDONLY)
    assert ops.write(fh, 0, b"x" * 4096) == 4096
    with pytest.raises(OSError) as e:
        ops.flush(fh)
    assert e.value.errno == errno.EBADF
    ops.flush(fh)  # reported once, as a failed writeback is
    assert ops.write(fh, 0, b"x") == 1
    with pytest.raises(OSError) as e:
        await ops.fsync(fh, False)
    assert e.value.errno == errno.EBADF
    ops.release(fh)


async def test_attributes_taken_before_the_last_write_was_applied_are_taken_again(ops):
    """The worker may apply a file's last queued write between a handler's fstat and its
    reply. Whether a write is queued at the reply is then no guide: the status must still
    be taken again, or the kernel believes the older size and cuts its view of the file."""
    fh, ino = await create(ops, b"f", os.O_RDWR)
    ops.write(fh, 0, b"a" * 70_000)
    await ops.setattr(ino, attrs_of_size(30_000), size_only(), fh, pyfuse3.RequestContext())
    ops.write(fh, 250_000, b"b" * 3_000)  # past the end: the size is this write's
    _, st = ops.getattr(ino)  # GETATTR's fstat, taken while the write is queued
    wait_for(lambda: not ops.writes.pending(ino), 10, "the worker to apply the write", interval=0.001)
    assert ops.fuse_attr(ino, st)[1] == 253_000  # what the kernel session replies
    ops.write(fh, 260_000, b"c")
    lookup = ops.lookup(pyfuse3.ROOT_INODE, b"f")
    wait_for(lambda: not ops.writes.pending(ino), 10, "the worker to apply the write", interval=0.001)
    assert Pyfuse3Volume(ops)._entry(*lookup).st_size == 260_001  # what pyfuse3 replies
    ops.release(fh)


async def test_writes_land_at_the_kernels_offsets_through_an_append_handle(ops, tree):
    """The kernel gives every write its offset: for an O_APPEND open, the end of the file
    as it knows it; for mapped pages written back, through whichever handle it holds open
    for writing, the pages' own place."""
    fh, ino = await create(ops, b"f", os.O_RDWR)
    ops.write(fh, 0, b"a" * 100)
    appending = (await ops.open(ino, os.O_RDWR | os.O_APPEND, pyfuse3.RequestContext())).fh
    ops.write(appending, 100, b"c" * 10)  # an append
    ops.write(appending, 10, b"b" * 5)  # a page written back
    ops.flush(appending)
    assert (tree / "f").read_bytes() == b"a" * 10 + b"b" * 5 + b"a" * 85 + b"c" * 10
    ops.release(appending)
    ops.release(fh)


def attrs_of_size(size: int) -> pyfuse3.EntryAttributes:
    attr = pyfuse3.EntryAttributes()
    attr.st_size = size
    return attr


def size_only() -> SetattrFields:
    return SetattrFields(abi.FATTR_SIZE)


async def test_a_file_that_lost_an_answered_write_does_not_count_as_written(tree, monkeypatch):
    """Closing it does not tell the commit rules it was written (a file: rule would commit
    a file missing bytes the writer was told were in); a file written whole does."""
    done = []

    class Events:
        def file_done(self, path):
            done.append(path)

        def dir_renamed(self, path):
            pass

    ops = Operations(tree, SpaceAccount(None, tree), events=Events())
    with ops.writes:
        bad, _ = await create(ops, b"bad", os.O_WRONLY)
        assert ops.write(bad, (1 << 63) - 2, b"xx") == 2  # answered; past the largest file: EINVAL
        with pytest.raises(OSError) as e:
            ops.flush(bad)
        assert e.value.errno == errno.EINVAL
        ops.release(bad)
        good, _ = await create(ops, b"good", os.O_WRONLY)
        await write_all(ops, good, b"y" * MiB)
        ops.flush(good)
        ops.release(good)
    ops.close()
    assert done == ["good"]
