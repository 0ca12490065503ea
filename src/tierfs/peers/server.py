"""The peer service: other nodes put replicas here and fetch them back.

One task per connection, all in the listener's nursery. A connection is authenticated
before anything else is read, then serves requests one at a time, each answered. Every
wait has a deadline (:class:`Timeouts`): a peer that stalls is dropped, never waited for.

Two kinds of failure, two answers. A *refusal* (no space, hash mismatch, not found,
missing chunks) is answered and the connection carries on: its body, if any, has been read
to the end, so both sides are still in step. A *protocol violation* (malformed header,
body too large, unknown op with a body) is answered if possible and the connection closed:
where the next message starts is no longer known. Neither ever stops the service.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import trio

from tierfs.peers import wire
from tierfs.peers.store import MissingChunks, ReplicaStore, is_hash
from tierfs.peers.wire import MAX_CHUNK, MAX_HAVE, MAX_MANIFEST, NoSpace, PeerError, PeerUnavailable, ProtocolError

log = logging.getLogger(__name__)

_RESERVED = frozenset({"ok", "error", "len"})


@dataclass(frozen=True)
class Timeouts:
    handshake: float = 5.0  # the whole handshake, from accept to "ok"
    idle: float = 300.0  # waiting for the next request header (a replicator between steps)
    request: float = 60.0  # one request, its body and its answer: 64 MiB at >= 1.1 MB/s


@dataclass(frozen=True)
class _Context:
    job: str
    secret: bytes
    store: ReplicaStore
    info: Callable[[], dict]
    timeouts: Timeouts


async def serve(listen: tuple[str, int], *, job: str, secret: bytes, store: ReplicaStore,
                info: Callable[[], dict], timeouts: Timeouts = Timeouts(),
                task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the peer protocol on ``listen`` (host, port; port 0 picks one) until cancelled.

    ``task_status.started`` reports the port actually bound. ``info()`` is called for every
    ``info`` request and must return a JSON-able dict without the keys ok, error or len.
    """
    if not secret:
        raise ValueError("the peer service needs the job's secret")
    host, port = listen
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    log.info("peer service of job %s listening on %s:%d", job, host, bound)
    ctx = _Context(job, secret, store, info, timeouts)
    task_status.started(bound)
    await trio.serve_listeners(functools.partial(_connection, ctx), listeners)


async def _connection(ctx: _Context, stream: trio.SocketStream) -> None:
    """One peer connection, from the handshake to its close; never raises."""
    try:
        host, port = stream.socket.getpeername()[:2]
        peer = f"{host}:{port}"
    except OSError:
        peer = "a vanished peer"
    async with stream:
        try:
            await _session(ctx, stream, peer)
        except PeerUnavailable as e:
            log.debug("peer %s: %s", peer, e)
        except ProtocolError as e:
            log.warning("peer %s broke the protocol (%s): connection closed", peer, e)
            await _try_answer(stream, {"error": str(e)}, ctx.timeouts.handshake)
        except Exception:  # a bug or a local I/O error must not stop the service
            # Not answered: it may have struck halfway through an answer's body.
            log.exception("peer %s: request failed: connection closed", peer)
        finally:
            ctx.store.end_session(stream)  # its chunks are now kept only if a manifest names them


async def _session(ctx: _Context, stream: trio.SocketStream, peer: str) -> None:
    with trio.move_on_after(ctx.timeouts.handshake) as scope:
        refused = await wire.authenticate(stream, job=ctx.job, secret=ctx.secret)
    if scope.cancelled_caught:
        log.info("peer %s did not complete the handshake within %gs: dropped", peer, ctx.timeouts.handshake)
        return
    if refused is not None:
        log.warning("peer %s refused: %s", peer, refused)
        return
    log.debug("peer %s authenticated", peer)
    while True:
        with trio.move_on_after(ctx.timeouts.idle) as scope:
            request = await wire.recv_msg(stream)
        if scope.cancelled_caught:
            log.debug("peer %s idle for %gs: closed", peer, ctx.timeouts.idle)
            return
        op = request.get("op")
        with trio.move_on_after(ctx.timeouts.request) as scope:
            await _dispatch(ctx, stream, request, peer)
        if scope.cancelled_caught:
            log.warning("peer %s: %r took longer than %gs: dropped", peer, op, ctx.timeouts.request)
            return


