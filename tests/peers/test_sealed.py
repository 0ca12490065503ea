"""The sealed channel: what TLS hands over to, record by record.

Real peer services with TLS keyed from the job's secret on 127.0.0.2; forged traffic comes
from a blocking client that seals records itself (``sealing.py``), so each test can alter,
replay, reorder, mislabel or cut exactly one record and see that the service refuses it,
stores nothing, and goes on serving.
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import xxhash

from tests.peers.sealing import HEAD, Channel, open_channel
from tests.peers.test_peer_service import JOB, SECRET, randbytes, start_node
from tierfs.core.chunks import chunk_hash
from tierfs.peers import bodies, tls, wire
from tierfs.peers.bodies import chunk_label
from tierfs.peers.client import PeerClient
from tierfs.peers.sealed import RECORD, SealedStream, channel_keys
from tierfs.peers.wire import Nonces, PeerError, ProtocolError

MiB = 1 << 20
TLS = tls.from_secret(JOB, SECRET)


@pytest.fixture
async def node(nursery, tmp_path):
    return await start_node(nursery, "127.0.0.2", tmp_path / "node", tls=TLS)


async def client_of(node) -> PeerClient:
    return await PeerClient.connect(node.address, job=JOB, secret=SECRET, tls=TLS, timeout=5)


def info_request() -> bytes:
    return wire.encode_header({"op": "info"})


async def forge(node, wire_bytes: Callable[[Channel], bytes]) -> bytes:
    """Send what ``wire_bytes`` makes on a fresh channel; what the service says until it closes.

    The answer's records are opened in order: a forged record ends the connection.
    """

    def run() -> bytes:
        channel = open_channel(node.address, TLS, JOB, SECRET)
        try:
            try:
                channel.sock.sendall(wire_bytes(channel))
                channel.sock.shutdown(socket.SHUT_WR)
            except OSError:  # the service refused a record before the rest arrived, and hung up
                pass
            return channel.receive()
        finally:
            channel.close()

    return await trio.to_thread.run_sync(run)


def body_record(channel: Channel, data: bytes, h: str, at: int) -> bytes:
    """Bytes ``at`` onwards of chunk ``h``'s body, sealed as that body's record (at most :data:`RECORD`)."""
    return channel.record(data[at : at + RECORD], chunk_label(h, 0) + at.to_bytes(8, "big"))


# -- what goes through --------------------------------------------------------------------


async def test_chunks_go_both_ways_in_sealed_records(node, tmp_path):
    data = randbytes(9 * MiB + 123, 1)  # records of 1 MiB, and a short last one
    h = chunk_hash(data)
    src = tmp_path / "src"
    src.write_bytes(b"x" * 100 + data)
    async with await client_of(node) as client:
        assert isinstance(client._stream, SealedStream)
        await client.put_chunk(h, src, 100, len(data))
        assert node.store.has(h)
        assert await client.fetch_chunk(h, len(data)) == data
        assert await client.get_chunk(h, 5 * MiB + 7, 1000) == data[5 * MiB + 7 : 5 * MiB + 1007]
        fd = os.open(tmp_path / "into", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            assert await client.get_chunk_into(h, fd, 4096) == len(data)
            assert os.pread(fd, len(data), 4096) == data
        finally:
            os.close(fd)
        assert (await client.info())["rank"] == 1  # still in step after every body


async def test_each_connection_and_direction_has_its_own_key():
    a, b = Nonces(wire.new_nonce(), wire.new_nonce()), Nonces(wire.new_nonce(), wire.new_nonce())
    client_send, client_receive = channel_keys(JOB, SECRET, a, server_side=False)
    server_send, server_receive = channel_keys(JOB, SECRET, a, server_side=True)
    assert (client_send, client_receive) == (server_receive, server_send)
    assert client_send != client_receive
    assert not {client_send, client_receive} & set(channel_keys(JOB, SECRET, b, server_side=False))
    assert channel_keys(JOB, b"another secret of this job", a, server_side=False)[0] != client_send


# -- what is refused ----------------------------------------------------------------------


@pytest.mark.parametrize("where", [0, HEAD.size + 3, -1])  # the length, the ciphertext, the tag
async def test_an_altered_record_is_refused_and_the_service_goes_on(node, where):
    def altered(channel: Channel) -> bytes:
        record = bytearray(channel.record(info_request()))
        if where == 0:
            record[3] ^= 1  # the length: the tag covers it too (and the record now ends elsewhere)
        else:
            record[where] ^= 0x40
        return bytes(record)

    assert b'"ok":true' not in await forge(node, altered)
    await still_serving(node)


async def test_a_replayed_record_is_refused(node):
    def replayed(channel: Channel) -> bytes:
        record = channel.record(info_request())
        return record + record

    answered = await forge(node, replayed)
    assert answered.count(b'"ok":true') == 1  # the first is answered, its copy is not
    assert b"failed authentication" in answered
    await still_serving(node)


async def test_reordered_records_are_refused(node):
    def reordered(channel: Channel) -> bytes:
        first, second = channel.record(info_request()), channel.record(info_request())
        return second + first

    assert b'"ok":true' not in await forge(node, reordered)
    await still_serving(node)


async def test_a_record_sealed_for_another_chunk_is_refused_and_nothing_is_stored(node):
    data = randbytes(2 * MiB, 2)
    h, other = chunk_hash(data), chunk_hash(b"another chunk")

    def mislabelled(channel: Channel) -> bytes:  # the right bytes, sealed for another chunk's body
        head = channel.record(wire.encode_header({"op": "put_chunk", "hash": h, "len": len(data)}))
        return head + b"".join(body_record(channel, data, other, at) for at in range(0, len(data), RECORD))

    assert b'"ok":true' not in await forge(node, mislabelled)
    assert not node.store.has(h) and not node.files()
    await still_serving(node)


async def test_bodies_of_a_batch_in_each_other_s_places_are_refused_and_nothing_is_stored(node):
    first, second = randbytes(MiB, 4), randbytes(MiB, 5)
    a, b = chunk_hash(first), chunk_hash(second)

    def swapped(channel: Channel) -> bytes:  # each body sealed for itself, sent in the other's place
        head = channel.record(wire.encode_header({"op": "put_chunks", "chunks": [[a, MiB], [b, MiB]], "len": 2 * MiB}))
        return head + body_record(channel, second, b, 0) + body_record(channel, first, a, 0)

    assert b'"ok":true' not in await forge(node, swapped)
    assert not node.store.has(a) and not node.store.has(b) and not node.files()
    await still_serving(node)


@pytest.mark.parametrize("cut", ["mid-record", "between records"])
async def test_a_truncated_body_stores_nothing(node, cut):
    data = randbytes(3 * MiB, 3)
    h = chunk_hash(data)

    def truncated(channel: Channel) -> bytes:
        head = channel.record(wire.encode_header({"op": "put_chunk", "hash": h, "len": len(data)}))
        first, second = body_record(channel, data, h, 0), body_record(channel, data, h, RECORD)
        return head + first + (second[: len(second) // 2] if cut == "mid-record" else b"")

    assert b'"ok":true' not in await forge(node, truncated)
    assert not node.store.has(h) and not node.files()
    await still_serving(node)


async def test_a_record_longer_than_allowed_is_refused_before_it_is_read(node):
    with trio.fail_after(3):  # far below the request deadline: refused at once, not after waiting for 1 MiB
        answered = await forge(node, lambda channel: HEAD.pack(RECORD + 1))
    assert b'"ok":true' not in answered
    await still_serving(node)


async def still_serving(node) -> None:
    async with await client_of(node) as client:
        assert (await client.info())["rank"] == 1


# -- the stream itself ---------------------------------------------------------------------


@asynccontextmanager
async def sealed_pair(source: Path, data: bytes) -> AsyncIterator[tuple[SealedStream, SealedStream, int]]:
    """Two ends of a sealed connection over a socket pair, and ``data`` in ``source``, open."""
    a, b = socket.socketpair()
    nonces = Nonces(wire.new_nonce(), wire.new_nonce())
    streams = []
    for sock, server_side in ((a, False), (b, True)):
        sock.setblocking(False)
        keys = channel_keys(JOB, SECRET, nonces, server_side=server_side)
        streams.append(SealedStream(trio.SocketStream(trio.socket.from_stdlib_socket(sock)), *keys))
    source.write_bytes(data)
    fd = os.open(source, os.O_RDONLY)
    try:
        yield streams[0], streams[1], fd
    finally:
        os.close(fd)
        for stream in streams:
            stream.abort()


async def test_a_body_and_messages_around_it_keep_their_order(tmp_path):
    data = randbytes(5 * MiB + 1, 4)
    out = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT, 0o600)
    hasher = xxhash.xxh3_128()
    try:
        async with sealed_pair(tmp_path / "src", data) as (a, b, fd), trio.open_nursery() as nursery:

            async def send():
                await wire.send_msg(a, {"op": "first"})
                await bodies.send_file(a, fd, 0, len(data), b"label")
                await wire.send_msg(a, {"op": "after"}, b"a small body")

            nursery.start_soon(send)
            assert await wire.recv_msg(b) == {"op": "first"}
            await bodies.receive_into_file(b, len(data), out, hasher, 0, b"label")
            after = await wire.recv_msg(b)
            assert after["op"] == "after" and await wire.recv_body(b, after["len"], 100) == b"a small body"
        assert os.pread(out, len(data) + 1, 0) == data and hasher.digest() == xxhash.xxh3_128(data).digest()
    finally:
        os.close(out)


async def test_a_body_under_another_label_fails_to_open(tmp_path):
    async with sealed_pair(tmp_path / "src", randbytes(2 * MiB, 5)) as (a, b, fd), trio.open_nursery() as nursery:
        nursery.start_soon(bodies.send_file, a, fd, 0, 2 * MiB, chunk_label("a" * 32, 0))
        with pytest.raises(ProtocolError, match="failed authentication"):
            await bodies.receive_bytes(b, 2 * MiB, None, chunk_label("b" * 32, 0))
        nursery.cancel_scope.cancel()


async def test_cancelling_a_body_midway_waits_for_its_thread_and_closes_cleanly(tmp_path):
    written = []
    async with sealed_pair(tmp_path / "src", randbytes(8 * MiB, 6)) as (a, b, fd), trio.open_nursery() as nursery:

        async def send():
            await bodies.send_file(a, fd, 0, 4 * MiB, b"x")  # half of what is announced below
            await trio.sleep_forever()

        nursery.start_soon(send)
        with trio.move_on_after(1) as scope:
            await bodies.receive(b, 8 * MiB, lambda piece, at: written.append((at, len(piece))), b"x")
        assert scope.cancelled_caught
        nursery.cancel_scope.cancel()
    assert sum(n for _, n in written) == 4 * MiB  # every piece that arrived, each handled whole


async def test_a_peer_with_the_wrong_secret_gets_no_record(node):
    with pytest.raises(PeerError):
        await PeerClient.connect(
            node.address,
            job=JOB,
            secret=b"not the secret of this job",
            tls=tls.from_secret(JOB, b"not the secret of this job"),
            timeout=3,
        )
    await still_serving(node)
