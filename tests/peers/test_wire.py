"""The wire: framing, bounded bodies, zero-copy sends over real sockets, the handshake."""

from __future__ import annotations

import json
import os
import random
import socket
import struct

import pytest
import trio
import trio.testing
import xxhash

from tierfs.peers import bodies, wire
from tierfs.peers.wire import AuthFailed, PeerError, PeerUnavailable, ProtocolError

JOB = "llama"
SECRET = b"a-secret-of-the-job-0123"


def randbytes(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


# -- framing ------------------------------------------------------------------------------


async def test_message_round_trip_with_and_without_body():
    a, b = trio.testing.memory_stream_pair()
    sent = await wire.send_msg(a, {"op": "put", "x": [1, "é"]}, b"body bytes")
    await wire.send_msg(a, {"op": "list"})
    header = await wire.recv_msg(b)
    assert header == {"op": "put", "x": [1, "é"], "len": 10}
    assert sent == 4 + len(json.dumps(header, separators=(",", ":")).encode()) + 10
    assert await wire.recv_body(b, header["len"], 100) == b"body bytes"
    header = await wire.recv_msg(b)
    assert header == {"op": "list"} and wire.body_length(header) == 0


async def test_big_body_is_sent_and_received_whole():
    a, b = trio.testing.memory_stream_pair()
    body = randbytes(3 * wire.PIECE + 5)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wire.send_msg, a, {"op": "put_manifest"}, body)
        header = await wire.recv_msg(b)
        assert await wire.recv_body(b, header["len"], len(body)) == body


@pytest.mark.parametrize("limit", [wire.HELLO_MAX_HEADER, wire.MAX_HEADER])
async def test_oversized_header_is_refused_before_it_is_read(limit):
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(struct.pack(">I", limit + 1))  # and not one byte of header follows
    with pytest.raises(ProtocolError, match="exceeds"):
        await wire.recv_msg(b, limit)


async def test_a_header_too_big_to_send_is_refused_locally():
    a, _ = trio.testing.memory_stream_pair()
    with pytest.raises(ValueError, match="exceeds"):
        await wire.send_msg(a, {"op": "have", "hashes": ["0" * 32] * 40_000})


@pytest.mark.parametrize(
    "raw", [b"[1, 2]", b"{not json", b"\xff\xfe", b'{"len": -1}', b'{"len": true}', b'{"len": "5"}']
)
async def test_malformed_headers_are_protocol_errors(raw):
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(struct.pack(">I", len(raw)) + raw)
    with pytest.raises(ProtocolError):
        await wire.recv_msg(b)


async def test_end_of_stream_is_peer_unavailable_wherever_it_happens():
    a, b = trio.testing.memory_stream_pair()
    await a.aclose()
    with pytest.raises(PeerUnavailable, match="closed by the peer"):
        await wire.recv_msg(b)
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(struct.pack(">I", 100) + b'{"op"')
    await a.aclose()
    with pytest.raises(PeerUnavailable, match="into a message"):
        await wire.recv_msg(b)
    a, b = trio.testing.memory_stream_pair()
    await a.send_all(b"x" * 1000)
    await a.aclose()
    with pytest.raises(PeerUnavailable, match="mid-body"):
        await bodies.receive_into_file(b, 2000, None)


async def test_body_limit_is_checked_before_reading():
    a, b = trio.testing.memory_stream_pair()
    with pytest.raises(ProtocolError, match="exceeds"):
        await wire.recv_body(b, 101, 100)


async def test_receive_into_file_in_bounded_pieces_with_streaming_hash(tmp_path):
    body = randbytes(2 * wire.PIECE + 12345)
    a, b = trio.testing.memory_stream_pair()
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.send_all, body)
            hasher = xxhash.xxh3_128()
            await bodies.receive_into_file(b, len(body), fd, hasher, offset=100)
    finally:
        os.close(fd)
    assert hasher.hexdigest() == xxhash.xxh3_128_hexdigest(body)
    data = (tmp_path / "f").read_bytes()
    assert data[:100] == bytes(100) and data[100:] == body


# -- send_file ----------------------------------------------------------------------------


@pytest.fixture
def big_file(tmp_path):
    path = tmp_path / "big"
    path.write_bytes(randbytes(8 << 20, seed=1))
    fd = os.open(path, os.O_RDONLY)
    yield path, fd
    os.close(fd)


async def _receive_all(stream: trio.abc.ReceiveStream) -> bytes:
    parts = []
    while data := await stream.receive_some(1 << 20):
        parts.append(data)
    return b"".join(parts)


async def test_send_file_sends_exactly_the_range_over_tcp(big_file):
    path, fd = big_file
    expected = path.read_bytes()[12345 : 12345 + 5_000_000]
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.2")
    port = listeners[0].socket.getsockname()[1]
    async with listeners[0]:
        client = await trio.open_tcp_stream("127.0.0.2", port)
        server = await listeners[0].accept()
        got = {}
        async with client, server, trio.open_nursery() as nursery:

            async def receive():
                got["data"] = await _receive_all(server)

            nursery.start_soon(receive)
            # Far more than the socket buffers: partial sends and waits for room happen.
            assert await bodies.send_file(client, fd, 12345, 5_000_000) == 5_000_000
            await client.send_eof()
    assert got["data"] == expected


