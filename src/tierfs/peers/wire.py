"""The peer wire: length-prefixed JSON headers, raw bodies, and the mutual handshake.

A message is a 4-byte big-endian length, that many bytes of a UTF-8 JSON object (the
header), then, only when the header has a ``"len"`` key, exactly that many body bytes.
Headers are small and parsed whole; bodies can be large and are never parsed here: the
receiver decides where they go (a file, a hash, a bounded buffer) and reads them in
pieces of at most :data:`PIECE` bytes, so a transfer holds a piece or two in memory,
whatever its size.

Everything read from the other side is bounded before it is used: a header's length is
checked before a byte of it is read, a header nesting lists or objects deeper than
:data:`MAX_DEPTH` is refused, and a body's announced length reserves at most
:data:`BODY_RESERVE` bytes until the bytes actually arrive.

The stream is a plain ``trio.SocketStream``, a :class:`tierfs.peers.tls.TLSStream` (during
the handshake) or a :class:`tierfs.peers.sealed.SealedStream`; all receive straight into
buffers. Chunk bodies, the bulk of the traffic, go through :mod:`tierfs.peers.bodies`.

Every function here raises :class:`PeerUnavailable` when the connection breaks or ends
mid-message and :class:`ProtocolError` when the other side breaks the protocol. None of them
sets a deadline: the request is the unit a timeout makes sense for, so callers wrap whole
requests in ``trio.fail_after``. Every loop has a checkpoint, so cancellation is prompt.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing's own from Python 3.13

from tierfs.core import bounded_json, keys
from tierfs.core.chunks import MAX_CHUNK_SIZE
from tierfs.core.manifest import MAX_BYTES as MAX_MANIFEST_BYTES

VERSION = 3  # the newest this build speaks. 2: after TLS, sealed records (tierfs.peers.sealed); 3: put_chunks
OLDEST = 3  # the oldest it still speaks: a job's nodes are upgraded one at a time
MAX_HEADER = 1 << 20  # an authenticated peer's header
HELLO_MAX_HEADER = 4096  # before authentication: a stranger gets no big allocation
PIECE = 1 << 20  # the most body bytes held in memory at once
MAX_CHUNK = MAX_CHUNK_SIZE  # a chunk body: no chunk is larger than the largest --chunk-size
MAX_MANIFEST = MAX_MANIFEST_BYTES  # a manifest body
MAX_BATCH = 256  # chunks per put_chunks request
MAX_BATCH_BYTES = MAX_CHUNK  # their bodies together: the request's deadline allows for one largest chunk
MAX_HAVE = 100_000  # hashes per "have" request (the header limit binds first, near 29 000)
HAVE_BATCH = 25_000  # hashes a client asks about per request: 875 kB, inside MAX_HEADER
MAX_DEPTH = 8  # lists and objects inside one another in a header; coord_decide's answer nests 5
BODY_RESERVE = 4 << 20  # memory a body's announced length gets before its bytes arrive

_LENGTH = struct.Struct(">I")
_TLS_RECORDS = {0x14, 0x15, 0x16, 0x17}  # a TLS record starts with its type, then major version 3
_NONCE_RE = re.compile(r"[0-9a-f]{32}")
_PROOF_RE = re.compile(r"[0-9a-f]{64}")


class PeerError(Exception):
    """The peer refused a request, or broke the protocol."""


class PeerUnavailable(PeerError):
    """The peer cannot be reached or went away: refused, reset, timed out, or closed mid-message."""


class PeerRefused(PeerUnavailable):
    """Nothing listens at the peer's address (yet): its daemon is down or still starting."""


class ProtocolError(PeerError):
    """The other side broke the protocol: the connection is out of step and must be closed."""


class AuthFailed(PeerError):
    """The handshake failed: wrong secret or wrong job (deliberately indistinguishable)."""


class NoSpace(PeerError):
    """The peer's RAM tier has no room for what was offered."""

    def __init__(self, message: str = "no space"):
        super().__init__(message)


# -- framing ------------------------------------------------------------------------------


