"""The peer protocol against hostile input and hostile networks, with real servers on loopback.

Covered: nesting bombs and garbage in headers (one short log line, never a traceback, the
service goes on), the connection cap and the handshake deadline, ranged reads that must not
re-hash whole chunks, TLS 1.3 on peer traffic (on by default, keyed from the job's secret or
from mounted certificates, still authenticated with the secret inside), and property-based
fuzzing of frames, headers and requests against a running server.

The fuzz tests drive a server that runs in a thread of its own (``trio.run``) with blocking
sockets from the test, so hypothesis' synchronous examples can talk to it directly. A
recording relay (threads, blocking sockets) sits between client and server where a test
needs to see what crosses the network.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import random
import shutil
import socket
import ssl
import struct
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import wait_for, write_orbax_step
from tests.peers.sealing import Channel, handshake
from tests.peers.test_peer_service import JOB, SECRET, frame, make_step, push, randbytes, read_until_closed, start_node
from tierfs.config import Config
from tierfs.core.chunks import chunk_hash
from tierfs.core.errors import UserError
from tierfs.peers import wire
from tierfs.peers.client import PeerClient
from tierfs.peers.wire import AuthFailed, PeerError, PeerUnavailable
from tierfs.ramtier.space import SpaceAccount
from tierfs.store import chunkfiles
from tierfs.store.replicas import ReplicaStore
from tierfs.store.server import Timeouts, serve

INFO = {"rank": 1, "topology": [["zone", "a"]], "free": 123}
MiB = 1 << 20


# -- helpers --------------------------------------------------------------------------------


class LogRecorder(logging.Handler):
    """Every record of the peer service's loggers, for checks on what an operator would see."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._lock_records = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock_records:
            self.records.append(record)

    def since(self, n: int, level: int = logging.INFO) -> list[logging.LogRecord]:
        with self._lock_records:
            return [r for r in self.records[n:] if r.levelno >= level]

    def __len__(self) -> int:
        return len(self.records)


def _recording_peer_log():
    """The peer protocol's log and the peer service's (:mod:`tierfs.store.server`)."""
    loggers = [logging.getLogger(name) for name in ("tierfs.peers", "tierfs.store")]
    recorder, old_levels = LogRecorder(), [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(recorder)
        logger.setLevel(logging.INFO)
    try:
        yield recorder
    finally:
        for logger, level in zip(loggers, old_levels, strict=True):
            logger.removeHandler(recorder)
            logger.setLevel(level)


@pytest.fixture
def peer_log():
    yield from _recording_peer_log()


def assert_clean_log(records: list[logging.LogRecord]) -> None:
    """What an operator reads: one short line per event, never a traceback."""
    for r in records:
        message = r.getMessage()
        assert r.exc_info is None and r.exc_text is None, f"traceback logged: {message}"
        assert "\n" not in message and "Traceback" not in message, message
        assert len(message) < 400, message


class Relay:
    """A TCP relay on 127.0.0.9 that records every byte in both directions (a wiretap)."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.listener = socket.create_server(("127.0.0.9", 0))
        self.address = self.listener.getsockname()[:2]
        self._recorded: list[bytes] = []
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def recorded(self) -> bytes:
        with self._lock:
            return b"".join(self._recorded)

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.target)
            except OSError:
                down.close()
                continue
            with self._lock:
                self._sockets += [down, up]
            for a, b in ((down, up), (up, down)):
                t = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(1 << 16):
                with self._lock:
                    self._recorded.append(data)
                b.sendall(data)
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept(): close() alone does not
        except OSError:
            pass
        self.listener.close()
        with self._lock:
            for s in self._sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        for t in self._threads:
            t.join(5)


def samples(data: bytes, n: int = 16, size: int = 48) -> list[bytes]:
    """Pieces of ``data`` that would show up in a recording of it in clear."""
    rng = random.Random(7)
    return [data[o : o + size] for o in (rng.randrange(0, len(data) - size) for _ in range(n))]


def make_certificates(directory: Path) -> dict[str, Path]:
    """A CA with two leaf certificates, and a leaf of another CA: what an operator would mount."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    files: dict[str, Path] = {}

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(tag: str, cert, key) -> None:
        files[f"{tag}.crt"] = directory / f"{tag}.crt"
        files[f"{tag}.crt"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            files[f"{tag}.key"] = directory / f"{tag}.key"
            files[f"{tag}.key"].write_bytes(
                key.private_bytes(
                    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
                )
            )

    def ca(tag: str):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(tag))
            .issuer_name(name(tag))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=9))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        write(tag, cert, key)
        return cert, key

    def leaf(tag: str, issuer) -> None:
        issuer_cert, issuer_key = issuer
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(tag))
            .issuer_name(issuer_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=9))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
            .sign(issuer_key, hashes.SHA256())
        )
        write(tag, cert, key)

    cluster_ca, other_ca = ca("cluster-ca"), ca("other-ca")
    leaf("node-a", cluster_ca)
    leaf("node-b", cluster_ca)
    leaf("stranger", other_ca)
    return files


