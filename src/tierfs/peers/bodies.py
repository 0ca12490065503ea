"""Chunk bodies, the bulk of peer traffic: moved, opened, hashed and written by one worker thread.

A body follows its header and is never parsed: it goes into a file, a hash or a buffer in
pieces of at most :data:`~tierfs.peers.wire.PIECE` bytes, so a transfer holds a piece or two
in memory whatever its size. A body of more than 64 KiB, or the bodies of one request
together (``put_chunks``: many small chunks back to back), is moved by one worker thread
from the first byte to the last, and what is done with each piece (the sink: hashing,
``pwrite``) runs in that thread too (:mod:`tierfs.peers.transfer`), so a node receiving
from several peers at once uses every core and the event loop stays free.

In clear, a body leaves with ``os.sendfile`` (tmpfs pages straight into the socket). On a
sealed connection its records carry a label, the chunk's hash and where the range starts
in it, bound into every record's tag (:mod:`tierfs.peers.sealed`).

A sink that fails (no space, an I/O error) is not called again, but the body is still read
to its end before its error is raised: the connection stays in step, so a peer can answer
"no space" on it. Otherwise every function here raises
:class:`~tierfs.peers.wire.PeerUnavailable` when the connection breaks or ends mid-body and
:class:`~tierfs.peers.wire.ProtocolError` when the other side breaks the protocol; callers
put whole requests under one deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import trio

from tierfs.core.linux import pwrite_all
from tierfs.peers import transfer
from tierfs.peers.offload import BUFFERS
from tierfs.peers.sealed import SealedStream
from tierfs.peers.transfer import Recv, SendFile, Steps
from tierfs.peers.wire import PIECE

Sink = Callable[[memoryview, int], None]  # (piece, its offset in the body): in a worker thread, in order


def chunk_label(h: str, offset: int) -> bytes:
    """What a body carrying chunk ``h`` from ``offset`` is sealed for."""
    return f"chunk {h} from {offset}".encode()


async def receive(stream: trio.abc.Stream, n: int, sink: Sink, label: bytes) -> None:
    """Receive an ``n``-byte body, handing each piece to ``sink`` in order."""
    (failure,) = await receive_many(stream, [(n, sink, label)])
    if failure is not None:
        raise failure


async def receive_many(stream: trio.abc.Stream, parts: Sequence[tuple[int, Sink, bytes]]) -> list[Exception | None]:
    """Receive bodies back to back, each ``(length, sink, label)``, moved by one worker thread.

    Returns each sink's failure (``None``: it took every piece); every body is read to its
    end whatever its sink did, so the connection stays in step.
    """
    failures: list[Exception | None] = [None] * len(parts)

    def guarded(i: int, sink: Sink) -> Sink:
        def take(piece: memoryview, at: int) -> None:
            if failures[i] is None:
                try:
                    sink(piece, at)
                except Exception as e:  # noqa: BLE001 (raised once the body is read: the connection stays in step)
                    failures[i] = e

        return take

    sealed = stream if isinstance(stream, SealedStream) else None
    buffers = [BUFFERS.take() for _ in range(2 if sealed else 1)]  # (records and) opened pieces

    def steps() -> Steps:
        for i, (n, sink, label) in enumerate(parts):
            if sealed is not None:
                yield from sealed.body_in(n, guarded(i, sink), label, *buffers)
            else:
                yield from _pieces_in(n, guarded(i, sink), memoryview(buffers[0])[:PIECE])

    try:
        await transfer.run(stream, steps(), sum(n for n, _, _ in parts))
    finally:
        BUFFERS.give(*buffers)
    return failures


def _pieces_in(n: int, sink: Sink, view: memoryview) -> Steps:
    done = 0
    while done < n:
        piece = view[: min(len(view), n - done)]
        yield Recv(piece)
        sink(piece, done)
        done += len(piece)


async def receive_into_file(
    stream: trio.abc.Stream, n: int, fd: int | None, hasher: Any | None = None, offset: int = 0, label: bytes = b""
) -> None:
    """Receive an ``n``-byte body into ``fd`` at ``offset``, feeding ``hasher`` on the way.

    ``fd=None`` only hashes (or, without ``hasher``, discards) the bytes: how a body that is
    refused or already held is read to its end, keeping the connection in step.
    """
    await receive(stream, n, into_file(fd, offset, hasher), label)


def into_file(fd: int | None, offset: int, hasher: Any | None) -> Sink:
    """A sink writing a body into ``fd`` from ``offset`` (unless None) and feeding ``hasher`` (unless None)."""

    def sink(piece: memoryview, at: int) -> None:
        if hasher is not None:
            hasher.update(piece)
        if fd is not None:
            pwrite_all(fd, piece, offset + at)

    return sink


async def receive_bytes(stream: trio.abc.Stream, n: int, hasher: Any | None = None, label: bytes = b"") -> bytes:
    """An ``n``-byte body as bytes (the caller has bounded ``n``), hashed on the way.

    The buffer grows as pieces arrive: a peer that announces a large body and sends nothing
    holds no memory for it.
    """
    data = bytearray()

    def sink(piece: memoryview, at: int) -> None:
        data.extend(piece)
        if hasher is not None:
            hasher.update(piece)

    await receive(stream, n, sink, label)
    return bytes(data)


async def drain(stream: trio.abc.Stream, n: int, label: bytes = b"") -> None:
    """Read and discard an ``n``-byte body that was refused."""
    await receive_into_file(stream, n, None, None, 0, label)


async def send_file(stream: trio.abc.Stream, fd: int, offset: int, count: int, label: bytes = b"") -> int:
    """Send ``count`` bytes of ``fd`` from ``offset`` as a body; returns the bytes sent.

    In clear, ``os.sendfile`` moves tmpfs pages straight into the socket; streams without a
    socket (tests' memory streams) and kernels that refuse sendfile take ``pread`` + send.
    A file shorter than ``offset + count`` raises ``EOFError``: a local fault, after which
    the connection is out of step and must be dropped.
    """
    return await send_files(stream, [(fd, offset, count, label)])


async def send_files(stream: trio.abc.Stream, parts: Sequence[tuple[int, int, int, bytes]]) -> int:
    """Send file ranges ``(fd, offset, count, label)`` as bodies back to back, by one worker thread; the bytes sent."""
    sealed = stream if isinstance(stream, SealedStream) else None
    buffers = [BUFFERS.take(), BUFFERS.take()] if sealed else []  # pieces read, and sealed

    def steps() -> Steps:
        for fd, offset, count, label in parts:
            if sealed is not None:
                yield from sealed.body_out(fd, offset, count, label, *buffers)
            elif count:
                yield SendFile(fd, offset, count)

    size = sum(count for _, _, count, _ in parts)
    try:
        await transfer.run(stream, steps(), size)
    finally:
        BUFFERS.give(*buffers)
    return size
