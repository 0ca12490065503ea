"""A connection to one peer's service: put replicas there, fetch them back.

Every call runs under one deadline (``timeout``): a peer that is slow, down, or gone
mid-transfer raises :class:`PeerUnavailable` in bounded time, never hangs the caller. A
refusal (:class:`PeerError`, e.g. :class:`NoSpace`) leaves the connection usable. Anything
that leaves it out of step (a timeout, a cancellation, a broken message) closes it, and
every later call raises :class:`PeerUnavailable`: reconnect to go on.

One request at a time per client; open several clients for parallel transfers. With
``tls`` the connection is TLS 1.3 first (:mod:`tierfs.peers.tls`), then authenticated
with the job's secret inside it, as in clear, then sealed records keyed from that
handshake (:mod:`tierfs.peers.sealed`).
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import trio
import xxhash

from tierfs.coordination.transport import BadMessage
from tierfs.core.manifest import MAX_DEPTH as MAX_MANIFEST_DEPTH
from tierfs.core.manifest import split_seal
from tierfs.peers import answers, bodies, wire
from tierfs.peers.answers import MalformedAnswer
from tierfs.peers.bodies import chunk_label
from tierfs.peers.sealed import seal
from tierfs.peers.tls import PeerTLS, TLSStream
from tierfs.peers.wire import (
    HAVE_BATCH,
    MAX_BATCH,
    MAX_BATCH_BYTES,
    MAX_CHUNK,
    MAX_MANIFEST,
    NoSpace,
    PeerError,
    PeerRefused,
    PeerUnavailable,
    ProtocolError,
)

T = TypeVar("T")


class PeerClient:
    def __init__(self, stream: trio.abc.Stream, address: tuple[str, int], timeout: float):
        """Use :meth:`connect`: a client is born authenticated."""
        self.address = address
        self.timeout = timeout
        self.bytes_sent = 0  # everything written to the socket, headers included
        self.bytes_received = 0  # body bytes received
        self._stream = stream
        self._broken: str | None = None

    @classmethod
    async def connect(
        cls,
        address: tuple[str, int],
        *,
        job: str,
        secret: bytes | None,
        tls: PeerTLS | None,
        timeout: float = 10.0,
        local_host: str | None = None,
    ) -> PeerClient:
        """Connect to ``address``, run TLS (unless ``tls`` is None) and authenticate, all within ``timeout``.

        ``local_host`` binds the source address (several nodes on one machine use distinct
        loopback addresses, as distinct machines would).
        """
        if not secret:
            raise ValueError("connecting to a peer needs the job's secret")
        name = _name(address)
        try:
            with trio.fail_after(timeout):
                tcp = await trio.open_tcp_stream(*address, local_address=local_host)
                stream: trio.abc.Stream = tcp
                try:
                    in_tls: TLSStream | None = None
                    if tls is not None:
                        stream = in_tls = await TLSStream.handshake(tcp, tls, server_side=False)
                    nonces = await wire.client_handshake(stream, job=job, secret=secret)
                    if in_tls is not None:
                        stream = await seal(in_tls, job, secret, nonces, server_side=False)
                except BaseException:
                    wire.abort(stream)
                    raise
        except trio.TooSlowError:
            raise PeerUnavailable(f"peer {name} did not connect and authenticate within {timeout:g}s") from None
        except OSError as e:
            if _refused(e):
                raise PeerRefused(f"cannot connect to peer {name}: connection refused") from None
            raise PeerUnavailable(f"cannot connect to peer {name}: {e.strerror or e}") from None
        except PeerError as e:
            raise type(e)(f"peer {name}: {e}") from None
        return cls(stream, address, timeout)

    @property
    def usable(self) -> bool:
        """Still in step with the peer: a refusal leaves it so, a timeout or broken message does not."""
        return self._broken is None

    async def aclose(self) -> None:
        self._broken = self._broken or "closed"
        await trio.aclose_forcefully(self._stream)

    async def __aenter__(self) -> PeerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"PeerClient({_name(self.address)})"

    # -- requests ------------------------------------------------------------------------

    async def info(self, nodes: int | None = None) -> dict[str, Any]:
        """What the peer says about itself (rank, topology, free bytes...), checked (:func:`answers.info`).

        Its rank must be one of the job's ``nodes`` (if given). A malformed answer raises
        :class:`MalformedAnswer`; the connection is still in step.
        """
        with self._request("info"):
            reply = await self._call({"op": "info"})
        self._check(reply)
        return self._parse("info", answers.info, reply, nodes)

    async def have(self, hashes: Sequence[str]) -> list[bool]:
        """For each hash: does the peer hold that chunk (or can it make it locally)?"""
        out: list[bool] = []
        for start in range(0, len(hashes), HAVE_BATCH):
            batch = list(hashes[start : start + HAVE_BATCH])
            with self._request("have"):
                reply = await self._call({"op": "have", "hashes": batch})
                answer = reply.get("have")
                # Checked unless a refusal, as _check tells one: {"error": null} is none.
                if reply.get("error") is None and (not isinstance(answer, list) or len(answer) != len(batch)):
                    raise ProtocolError("have: the answer does not match the question")
            self._check(reply)
            # A list as long as the batch: checked above, as any answer that is not a refusal (raised just now).
            out.extend(bool(x) for x in cast(builtins.list[object], answer))
        return out

    async def put_chunk(self, h: str, path: str | os.PathLike[str], offset: int, length: int) -> None:
        """Send chunk ``h``: ``length`` bytes of ``path`` from ``offset``, straight from the page cache.

        The peer hashes what it receives and refuses a mismatch (:class:`PeerError`) or a
        chunk it has no room for (:class:`NoSpace`).
        """
        if not 0 <= length <= MAX_CHUNK:
            raise ValueError(f"chunk of {length} bytes: at most {MAX_CHUNK}")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            with self._request("put_chunk"):
                await self._send({"op": "put_chunk", "hash": h, "len": length})
                self.bytes_sent += await bodies.send_file(self._stream, fd, offset, length, chunk_label(h, 0))
                reply = await wire.recv_msg(self._stream)
        finally:
            os.close(fd)
        self._check(reply)

    async def put_chunks(self, chunks: Sequence[tuple[str, str | os.PathLike[str], int, int]]) -> None:
        """Send several chunks ``(h, path, offset, length)`` in one request, their bodies back to back.

        One round trip and one worker thread for the lot: a step of many small files costs
        the requests of a few large ones. The peer stores each chunk that hashes right and
        has room, then refuses the request if any did not (:class:`NoSpace` if one had no
        room): the caller puts what is missing again, or gives up.
        """
        total = _check_batch([length for _, _, _, length in chunks])
        fds: dict[str, int] = {}
        try:
            for _, path, _, _ in chunks:
                if os.fspath(path) not in fds:
                    fds[os.fspath(path)] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            parts = [(fds[os.fspath(path)], offset, length, chunk_label(h, 0)) for h, path, offset, length in chunks]
            with self._request("put_chunks"):
                await self._send(
                    {"op": "put_chunks", "chunks": [[h, length] for h, _, _, length in chunks], "len": total}
                )
                self.bytes_sent += await bodies.send_files(self._stream, parts)
                reply = await wire.recv_msg(self._stream)
        finally:
            for fd in fds.values():
                os.close(fd)
        self._check(reply)

    async def put_manifest(self, rank: int, step: int, data: bytes) -> None:
        """Commit the replica; the peer refuses it while any chunk it names is missing."""
        if len(data) > MAX_MANIFEST:
            raise ValueError(f"manifest of {len(data)} bytes: at most {MAX_MANIFEST}")
        with self._request("put_manifest"):
            reply = await self._call({"op": "put_manifest", "rank": rank, "step": step}, data)
        self._check(reply)

    async def list(self, nodes: int | None = None) -> list[tuple[int, int]]:
        """The (rank, step) of every manifest the peer holds (for a rank of the job's ``nodes``, if given), checked."""
        with self._request("list"):
            reply = await self._call({"op": "list"})
        self._check(reply)
        return self._parse("list", answers.listing, reply, nodes)

    async def get_manifest(self, rank: int, step: int) -> bytes:
        """The manifest's bytes, checked to be JSON of a sane depth (the caller parses it)."""
        with self._request("get_manifest"):
            reply = await self._call({"op": "get_manifest", "rank": rank, "step": step})
            data = await self._body(reply, MAX_MANIFEST)
        self._check(reply)
        try:
            wire.parse_json(split_seal(data)[0], "manifest", MAX_MANIFEST_DEPTH)
        except ProtocolError as e:
            raise PeerError(f"peer {_name(self.address)}: get_manifest: {e}") from None
        return data

    async def get_chunk(self, h: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes ``offset`` to ``offset + length`` of chunk ``h`` (to its end without ``length``).

        The peer verified the whole chunk before sending; the bytes in transit are the
        caller's to check, or use :meth:`fetch_chunk`.
        """
        return await self._get_chunk(
            h, offset, length, lambda n, label: bodies.receive_bytes(self._stream, n, None, label)
        )

    async def fetch_chunk(self, h: str, length: int) -> bytes:
        """The whole ``length``-byte chunk ``h``, hashed as it arrives.

        Bytes that are not it raise :class:`PeerError`.
        """
        hasher = xxhash.xxh3_128()
        data = await self._get_chunk(
            h, 0, length, lambda n, label: bodies.receive_bytes(self._stream, n, hasher, label)
        )
        self._check_hash(hasher, h)
        return data

    async def get_chunk_into(self, h: str, fd: int, file_offset: int, length: int | None = None) -> int:
        """Receive the whole chunk ``h`` (of ``length`` bytes, if given) into ``fd`` at ``file_offset``; its length.

        Written in pieces of at most 1 MiB as they arrive, hashed on the way; a chunk that
        does not match ``h`` raises :class:`PeerError` (its bytes are already in the file:
        the caller overwrites them from another source or discards the file).
        """
        hasher = xxhash.xxh3_128()

        async def receive(n: int, label: bytes) -> int:
            await bodies.receive_into_file(self._stream, n, fd, hasher, file_offset, label)
            return n

        n = await self._get_chunk(h, 0, length, receive)
        self._check_hash(hasher, h)
        return n

    async def get_chunks_into(self, chunks: Sequence[tuple[str, int, int, int]]) -> builtins.list[bool]:
        """Whole chunks ``(h, length, fd, offset)`` in one request; for each, whether the peer had it.

        Each chunk that comes is written into its ``fd`` at its ``offset`` as it arrives and
        hashed on the way, all in one worker thread. Bytes that are not the chunk they were
        sent as raise :class:`PeerError` once every body is read; any chunk's bytes may then
        be in its file already, as with :meth:`get_chunk_into`.
        """
        _check_batch([length for _, length, _, _ in chunks])
        hashers = [xxhash.xxh3_128() for _ in chunks]
        with self._request("get_chunks"):
            reply = await self._call({"op": "get_chunks", "chunks": [[h, length] for h, length, _, _ in chunks]})
            n, held = self._body_length(reply), reply.get("held")
            if reply.get("error") is None:  # not a refusal, as _check tells one
                if not (isinstance(held, list) and len(held) == len(chunks) and all(type(x) is bool for x in held)):
                    raise ProtocolError("get_chunks: the answer does not match the question")
                if n != sum(length for (_, length, _, _), came in zip(chunks, held, strict=True) if came):
                    raise ProtocolError(f"get_chunks: a body of {n} bytes for the chunks it says it holds")
                parts = [
                    (length, bodies.into_file(fd, offset, hasher), chunk_label(h, 0))
                    for (h, length, fd, offset), hasher, came in zip(chunks, hashers, held, strict=True)
                    if came
                ]
                for failure in await bodies.receive_many(self._stream, parts):
                    if failure is not None:
                        raise failure
                self.bytes_received += n
        self._check(reply)
        # One bool per chunk: checked above, as any answer that is not a refusal (raised just now).
        came_each = cast(builtins.list[bool], held)
        for (h, _, _, _), hasher, came in zip(chunks, hashers, came_each, strict=True):
            if came:
                self._check_hash(hasher, h)
        return came_each

    async def _get_chunk(
        self, h: str, offset: int, length: int | None, receive: Callable[[int, bytes], Awaitable[T]]
    ) -> T:
        """A ``get_chunk`` exchange whose body (of its announced length, with its label) ``receive`` takes."""
        request: dict[str, Any] = {"op": "get_chunk", "hash": h, "offset": offset}
        if length is not None:
            request["length"] = length
        with self._request("get_chunk"):
            reply = await self._call(request)
            n = self._body_length(reply)
            if length is not None and "error" not in reply and n != length:
                raise ProtocolError(f"asked for {length} bytes, the answer has {n}")
            out = await receive(n, chunk_label(h, offset))
            self.bytes_received += n
        self._check(reply)
        return out

    def _check_hash(self, hasher: Any, h: str) -> None:
        if hasher.hexdigest() != h:
            raise PeerError(f"peer {_name(self.address)} sent bytes that do not hash to chunk {h}")

    async def call(self, header: dict[str, Any], timeout: float) -> dict[str, Any]:
        """A request of one JSON header answered by one, within ``timeout`` (coordination's long polls).

        The answer is returned as it came, refusals (``{"error": ...}``) included; one
        with a body breaks the protocol.
        """
        with self._request(str(header.get("op")), timeout):
            reply = await self._call(header)
            if "len" in reply:
                raise ProtocolError(f"{wire.brief(header.get('op'))}: an answer with a body")
        return reply

    async def stripe_call(
        self, header: dict[str, Any], body: bytes = b"", max_answer: int = 0, timeout: float | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """An erasure-coding request (:mod:`tierfs.store.stripe_service`): a header and a body each
        way, the answer's body refused unread beyond ``max_answer`` bytes, all within ``timeout``
        (None: the client's). A refusal raises :class:`PeerError`; the connection is still in step."""
        with self._request(str(header.get("op")), timeout):
            reply = await self._call(header, body)
            data = await self._body(reply, max_answer)
        self._check(reply)
        return reply, data

    # -- plumbing ------------------------------------------------------------------------

    @contextmanager
    def _request(self, op: str, timeout: float | None = None) -> Iterator[None]:
        """One exchange under the deadline; anything but a clean finish closes the connection."""
        if self._broken is not None:
            raise PeerUnavailable(f"peer {_name(self.address)}: connection unusable ({self._broken})")
        timeout = self.timeout if timeout is None else timeout
        finished = False
        try:
            with trio.fail_after(timeout):
                yield
            finished = True
        except trio.TooSlowError:
            self._broken = "timed out"
            raise PeerUnavailable(f"peer {_name(self.address)}: {op} got no answer within {timeout:g}s") from None
        except PeerUnavailable as e:
            raise PeerUnavailable(f"peer {_name(self.address)}: {op}: {e}") from None
        except ProtocolError as e:
            raise ProtocolError(f"peer {_name(self.address)}: {op}: {e}") from None
        finally:
            if not finished:
                self._broken = self._broken or f"{op} did not finish"
                wire.abort(self._stream)  # synchronous: also right under cancellation

    async def _send(self, header: dict[str, Any], body: bytes = b"") -> None:
        self.bytes_sent += await wire.send_msg(self._stream, header, body)

    async def _call(self, header: dict[str, Any], body: bytes = b"") -> dict[str, Any]:
        await self._send(header, body)
        return await wire.recv_msg(self._stream)

    @staticmethod
    def _body_length(reply: dict[str, Any]) -> int:
        """A chunk answer's body length, refused before a byte of it is read if no chunk can be that long."""
        n = wire.body_length(reply)
        if "error" in reply and "len" in reply:
            raise ProtocolError("an error answer with a body")
        if n > MAX_CHUNK:
            raise ProtocolError(f"chunk of {n} bytes exceeds the {MAX_CHUNK}-byte limit")
        return n

    async def _body(self, reply: dict[str, Any], max_n: int) -> bytes:
        if "error" in reply:
            if "len" in reply:
                raise ProtocolError("an error answer with a body")
            return b""
        data = await wire.recv_body(self._stream, wire.body_length(reply), max_n)
        self.bytes_received += len(data)
        return data

    def _parse(
        self, op: str, parse: Callable[[dict[str, Any], int | None], T], reply: dict[str, Any], nodes: int | None
    ) -> T:
        """The answer checked by ``parse``; a malformed one was read whole, so the connection stays in step."""
        try:
            return parse(reply, nodes)
        except BadMessage as e:
            raise MalformedAnswer(f"peer {_name(self.address)} sent a malformed {op} answer: {e}") from None

    def _check(self, reply: dict[str, Any]) -> None:
        """Raise the peer's refusal; the connection is still in step."""
        error = reply.get("error")
        if error is None and reply.get("ok") is True:
            return
        if error is None:
            self._broken = "malformed answer"
            raise ProtocolError(f"peer {_name(self.address)}: answer is neither ok nor an error")
        message = f"peer {_name(self.address)}: {error}"
        raise NoSpace(message) if error == "no space" else PeerError(message)


def _check_batch(lengths: list[int]) -> int:
    """Refuse, before a byte goes out, chunks no peer takes in one request; their bytes in all."""
    if not 0 < len(lengths) <= MAX_BATCH:
        raise ValueError(f"{len(lengths)} chunks in one request: 1 to {MAX_BATCH}")
    if any(not 0 <= length <= MAX_CHUNK for length in lengths):
        raise ValueError(f"a chunk of more than {MAX_CHUNK} bytes")
    if (total := sum(lengths)) > MAX_BATCH_BYTES:
        raise ValueError(f"{total} bytes of chunks in one request: at most {MAX_BATCH_BYTES}")
    return total


def _refused(e: OSError) -> bool:
    """Whether every attempt of a connect was refused (trio groups them under its own OSError)."""
    cause = e.__cause__
    if isinstance(cause, BaseExceptionGroup):
        return all(isinstance(x, ConnectionRefusedError) for x in cause.exceptions)
    return isinstance(e, ConnectionRefusedError)


def _name(address: tuple[str, int]) -> str:
    return f"{address[0]}:{address[1]}"