# -- nesting bombs and garbage: one line each, never a traceback ----------------------------------


async def test_deep_nesting_is_refused_in_one_line_and_the_service_goes_on(nursery, tmp_path, peer_log):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n")
    bomb = b"[" * 2000 + b"]" * 2000  # fits the 4 KiB pre-authentication header
    for _ in range(40):
        async with await trio.open_tcp_stream(*node.address) as s:
            await s.send_all(struct.pack(">I", len(bomb)) + bomb)
            answer = await read_until_closed(s)
        header = json.loads(answer[4:])
        assert "nest" in header["error"] and "\n" not in header["error"]
    # After authentication too, and in a manifest body: refused, the connection answered.
    async with await node.connect() as client:
        with pytest.raises(PeerError, match="nest"):
            await client.put_manifest(2, 10, b"[" * 5000 + b"]" * 5000)
        assert await client.list() == []
    s = await trio.open_tcp_stream(*node.address)
    async with s:
        await wire.client_handshake(s, job=JOB, secret=SECRET)
        deep = {"op": "have", "hashes": functools.reduce(lambda x, _: [x], range(50), [])}
        await s.send_all(frame(deep))
        answer = await read_until_closed(s)
    assert b"nest" in answer
    async with await node.connect() as client:  # still serving
        assert await client.info() == INFO
    records = peer_log.since(0)
    assert_clean_log(records)
    refusals = [r for r in records if r.levelno >= logging.WARNING]
    assert 1 <= len(refusals) <= 12, [r.getMessage() for r in refusals]  # rate-limited, not 41 lines


async def test_an_internal_failure_is_one_line_and_the_service_goes_on(nursery, tmp_path, peer_log):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n")
    node.store.manifests = lambda: 1 / 0  # a bug behind "list"
    for _ in range(3):
        async with await node.connect() as client:
            with pytest.raises(PeerUnavailable):
                await client.list()
    del node.store.manifests
    async with await node.connect() as client:
        assert await client.list() == []
    records = peer_log.since(0, logging.WARNING)
    assert_clean_log(records)
    assert any("ZeroDivisionError" in r.getMessage() for r in records)


async def test_an_announced_body_reserves_memory_only_as_its_bytes_arrive():
    """A peer that announces a 64 MiB body and sends 1 KiB gets 4 MiB of this node's memory, not 64."""
    import tracemalloc

    send, receive = trio.testing.memory_stream_one_way_pair()
    await send.send_all(b"x" * 1024)
    await send.aclose()
    tracemalloc.start()
    try:
        with pytest.raises(PeerUnavailable):
            await wire.recv_body(receive, wire.MAX_MANIFEST, wire.MAX_MANIFEST)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= wire.BODY_RESERVE + MiB


