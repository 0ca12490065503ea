"""The peer service: other nodes put replicas here and fetch them back.

One task per connection, at most ``max_connections`` at once: past that, new connections
wait in the kernel's accept queue until a slot frees. A connection first completes TLS (unless
it is off) and the HMAC handshake, both within the handshake deadline, so a stranger holds a
slot for a few seconds at most; then it goes on in sealed records (:mod:`tierfs.peers.sealed`)
and serves requests one at a time, each answered. Every
wait has a deadline (:class:`Timeouts`): a peer that stalls is dropped, never waited for.

Two kinds of failure, two answers. A *refusal* (no space, hash mismatch, not found,
missing chunks) is answered and the connection carries on: its body, if any, has been read
to the end, so both sides are still in step. A *protocol violation* (malformed header,
body too large, unknown op with a body) is answered if possible and the connection closed:
where the next message starts is no longer known. Neither ever stops the service.

Every bad connection (refused, broken, or hitting a bug here) is one line in the log, never
a traceback, and at most :data:`LOG_BURST` such lines a minute: anyone who can reach the
port can make the service refuse connections, but not fill the log.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from tierfs.peers import bodies, wire
from tierfs.peers.bodies import chunk_label
from tierfs.peers.sealed import seal
from tierfs.peers.tls import PeerTLS, TLSStream
from tierfs.peers.wire import (
    MAX_BATCH,
    MAX_BATCH_BYTES,
    MAX_CHUNK,
    MAX_HAVE,
    MAX_MANIFEST,
    AuthFailed,
    NoSpace,
    PeerError,
    PeerUnavailable,
    ProtocolError,
)
from tierfs.store.chunkfiles import ChunkWriter, is_hash
from tierfs.store.replicas import MissingChunks, ReplicaStore

log = logging.getLogger(__name__)

_RESERVED = frozenset({"ok", "error", "len"})
MESSAGE_OPS = frozenset({"coord_report", "coord_decide", "coord_pull", "await_chunk"})  # to ``messages``
MAX_CONNECTIONS = 256  # per service: every node's survey, replication and restore fit many times
LOG_BURST = 10  # lines about bad connections per LOG_PERIOD
LOG_PERIOD = 60.0
# accept() failing for want of descriptors or memory: wait and go on, as trio.serve_listeners does.
_ACCEPT_CAPACITY_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


@dataclass(frozen=True)
class Timeouts:
    handshake: float = 5.0  # TLS and the HMAC handshake, from accept to "ok"
    idle: float = 300.0  # waiting for the next request header (a replicator between steps)
    request: float = 60.0  # one request, its body and its answer: 64 MiB at >= 1.1 MB/s


class RateLimitedLog:
    """At most ``burst`` lines per ``period`` seconds; the rest are counted, and the count is
    told with the next line let through. Lines about strangers must not fill the disk."""

    def __init__(self, logger: logging.Logger, burst: int = LOG_BURST, period: float = LOG_PERIOD):
        self._logger, self._burst, self._period = logger, burst, period
        self._window, self._count, self._suppressed = float("-inf"), 0, 0

    def __call__(self, level: int, message: str, *args: object) -> None:
        if not self._logger.isEnabledFor(level):
            return
        now = time.monotonic()
        if now - self._window >= self._period:
            self._window, self._count = now, 0
        if self._count >= self._burst:
            self._suppressed += 1
            return
        self._count += 1
        if self._suppressed:
            message, args = message + " (and %d similar lines suppressed)", (*args, self._suppressed)
            self._suppressed = 0
        self._logger.log(level, message, *args)


Messages = Callable[[str, dict], Awaitable[dict]]  # (the sender's listen address, request) -> answer


@dataclass(frozen=True)
class _Context:
    job: str
    secret: bytes
    store: ReplicaStore
    info: Callable[[], dict]
    timeouts: Timeouts
    tls: PeerTLS | None
    messages: Messages | None = None
    say: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(log))


async def serve(
    listen: tuple[str, int],
    *,
    job: str,
    secret: bytes,
    store: ReplicaStore,
    info: Callable[[], dict],
    tls: PeerTLS | None,
    timeouts: Timeouts = Timeouts(),
    max_connections: int = MAX_CONNECTIONS,
    messages: Messages | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the peer protocol on ``listen`` (host, port; port 0 picks one) until cancelled.

    ``tls`` encrypts every connection (``None``: in clear, for trusted networks only).
    ``task_status.started`` reports the port actually bound. ``info()`` is called for every
    ``info`` request and must return a JSON-able dict without the keys ok, error or len.
    ``messages`` answers the coordination requests (:data:`MESSAGE_OPS`, header only), given
    the sender's listen address, which must be on the host the connection comes from.
    """
    if not secret:
        raise ValueError("the peer service needs the job's secret")
    if max_connections < 1:
        raise ValueError(f"max_connections must be at least 1, not {max_connections}")
    host, port = listen
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    log.info(
        "peer service of job %s listening on %s:%d (%s, at most %d connections)",
        job,
        host,
        bound,
        f"TLS 1.3, {tls.origin}" if tls else "in clear: --peer-tls off",
        max_connections,
    )
    ctx = _Context(job, secret, store, info, timeouts, tls, messages)
    slots = trio.Semaphore(max_connections, max_value=max_connections)
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(_accept, ctx, listener, slots, nursery)
        task_status.started(bound)