def encode_header(header: dict[str, Any]) -> bytes:
    """A header as it goes on the wire, length prefix included."""
    data = json.dumps(header, separators=(",", ":")).encode()
    if len(data) > MAX_HEADER:
        raise ValueError(f"header of {len(data)} bytes exceeds the {MAX_HEADER}-byte limit")
    return _LENGTH.pack(len(data)) + data


async def send_msg(stream: trio.abc.SendStream, header: dict[str, Any], body: bytes | bytearray = b"") -> int:
    """Send one message; a non-empty ``body`` sets ``"len"``. Returns the bytes sent."""
    if body:
        header = {**header, "len": len(body)}
    frame = encode_header(header)
    try:
        if len(body) <= PIECE:  # one write, one segment train
            await stream.send_all(frame + body)
        else:  # a big manifest is not copied again just to prepend a few bytes
            await stream.send_all(frame)
            await stream.send_all(body)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
        raise PeerUnavailable(f"connection lost while sending: {reason(e)}") from None
    return len(frame) + len(body)


async def recv_msg(stream: trio.abc.ReceiveStream, limit: int = MAX_HEADER) -> dict[str, Any]:
    """Receive one header (not its body), refusing one longer than ``limit`` bytes unread.

    A clean end of stream before the first byte is still :class:`PeerUnavailable`: to a
    caller waiting for an answer, a peer that hung up is a peer that is gone.
    """
    prefix = await _recv_exactly(stream, _LENGTH.size, at_boundary=True)
    (n,) = _LENGTH.unpack(prefix)
    if n > limit:
        if prefix[0] in _TLS_RECORDS and prefix[1] == 3:  # as a length, over 300 MB: never a header
            raise ProtocolError(
                "the other side speaks TLS and this node does not: every node of a job needs the same --peer-tls"
            )
        raise ProtocolError(f"header of {n} bytes exceeds the {limit}-byte limit")
    raw = await _recv_exactly(stream, n, at_boundary=False)
    header = parse_json(raw, "header")
    if not isinstance(header, dict):
        raise ProtocolError("header is not a JSON object")
    if "len" in header and not is_count(header["len"]):
        raise ProtocolError(f"header has an invalid body length {brief(header['len'])}")
    return header


def parse_json(raw: bytes, what: str, max_depth: int = MAX_DEPTH) -> Any:
    """``raw`` as JSON; :class:`ProtocolError` if it is not, or nests deeper than ``max_depth``.

    The caller has already bounded ``raw``'s size.
    """
    try:
        return bounded_json.load(raw, max_depth)
    except bounded_json.TooDeep as e:
        raise ProtocolError(f"{what} {e}") from None
    except ValueError:  # UnicodeDecodeError is a ValueError too
        raise ProtocolError(f"{what} is not valid UTF-8 JSON") from None


