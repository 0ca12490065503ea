"""The peer service: other nodes put replicas here and fetch them back.

One task per connection, at most ``max_connections`` at once: past that, new connections
wait in the kernel's accept queue until a slot frees. A connection first completes TLS (unless
it is off) and the HMAC handshake, both within the handshake deadline, so a stranger holds a
slot for a few seconds at most; then it goes on in sealed records (:mod:`tierfs.peers.sealed`)
and serves requests one at a time, each answered (what each does is
:mod:`tierfs.store.requests`). Every wait has a deadline (:class:`Timeouts`): a peer that
stalls is dropped, never waited for.

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

import errno
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from tierfs.peers import wire
from tierfs.peers.sealed import seal
from tierfs.peers.tls import PeerTLS, TLSStream
from tierfs.peers.wire import AuthFailed, PeerError, PeerUnavailable, ProtocolError
from tierfs.store.erasure_member import ErasureMember
from tierfs.store.replicas import ReplicaStore
from tierfs.store.requests import MESSAGE_OPS as MESSAGE_OPS  # re-exported: tierfs.coordination's docs name it here
from tierfs.store.requests import Messages, Requests, dispatch

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class _Context:
    job: str
    secret: bytes
    timeouts: Timeouts
    tls: PeerTLS | None
    say: RateLimitedLog
    requests: Requests  # what the requests act on (tierfs.store.requests)


async def serve(
    listen: tuple[str, int],
    *,
    job: str,
    secret: bytes,
    store: ReplicaStore,
    info: Callable[[], dict[str, Any]],
    tls: PeerTLS | None,
    timeouts: Timeouts = Timeouts(),
    max_connections: int = MAX_CONNECTIONS,
    messages: Messages | None = None,
    erasure: ErasureMember | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the peer protocol on ``listen`` (host, port; port 0 picks one) until cancelled.

    ``tls`` encrypts every connection (``None``: in clear, for trusted networks only).
    ``task_status.started`` reports the port actually bound. ``info()`` is called for every
    ``info`` request and must return a JSON-able dict without the keys ok, error or len.
    ``messages`` answers the coordination requests (:data:`MESSAGE_OPS`, header only), given
    the sender's listen address, which must be on the host the connection comes from.
    ``erasure`` answers the erasure group's requests (``--erasure``).
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
    say = RateLimitedLog(log)
    ctx = _Context(job, secret, timeouts, tls, say, Requests(store, info, messages, say, erasure))
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
    tls: TLSStream | None = None
    try:
        with trio.move_on_after(ctx.timeouts.handshake) as deadline:
            if ctx.tls is not None:
                await _expect_tls(stream)
                conn = tls = await TLSStream.handshake(stream, ctx.tls, server_side=True)
            nonces = await wire.authenticate(conn, job=ctx.job, secret=ctx.secret)
            if tls is not None:
                conn = await seal(tls, ctx.job, ctx.secret, nonces, server_side=True)
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
        ctx.requests.store.end_session(conn)  # its chunks are now kept only if a manifest names them
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
            await dispatch(ctx.requests, stream, request, peer)
        if scope.cancelled_caught:
            ctx.say(
                logging.WARNING,
                "peer %s: %s took longer than %gs: dropped",
                peer,
                wire.brief(request.get("op")),
                ctx.timeouts.request,
            )
            return


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


async def _try_answer(stream: trio.abc.Stream, answer: dict[str, Any], timeout: float) -> None:
    """A last word before closing; a peer that does not take it within ``timeout`` does without."""
    with trio.move_on_after(timeout):
        try:
            await wire.send_msg(stream, answer)
        except PeerUnavailable:
            pass
