"""The requests of an authenticated peer: what each op does with the replica store.

Apart from the service (:mod:`tierfs.store.server`), which owns the connections (accept,
handshake, deadlines, what a failure costs), because a handler sees one request and the
store, never the life of a connection. A handler reads its request's body to the end
before it refuses, so a refusal (:class:`~tierfs.peers.wire.PeerError`) is answered and the
connection carries on; after a :class:`~tierfs.peers.wire.ProtocolError` it ends, since
where the next message starts is no longer known.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from tierfs.peers import bodies, wire
from tierfs.peers.bodies import chunk_label
from tierfs.peers.wire import (
    MAX_BATCH,
    MAX_BATCH_BYTES,
    MAX_CHUNK,
    MAX_HAVE,
    MAX_MANIFEST,
    NoSpace,
    PeerError,
    PeerUnavailable,
    ProtocolError,
)
from tierfs.store import stripe_service
from tierfs.store.chunkfiles import ChunkWriter, is_hash
from tierfs.store.erasure_member import ErasureMember
from tierfs.store.replicas import MissingChunks, ReplicaStore

log = logging.getLogger("tierfs.store.server")  # the peer service's log, as its lines always were

_RESERVED = frozenset({"ok", "error", "len"})
MESSAGE_OPS = frozenset({"coord_report", "coord_decide", "coord_pull", "await_chunk"})  # to ``messages``

Request = dict[str, Any]  # a request's header, parsed JSON: each handler checks the fields it reads
Messages = Callable[[str, Request], Awaitable[dict[str, Any]]]  # (the sender's listen address, request) -> answer


class Say(Protocol):
    """A log that may drop lines (:class:`tierfs.store.server.RateLimitedLog`)."""

    def __call__(self, level: int, message: str, *args: object) -> None: ...


@dataclass(frozen=True)
class Requests:
    """What the requests of every connection act on."""

    store: ReplicaStore
    info: Callable[[], dict[str, Any]]  # the node's ``info`` answer, without the keys ok, error and len
    messages: Messages | None  # answers the coordination requests (MESSAGE_OPS)
    say: Say  # lines about peers, rate-limited
    erasure: ErasureMember | None = None  # answers the erasure group's requests (stripe_service.OPS)


async def dispatch(ctx: Requests, stream: trio.abc.Stream, request: Request, peer: str) -> None:
    """Answer one request; raises :class:`ProtocolError` when the connection cannot go on."""
    op = request.get("op")
    if op in MESSAGE_OPS:
        await _message(ctx, stream, request, peer)
        return
    entry: tuple[_Handler, bool | None] | None = (_stripes, None)  # a body or none: the handler reads it
    if op not in stripe_service.OPS:
        entry = _OPS.get(op) if isinstance(op, str) else None
    if entry is None:
        if wire.body_length(request):
            raise ProtocolError(f"unknown op {wire.brief(op)} with a body")
        await wire.send_msg(stream, {"error": f"unknown op {wire.brief(op)}"})
        return
    handler, has_body = entry
    if has_body is not None and has_body != ("len" in request):
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


async def _info(ctx: Requests, stream: trio.abc.Stream, request: Request) -> None:
    info = dict(ctx.info())
    if clash := info.keys() & _RESERVED:
        raise RuntimeError(f"info() returned reserved keys {sorted(clash)}")
    await wire.send_msg(stream, {**info, "ok": True})


async def _have(ctx: Requests, stream: trio.abc.Stream, request: Request) -> None:
    hashes = request.get("hashes")
    if not isinstance(hashes, list) or len(hashes) > MAX_HAVE or not all(isinstance(h, str) for h in hashes):
        raise ProtocolError(f"have needs a list of at most {MAX_HAVE} hashes")
    have = [ctx.store.has(h) for h in hashes]
    for h, held in zip(hashes, have, strict=True):
        if held:
            ctx.store.hold_for(stream, h)
    await wire.send_msg(stream, {"ok": True, "have": have})


async def _put_chunk(ctx: Requests, stream: trio.abc.Stream, request: Request) -> None:
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


async def _put_chunks(ctx: Requests, stream: trio.abc.Stream, request: Request) -> None:
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
            stream,
            [(n, w.write if w else _discard, chunk_label(h, 0)) for (h, n), w in zip(chunks, writers, strict=True)],
        )
        for (h, _), writer, failure in zip(chunks, writers, failures, strict=True):
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


async def _put_manifest(ctx: Requests, stream: trio.abc.Stream, request: Request) -> None:
    rank, step = _count(request, "rank"), _count(request, "step")
    data = await wire.recv_body(stream, request["len"], MAX_MANIFEST)
    await ctx.store.put_manifest(rank, step, data)
    await wire.send_msg(stream, {"ok": True})


async def _list(ctx: Requests, stream: trio.abc.Stream, request: Request) -> None:
    held = ctx.store.manifests() + (ctx.erasure.claims() if ctx.erasure is not None else [])
    await wire.send_msg(stream, {"ok": True, "manifests": [list(m) for m in held]})


async def _get_manifest(ctx: Requests, stream: trio.abc.Stream, request: Request) -> None:
    data = ctx.store.get_manifest(_count(request, "rank"), _count(request, "step"))
    await wire.send_msg(stream, {"ok": True, "len": len(data)}, data)


async def _get_chunk(ctx: Requests, stream: trio.abc.Stream, request: Request) -> None:
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


async def _get_chunks(ctx: Requests, stream: trio.abc.Stream, request: Request) -> None:
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
        parts = [
            (s.fd, s.offset, n, chunk_label(h, 0)) for (h, n), s in zip(chunks, sources, strict=True) if s is not None
        ]
        await wire.send_msg(
            stream, {"ok": True, "held": [s is not None for s in sources], "len": sum(n for _, _, n, _ in parts)}
        )
        await bodies.send_files(stream, parts)


async def _message(ctx: Requests, stream: trio.abc.Stream, request: Request, peer: str) -> None:
    """A coordination request: its answer (a refusal included) is the handler's, one header."""
    if wire.body_length(request):
        raise ProtocolError(f"{request['op']} takes no body")
    sender = request.get("from")
    host = peer.rsplit(":", 1)[0].strip("[]")
    answer: dict[str, Any]
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