def brief(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: what a peer sent, quoted in one short line."""
    return clip(repr(value), limit)


def clip(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters, on one line."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def body_length(header: dict[str, Any]) -> int:
    """The number of body bytes that follow ``header`` (0 when there is no body)."""
    n: int = header.get("len", 0)  # a count: recv_msg checked it as the header arrived
    return n


def is_count(value: object) -> bool:
    """A non-negative JSON integer (``true`` is not 1 here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


async def recv_body(stream: trio.abc.ReceiveStream, n: int, max_n: int) -> bytes:
    """A body as bytes (a manifest, a chunk range), refusing more than ``max_n`` unread.

    Received straight into a buffer (asking the socket for "up to what is left" would
    allocate that much on every call). The buffer starts at ``n`` bytes up to
    :data:`BODY_RESERVE` and doubles as bytes arrive, so a peer that announces 64 MiB and
    sends nothing holds 4 MiB here, not 64.
    """
    if n > max_n:
        raise ProtocolError(f"body of {n} bytes exceeds the {max_n}-byte limit")
    buf = bytearray(min(n, BODY_RESERVE))
    done = 0
    while done < n:
        if done == len(buf):
            buf.extend(bytes(min(len(buf), n - len(buf))))
        with memoryview(buf) as view:
            done += await recv_into(stream, view[done : min(done + PIECE, len(buf))])
    if n == 0:
        await trio.lowlevel.checkpoint()
    return bytes(buf)


async def _recv_exactly(stream: trio.abc.ReceiveStream, n: int, *, at_boundary: bool) -> bytes:
    parts, got = [], 0
    while got < n:
        try:
            data = await stream.receive_some(n - got)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            raise PeerUnavailable(f"connection lost: {reason(e)}") from None
        if not data:
            if at_boundary and got == 0:
                raise PeerUnavailable("connection closed by the peer")
            raise PeerUnavailable(f"connection closed {n - got} bytes into a message")
        parts.append(data)
        got += len(data)
    return b"".join(parts)


async def recv_into(stream: trio.abc.ReceiveStream, view: memoryview) -> int:
    """Fill some of ``view``; socket and TLS streams receive straight into it (no allocation)."""
    try:
        if isinstance(stream, trio.SocketStream):
            got = await stream.socket.recv_into(view)
        elif hasattr(stream, "receive_into"):  # tls.TLSStream
            got = await stream.receive_into(view)
        else:
            data = await stream.receive_some(len(view))
            got = len(data)
            view[:got] = data
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
        raise PeerUnavailable(f"connection lost mid-body: {reason(e)}") from None
    if not got:
        raise PeerUnavailable("connection closed mid-body")
    return got


def abort(stream: trio.abc.Stream) -> None:
    """Close ``stream``'s connection at once (synchronous: also right under cancellation)."""
    if isinstance(stream, trio.SocketStream):
        stream.socket.close()
    elif hasattr(stream, "abort"):  # tls.TLSStream
        stream.abort()


def reason(e: BaseException) -> str:
    cause = e.__cause__ if isinstance(e, trio.BrokenResourceError) and e.__cause__ else e
    return getattr(cause, "strerror", None) or str(cause) or type(cause).__name__


# -- authentication -----------------------------------------------------------------------


@dataclass(frozen=True)
class Nonces:
    """The two fresh nonces of one connection's handshake: inside TLS, they key its records;
    and the protocol version both sides chose."""

    client: str
    server: str
    version: int = VERSION


def choose_version(hello: dict[str, Any], speaks: tuple[int, int] | None = None) -> int | None:
    """The newest version both sides speak, from a hello's ``version`` (what it asks for) and
    ``versions`` (the range it speaks; a peer before negotiation sends only ``version``)."""
    oldest, newest = speaks or (OLDEST, VERSION)
    asked = hello.get("version")
    offered = hello.get("versions")
    if (
        isinstance(offered, list)
        and len(offered) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in offered)
    ):
        low: int = max(offered[0], oldest)  # both ints: checked just above
        high: int = min(offered[1], newest)
        if low <= high:
            return high
    if isinstance(asked, int) and not isinstance(asked, bool) and oldest <= asked <= newest:
        return asked
    return None


def new_nonce() -> str:
    """128 random bits as 32 hex digits: never repeats, so no proof is ever valid twice."""
    return secrets.token_hex(16)


def proof(secret: bytes, role: str, job: str, client_nonce: str, server_nonce: str) -> str:
    """HMAC-SHA256(handshake key, role|job|client_nonce|server_nonce) in hex.

    The key is the job's handshake key (:func:`tierfs.core.keys.derive`), not the secret: a
    stranger's connection gets the server's proof, and testing a guess of the secret
    against it must cost the scrypt stretch, not one HMAC. The role (``server`` or
    ``client``) keeps one side's proof from ever serving as the other's, so a proof cannot
    be reflected back at its sender. Nonces have a fixed length, so the message is
    unambiguous even if a job name contained ``|``.
    """
    message = b"|".join((role.encode(), job.encode(), client_nonce.encode(), server_nonce.encode()))
    return hmac.new(keys.derive(job, secret).handshake, message, hashlib.sha256).hexdigest()


async def client_handshake(stream: trio.abc.Stream, *, job: str, secret: bytes) -> Nonces:
    """Prove to the server that we hold the job's secret, after it proves the same to us; the nonces.

    Raises :class:`AuthFailed` if the server cannot prove it (wrong secret or wrong job:
    which of the two is not knowable, by design) or refuses our proof.
    """
    client_nonce = new_nonce()
    # ``version`` alone is what a peer from before the negotiation reads; ``versions`` the range.
    await send_msg(
        stream, {"op": "hello", "version": VERSION, "versions": [OLDEST, VERSION], "job": job, "nonce": client_nonce}
    )
    challenge = await recv_msg(stream, HELLO_MAX_HEADER)
    if "error" in challenge:
        raise AuthFailed(f"peer refused the handshake: {challenge['error']}")
    server_nonce, server_proof = challenge.get("nonce"), challenge.get("proof")
    if challenge.get("op") != "challenge" or not _valid(server_nonce, _NONCE_RE) or not _valid(server_proof, _PROOF_RE):
        raise ProtocolError("peer answered the hello with something other than a challenge")
    version = challenge.get("version", VERSION)  # a peer from before the negotiation names none
    if not isinstance(version, int) or isinstance(version, bool) or not OLDEST <= version <= VERSION:
        raise ProtocolError(f"peer chose protocol version {brief(version)}, not one of {OLDEST}..{VERSION}")
    expected = proof(secret, "server", job, client_nonce, server_nonce)
    if not hmac.compare_digest(expected, server_proof):
        raise AuthFailed(f"peer could not prove it holds the secret of job {job!r}")
    await send_msg(stream, {"op": "auth", "proof": proof(secret, "client", job, client_nonce, server_nonce)})
    answer = await recv_msg(stream, HELLO_MAX_HEADER)
    if answer.get("ok") is not True:
        raise AuthFailed(f"peer refused our proof: {answer.get('error', 'no reason given')}")
    return Nonces(client_nonce, server_nonce, version)


async def authenticate(stream: trio.abc.Stream, *, job: str, secret: bytes) -> Nonces:
    """Server side of the handshake: the nonces when the peer is in, else :class:`AuthFailed` saying why.

    The refusal has already been sent when this raises; the caller closes the connection.
    Only the two small handshake headers are ever read: a body an unauthenticated peer
    sends along is never read, let alone stored. A wrong secret and a
    wrong job get the same answer, so a stranger learns nothing about either.
    """
    hello = await recv_msg(stream, HELLO_MAX_HEADER)
    if hello.get("op") != "hello":
        await send_msg(stream, {"error": "authentication required"})
        raise AuthFailed(f"{brief(hello.get('op'))} before authenticating")
    version = choose_version(hello)
    if version is None:
        await send_msg(
            stream,
            {
                "error": f"unsupported protocol version {brief(hello.get('version'))}: "
                f"this peer speaks {OLDEST}..{VERSION}"
            },
        )
        raise AuthFailed(f"protocol version {brief(hello.get('version'))}")
    client_nonce = hello.get("nonce")
    if not isinstance(hello.get("job"), str) or not _valid(client_nonce, _NONCE_RE):
        await send_msg(stream, {"error": "malformed hello"})
        raise AuthFailed("malformed hello")
    server_nonce = new_nonce()
    await send_msg(
        stream,
        {
            "op": "challenge",
            "nonce": server_nonce,
            "version": version,
            "proof": proof(secret, "server", job, client_nonce, server_nonce),
        },
    )
    auth = await recv_msg(stream, HELLO_MAX_HEADER)
    expected = proof(secret, "client", job, client_nonce, server_nonce)
    client_proof = auth.get("proof")
    if (
        auth.get("op") != "auth"
        or not _valid(client_proof, _PROOF_RE)
        or not hmac.compare_digest(expected, client_proof)
    ):
        await send_msg(stream, {"error": "authentication failed"})
        raise AuthFailed(f"authentication failed (peer claims job {brief(hello['job'])})")
    await send_msg(stream, {"ok": True})
    return Nonces(client_nonce, server_nonce, version)


def _valid(value: object, pattern: re.Pattern[str]) -> TypeIs[str]:
    return isinstance(value, str) and pattern.fullmatch(value) is not None
