"""The sealed channel spoken byte by byte, on a blocking socket: for tests that forge, drop
or replay records, or fuzz what goes inside them."""

from __future__ import annotations

import json
import socket
import ssl
import struct

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tierfs.peers import wire
from tierfs.peers.sealed import RECORD, TAG, channel_keys
from tierfs.peers.tls import PeerTLS

HEAD = struct.Struct(">I")


class Channel:
    """The client's end of a sealed connection, after TLS and the handshake on ``tls_sock``."""

    def __init__(self, tls_sock: ssl.SSLSocket, nonces: wire.Nonces, job: str, secret: bytes):
        tls_sock.unwrap()
        self.sock = socket.socket(fileno=tls_sock.detach())
        send_key, receive_key = channel_keys(job, secret, nonces, server_side=False)
        self._seal, self._open = AESGCM(send_key), AESGCM(receive_key)
        self.sent = self.received = 0

    def record(self, plain: bytes, label: bytes = b"", counter: int | None = None) -> bytes:
        """``plain`` sealed as the next record (or as record number ``counter``), as it goes on the wire."""
        if counter is None:
            counter, self.sent = self.sent, self.sent + 1
        head = HEAD.pack(len(plain))
        return head + self._seal.encrypt(counter.to_bytes(12, "big"), plain, head + label)

    def send(self, data: bytes) -> None:
        """``data`` as message records, as a peer's headers go."""
        for start in range(0, len(data), RECORD):
            self.sock.sendall(self.record(data[start : start + RECORD]))

    def receive(self, timeout: float = 8.0) -> bytes:
        """The plaintext of the message records that arrive until the server closes, opened in order."""
        self.sock.settimeout(timeout)
        raw = b""
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                raise AssertionError("the server kept the connection open") from None
            except OSError:
                break
            if not data:
                break
            raw += data
        out = b""
        while len(raw) >= HEAD.size:
            (n,) = HEAD.unpack(raw[: HEAD.size])
            record, raw = raw[HEAD.size : HEAD.size + n + TAG], raw[HEAD.size + n + TAG :]
            assert len(record) == n + TAG, "a torn record"
            nonce, self.received = self.received.to_bytes(12, "big"), self.received + 1
            out += self._open.decrypt(nonce, record, HEAD.pack(n))
        assert not raw, "a torn record header"
        return out

    def close(self) -> None:
        self.sock.close()


def open_channel(address: tuple[str, int], tls: PeerTLS, job: str, secret: bytes) -> Channel:
    """Connect, run TLS and the handshake as a peer does, and end TLS: the channel's first record is next."""
    sock = tls.client.wrap_socket(socket.create_connection(address, timeout=5))
    return Channel(sock, handshake(sock, job, secret), job, secret)


def handshake(sock: socket.socket, job: str, secret: bytes) -> wire.Nonces:
    """The client's side of the HMAC handshake, byte by byte; the nonces that key the records."""
    nonce = wire.new_nonce()
    sock.sendall(wire.encode_header({"op": "hello", "version": wire.VERSION, "job": job, "nonce": nonce}))
    challenge = _frame(sock)
    sock.sendall(
        wire.encode_header({"op": "auth", "proof": wire.proof(secret, "client", job, nonce, challenge["nonce"])})
    )
    assert _frame(sock) == {"ok": True}
    return wire.Nonces(nonce, challenge["nonce"])


def _frame(sock: socket.socket) -> dict:
    raw = b""
    while len(raw) < 4 or len(raw) < 4 + HEAD.unpack(raw[:4])[0]:
        data = sock.recv(1 << 16)
        assert data, "closed during the handshake"
        raw += data
    return json.loads(raw[4:])