async def test_a_hostile_peer_cannot_crash_a_restore_with_a_nested_manifest(nursery):
    bomb = b"[" * 5000 + b"]" * 5000

    async def hostile(stream: trio.SocketStream) -> None:  # holds the secret, answers with a bomb
        async with stream:
            await wire.authenticate(stream, job=JOB, secret=SECRET)
            await wire.recv_msg(stream)
            await wire.send_msg(stream, {"ok": True, "len": len(bomb)}, bomb)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, hostile, 0, host="127.0.0.3"))
    address = ("127.0.0.3", listeners[0].socket.getsockname()[1])
    async with await PeerClient.connect(address, job=JOB, secret=SECRET, tls=None, timeout=3) as client:
        with pytest.raises(PeerError, match="nests deeper"):
            await client.get_manifest(0, 1)


# -- connection cap and handshake deadline ---------------------------------------------------------


async def test_connections_are_capped_and_strangers_cannot_hold_a_slot(nursery, tmp_path, peer_log):
    root = tmp_path / "n"
    root.mkdir()
    store = ReplicaStore(root, SpaceAccount(None, root), job=JOB)
    store.load()
    port = await nursery.start(
        functools.partial(
            serve,
            ("127.0.0.2", 0),
            job=JOB,
            secret=SECRET,
            store=store,
            info=lambda: INFO,
            tls=None,
            timeouts=Timeouts(handshake=30, idle=30, request=5),
            max_connections=3,
        )
    )
    address = ("127.0.0.2", port)
    idle = [await trio.open_tcp_stream(*address) for _ in range(3)]
    with pytest.raises(PeerUnavailable):  # every slot is taken: not served
        await PeerClient.connect(address, job=JOB, secret=SECRET, tls=None, timeout=1)
    await idle.pop().aclose()
    async with await PeerClient.connect(address, job=JOB, secret=SECRET, tls=None, timeout=3) as client:
        assert await client.info() == INFO  # a slot came free: served
    for s in idle:
        await s.aclose()
    assert_clean_log(peer_log.since(0))


async def test_silent_and_stalled_handshakes_are_dropped_at_the_deadline(nursery, tmp_path):
    from tierfs.peers import tls

    secured = tls.from_secret(JOB, SECRET)
    for mode in (None, secured):
        root = tmp_path / f"n-{mode is None}"
        root.mkdir()
        store = ReplicaStore(root, SpaceAccount(None, root), job=JOB)
        store.load()
        port = await nursery.start(
            functools.partial(
                serve,
                ("127.0.0.2", 0),
                job=JOB,
                secret=SECRET,
                store=store,
                info=lambda: INFO,
                tls=mode,
                timeouts=Timeouts(handshake=0.5, idle=30, request=5),
                max_connections=2,
            )
        )
        address = ("127.0.0.2", port)
        silent = await trio.open_tcp_stream(*address)  # connects, says nothing
        stalled = await trio.open_tcp_stream(*address)  # starts a handshake, never finishes it
        await stalled.send_all(b"\x16\x03\x01\x02\x00\x01" if mode else b"\x00\x00\x00\x40{")
        started = trio.current_time()
        async with await PeerClient.connect(address, job=JOB, secret=SECRET, tls=mode, timeout=5) as client:
            assert await client.info() == INFO
        assert trio.current_time() - started < 3
        for s in (silent, stalled):
            assert await read_until_closed(s, 3) == b""  # dropped at the deadline, unanswered
            await s.aclose()


# -- ranged reads do not re-hash whole chunks -----------------------------------------------------


@pytest.fixture
def hashed(monkeypatch):
    """Bytes the replica store hashes, counted."""
    count = {"bytes": 0}
    real = chunkfiles.hash_range

    def counting(fd, offset, length):
        count["bytes"] += length
        return real(fd, offset, length)

    monkeypatch.setattr(chunkfiles, "hash_range", counting)
    return count