async def _accept(ctx: _Context, listener: trio.SocketListener, slots: trio.Semaphore, nursery: trio.Nursery) -> None:
    """Accept connections while a slot is free; the rest wait in the kernel's queue."""
    async with listener:
        while True:
            if slots.value == 0:
                ctx.say(logging.WARNING, "peer service: all %d connections are busy; new ones wait", slots.max_value)
            await slots.acquire()
            try:
                stream = await listener.accept()
            except OSError as e:
                slots.release()
                if e.errno not in _ACCEPT_CAPACITY_ERRORS:
                    raise
                ctx.say(logging.ERROR, "peer service: cannot accept a connection (%s); retrying", e.strerror)
                await trio.sleep(0.1)
                continue
            nursery.start_soon(_connection, ctx, stream, slots)


async def _connection(ctx: _Context, stream: trio.SocketStream, slots: trio.Semaphore) -> None:
    """One peer connection, from the handshake to its close; never raises."""
    try:
        host, port = stream.socket.getpeername()[:2]
        peer = f"{host}:{port}"
    except OSError:
        peer = "a vanished peer"
    conn: trio.abc.Stream = stream
    try:
        with trio.move_on_after(ctx.timeouts.handshake) as deadline:
            if ctx.tls is not None:
                await _expect_tls(stream)
                conn = await TLSStream.handshake(stream, ctx.tls, server_side=True)
            nonces = await wire.authenticate(conn, job=ctx.job, secret=ctx.secret)
            if ctx.tls is not None:
                conn = await seal(conn, ctx.job, ctx.secret, nonces, server_side=True)
        if deadline.cancelled_caught:
            ctx.say(
                logging.INFO, "peer %s did not complete the handshake within %gs: dropped", peer, ctx.timeouts.handshake
            )
        else:
            log.debug("peer %s authenticated", peer)
            await _session(ctx, conn, peer)
    except PeerUnavailable as e:
        log.debug("peer %s: %s", peer, e)
    except AuthFailed as e:  # its TLS certificate, or ours, or its proof was refused
        ctx.say(logging.WARNING, "peer %s refused: %s", peer, e)
    except ProtocolError as e:
        ctx.say(logging.WARNING, "peer %s broke the protocol (%s): connection closed", peer, e)
        _discard_received(conn)
        await _try_answer(conn, {"error": str(e)}, ctx.timeouts.handshake)
    except Exception as e:  # a bug or a local I/O error must not stop the service, nor fill the log
        # Not answered: it may have struck halfway through an answer's body.
        ctx.say(logging.ERROR, "peer %s: request failed (%s: %s): connection closed", peer, type(e).__name__, e)
        log.debug("peer %s: the failure in full", peer, exc_info=True)
    finally:
        ctx.store.end_session(conn)  # its chunks are now kept only if a manifest names them
        wire.abort(conn)
        slots.release()


