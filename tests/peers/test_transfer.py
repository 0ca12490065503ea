"""Moving a body in a worker thread: where the steps run, and cancellation.

Real connected sockets (a socketpair), no peer service: what is tested is the driver, that
a cancelled transfer returns only once its thread has stopped using the buffers and the
socket, and that it returns at once even when the other end has gone silent.
"""

from __future__ import annotations

import random
import threading

import pytest
import trio
import xxhash

from tierfs.peers import bodies, transfer
from tierfs.peers.transfer import INLINE, Recv, Send

MiB = 1 << 20


@pytest.fixture
async def pair():
    a, b = trio.socket.socketpair()
    left, right = trio.SocketStream(a), trio.SocketStream(b)
    try:
        yield left, right
    finally:
        await left.aclose()
        await right.aclose()


def receiving(n: int, where: list, ended: list):
    """Steps receiving ``n`` bytes a MiB at a time; records the thread of each step and the end."""
    buf = memoryview(bytearray(MiB))
    done = 0
    try:
        while done < n:
            k = min(MiB, n - done)
            yield Recv(buf[:k])
            where.append(threading.current_thread())
            done += k
    finally:
        ended.append(threading.current_thread())


@pytest.mark.parametrize("size", [INLINE, INLINE + 1])
async def test_a_small_body_runs_on_the_loop_and_a_larger_one_in_a_worker_thread(pair, size):
    left, right = pair
    where, ended = [], []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(right.send_all, bytes(size))
        await transfer.run(left, receiving(size, where, ended), size)
    on_loop = size <= INLINE
    assert where and all((t is threading.main_thread()) == on_loop for t in where)
    assert len(ended) == 1


async def test_a_receive_cancelled_while_the_sender_is_silent_returns_once_its_thread_ended(pair):
    left, right = pair
    where, ended = [], []
    with trio.fail_after(10):  # the thread is interrupted, not waited out
        async with trio.open_nursery() as nursery:
            nursery.start_soon(right.send_all, bytes(MiB + 5))  # a piece and a bit, then nothing
            with trio.move_on_after(0.2) as scope:
                await transfer.run(left, receiving(8 * MiB, where, ended), 8 * MiB)
    assert scope.cancelled_caught
    assert len(where) == 1 and ended and ended[0] is not threading.main_thread()  # ended before run returned
    with pytest.raises(trio.BrokenResourceError):  # the connection is out of step: it was shut down
        await right.send_all(bytes(MiB) * 8)


async def test_a_send_cancelled_while_the_reader_is_stuck_returns_once_its_thread_ended(pair):
    left, right = pair
    sent, ended = [], []
    data = memoryview(bytes(MiB))

    def sending():
        try:
            for _ in range(64):  # far more than the socket buffers hold: the send blocks
                yield Send(data)
                sent.append(threading.current_thread())
        finally:
            ended.append(threading.current_thread())

    with trio.fail_after(10):
        with trio.move_on_after(0.2) as scope:
            await transfer.run(left, sending(), 64 * MiB)
    assert scope.cancelled_caught
    assert len(sent) < 64 and ended and ended[0] is not threading.main_thread()
    assert await right.receive_some(MiB)  # what was sent before the cancel is readable


@pytest.mark.parametrize("size", [5, INLINE + 1, 3 * MiB + 7])
async def test_a_body_in_clear_arrives_whole_from_a_file_range_into_a_file_range(pair, tmp_path, size):
    left, right = pair
    data = random.Random(size).randbytes(size)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(b"head" + data + b"tail")
    dst.write_bytes(b"")
    hasher = xxhash.xxh3_128()
    with open(src, "rb") as fin, open(dst, "r+b") as fout:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(bodies.send_file, left, fin.fileno(), 4, size)
            await bodies.receive_into_file(right, size, fout.fileno(), hasher, 100)
    assert dst.read_bytes() == bytes(100) + data
    assert hasher.digest() == xxhash.xxh3_128(data).digest()


async def test_a_transfer_whose_socket_the_loop_closed_meanwhile_is_still_interrupted(pair):
    """A pool may close a connection while a request on it waits: cancelling that request must
    still end its thread (which holds a descriptor of its own), not wait for the peer to hang up."""
    left, right = pair
    where, ended = [], []
    scope = trio.CancelScope()

    async def close_then_cancel() -> None:
        while not where:  # the thread holds the first piece: it is blocked on the rest
            await trio.sleep(0.005)
        left.socket.close()
        scope.cancel()

    async def hang_up_at_last() -> None:  # so that a regression fails below instead of hanging
        await trio.sleep(5)
        await right.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(right.send_all, bytes(MiB + 5))
        nursery.start_soon(close_then_cancel)
        nursery.start_soon(hang_up_at_last)
        started = trio.current_time()
        with scope:
            await transfer.run(left, receiving(8 * MiB, where, ended), 8 * MiB)
        took = trio.current_time() - started
        nursery.cancel_scope.cancel()
    assert scope.cancelled_caught and ended
    assert took < 4, f"the thread ended only when the peer hung up ({took:.1f} s)"