async def test_ranged_reads_trust_the_hash_checked_at_store_time(nursery, tmp_path, hashed):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n")
    data = randbytes(8 * MiB, 31)
    source = tmp_path / "chunk"
    source.write_bytes(data)
    h = chunk_hash(data)
    async with await node.connect(timeout=10) as client:
        await client.put_chunk(h, source, 0, len(data))
        stored = hashed["bytes"]
        for i in range(20):
            assert await client.get_chunk(h, i * 4096, 1) == data[i * 4096 : i * 4096 + 1]
        assert await client.get_chunk(h, 5 * MiB, 7) == data[5 * MiB : 5 * MiB + 7]
        assert hashed["bytes"] == stored  # verified once, when it was stored
        for offset, length in ((2**62, 1), (0, 2**40), (len(data), 1)):
            with pytest.raises(PeerError, match="outside"):
                await client.get_chunk(h, offset, length)
        assert hashed["bytes"] == stored
        # The file changes under the store (rot, or a hand): verified again, refused, removed.
        path = next(p for p in node.files() if p.name == h)
        with open(path, "r+b") as f:
            f.seek(MiB)
            f.write(b"\xff" * 16)
        with pytest.raises(PeerError, match="corrupt|not found"):
            await client.get_chunk(h, 0, 1)
        assert hashed["bytes"] == stored + len(data)
        assert not path.exists()


async def test_after_a_restart_a_chunk_is_verified_once_then_trusted(nursery, tmp_path, hashed):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n")
    manifest, where = make_step(tmp_path, 2, 10, {"a": randbytes(3 * 64 << 10, 32)})
    async with await node.connect() as client:
        await push(client, manifest, where)
    h = next(iter(where))
    reloaded = ReplicaStore(node.root, SpaceAccount(None, node.root), job=JOB)
    reloaded.load()
    before = hashed["bytes"]
    for _ in range(5):
        with reloaded.open_chunk(h) as source:
            assert os.pread(source.fd, 1, source.offset) == read_range_bytes(where[h])[:1]
    assert hashed["bytes"] - before == where[h][2]


def read_range_bytes(location) -> bytes:
    path, offset, length = location
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


# -- TLS ---------------------------------------------------------------------------------------


async def start_tls_node(nursery, host: str, root: Path, mode):
    root.mkdir(parents=True)
    store = ReplicaStore(root, SpaceAccount(None, root), job=JOB, grace=0.0, keep_from=lambda: 10**9)
    store.load()
    port = await nursery.start(
        functools.partial(
            serve,
            (host, 0),
            job=JOB,
            secret=SECRET,
            store=store,
            info=lambda: INFO,
            tls=mode,
            timeouts=Timeouts(handshake=2, idle=5, request=5),
        )
    )
    return (host, port), store


def test_tls_is_on_by_default_and_can_be_turned_off(tmp_path):
    from tierfs.peers import tls

    base = dict(mountpoint=tmp_path, job=JOB, listen="127.0.0.2:7420", secret=SECRET.decode())
    on = Config.build(**base)
    assert on.peer_tls is True and tls.for_config(on) is not None
    assert tls.for_config(on).origin.startswith("keyed from the job's secret")
    assert tls.for_config(Config.build(**base, peer_tls="off")) is None
    assert Config.build(**base, peer_tls="on").peer_tls is True
    assert tls.for_config(Config.build(mountpoint=tmp_path)) is None  # no secret, no peers, no TLS


def test_tls_options_are_checked_with_one_clear_line(tmp_path):
    from tierfs.peers import tls

    files = make_certificates(tmp_path)
    base = dict(mountpoint=tmp_path, job=JOB, listen="127.0.0.2:7420", secret=SECRET.decode())
    pem = dict(tls_cert=files["node-a.crt"], tls_key=files["node-a.key"], tls_ca=files["cluster-ca.crt"])
    assert Config.build(**base, **pem).tls_cert == files["node-a.crt"]
    bad = [
        (dict(peer_tls="maybe"), "--peer-tls"),
        (dict(tls_cert=files["node-a.crt"]), "--tls-key"),
        (dict(**pem, peer_tls="off"), "--peer-tls"),
        (dict(pem, tls_key=tmp_path / "missing.key"), "missing.key"),
        (dict(pem, tls_key=files["node-b.key"]), "--tls-key"),  # not the certificate's key
        (dict(pem, tls_ca=files["node-a.key"]), "--tls-ca"),
    ]
    for extra, mentions in bad:  # refused when the options are read, or at the latest when TLS is set up
        with pytest.raises(UserError, match=mentions) as e:
            tls.for_config(Config.build(**base, **extra))
        assert "\n" not in str(e.value) and len(str(e.value)) < 300