async def _session(ctx: _Context, stream: trio.abc.Stream, peer: str) -> None:
    """Requests of an authenticated peer, one at a time, until it leaves or idles out."""
    while True:
        with trio.move_on_after(ctx.timeouts.idle) as scope:
            request = await wire.recv_msg(stream)
        if scope.cancelled_caught:
            log.debug("peer %s idle for %gs: closed", peer, ctx.timeouts.idle)
            return
        with trio.move_on_after(ctx.timeouts.request) as scope:
            await _dispatch(ctx, stream, request, peer)
        if scope.cancelled_caught:
            ctx.say(
                logging.WARNING,
                "peer %s: %s took longer than %gs: dropped",
                peer,
                wire.brief(request.get("op")),
                ctx.timeouts.request,
            )
            return


async def _dispatch(ctx: _Context, stream: trio.abc.Stream, request: dict, peer: str) -> None:
    op = request.get("op")
    if op in MESSAGE_OPS:
        await _message(ctx, stream, request, peer)
        return
    entry = _OPS.get(op) if isinstance(op, str) else None
    if entry is None:
        if wire.body_length(request):
            raise ProtocolError(f"unknown op {wire.brief(op)} with a body")
        await wire.send_msg(stream, {"error": f"unknown op {wire.brief(op)}"})
        return
    handler, has_body = entry
    if has_body != ("len" in request):
        raise ProtocolError(f"{op} {'needs' if has_body else 'takes no'} body")
    try:
        await handler(ctx, stream, request)
    except (PeerUnavailable, ProtocolError):
        raise
    except PeerError as e:  # a refusal: the request was read whole, the connection goes on
        if op in ("get_chunk", "get_manifest"):  # "not found" is a restore's normal question
            log.debug("peer %s: %s refused: %s", peer, op, e)
        else:
            ctx.say(logging.INFO, "peer %s: %s refused: %s", peer, op, e)
        answer: dict[str, Any] = {"error": str(e)}
        if isinstance(e, MissingChunks):
            answer["missing"] = e.missing
        await wire.send_msg(stream, answer)


# -- requests -----------------------------------------------------------------------------


async def _info(ctx: _Context, stream: trio.abc.Stream, request: dict) -> None:
    info = dict(ctx.info())
    if clash := info.keys() & _RESERVED:
        raise RuntimeError(f"info() returned reserved keys {sorted(clash)}")
    await wire.send_msg(stream, {**info, "ok": True})


async def _have(ctx: _Context, stream: trio.abc.Stream, request: dict) -> None:
    hashes = request.get("hashes")
    if not isinstance(hashes, list) or len(hashes) > MAX_HAVE or not all(isinstance(h, str) for h in hashes):
        raise ProtocolError(f"have needs a list of at most {MAX_HAVE} hashes")
    have = [ctx.store.has(h) for h in hashes]
    for h, held in zip(hashes, have):
        if held:
            ctx.store.hold_for(stream, h)
    await wire.send_msg(stream, {"ok": True, "have": have})


async def _put_chunk(ctx: _Context, stream: trio.abc.Stream, request: dict) -> None:
    h, n = _hash(request), request["len"]
    if n > MAX_CHUNK:
        raise ProtocolError(f"chunk of {n} bytes exceeds the {MAX_CHUNK}-byte limit")
    try:
        writer = ctx.store.begin_chunk(h, n)
    except NoSpace:
        await bodies.drain(stream, n, chunk_label(h, 0))  # keep in step; not a byte of it is kept
        raise
    with writer:
        await bodies.receive(stream, n, writer.write, chunk_label(h, 0))
        writer.commit()
    ctx.store.hold_for(stream, h)
    await wire.send_msg(stream, {"ok": True})


async def _put_chunks(ctx: _Context, stream: trio.abc.Stream, request: dict) -> None:
    """Several chunks, bodies back to back: each stored if it hashes right and has room.

    Any refusal refuses the request (``no space`` if one had no room) once every body is
    read; the chunks that were stored are kept for the session all the same.
    """
    chunks = _batch(request)
    refusals: list[PeerError] = []
    with contextlib.ExitStack() as stack:
        writers: list[ChunkWriter | None] = []
        for h, n in chunks:
            try:
                writers.append(stack.enter_context(ctx.store.begin_chunk(h, n)))
            except NoSpace as e:
                refusals.append(e)
                writers.append(None)  # its body is read and dropped: the connection stays in step
        failures = await bodies.receive_many(
            stream, [(n, w.write if w else _discard, chunk_label(h, 0)) for (h, n), w in zip(chunks, writers)]
        )
        for (h, _), writer, failure in zip(chunks, writers, failures):
            if writer is None:
                continue
            try:
                if failure is not None:
                    raise failure
                writer.commit()
            except PeerError as e:
                refusals.append(e)
            else:
                ctx.store.hold_for(stream, h)
    if refusals:
        raise next((e for e in refusals if isinstance(e, NoSpace)), refusals[0])
    await wire.send_msg(stream, {"ok": True})