async def _stripes(ctx: Requests, stream: trio.abc.Stream, request: Request) -> None:
    """An erasure group's request: its body (a window, a manifest) read whole, bounded, before it is acted on."""
    body = await wire.recv_body(stream, wire.body_length(request), stripe_service.MAX_ANSWER)
    if ctx.erasure is None:
        raise PeerError("this node is in no erasure group (mounted without --erasure)")
    answer, data = await ctx.erasure.handle(request, body)
    await wire.send_msg(stream, answer, data)


_Handler = Callable[[Requests, trio.abc.Stream, Request], Awaitable[None]]
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


def _hash(request: Request) -> str:
    h = request.get("hash")
    if not is_hash(h):
        raise ProtocolError(f"{wire.brief(h)} is not a chunk hash")
    return h


def _batch(request: Request) -> list[tuple[str, int]]:
    """The ``(hash, length)`` pairs of a put_chunks or get_chunks, checked (against the body's length too)."""
    op, chunks = request["op"], request.get("chunks")
    if not isinstance(chunks, list) or not 0 < len(chunks) <= MAX_BATCH:
        raise ProtocolError(f"{op} needs a list of 1 to {MAX_BATCH} chunks")
    pairs: list[tuple[str, int]] = []
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


def _count(request: Request, key: str, default: int | None = None) -> int:
    value = request.get(key, default)
    if not (isinstance(value, int) and wire.is_count(value)):
        raise ProtocolError(f"invalid {key} {wire.brief(value)}")
    return value