async def test_peer_traffic_is_encrypted_and_a_wiretap_sees_no_data(nursery, tmp_path):
    from tierfs.peers import tls

    data = randbytes(3 * 64 << 10, 40)
    for mode in (tls.from_secret(JOB, SECRET), None):
        address, _ = await start_tls_node(nursery, "127.0.0.2", tmp_path / f"n-{mode is None}", mode)
        relay = Relay(address)
        try:
            manifest, where = make_step(tmp_path, 2, 10, {"a": data})
            async with await PeerClient.connect(relay.address, job=JOB, secret=SECRET, tls=mode, timeout=5) as client:
                await push(client, manifest, where)  # sendfile in clear, TLS records encrypted
                h = next(iter(where))
                assert await client.get_chunk(h) == read_range_bytes(where[h])
            recorded = relay.recorded
        finally:
            relay.close()
        seen = [s in recorded for s in samples(data)] + [b'"op"' in recorded, JOB.encode() in recorded]
        if mode is None:
            assert all(seen)  # the wiretap works: in clear, everything shows
        else:
            assert not any(seen) and len(recorded) > len(data)


async def test_without_the_secret_tls_cannot_even_complete(nursery, tmp_path, peer_log):
    from tierfs.peers import tls

    address, store = await start_tls_node(nursery, "127.0.0.2", tmp_path / "n", tls.from_secret(JOB, SECRET))
    for wrong in (tls.from_secret(JOB, b"not-the-secret-at-all"), tls.from_secret("other-job", SECRET)):
        with pytest.raises(AuthFailed, match="certificate"):
            await PeerClient.connect(address, job=JOB, secret=SECRET, tls=wrong, timeout=3)
    async with await PeerClient.connect(
        address, job=JOB, secret=SECRET, tls=tls.from_secret(JOB, SECRET), timeout=3
    ) as client:
        assert await client.info() == INFO
    records = peer_log.since(0)
    assert_clean_log(records)
    assert sum("TLS" in r.getMessage() for r in records if r.levelno >= logging.WARNING) == 2


async def test_mismatched_tls_settings_get_a_clear_error(nursery, tmp_path):
    from tierfs.peers import tls

    secured = tls.from_secret(JOB, SECRET)
    tls_server, _ = await start_tls_node(nursery, "127.0.0.2", tmp_path / "a", secured)
    plain_server, _ = await start_tls_node(nursery, "127.0.0.3", tmp_path / "b", None)
    for address, mode in ((tls_server, None), (plain_server, secured)):
        with pytest.raises(PeerError, match="--peer-tls") as e:
            await PeerClient.connect(address, job=JOB, secret=SECRET, tls=mode, timeout=3)
        assert "\n" not in str(e.value)
    for address, mode in ((tls_server, secured), (plain_server, None)):  # both still serve
        async with await PeerClient.connect(address, job=JOB, secret=SECRET, tls=mode, timeout=3) as client:
            assert await client.info() == INFO


async def test_mounted_certificates_and_the_secret_are_both_required(nursery, tmp_path):
    from tierfs.peers import tls

    files = make_certificates(tmp_path)
    ca = files["cluster-ca.crt"]
    server_tls = tls.from_files(files["node-a.crt"], files["node-a.key"], ca)
    address, _ = await start_tls_node(nursery, "127.0.0.2", tmp_path / "n", server_tls)
    member = tls.from_files(files["node-b.crt"], files["node-b.key"], ca)
    async with await PeerClient.connect(address, job=JOB, secret=SECRET, tls=member, timeout=3) as client:
        assert await client.info() == INFO
    with pytest.raises(AuthFailed):  # a valid certificate, but not the job's secret: no data
        await PeerClient.connect(address, job=JOB, secret=b"not-the-secret-at-all", tls=member, timeout=3)
    stranger = tls.from_files(files["stranger.crt"], files["stranger.key"], ca)
    with pytest.raises(PeerError):  # the right secret, a certificate of another CA
        async with await PeerClient.connect(address, job=JOB, secret=SECRET, tls=stranger, timeout=3) as c:
            await c.info()
    async with await PeerClient.connect(address, job=JOB, secret=SECRET, tls=member, timeout=3) as client:
        assert await client.info() == INFO


