"""Peer traffic after TLS has done its part: AES-256-GCM records of up to 1 MiB.

TLS 1.3 authenticates both ends (the job's certificate, or the operator's CA) and, with its
ephemeral key exchange, carries the HMAC handshake's two fresh nonces in secret. Then both
sides end TLS (``close_notify`` both ways) and go on over the same TCP connection in records
of their own. The reason is speed: through Python's ``ssl`` every 16 KiB TLS record costs a
call and a copy, which halved the peer tier's throughput; here a 1 MiB record is sealed or
opened in one call of a maintained library (``cryptography``), off the event loop.

A record on the wire::

    length (4 bytes, big-endian: plaintext bytes, 1 to RECORD) || ciphertext || tag (16 bytes)

- **Keys**: one per direction and connection, HMAC-SHA256 of the job's channel key
  (:mod:`tierfs.core.keys`) over the direction and both handshake nonces. The nonces never
  travel outside TLS, so an observer cannot derive them, even one who later learns the
  job's secret (TLS's ephemeral exchange gives forward secrecy to what it carried).
- **Nonces**: the count of records already sent in that direction (96 bits, never sent).
  A key is used for one connection only, so a nonce never repeats under it; a replayed,
  reordered, dropped or injected record fails its tag.
- **Associated data**: the length field, and for a body's records the body's label (the
  chunk's hash and where the range starts in it) and the record's offset in the body; so
  a record opens only at the place it was sealed for.
- **Truncation**: every body's length is announced in its header; a connection that ends
  early ends mid-message (:class:`PeerUnavailable`), never a short chunk. A record announcing
  more than :data:`RECORD` bytes is refused before any of it is read.

Any record that fails to open is a :class:`ProtocolError`: the connection is closed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Callable

import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tierfs.core import keys
from tierfs.peers.offload import run_sync
from tierfs.peers.tls import TLSStream
from tierfs.peers.transfer import Recv, Send, Steps
from tierfs.peers.wire import PIECE, Nonces, PeerUnavailable, ProtocolError, reason

RECORD = PIECE  # plaintext bytes per record, at most
TAG = 16
_HEAD = struct.Struct(">I")
_OFFSET = struct.Struct(">Q")
_TO_SERVER, _TO_CLIENT = b"client to server", b"server to client"

Sink = Callable[[memoryview, int], None]  # (plaintext piece, its offset in the body); runs in a thread


def channel_keys(job: str, secret: bytes, nonces: Nonces, *, server_side: bool) -> tuple[bytes, bytes]:
    """This end's (sending, receiving) keys for one connection."""
    root = keys.derive(job, secret).channel
    mixed = (nonces.client + nonces.server).encode()
    to_server, to_client = (
        hmac.new(root, label + mixed, hashlib.sha256).digest() for label in (_TO_SERVER, _TO_CLIENT)
    )
    return (to_client, to_server) if server_side else (to_server, to_client)