def _discard(piece: memoryview, at: int) -> None:
    """The sink of a body refused before it arrived."""


async def _put_manifest(ctx: _Context, stream: trio.abc.Stream, request: dict) -> None:
    rank, step = _count(request, "rank"), _count(request, "step")
    data = await wire.recv_body(stream, request["len"], MAX_MANIFEST)
    await ctx.store.put_manifest(rank, step, data)
    await wire.send_msg(stream, {"ok": True})


async def _list(ctx: _Context, stream: trio.abc.Stream, request: dict) -> None:
    await wire.send_msg(stream, {"ok": True, "manifests": [list(m) for m in ctx.store.manifests()]})


async def _get_manifest(ctx: _Context, stream: trio.abc.Stream, request: dict) -> None:
    data = ctx.store.get_manifest(_count(request, "rank"), _count(request, "step"))
    await wire.send_msg(stream, {"ok": True, "len": len(data)}, data)


async def _get_chunk(ctx: _Context, stream: trio.abc.Stream, request: dict) -> None:
    h, offset = _hash(request), _count(request, "offset", 0)
    length = request.get("length")
    if length is not None and not wire.is_count(length):
        raise ProtocolError(f"invalid length {wire.brief(length)}")
    if offset + (length or 0) > MAX_CHUNK:  # refused before any file is opened
        raise PeerError(f"range {offset}+{length} is outside any chunk (at most {MAX_CHUNK} bytes)")
    with ctx.store.open_chunk(h) as source:  # verified when stored, or just now
        if length is None:
            length = max(0, source.length - offset)
        if offset + length > source.length:
            raise PeerError(f"range {offset}+{length} is outside the chunk's {source.length} bytes")
        await wire.send_msg(stream, {"ok": True, "len": length})
        await bodies.send_file(stream, source.fd, source.offset + offset, length, chunk_label(h, offset))


async def _get_chunks(ctx: _Context, stream: trio.abc.Stream, request: dict) -> None:
    """Several whole chunks, each verified, bodies back to back; ``held`` says which come (the others are not here)."""
    chunks = _batch(request)
    with contextlib.ExitStack() as stack:
        sources = []
        for h, n in chunks:
            try:
                source = stack.enter_context(ctx.store.open_chunk(h))
            except PeerError:  # not found, or corrupt (and removed): the asker goes elsewhere for it
                source = None
            sources.append(source if source is not None and source.length == n else None)
        parts = [(s.fd, s.offset, n, chunk_label(h, 0)) for (h, n), s in zip(chunks, sources) if s is not None]
        await wire.send_msg(
            stream, {"ok": True, "held": [s is not None for s in sources], "len": sum(n for _, _, n, _ in parts)}
        )
        await bodies.send_files(stream, parts)


async def _message(ctx: _Context, stream: trio.abc.Stream, request: dict, peer: str) -> None:
    """A coordination request: its answer (a refusal included) is the handler's, one header."""
    if wire.body_length(request):
        raise ProtocolError(f"{request['op']} takes no body")
    sender = request.get("from")
    host = peer.rsplit(":", 1)[0].strip("[]")
    if ctx.messages is None:
        answer = {"error": "this node takes no coordination requests"}
    elif not isinstance(sender, str) or len(sender) > 300 or sender.rsplit(":", 1)[0].strip("[]") != host:
        answer = {"error": f"{request['op']} from {host} must name its sender's address on that host"}
    else:
        try:
            answer = await ctx.messages(sender, request)
        except ValueError as e:  # a malformed message: refused, the connection stays in step
            answer = {"error": f"malformed {request['op']}: {e}"}
        if not isinstance(answer, dict) or "len" in answer:
            raise RuntimeError(f"the {request['op']} handler answered {type(answer).__name__} with a body")
    if "error" in answer:
        ctx.say(logging.INFO, "peer %s: %s refused: %s", peer, request["op"], answer["error"])
    await wire.send_msg(stream, answer)