@pytest.mark.expect_log('not answer yet')
def test_daemons_encrypt_peer_traffic_by_default():
    """Two real daemons; node 0 reaches its peer only through a wiretap: it sees no checkpoint byte."""
    from tierfs_testing.cluster import LocalCluster

    c = LocalCluster(
        Path("/dev/shm") / f"tierfs-sec-{uuid.uuid4().hex[:10]}",
        2,
        "wiretap",
        replicas=1,
        capacity="256M",
        restore_wait="1s",
    )
    relay = None
    try:
        c.start(1)
        relay = Relay((c.nodes[1].host, c.nodes[1].port))
        c.start(0, peers=f"{relay.address[0]}:{relay.address[1]}")
        data = os.urandom(2 * MiB)
        write_orbax_step(c.nodes[0].mountpoint, 3, {"shard": data})
        wait_for(
            lambda: any(s["step"] == 3 and s["replicas"].get("peers") for s in c.status(0)["steps"]),
            60,
            "step 3 to be replicated",
        )
        assert c.status(1)["replicas_held"]["manifests"] == 1
        recorded = relay.recorded
        assert len(recorded) > len(data)
        assert not any(s in recorded for s in samples(data)) and b'"op"' not in recorded
    finally:
        if relay is not None:
            relay.close()
        c.close()


# -- fuzzing against a running server ---------------------------------------------------------------


class ThreadedServer:
    """A real peer service on 127.0.0.1, in a thread of its own, for synchronous fuzz examples."""

    def __init__(self, root: Path, mode):
        self.root, self.mode = root, mode
        self.port = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    async def _main(self) -> None:
        store = ReplicaStore(self.root, SpaceAccount(None, self.root), job=JOB, keep_from=lambda: 10**9)
        store.load()
        async with trio.open_nursery() as nursery:
            self._scope = nursery.cancel_scope
            self._token = trio.lowlevel.current_trio_token()
            self.port = await nursery.start(
                functools.partial(
                    serve,
                    ("127.0.0.1", 0),
                    job=JOB,
                    secret=SECRET,
                    store=store,
                    info=lambda: INFO,
                    tls=self.mode,
                    timeouts=Timeouts(handshake=2, idle=2, request=2),
                )
            )
            self._ready.set()

    def __enter__(self) -> ThreadedServer:
        self._thread.start()
        assert self._ready.wait(10), "the fuzzed server did not start"
        return self

    def __exit__(self, *exc) -> None:
        trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        self._thread.join(10)

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    def open(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=5)
        if self.mode is not None:
            sock = self.mode.client.wrap_socket(sock)
        return sock


def recv_frame(sock: socket.socket) -> dict:
    prefix = _recv_exactly(sock, 4)
    (n,) = struct.unpack(">I", prefix)
    return json.loads(_recv_exactly(sock, n))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        data = sock.recv(n - len(buf))
        if not data:
            raise EOFError("closed")
        buf += data
    return buf


def authenticate(sock: socket.socket) -> wire.Nonces:
    return handshake(sock, JOB, SECRET)


def still_serving(server: ThreadedServer) -> None:
    with server.open() as sock:
        nonces = authenticate(sock)
        request = wire.encode_header({"op": "info"})
        if server.mode is None:
            sock.sendall(request)
            assert recv_frame(sock) == {**INFO, "ok": True}
            return
        channel = Channel(sock, nonces, JOB, SECRET)
        try:
            channel.send(request)
            channel.sock.shutdown(socket.SHUT_WR)
            assert answers(channel.receive()) == [{**INFO, "ok": True}]
        finally:
            channel.close()