class SealedStream(trio.abc.Stream):
    """One connection's records, over the TCP socket TLS was ended on.

    One task at a time sends, and one receives, as the peer protocol does. A send or receive
    cut short leaves the record counts out of step: close the stream.
    """

    def __init__(self, stream: trio.SocketStream, send_key: bytes, receive_key: bytes):
        self._stream = stream
        self._seal, self._open = AESGCM(send_key), AESGCM(receive_key)
        self._sent = self._received = 0  # records, in each direction: the nonces
        self._plain = memoryview(b"")  # opened bytes of the last message record, not yet taken

    @property
    def socket(self) -> trio.socket.SocketType:
        return self._stream.socket

    @property
    def raw(self) -> trio.SocketStream:
        """The TCP stream the records travel on: a body's steps move sealed bytes through it as they are."""
        return self._stream

    # -- messages: headers, manifests, answers --------------------------------------------

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), RECORD):
            piece = view[start : start + RECORD]
            out = bytearray(_HEAD.size + len(piece) + TAG)
            seal = self._sealer(piece, out, b"")
            await run_sync(seal, len(piece))
            await self._send(out)
        if not view:
            await trio.lowlevel.checkpoint()

    async def receive_into(self, view: memoryview) -> int:
        """Fill some of ``view`` from the current message record (the next one if it is used up); 0 at the end."""
        if not self._plain:
            n = await self._head()
            if n is None:
                return 0
            record = bytearray(n + TAG)
            await self._recv_exactly(memoryview(record))
            plain = bytearray(n)
            opener = self._opener(n, record, plain, b"")
            await run_sync(opener, n)
            self._plain = memoryview(plain)
        k = min(len(view), len(self._plain))
        view[:k] = self._plain[:k]
        self._plain = self._plain[k:]
        return k

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        buf = bytearray(max_bytes or 65536)
        n = await self.receive_into(memoryview(buf))
        return bytes(buf[:n])

    # -- bodies: chunks ----------------------------------------------------------------------

    def body_out(self, fd: int, offset: int, count: int, label: bytes, plain: bytearray, out: bytearray) -> Steps:
        """The steps sending ``count`` bytes of ``fd`` from ``offset`` as a body labelled ``label``.

        Each record is read into ``plain`` and sealed into ``out``, in whichever thread runs
        the steps. A file shorter than promised raises ``EOFError``; the connection is then
        out of step.
        """
        self._at_boundary()
        at = 0
        while at < count:
            n = min(RECORD, count - at)
            piece = memoryview(plain)[:n]
            if os.preadv(fd, [piece], offset + at) != n:
                raise EOFError(f"file ended short of the promised {count}-byte body")
            self._sealer(piece, out, label + _OFFSET.pack(at))()
            yield Send(memoryview(out)[: _HEAD.size + n + TAG])
            at += n

    def body_in(self, n: int, sink: Sink, label: bytes, record: bytearray, plain: bytearray) -> Steps:
        """The steps receiving an ``n``-byte body labelled ``label``, each opened piece given to ``sink`` in order."""
        self._at_boundary()
        head = memoryview(record)[: _HEAD.size]
        done = 0
        while done < n:
            yield Recv(head)
            k = self._length(head)
            if k > n - done:
                raise ProtocolError(f"a record of {k} bytes runs past the body's end ({n - done} bytes left)")
            yield Recv(memoryview(record)[: k + TAG])
            self._opener(k, record, plain, label + _OFFSET.pack(done))()
            sink(memoryview(plain)[:k], done)
            done += k

    # -- records ---------------------------------------------------------------------------

    def _sealer(self, piece: memoryview, out: bytearray, label: bytes) -> Callable[[], None]:
        """Sealing ``piece`` into ``out`` (length field first), with this record's nonce: run it once."""
        head = _HEAD.pack(len(piece))
        nonce, self._sent = self._sent.to_bytes(12, "big"), self._sent + 1

        def seal() -> None:
            out[: _HEAD.size] = head
            sealed = memoryview(out)[_HEAD.size : _HEAD.size + len(piece) + TAG]
            self._seal.encrypt_into(nonce, piece, head + label, sealed)

        return seal

    def _opener(self, n: int, record: bytearray, plain: bytearray, label: bytes) -> Callable[[], None]:
        """Opening the ``n``-byte record in ``record`` into ``plain``, with this record's nonce: run it once."""
        nonce, self._received = self._received.to_bytes(12, "big"), self._received + 1
        ad = _HEAD.pack(n) + label

        def open_() -> None:
            try:
                self._open.decrypt_into(nonce, memoryview(record)[: n + TAG], ad, memoryview(plain)[:n])
            except InvalidTag:
                raise ProtocolError(
                    "a sealed record failed authentication (altered, replayed, "
                    "reordered or out of place): connection closed"
                ) from None

        return open_

    def _at_boundary(self) -> None:
        if self._plain:
            raise ProtocolError(f"{len(self._plain)} bytes of a message are unread where a body starts")

    async def _head(self) -> int | None:
        """The next message record's plaintext length; ``None`` at a clean end between messages."""
        head = bytearray(_HEAD.size)
        got = await self._recv_some(memoryview(head))
        if not got:
            return None
        if got < len(head):
            await self._recv_exactly(memoryview(head)[got:])
        return self._length(head)

    @staticmethod
    def _length(head: bytes | bytearray | memoryview) -> int:
        n: int = _HEAD.unpack(head)[0]  # ">I": one unsigned int
        if not 0 < n <= RECORD:
            raise ProtocolError(f"a sealed record of {n} bytes (1 to {RECORD} allowed)")
        return n

    async def _recv_exactly(self, view: memoryview) -> None:
        while view:
            got = await self._recv_some(view)
            if not got:
                raise PeerUnavailable("connection closed mid-record")
            view = view[got:]

    async def _recv_some(self, view: memoryview) -> int:
        try:
            return await self._stream.socket.recv_into(view)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            raise PeerUnavailable(f"connection lost: {reason(e)}") from None

    async def _send(self, data: bytearray | memoryview) -> None:
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
            raise PeerUnavailable(f"connection lost while sending: {reason(e)}") from None

    # -- the rest of a stream ------------------------------------------------------------------

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        self.abort()
        await trio.lowlevel.checkpoint()

    def abort(self) -> None:
        """Close at once: also right under cancellation."""
        self._stream.socket.close()


async def seal(tls: TLSStream, job: str, secret: bytes, nonces: Nonces, *, server_side: bool) -> SealedStream:
    """End TLS on an authenticated connection and go on in records keyed from its ``nonces``."""
    sock = await tls.unwrap()
    sock.setblocking(False)
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
    return SealedStream(stream, *channel_keys(job, secret, nonces, server_side=server_side))