async def test_send_file_over_a_socketpair_and_without_a_socket(big_file):
    path, fd = big_file
    expected = path.read_bytes()[1 << 20 : 3 << 20]
    left, right = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a, b = trio.SocketStream(left), trio.SocketStream(right)
    got = {}
    async with a, b, trio.open_nursery() as nursery:

        async def receive():
            got["data"] = await _receive_all(b)

        nursery.start_soon(receive)
        await bodies.send_file(a, fd, 1 << 20, 2 << 20)
        await a.send_eof()
    assert got["data"] == expected
    a, b = trio.testing.memory_stream_pair()  # no socket: pread + send_all
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bodies.send_file, a, fd, 1 << 20, 2 << 20)
        assert await wire.recv_body(b, 2 << 20, 2 << 20) == expected


async def test_send_file_refuses_to_send_past_the_end_of_the_file(big_file):
    path, fd = big_file
    a, b = trio.testing.memory_stream_pair()
    with pytest.raises(EOFError, match="short"):
        await bodies.send_file(a, fd, (8 << 20) - 10, 20)


# -- handshake ----------------------------------------------------------------------------


async def _handshake(
    client_job: str, client_secret: bytes, server_job: str = JOB, server_secret: bytes = SECRET
) -> dict:
    a, b = trio.testing.memory_stream_pair()
    result: dict = {}

    async def server():
        try:
            result["server"] = await wire.authenticate(b, job=server_job, secret=server_secret)
        except (PeerUnavailable, AuthFailed) as e:
            result["server"] = e

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server)
        try:
            result["client"] = await wire.client_handshake(a, job=client_job, secret=client_secret)
        except PeerError as e:
            result["client"] = e
        finally:
            await a.aclose()
    return result


async def test_handshake_succeeds_with_the_same_job_and_secret():
    result = await _handshake(JOB, SECRET)
    assert isinstance(result["client"], wire.Nonces)
    assert result["client"] == result["server"]  # both ends hold the same fresh nonces: they key the records


@pytest.mark.parametrize("job, secret", [(JOB, b"another-secret-entirely"), ("other-job", SECRET)])
async def test_wrong_secret_or_job_fails_the_same_way(job, secret):
    result = await _handshake(job, secret)
    assert isinstance(result["client"], AuthFailed)
    assert "could not prove it holds the secret" in str(result["client"])
    # The client gave up without sending a proof: the server never let it in.
    assert isinstance(result["server"], PeerUnavailable)


@pytest.mark.parametrize(
    "hello, speaks, chosen",
    [
        ({"version": 3}, (3, 3), 3),  # a peer from before the negotiation, which sends one version
        ({"version": 3}, (3, 4), 3),  # ... met by a newer build that still speaks it
        ({"version": 4, "versions": [3, 4]}, (3, 3), 3),  # a newer peer, met by this build: the older one wins
        ({"version": 4, "versions": [3, 4]}, (2, 5), 4),  # the newest both speak
        ({"version": 5, "versions": [5, 6]}, (3, 4), None),  # nothing in common
        ({"version": 2}, (3, 4), None),
        ({"version": True, "versions": [True, 9]}, (3, 4), None),  # booleans are not versions
        ({"version": 3, "versions": "3..4"}, (3, 4), 3),  # a malformed range: the one version asked for
    ],
)
def test_the_newest_version_both_sides_speak_is_chosen(hello, speaks, chosen):
    assert wire.choose_version(hello, speaks) == chosen


async def test_a_peer_before_the_negotiation_and_this_build_agree(monkeypatch):
    """A server of the release before reads only ``version``; its challenge names none."""
    a, b = trio.testing.memory_stream_pair()

    async def old_server():
        hello = await wire.recv_msg(b, wire.HELLO_MAX_HEADER)
        assert hello["version"] == 3 and hello["versions"] == [wire.OLDEST, wire.VERSION]
        server_nonce = wire.new_nonce()
        await wire.send_msg(
            b,
            {
                "op": "challenge",
                "nonce": server_nonce,
                "proof": wire.proof(SECRET, "server", JOB, hello["nonce"], server_nonce),
            },
        )
        await wire.recv_msg(b, wire.HELLO_MAX_HEADER)
        await wire.send_msg(b, {"ok": True})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(old_server)
        nonces = await wire.client_handshake(a, job=JOB, secret=SECRET)
    assert nonces.version == 3


async def test_a_version_nobody_speaks_is_refused_in_one_line():
    a, b = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:

        async def client():
            await wire.send_msg(
                a, {"op": "hello", "version": 99, "versions": [99, 100], "job": JOB, "nonce": wire.new_nonce()}
            )
            answer = await wire.recv_msg(a, wire.HELLO_MAX_HEADER)
            assert answer["error"] == f"unsupported protocol version 99: this peer speaks {wire.OLDEST}..{wire.VERSION}"

        nursery.start_soon(client)
        with pytest.raises(AuthFailed, match="protocol version 99"):
            await wire.authenticate(b, job=JOB, secret=SECRET)


def test_proofs_depend_on_every_input_and_on_the_role():
    base = wire.proof(SECRET, "server", JOB, "a" * 32, "b" * 32)
    assert len(base) == 64 and base == wire.proof(SECRET, "server", JOB, "a" * 32, "b" * 32)
    others = {
        wire.proof(SECRET, "client", JOB, "a" * 32, "b" * 32),
        wire.proof(SECRET + b"x", "server", JOB, "a" * 32, "b" * 32),
        wire.proof(SECRET, "server", JOB + "x", "a" * 32, "b" * 32),
        wire.proof(SECRET, "server", JOB, "c" * 32, "b" * 32),
        wire.proof(SECRET, "server", JOB, "a" * 32, "c" * 32),
    }
    assert base not in others and len(others) == 5
    assert SECRET.hex() not in base