def exchange(server: ThreadedServer, payload: bytes, *, authenticated: bool = False) -> bytes:
    """Send ``payload`` (then end the stream); everything the server answers until it closes.

    On a TLS server, ``payload`` goes after the handshake in sealed records, as a peer's
    requests do.
    """
    sock = server.open()
    if authenticated and server.mode is not None:
        channel = Channel(sock, authenticate(sock), JOB, SECRET)
        try:
            try:
                channel.send(payload)
                channel.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            return channel.receive()
        finally:
            channel.close()
    try:
        if authenticated:
            authenticate(sock)
        try:
            sock.sendall(payload)
            socket.socket.shutdown(sock, socket.SHUT_WR)  # TCP's end only: TLS stays readable
        except OSError:
            pass
        parts = []
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            try:
                data = sock.recv(1 << 16)
            except (OSError, ssl.SSLError):
                break
            if not data:
                break
            parts.append(data)
        else:
            raise AssertionError("the server kept a broken connection open")
        return b"".join(parts)
    finally:
        sock.close()


def answers(raw: bytes) -> list[dict]:
    """The frames of an answer stream; every one must be a complete JSON object."""
    out = []
    while raw:
        assert len(raw) >= 4, f"a torn frame: {raw!r}"
        (n,) = struct.unpack(">I", raw[:4])
        assert len(raw) >= 4 + n, f"a torn frame: {raw[:80]!r}"
        header = json.loads(raw[4 : 4 + n])
        assert isinstance(header, dict)
        raw = raw[4 + n + header.get("len", 0) :]
        out.append(header)
    return out


def assert_clear_refusals(frames: list[dict], *, authenticated: bool) -> None:
    for f in frames:
        if "error" in f:
            assert isinstance(f["error"], str) and "\n" not in f["error"] and len(f["error"]) < 300, f
            assert "Traceback" not in f["error"]
        elif authenticated:
            assert f.get("ok") is True, f
        else:
            assert f.get("op") == "challenge", f  # a well-formed hello gets a challenge, nothing more


def outside(base: Path, root: Path) -> dict[str, tuple[int, int]]:
    """Every file beside the store's tree, with its size and mtime."""
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in base.rglob("*") if root not in p.parents and p != root
    }


@pytest.fixture(scope="module")
def fuzz_base():
    base = Path(tempfile.mkdtemp(prefix="tierfs-fuzz-", dir="/dev/shm"))
    (base / "beside").mkdir()
    (base / "beside" / "keep.txt").write_text("not the store's")
    (base / "etc").mkdir()
    (base / "etc" / "passwd").write_text("root:x:0:0")
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def fuzz_log():
    yield from _recording_peer_log()


@pytest.fixture(scope="module")
def plain_server(fuzz_base, fuzz_log):
    with ThreadedServer(fuzz_base / "plain" / "replicas", None) as server:
        yield server


@pytest.fixture(scope="module")
def tls_server(fuzz_base, fuzz_log):
    from tierfs.peers import tls

    with ThreadedServer(fuzz_base / "tls" / "replicas", tls.from_secret(JOB, SECRET)) as server:
        yield server


def check_after(server: ThreadedServer, base: Path, before: dict, log: LogRecorder, mark: int) -> None:
    still_serving(server)
    assert outside(base, server.root) == before
    assert_clean_log(log.since(mark))


def fuzz_plain(server: ThreadedServer, base: Path, log: LogRecorder, payload: bytes, authenticated: bool) -> None:
    """Send ``payload`` in clear: only clear refusals come back, and nothing else changes."""
    before, mark = outside(base, server.root), len(log)
    assert_clear_refusals(answers(exchange(server, payload, authenticated=authenticated)), authenticated=authenticated)
    check_after(server, base, before, log, mark)