_Handler = Callable[[_Context, trio.abc.Stream, dict], Awaitable[None]]
_OPS: dict[str, tuple[_Handler, bool]] = {  # op -> (handler, carries a body)
    "info": (_info, False),
    "have": (_have, False),
    "put_chunk": (_put_chunk, True),
    "put_chunks": (_put_chunks, True),
    "put_manifest": (_put_manifest, True),
    "list": (_list, False),
    "get_manifest": (_get_manifest, False),
    "get_chunk": (_get_chunk, False),
    "get_chunks": (_get_chunks, False),
}


def _hash(request: dict) -> str:
    h = request.get("hash")
    if not is_hash(h):
        raise ProtocolError(f"{wire.brief(h)} is not a chunk hash")
    return h


def _batch(request: dict) -> list[tuple[str, int]]:
    """The ``(hash, length)`` pairs of a put_chunks or get_chunks, checked (against the body's length too)."""
    op, chunks = request["op"], request.get("chunks")
    if not isinstance(chunks, list) or not 0 < len(chunks) <= MAX_BATCH:
        raise ProtocolError(f"{op} needs a list of 1 to {MAX_BATCH} chunks")
    pairs = []
    for entry in chunks:
        if not (
            isinstance(entry, list)
            and len(entry) == 2
            and is_hash(entry[0])
            and wire.is_count(entry[1])
            and entry[1] <= MAX_CHUNK
        ):
            raise ProtocolError(f"{op}: {wire.brief(entry)} is not a chunk's [hash, length]")
        pairs.append((entry[0], entry[1]))
    total = sum(n for _, n in pairs)
    if total > MAX_BATCH_BYTES or total != request.get("len", total):
        raise ProtocolError(
            f"{op}: chunks of {total} bytes (at most {MAX_BATCH_BYTES}), a body of {request.get('len', 0)}"
        )
    return pairs


def _count(request: dict, key: str, default: int | None = None) -> int:
    value = request.get(key, default)
    if not wire.is_count(value):
        raise ProtocolError(f"invalid {key} {wire.brief(value)}")
    return value


async def _expect_tls(stream: trio.SocketStream) -> None:
    """Refuse, in words it can read, a peer that starts in clear while this service speaks TLS.

    Every TLS connection starts with a handshake record (byte 0x16). Anything else is a node
    with ``--peer-tls off`` (or not a node): its hello is read, so that the refusal reaches
    it instead of being lost to the reset that closing over unread bytes sends.
    """
    try:
        first = await stream.socket.recv(1, socket.MSG_PEEK)
    except OSError as e:
        raise PeerUnavailable(f"connection lost before the TLS handshake: {e.strerror or e}") from None
    if first and first != b"\x16":
        try:
            await wire.recv_msg(stream, wire.HELLO_MAX_HEADER)
        except PeerError:
            pass
        raise ProtocolError(
            "this peer service speaks TLS and the connection is in clear: every node of a job needs the same --peer-tls"
        )


def _discard_received(stream: trio.abc.Stream) -> None:
    """Drop bytes that arrived unread (at most 1 MiB, without waiting) before answering and closing.

    Closing a socket with unread bytes sends a reset, which can destroy the answer on its
    way; this is what lets a peer that sent TLS to a service in clear read why it was refused.
    """
    if not isinstance(stream, trio.SocketStream):
        return
    fd = stream.socket.fileno()
    for _ in range(16):
        try:
            if not os.read(fd, 1 << 16):
                return
        except OSError:  # nothing more has arrived (EAGAIN), or the connection is gone
            return


async def _try_answer(stream: trio.abc.Stream, answer: dict, timeout: float) -> None:
    """A last word before closing; a peer that does not take it within ``timeout`` does without."""
    with trio.move_on_after(timeout):
        try:
            await wire.send_msg(stream, answer)
        except PeerUnavailable:
            pass