async def _dispatch(ctx: _Context, stream: trio.SocketStream, request: dict, peer: str) -> None:
    op = request.get("op")
    entry = _OPS.get(op) if isinstance(op, str) else None
    if entry is None:
        if wire.body_length(request):
            raise ProtocolError(f"unknown op {op!r} with a body")
        await wire.send_msg(stream, {"error": f"unknown op {op!r}"})
        return
    handler, has_body = entry
    if has_body != ("len" in request):
        raise ProtocolError(f"{op} {'needs' if has_body else 'takes no'} body")
    try:
        await handler(ctx, stream, request)
    except (PeerUnavailable, ProtocolError):
        raise
    except PeerError as e:  # a refusal: the request was read whole, the connection goes on
        log.log(logging.DEBUG if op in ("get_chunk", "get_manifest") else logging.INFO,
                "peer %s: %s refused: %s", peer, op, e)
        answer: dict[str, Any] = {"error": str(e)}
        if isinstance(e, MissingChunks):
            answer["missing"] = e.missing
        await wire.send_msg(stream, answer)


# -- requests -----------------------------------------------------------------------------


async def _info(ctx: _Context, stream: trio.SocketStream, request: dict) -> None:
    info = dict(ctx.info())
    if clash := info.keys() & _RESERVED:
        raise RuntimeError(f"info() returned reserved keys {sorted(clash)}")
    await wire.send_msg(stream, {**info, "ok": True})


async def _have(ctx: _Context, stream: trio.SocketStream, request: dict) -> None:
    hashes = request.get("hashes")
    if not isinstance(hashes, list) or len(hashes) > MAX_HAVE or not all(isinstance(h, str) for h in hashes):
        raise ProtocolError(f"have needs a list of at most {MAX_HAVE} hashes")
    have = [ctx.store.has(h) for h in hashes]
    for h, held in zip(hashes, have):
        if held:
            ctx.store.hold_for(stream, h)
    await wire.send_msg(stream, {"ok": True, "have": have})


async def _put_chunk(ctx: _Context, stream: trio.SocketStream, request: dict) -> None:
    h, n = _hash(request), request["len"]
    if n > MAX_CHUNK:
        raise ProtocolError(f"chunk of {n} bytes exceeds the {MAX_CHUNK}-byte limit")
    try:
        writer = ctx.store.begin_chunk(h, n)
    except NoSpace:
        await wire.drain(stream, n)  # keep in step; not a byte of it is kept
        raise
    with writer:
        await wire.recv_exact_into_file(stream, n, writer.fd, writer.hasher)
        writer.commit()
    ctx.store.hold_for(stream, h)
    await wire.send_msg(stream, {"ok": True})


async def _put_manifest(ctx: _Context, stream: trio.SocketStream, request: dict) -> None:
    rank, step = _count(request, "rank"), _count(request, "step")
    data = await wire.recv_body(stream, request["len"], MAX_MANIFEST)
    await ctx.store.put_manifest(rank, step, data)
    await wire.send_msg(stream, {"ok": True})


async def _list(ctx: _Context, stream: trio.SocketStream, request: dict) -> None:
    await wire.send_msg(stream, {"ok": True, "manifests": [list(m) for m in ctx.store.manifests()]})


async def _get_manifest(ctx: _Context, stream: trio.SocketStream, request: dict) -> None:
    data = ctx.store.get_manifest(_count(request, "rank"), _count(request, "step"))
    await wire.send_msg(stream, {"ok": True, "len": len(data)}, data)


async def _get_chunk(ctx: _Context, stream: trio.SocketStream, request: dict) -> None:
    h, offset = _hash(request), _count(request, "offset", 0)
    length = request.get("length")
    if length is not None and not wire.is_count(length):
        raise ProtocolError(f"invalid length {length!r}")
    with ctx.store.open_chunk(h) as source:  # hashed just now
        if length is None:
            length = max(0, source.length - offset)
        if offset + length > source.length:
            raise PeerError(f"range {offset}+{length} is outside the chunk's {source.length} bytes")
        await wire.send_msg(stream, {"ok": True, "len": length})
        await wire.send_file(stream, source.fd, source.offset + offset, length)


_Handler = Callable[[_Context, trio.SocketStream, dict], Awaitable[None]]
_OPS: dict[str, tuple[_Handler, bool]] = {  # op -> (handler, carries a body)
    "info": (_info, False),
    "have": (_have, False),
    "put_chunk": (_put_chunk, True),
    "put_manifest": (_put_manifest, True),
    "list": (_list, False),
    "get_manifest": (_get_manifest, False),
    "get_chunk": (_get_chunk, False),
}


def _hash(request: dict) -> str:
    h = request.get("hash")
    if not is_hash(h):
        raise ProtocolError(f"{h!r} is not a chunk hash")
    return h


def _count(request: dict, key: str, default: int | None = None) -> int:
    value = request.get(key, default)
    if not wire.is_count(value):
        raise ProtocolError(f"invalid {key} {value!r}")
    return value


async def _try_answer(stream: trio.SocketStream, answer: dict, timeout: float) -> None:
    """A last word before closing; a peer that does not take it within ``timeout`` does without."""
    with trio.move_on_after(timeout):
        try:
            await wire.send_msg(stream, answer)
        except PeerUnavailable:
            pass
