"""Chunk bodies, the bulk of peer traffic: the event loop moves them, worker threads handle them.

A body follows its header and is never parsed: it goes into a file, a hash or a buffer in
pieces of at most :data:`~tierfs.peers.wire.PIECE` bytes, so a transfer holds two pieces in
memory whatever its size. The event loop only moves pieces through the socket; hashing,
writing and (on a sealed connection) opening them runs in a worker thread, overlapped with
the next piece (:mod:`tierfs.peers.offload`), so a node receiving from several peers at
once uses every core.

In clear, a body leaves with ``os.sendfile`` (tmpfs pages straight into the socket). On a
sealed connection its records carry a label, the chunk's hash and where the range starts
in it, bound into every record's tag (:mod:`tierfs.peers.sealed`).

Every function here raises :class:`PeerUnavailable` when the connection breaks or ends
mid-body and :class:`ProtocolError` when the other side breaks the protocol; callers put
whole requests under one deadline.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

import trio

from tierfs.core.linux import pwrite_all
from tierfs.peers.offload import BUFFERS, relay
from tierfs.peers.sealed import SealedStream
from tierfs.peers.wire import PIECE, PeerUnavailable, reason, recv_into

Sink = Callable[[memoryview, int], None]  # (piece, its offset in the body): in a worker thread, in order


def chunk_label(h: str, offset: int) -> bytes:
    """What a body carrying chunk ``h`` from ``offset`` is sealed for."""
    return f"chunk {h} from {offset}".encode()


async def receive(stream: trio.abc.ReceiveStream, n: int, sink: Sink, label: bytes) -> None:
    """Receive an ``n``-byte body, handing each piece to ``sink`` in order."""
    if isinstance(stream, SealedStream):
        await stream.receive_body(n, sink, label)
        return
    if n == 0:
        await trio.lowlevel.checkpoint()
        return
    size = min(PIECE, n)
    buffers = [BUFFERS.take(), BUFFERS.take()]
    done = 0

    async def fill(slot: int) -> Callable[[], None] | None:
        nonlocal done
        if done == n:
            return None
        view = memoryview(buffers[slot])[: min(size, n - done)]
        got = 0
        while got < len(view):  # a whole piece per work: a thread hand-off per piece, not per segment
            got += await recv_into(stream, view[got:])
        at, done = done, done + got
        return lambda: sink(view, at)

    try:
        await relay(fill, n)
    finally:
        BUFFERS.give(*buffers)


async def receive_into_file(stream: trio.abc.ReceiveStream, n: int, fd: int | None, hasher: Any | None = None,
                            offset: int = 0, label: bytes = b"") -> None:
    """Receive an ``n``-byte body into ``fd`` at ``offset``, feeding ``hasher`` on the way.

    ``fd=None`` only hashes (or, without ``hasher``, discards) the bytes: how a body that is
    refused or already held is read to its end, keeping the connection in step.
    """
    def sink(piece: memoryview, at: int) -> None:
        if hasher is not None:
            hasher.update(piece)
        if fd is not None:
            pwrite_all(fd, piece, offset + at)

    await receive(stream, n, sink, label)


async def receive_bytes(stream: trio.abc.ReceiveStream, n: int, hasher: Any | None = None,
                        label: bytes = b"") -> bytes:
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


async def drain(stream: trio.abc.ReceiveStream, n: int, label: bytes = b"") -> None:
    """Read and discard an ``n``-byte body that was refused."""
    await receive_into_file(stream, n, None, None, 0, label)


async def send_file(stream: trio.abc.SendStream, fd: int, offset: int, count: int, label: bytes = b"") -> int:
    """Send ``count`` bytes of ``fd`` from ``offset`` as a body; returns the bytes sent.

    In clear, ``os.sendfile`` moves tmpfs pages straight into the socket; streams without a
    socket (tests' memory streams) and kernels that refuse sendfile take ``pread`` +
    ``send_all``. A file shorter than ``offset + count`` raises ``EOFError``: a local
    fault, after which the connection is out of step and must be dropped.
    """
    if isinstance(stream, SealedStream):
        await stream.send_body(fd, offset, count, label)
        return count
    sent = 0
    sock = stream.socket if isinstance(stream, trio.SocketStream) else None
    if sock is not None:
        out = sock.fileno()
        while sent < count:
            try:
                n = os.sendfile(out, fd, offset + sent, count - sent)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)
                continue
            except OSError as e:
                if e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) and sent == 0:
                    break  # not a file sendfile can read: copy it instead
                raise PeerUnavailable(f"connection lost while sending: {reason(e)}") from None
            if n == 0:
                raise EOFError(f"file ended {count - sent} bytes short of the promised body")
            sent += n
            await trio.lowlevel.checkpoint()  # a fast reader never blocks us: stay cancellable
        else:
            return sent
    buf = BUFFERS.take()
    view = memoryview(buf)[:PIECE]
    try:
        while sent < count:  # one buffer, reused: every send_all copies it before returning
            n = os.preadv(fd, [view[: min(len(view), count - sent)]], offset + sent)
            if not n:
                raise EOFError(f"file ended {count - sent} bytes short of the promised body")
            try:
                await stream.send_all(view[:n])
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
                raise PeerUnavailable(f"connection lost while sending: {reason(e)}") from None
            sent += n
    finally:
        BUFFERS.give(buf)
    if not count:
        await trio.lowlevel.checkpoint()
    return sent