HASH = chunk_hash(b"fuzz")
OPS = ["hello", "auth", "info", "have", "put_chunk", "put_manifest", "list", "get_manifest", "get_chunk"]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
hashes = st.sampled_from([HASH, "../../etc/passwd", "0" * 32, "A" * 32, "/" + "a" * 31, ""]) | st.text(max_size=40)
counts = st.integers(-5, (70 << 20)) | st.sampled_from([2**63, 2**64 + 1, True]) | json_values
requests = (
    st.fixed_dictionaries(
        {},
        optional={
            "op": st.sampled_from(OPS) | st.text(max_size=12),
            "hash": hashes,
            "len": counts,
            "offset": counts,
            "length": counts,
            "rank": counts,
            "step": counts,
            "hashes": st.lists(hashes, max_size=6) | json_values,
            "version": st.integers(-1, 3) | json_values,
            "job": st.sampled_from([JOB, "other"]) | st.text(max_size=10),
            "nonce": st.sampled_from([wire.new_nonce()]) | st.text(max_size=40),
            "proof": st.text(max_size=70),
        },
    )
    | st.dictionaries(st.text(max_size=8), json_values, max_size=5)
    | json_values
)
nested = st.integers(1, 3000).map(
    lambda d: json.dumps({"op": "have"})[:-1].encode() + b',"hashes":' + b"[" * d + b"]" * d + b"}"
)


def encode(value) -> bytes:
    data = json.dumps(value).encode() if not isinstance(value, bytes) else value
    return struct.pack(">I", len(data)) + data


frames = (
    st.builds(lambda h, body: encode(h) + body, requests, st.binary(max_size=300))
    | nested.map(encode)
    | st.builds(lambda n, rest: struct.pack(">I", n) + rest, st.integers(0, 2**32 - 1), st.binary(max_size=200))
    | st.binary(max_size=300)
)
FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(payload=st.binary(max_size=6000))
def test_fuzz_arbitrary_bytes_before_authentication(plain_server, fuzz_base, fuzz_log, payload):
    fuzz_plain(plain_server, fuzz_base, fuzz_log, payload, authenticated=False)


@FUZZ
@given(payload=st.lists(frames, min_size=1, max_size=3).map(b"".join))
def test_fuzz_frames_and_headers_before_authentication(plain_server, fuzz_base, fuzz_log, payload):
    fuzz_plain(plain_server, fuzz_base, fuzz_log, payload, authenticated=False)


@FUZZ
@given(payload=st.lists(frames, min_size=1, max_size=4).map(b"".join))
def test_fuzz_requests_after_authentication(plain_server, fuzz_base, fuzz_log, payload):
    fuzz_plain(plain_server, fuzz_base, fuzz_log, payload, authenticated=True)


@settings(FUZZ, max_examples=60)
@given(payload=st.binary(max_size=3000) | st.lists(frames, min_size=1, max_size=2).map(b"".join))
def test_fuzz_a_tls_server_with_bytes_that_are_not_tls(tls_server, fuzz_base, fuzz_log, payload):
    before, mark = outside(fuzz_base, tls_server.root), len(fuzz_log)
    with socket.create_connection(tls_server.address, timeout=5) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        parts = []
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            try:
                data = sock.recv(1 << 16)
            except OSError:
                break
            if not data:
                break
            parts.append(data)
        else:
            raise AssertionError("the TLS server kept a broken connection open")
    raw = b"".join(parts)
    if raw[:1] not in (b"", b"\x15"):  # not a TLS alert: the refusal in clear, and nothing else
        refusals = answers(raw)
        assert_clear_refusals(refusals, authenticated=False)
        assert [r["error"] for r in refusals if "--peer-tls" in r["error"]] == [r.get("error") for r in refusals]
    check_after(tls_server, fuzz_base, before, fuzz_log, mark)


@settings(FUZZ, max_examples=60)
@given(payload=st.lists(frames, min_size=1, max_size=3).map(b"".join))
def test_fuzz_requests_in_sealed_records_after_authentication(tls_server, fuzz_base, fuzz_log, payload):
    before, mark = outside(fuzz_base, tls_server.root), len(fuzz_log)
    assert_clear_refusals(answers(exchange(tls_server, payload, authenticated=True)), authenticated=True)
    check_after(tls_server, fuzz_base, before, fuzz_log, mark)
