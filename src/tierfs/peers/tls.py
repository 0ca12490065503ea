"""TLS 1.3 on peer connections: keyed from the job's secret, or from mounted certificates.

Peer traffic carries checkpoints (model weights) between nodes, so it is encrypted unless
an operator turns it off (``--peer-tls off``) for a network they trust.

**Keyed from the secret (the default).** Every node of a job already holds the job's
secret, so nothing else has to be distributed. Python's ``ssl`` has no TLS 1.3 pre-shared
keys, so each node derives the same Ed25519 key from the secret and the job id (the
stretched secret of :mod:`tierfs.core.keys`: the certificate is public, and a guess of the
secret checked against it costs a scrypt), makes the same self-signed certificate from it, presents it, and trusts
exactly that certificate from the other side (mutual TLS: both sides verify). A node
without the secret, or of another job, cannot finish the TLS handshake; a network observer
sees neither the data nor the requests, and cannot alter them.

**Mounted certificates** (``--tls-cert``, ``--tls-key``, ``--tls-ca``): for operators with
their own PKI. Each node presents its certificate and accepts peers whose certificate the CA
signed. Host names are not checked: peers are dialled by address, and membership of the job
is proven by the secret inside.

Either way the HMAC handshake of :mod:`tierfs.peers.wire` still runs inside TLS: no secret,
no data, whatever certificate a peer holds.

The stream is the standard library's ``ssl.SSLSocket`` in non-blocking mode, driven by
trio's readiness waits. ``trio.SSLStream`` (memory BIOs) makes a Python round trip through
trio's scheduler for every 16 KiB TLS record; on this machine that moved ~200 MiB/s on
loopback against ~550 MiB/s this way. What TLS cannot keep is ``os.sendfile``: the kernel
would send the file's bytes without encrypting them. And each 16 KiB record costs a Python
call and a copy, which halved the peer tier's throughput: so TLS only authenticates and
carries the handshake, and the connection then goes on in the large records of
:mod:`tierfs.peers.sealed`.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import re
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, TypeVarTuple

import trio

from tierfs.core import keys
from tierfs.core.errors import UserError

if TYPE_CHECKING:
    from tierfs.config import Config
from tierfs.peers.wire import PIECE, AuthFailed, PeerUnavailable, ProtocolError

_R = TypeVar("_R")
_Args = TypeVarTuple("_Args")

# Reasons OpenSSL gives when the other side does not speak TLS at all.
_NOT_TLS = {
    "WRONG_VERSION_NUMBER",
    "HTTP_REQUEST",
    "PACKET_LENGTH_TOO_LONG",
    "RECORD_LAYER_FAILURE",
    "UNSUPPORTED_PROTOCOL",
    "RECORD_LENGTH_MISMATCH",
    "UNKNOWN_PROTOCOL",
}


@dataclass(frozen=True)
class PeerTLS:
    """The two contexts a node needs: serving peers and dialling them. Built once, shared."""

    server: ssl.SSLContext
    client: ssl.SSLContext
    origin: str  # how it is keyed, for the log: "keyed from the job's secret" or the certificate's path


def from_secret(job: str, secret: bytes) -> PeerTLS:
    """TLS keyed from the job's secret: the same certificate on every node of the job."""
    cert, key = _certificate_from_secret(job, secret)
    server, client = _context(ssl.PROTOCOL_TLS_SERVER), _context(ssl.PROTOCOL_TLS_CLIENT)
    for context in (server, client):
        context.load_verify_locations(cadata=cert.decode())
        _load_identity_from_memory(context, cert + key)
    return PeerTLS(server, client, "keyed from the job's secret")


def from_files(cert: Path, key: Path, ca: Path) -> PeerTLS:
    """TLS from mounted PEM files; a file that does not load is a :class:`UserError`."""
    for option, path in (("--tls-cert", cert), ("--tls-key", key), ("--tls-ca", ca)):
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            raise UserError(f"cannot read {option} {path}: {e.strerror}") from None
    server, client = _context(ssl.PROTOCOL_TLS_SERVER), _context(ssl.PROTOCOL_TLS_CLIENT)
    for context in (server, client):
        try:
            context.load_cert_chain(cert, key)
        except ssl.SSLError as e:
            raise UserError(
                f"--tls-cert {cert} and --tls-key {key} are not a PEM certificate and its private key ({_reason(e)})"
            ) from None
        try:
            context.load_verify_locations(cafile=ca)
        except ssl.SSLError as e:
            raise UserError(f"--tls-ca {ca} holds no PEM certificate of a CA ({_reason(e)})") from None
    return PeerTLS(server, client, f"certificate {cert}, CA {ca}")


def for_config(cfg: Config) -> PeerTLS | None:
    """The node's TLS settings (built once per setting), or ``None``: TLS off, or no secret (no peers)."""
    if not cfg.peer_tls or not cfg.secret:
        return None
    return _cached(cfg.job, cfg.secret, cfg.tls_cert, cfg.tls_key, cfg.tls_ca)


@functools.lru_cache(maxsize=8)
def _cached(job: str, secret: bytes, cert: Path | None, key: Path | None, ca: Path | None) -> PeerTLS:
    if cert is not None and key is not None and ca is not None:
        return from_files(cert, key, ca)
    return from_secret(job, secret)


def _context(purpose: int) -> ssl.SSLContext:
    context = ssl.SSLContext(purpose)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # peers are dialled by address; the job's secret proves membership
    context.verify_mode = ssl.CERT_REQUIRED  # both ways: a server also asks for the client's certificate
    if purpose == ssl.PROTOCOL_TLS_SERVER:
        context.num_tickets = 0  # no session resumption: connections are few and long
    return context


def _certificate_from_secret(job: str, secret: bytes) -> tuple[bytes, bytes]:
    """The job's certificate and key (PEM): the same bytes on every node that holds the secret."""
    from cryptography import x509  # noqa: PLC0415 (slow to import; only daemons with peers need it)
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415 (as above)
    from cryptography.hazmat.primitives.asymmetric import ed25519  # noqa: PLC0415 (as above)
    from cryptography.x509.oid import NameOID  # noqa: PLC0415 (as above)

    key = ed25519.Ed25519PrivateKey.from_private_bytes(keys.derive(job, secret).tls_seed)
    public = key.public_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tierfs peer")])
    raw_public = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(int.from_bytes(hashlib.sha256(raw_public).digest()[:16], "big") | 1)
        .not_valid_before(datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC))
        .not_valid_after(datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.UTC))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, None)
    )  # Ed25519 signatures are deterministic: identical certificates everywhere
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _load_identity_from_memory(context: ssl.SSLContext, pem: bytes) -> None:
    """``load_cert_chain`` wants a path; an anonymous memory file keeps the key off every disk."""
    fd = os.memfd_create("tierfs-peer-tls", os.MFD_CLOEXEC)
    try:
        os.write(fd, pem)
        context.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


# -- the stream -----------------------------------------------------------------------------


class TLSStream(trio.abc.Stream):
    """One TLS connection: a non-blocking ``ssl.SSLSocket`` driven by trio's readiness waits.

    One task at a time sends or receives on it, as the peer protocol does. A send or
    receive cut short by a cancellation leaves the TLS state out of step: close the stream.
    """

    def __init__(self, sock: ssl.SSLSocket):
        self._sock = sock

    @classmethod
    async def handshake(cls, stream: trio.SocketStream, tls: PeerTLS, *, server_side: bool) -> TLSStream:
        """Take over ``stream``'s socket and run the TLS handshake on it.

        Raises :class:`AuthFailed` when either side refuses the other's certificate (wrong
        secret, job or CA), :class:`ProtocolError` when the other side does not speak TLS,
        :class:`PeerUnavailable` when the connection breaks.
        """
        raw = socket.socket(fileno=stream.socket.detach())
        raw.setblocking(False)
        context = tls.server if server_side else tls.client
        self = cls(context.wrap_socket(raw, server_side=server_side, do_handshake_on_connect=False))
        try:
            await self._retry(self._sock.do_handshake)
        except OSError as e:
            self.abort()
            raise _handshake_error(e, server_side) from None
        except BaseException:
            self.abort()
            raise
        return self

    async def receive_into(self, view: memoryview) -> int:
        """Fill some of ``view``: at least one record, and every record that has already arrived.

        Returns 0 at the end of the stream.
        """
        got = await self._retry(self._sock.recv_into, view)
        while 0 < got < len(view):  # records already here cost no wait: take them in this call
            try:
                n = self._sock.recv_into(view[got:])
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            if not n:
                break
            got += n
        await trio.lowlevel.checkpoint()
        return got

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        buf = bytearray(max_bytes or 65536)
        n = await self.receive_into(memoryview(buf))
        return bytes(buf[:n])

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            # A retry after "want write" repeats the same call, as OpenSSL requires.
            n = await self._retry(self._sock.send, view[:PIECE])
            view = view[n:]
        await trio.lowlevel.checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.wait_writable(self._sock)

    async def unwrap(self) -> socket.socket:
        """End TLS (``close_notify`` both ways) and give back the TCP socket, blocking, in step.

        OpenSSL reads no further than the other side's ``close_notify``, so what follows it
        on the socket is the first record of :mod:`tierfs.peers.sealed`.
        """
        try:
            await self._retry(self._sock.unwrap)
        except OSError as e:
            self.abort()
            raise PeerUnavailable(f"connection lost while ending TLS: {_reason(e)}") from None
        except BaseException:
            self.abort()
            raise
        return socket.socket(fileno=self._sock.detach())

    async def aclose(self) -> None:
        self.abort()
        await trio.lowlevel.checkpoint()

    def abort(self) -> None:
        """Close at once, without TLS's goodbye: also right under cancellation."""
        if self._sock.fileno() >= 0:
            trio.lowlevel.notify_closing(self._sock)
            self._sock.close()

    async def _retry(self, fn: Callable[[*_Args], _R], *args: *_Args) -> _R:
        """``fn(*args)``, called again each time OpenSSL wants the socket readable or writable first."""
        while True:
            try:
                return fn(*args)
            except ssl.SSLWantReadError:
                await trio.lowlevel.wait_readable(self._sock)
            except ssl.SSLWantWriteError:
                await trio.lowlevel.wait_writable(self._sock)


def _handshake_error(e: OSError, server_side: bool) -> AuthFailed | ProtocolError | PeerUnavailable:
    """What a failed TLS handshake means, in one line that says what to check."""
    if isinstance(e, ssl.SSLCertVerificationError):
        who = "the client's" if server_side else "the peer's"
        return AuthFailed(
            f"TLS: {who} certificate is not this job's ({e.verify_message}): "
            "a wrong secret or job id, or not signed by --tls-ca"
        )
    if not isinstance(e, ssl.SSLError) or isinstance(e, (ssl.SSLEOFError, ssl.SSLSyscallError)):
        return PeerUnavailable(f"connection lost during the TLS handshake: {_reason(e)}")
    reason = getattr(e, "reason", None) or ""
    if reason in _NOT_TLS:
        return ProtocolError(
            f"TLS handshake failed ({_reason(e)}): the other side does not speak TLS; "
            "every node of a job needs the same --peer-tls"
        )
    if "ALERT" in reason:
        return AuthFailed(
            f"TLS handshake failed ({_reason(e)}): the other side refused this node's "
            "certificate: a wrong secret or job id, or not signed by its --tls-ca"
        )
    return ProtocolError(f"TLS handshake failed ({_reason(e)})")


def _reason(e: BaseException) -> str:
    """OpenSSL's reason in a few lowercase words (``wrong version number``), without file:line."""
    reason = getattr(e, "reason", None)
    if isinstance(reason, str) and reason:
        return reason.lower().replace("_", " ")
    text = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return re.sub(r"^\[\w+\]\s*|\s*\(_ssl\.c:\d+\)$", "", text)
