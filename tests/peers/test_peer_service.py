"""The peer service end to end: real servers and clients on loopback addresses, real stores.

Servers bind 127.0.0.2 and 127.0.0.3 on ephemeral ports; raw sockets check what a peer
that skips or fails the handshake can make the server do (nothing) and read (nothing).
Timeouts are shortened so that the stall tests take about a second.
"""

from __future__ import annotations

import functools
import os
import random
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import trio.testing

from tests import helpers
from tierfs.core.chunks import chunk_hash
from tierfs.core.manifest import Manifest
from tierfs.peers import tls as peer_tls
from tierfs.peers import wire
from tierfs.peers.client import PeerClient
from tierfs.peers.pool import ConnectionPool
from tierfs.peers.wire import AuthFailed, NoSpace, PeerError, PeerUnavailable
from tierfs.ramtier.space import SpaceAccount
from tierfs.store.replicas import ReplicaStore
from tierfs.store.server import Timeouts, serve

JOB = "llama"
SECRET = b"a-secret-of-the-job-0123"
CS = 64 << 10  # chunk size: small trees, several chunks per file
FAST = Timeouts(handshake=0.5, idle=0.5, request=2.0)
Where = dict[str, tuple[str, int, int]]


@dataclass
class Node:
    host: str
    port: int
    store: ReplicaStore
    space: SpaceAccount
    root: Path

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def connect(self, **kw) -> PeerClient:
        return PeerClient.connect(self.address, **{"job": JOB, "secret": SECRET, "tls": None, "timeout": 2.0, **kw})

    def files(self) -> list[Path]:
        """Every file under the store's chunks directory, temp files included."""
        return sorted(p for p in (self.root / "chunks").rglob("*") if p.is_file())


async def start_node(
    nursery: trio.Nursery,
    host: str,
    root: Path,
    *,
    capacity: int | None = None,
    local=None,
    grace: float = 0.0,
    timeouts: Timeouts = FAST,
    keep_from=lambda: 10**9,
    tls=None,
) -> Node:
    root.mkdir(parents=True)
    space = SpaceAccount(capacity, root)
    store = ReplicaStore(root, space, local, job=JOB, grace=grace, keep_from=keep_from)
    store.load()
    port = await nursery.start(
        functools.partial(
            serve,
            (host, 0),
            job=JOB,
            secret=SECRET,
            store=store,
            timeouts=timeouts,
            tls=tls,
            info=lambda: {"rank": 1, "topology": [["zone", "a"]], "free": 123},
        )
    )
    return Node(host, port, store, space, root)


def randbytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def make_step(base: Path, rank: int, step: int, files: dict[str, bytes]) -> tuple[Manifest, Where]:
    return helpers.make_step(base, files, job=JOB, rank=rank, step=step, chunk_size=CS)


async def push(client: PeerClient, manifest: Manifest, where: Where) -> None:
    hashes = list(where)
    for h, held in zip(hashes, await client.have(hashes), strict=True):
        if not held:
            await client.put_chunk(h, *where[h])
    await client.put_manifest(manifest.rank, manifest.step, manifest.to_json())


def read_range(location: tuple[str, int, int]) -> bytes:
    path, offset, length = location
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


async def read_until_closed(stream: trio.SocketStream, timeout: float = 3.0) -> bytes:
    """Everything the server sends until it closes (a reset counts as closed)."""
    parts = []
    with trio.fail_after(timeout):
        while True:
            try:
                data = await stream.receive_some(1 << 16)
            except trio.BrokenResourceError:
                break
            if not data:
                break
            parts.append(data)
    return b"".join(parts)


def frame(header: dict, body: bytes = b"") -> bytes:
    return wire.encode_header({**header, "len": len(body)} if body else header) + body


# -- authentication -------------------------------------------------------------------------


async def test_authenticated_client_gets_info_and_lists(nursery, tmp_path):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n")
    async with await node.connect(local_host="127.0.0.4") as client:
        assert await client.info() == {"rank": 1, "topology": [["zone", "a"]], "free": 123}
        assert await client.list() == []
        assert await client.have([chunk_hash(b"x")]) == [False]


async def test_wrong_secret_is_refused_and_nothing_is_stored(nursery, tmp_path):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n")
    with pytest.raises(AuthFailed):
        await PeerClient.connect(node.address, job=JOB, secret=b"not-the-secret-at-all", tls=None, timeout=2)
    # A raw peer that answers the challenge with a proof made from a wrong secret, and sends
    # a chunk right behind it without waiting: refused, and not one byte of it stored.
    body = randbytes(CS, 1)
    async with await trio.open_tcp_stream(*node.address) as s:
        nonce = wire.new_nonce()
        await s.send_all(frame({"op": "hello", "version": wire.VERSION, "job": JOB, "nonce": nonce}))
        challenge = await wire.recv_msg(s)
        bad = wire.proof(b"not-the-secret-at-all", "client", JOB, nonce, challenge["nonce"])
        await s.send_all(
            frame({"op": "auth", "proof": bad}) + frame({"op": "put_chunk", "hash": chunk_hash(body)}, body)
        )
        answer = await read_until_closed(s)
    assert b'"error":"authentication failed"' in answer and body[:64] not in answer
    assert node.files() == [] and node.store.stats()["chunks"] == 0


async def test_job_mismatch_is_refused_by_both_sides(nursery, tmp_path):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n")
    with pytest.raises(AuthFailed):
        await PeerClient.connect(node.address, job="other-job", secret=SECRET, tls=None, timeout=2)
    # With the right secret but another job, the server refuses the client's proof too.
    async with await trio.open_tcp_stream(*node.address) as s:
        nonce = wire.new_nonce()
        await s.send_all(frame({"op": "hello", "version": wire.VERSION, "job": "other-job", "nonce": nonce}))
        challenge = await wire.recv_msg(s)
        proof = wire.proof(SECRET, "client", "other-job", nonce, challenge["nonce"])
        await s.send_all(frame({"op": "auth", "proof": proof}) + frame({"op": "list"}))
        answer = await read_until_closed(s)
    assert b"authentication failed" in answer and b"manifests" not in answer


async def test_skipping_the_handshake_gets_nothing_in_and_nothing_out(nursery, tmp_path):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n")
    manifest, where = make_step(tmp_path, 2, 10, {"a": randbytes(2 * CS, 2)})
    async with await node.connect() as client:
        await push(client, manifest, where)
    stored = node.files()
    secret_chunk = next(iter(where))
    payload = read_range(where[secret_chunk])

    body = randbytes(CS, 3)
    requests = [
        frame({"op": "put_chunk", "hash": chunk_hash(body)}, body),
        frame({"op": "get_chunk", "hash": secret_chunk, "offset": 0}),
        frame({"op": "get_manifest", "rank": 2, "step": 10}),
        frame({"op": "list"}),
        frame({"op": "hello", "version": wire.VERSION, "job": JOB, "nonce": wire.new_nonce()})  # then skips auth:
        + frame({"op": "list"}),
    ]
    for request in requests:
        async with await trio.open_tcp_stream(*node.address, local_address="127.0.0.5") as s:
            await s.send_all(request)
            answer = await read_until_closed(s)
        assert b'"error":"authentication' in answer
        assert len(answer) < 300 and payload[:64] not in answer
        assert b"manifests" not in answer and b'"job"' not in answer
    assert node.files() == stored
    with pytest.raises(ValueError):
        await PeerClient.connect(node.address, job=JOB, secret=b"", tls=None)
    with pytest.raises(ValueError):
        await serve(("127.0.0.2", 0), job=JOB, secret=b"", store=node.store, info=dict, tls=None)


async def test_refusals_keep_the_connection_and_violations_close_it(nursery, tmp_path):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n")

    async def authenticated() -> trio.SocketStream:
        s = await trio.open_tcp_stream(*node.address)
        await wire.client_handshake(s, job=JOB, secret=SECRET)
        return s

    async with await authenticated() as s:
        await s.send_all(frame({"op": "rename-the-moon"}))
        assert "unknown op" in (await wire.recv_msg(s))["error"]
        await s.send_all(frame({"op": "list"}))
        assert await wire.recv_msg(s) == {"ok": True, "manifests": []}
    violations = [
        frame({"op": "list"}, b"a body where none belongs"),
        frame({"op": "put_chunk", "hash": "not-a-hash"}, b"x"),
        frame({"op": "put_chunk", "hash": chunk_hash(b"x"), "len": (64 << 20) + 1}),
        frame({"op": "get_chunk", "hash": chunk_hash(b"x"), "offset": -1}),
        frame({"op": "have", "hashes": "all of them"}),
        struct.pack(">I", (1 << 20) + 1),
    ]
    for request in violations:
        async with await authenticated() as s:
            await s.send_all(request)
            answer = await read_until_closed(s)  # answered, then closed
        assert answer.startswith(struct.pack(">I", len(answer) - 4)) and b'"error"' in answer
    assert node.files() == []


# -- chunks ---------------------------------------------------------------------------------


async def test_chunk_round_trip_with_ranges(nursery, tmp_path):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n")
    data = randbytes(CS + 1000, 4)
    source = tmp_path / "source"
    source.write_bytes(b"x" * 77 + data)
    h, other = chunk_hash(data), chunk_hash(b"absent")
    async with await node.connect() as client:
        await client.put_chunk(h, source, 77, len(data))
        await client.put_chunk(h, source, 77, len(data))  # again: a harmless duplicate
        assert await client.have([h, other]) == [True, False]
        assert await client.get_chunk(h) == data
        assert await client.get_chunk(h, 0, len(data)) == data
        assert await client.get_chunk(h, 100, 1000) == data[100:1100]
        assert await client.get_chunk(h, len(data) - 10) == data[-10:]
        with pytest.raises(PeerError, match="outside the chunk"):
            await client.get_chunk(h, len(data) - 10, 11)
        with pytest.raises(PeerError, match="not found"):
            await client.get_chunk(other)
        target = tmp_path / "target"
        fd = os.open(target, os.O_RDWR | os.O_CREAT)
        try:
            assert await client.get_chunk_into(h, fd, 5) == len(data)
        finally:
            os.close(fd)
        assert target.read_bytes() == bytes(5) + data
        assert await client.info()  # refusals left the connection in step
    assert [p.name for p in node.files()] == [h]
    assert (node.root / "chunks" / h[:2] / h).read_bytes() == data
    assert node.space.used >= len(data)


async def test_wrong_hash_is_refused_and_nothing_stored(nursery, tmp_path):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n")
    source = tmp_path / "source"
    source.write_bytes(randbytes(CS, 5))
    async with await node.connect() as client:
        with pytest.raises(PeerError, match="hash mismatch"):
            await client.put_chunk(chunk_hash(b"something else"), source, 0, CS)
        assert await client.have([chunk_hash(b"something else")]) == [False]
    assert node.files() == [] and node.space.used == 0


async def test_corrupt_chunk_is_not_served_and_is_removed(nursery, tmp_path):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n")
    source = tmp_path / "source"
    source.write_bytes(data := randbytes(CS, 6))
    h = chunk_hash(data)
    async with await node.connect() as client:
        await client.put_chunk(h, source, 0, CS)
        path = node.root / "chunks" / h[:2] / h
        with open(path, "r+b") as f:  # one bit of RAM rots
            f.seek(1234)
            byte = f.read(1)
            f.seek(1234)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(PeerError, match="corrupt"):
            await client.get_chunk(h, 0, 10)
        assert not path.exists()
        assert await client.have([h]) == [False]
    assert node.space.used == 0 and node.store.stats()["chunks"] == 0


async def test_no_space_is_refused_before_the_chunk_is_stored(nursery, tmp_path):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n", capacity=CS + CS // 2)
    source = tmp_path / "source"
    source.write_bytes(randbytes(2 * CS, 7))
    first, second = (chunk_hash(source.read_bytes()[i * CS : (i + 1) * CS]) for i in range(2))
    async with await node.connect() as client:
        await client.put_chunk(first, source, 0, CS)
        with pytest.raises(NoSpace):
            await client.put_chunk(second, source, CS, CS)
        assert await client.have([first, second]) == [True, False]  # still in step
    assert [p.name for p in node.files()] == [first]
    assert node.space.used <= node.space.capacity


@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
async def test_a_ram_tier_that_fills_mid_chunk_answers_no_space_and_stays_in_step(
    nursery, tmp_path, small_tmpfs, sealed
):
    """A chunk larger than what is left of the tmpfs: found by the write, after part of the body
    is stored; the rest is still read, so the answer arrives on a connection that goes on."""
    channel = peer_tls.from_secret(JOB, SECRET) if sealed else None
    node = await start_node(nursery, "127.0.0.2", small_tmpfs(1 << 20) / "n", capacity=1 << 30, tls=channel)
    source = tmp_path / "source"
    source.write_bytes(randbytes(4 << 20, 11))  # 4 MiB: moved by a worker thread, not inline
    big, small = chunk_hash(source.read_bytes()), chunk_hash(source.read_bytes()[:CS])
    async with await node.connect(tls=channel) as client:
        with pytest.raises(NoSpace):
            await client.put_chunk(big, source, 0, 4 << 20)
        await client.put_chunk(small, source, 0, CS)  # the same connection
        assert await client.have([big, small]) == [False, True]
    assert [p.name for p in node.files()] == [small]  # the partial chunk's file is gone


# -- many chunks in one request -------------------------------------------------------------


def chunks_of(path: Path, sizes: list[int], seed: int) -> list[tuple[str, Path, int, int]]:
    """Chunks of the given sizes, back to back in one new file: ``(hash, path, offset, length)``."""
    data = randbytes(sum(sizes), seed)
    path.write_bytes(data)
    out, at = [], 0
    for n in sizes:
        out.append((chunk_hash(data[at : at + n]), path, at, n))
        at += n
    return out


@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
async def test_many_chunks_go_in_one_request_and_each_is_stored(nursery, tmp_path, sealed):
    channel = peer_tls.from_secret(JOB, SECRET) if sealed else None
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n", tls=channel)
    # Small ones moved on the loop, and a batch large enough for a worker thread; one empty chunk.
    chunks = chunks_of(tmp_path / "a", [1000, 0, CS, 3 * CS + 7], 12) + chunks_of(tmp_path / "b", [2 << 20], 13)
    async with await node.connect(tls=channel) as client:
        await client.put_chunks(chunks[:2])
        await client.put_chunks(chunks)  # the first two again: harmless duplicates
        assert await client.have([h for h, *_ in chunks]) == [True] * len(chunks)
        for h, path, offset, length in chunks:
            assert await client.fetch_chunk(h, length) == read_range((str(path), offset, length))
    assert sorted(p.name for p in node.files()) == sorted({h for h, *_ in chunks})


async def test_a_bad_chunk_in_a_batch_is_refused_and_the_others_are_stored(nursery, tmp_path):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n")
    chunks = chunks_of(tmp_path / "src", [CS, CS, CS], 14)
    liar = (chunk_hash(b"something else"), *chunks[1][1:])
    async with await node.connect() as client:
        with pytest.raises(PeerError, match="hash mismatch"):
            await client.put_chunks([chunks[0], liar, chunks[2]])
        assert await client.have([chunks[0][0], liar[0], chunks[2][0]]) == [True, False, True]  # in step
    assert sorted(p.name for p in node.files()) == sorted([chunks[0][0], chunks[2][0]])


async def test_a_batch_past_the_space_stores_what_fits_and_answers_no_space(nursery, tmp_path):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n", capacity=CS + CS // 2)
    chunks = chunks_of(tmp_path / "src", [CS, CS, 100], 15)
    async with await node.connect() as client:
        with pytest.raises(NoSpace):
            await client.put_chunks(chunks)
        assert await client.have([h for h, *_ in chunks]) == [True, False, True]
    assert node.space.used <= node.space.capacity and len(node.files()) == 2


@pytest.mark.parametrize("sealed", [False, True], ids=["clear", "sealed"])
async def test_many_chunks_come_back_in_one_request_and_absent_ones_are_named(nursery, tmp_path, sealed):
    channel = peer_tls.from_secret(JOB, SECRET) if sealed else None
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n", tls=channel)
    chunks = chunks_of(tmp_path / "a", [1000, CS, 2 << 20, 0], 17)
    absent = chunk_hash(b"never stored")
    fd = os.open(tmp_path / "target", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        async with await node.connect(tls=channel) as client:
            await client.put_chunks(chunks)
            h, _, _, length = chunks[0]
            asks = [
                (h, length, fd, 0),
                (absent, 10, fd, 0),
                (chunks[1][0], CS, fd, 4 << 20),
                (h, length + 1, fd, 0),  # a length the chunk does not have: not it
                (chunks[2][0], 2 << 20, fd, 8 << 20),
                (chunks[3][0], 0, fd, 0),
            ]
            assert await client.get_chunks_into(asks) == [True, False, True, False, True, True]
            assert await client.get_chunks_into([(absent, 10, fd, 0)]) == [False]  # nothing comes: no body
            assert (await client.info())["rank"] == 1  # in step
        for (_, path, offset, length), at in zip(chunks[:3], (0, 4 << 20, 8 << 20), strict=True):
            assert os.pread(fd, length, at) == read_range((str(path), offset, length))
    finally:
        os.close(fd)


async def hostile_node(nursery, answer: dict, body: bytes) -> tuple[str, int]:
    """A peer holding the job's secret that answers any request with ``answer`` and ``body``."""

    async def serve_one(stream: trio.SocketStream) -> None:
        async with stream:
            await wire.authenticate(stream, job=JOB, secret=SECRET)
            await wire.recv_msg(stream)
            try:
                await wire.send_msg(stream, answer)
                await stream.send_all(body)
            except (PeerUnavailable, trio.BrokenResourceError):
                pass  # the client hung up on a bad answer before its body was all sent

    listeners = await nursery.start(functools.partial(trio.serve_tcp, serve_one, 0, host="127.0.0.3"))
    return "127.0.0.3", listeners[0].socket.getsockname()[1]


@pytest.mark.parametrize(
    "answer, body, error",
    [
        ({"ok": True, "held": [True, True], "len": 2 * CS}, bytes(2 * CS), "do not hash"),
        ({"ok": True, "held": [True], "len": CS}, bytes(CS), "does not match the question"),
        ({"ok": True, "held": [True, "yes"], "len": 2 * CS}, bytes(2 * CS), "does not match the question"),
        ({"ok": True, "held": [True, False], "len": 2 * CS}, bytes(2 * CS), "for the chunks it says it holds"),
        ({"ok": True, "held": [True, True], "len": (64 << 20) + 1}, b"", "exceeds"),
    ],
    ids=["wrong bytes", "short list", "not booleans", "body too long", "over the cap"],
)
async def test_a_peer_s_answer_to_many_chunks_is_checked(nursery, tmp_path, answer, body, error):
    address = await hostile_node(nursery, answer, body)
    chunks = chunks_of(tmp_path / "a", [CS, CS], 18)
    fd = os.open(tmp_path / "target", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        async with await PeerClient.connect(address, job=JOB, secret=SECRET, tls=None, timeout=3) as client:
            with pytest.raises(PeerError, match=error):
                await client.get_chunks_into([(h, n, fd, i * CS) for i, (h, _, _, n) in enumerate(chunks)])
    finally:
        os.close(fd)


async def test_a_client_refuses_a_batch_no_peer_takes(tmp_path):
    client = PeerClient(trio.testing.memory_stream_pair()[0], ("127.0.0.2", 1), 1.0)
    one = chunks_of(tmp_path / "src", [10], 16)[0]
    for chunks in (
        [],
        [one] * (wire.MAX_BATCH + 1),
        [one[:3] + (wire.MAX_CHUNK + 1,)],
        [one[:3] + (wire.MAX_CHUNK,), one],
    ):
        with pytest.raises(ValueError):
            await client.put_chunks(chunks)
        with pytest.raises(ValueError):
            await client.get_chunks_into([(h, n, 0, 0) for h, _, _, n in chunks])


BAD_BATCHES = {
    "not a list": {"chunks": "all of them", "len": 1},
    "empty": {"chunks": [], "len": 1},
    "too many": {"chunks": [[chunk_hash(b"x"), 1]] * (wire.MAX_BATCH + 1), "len": wire.MAX_BATCH + 1},
    "bad hash": {"chunks": [[chunk_hash(b"x"), 1], ["not-a-hash", 1]], "len": 2},
    "negative": {"chunks": [[chunk_hash(b"x"), -1]], "len": 1},
    "not a pair": {"chunks": [[chunk_hash(b"x"), 1, "extra"]], "len": 1},
    "length mismatch": {"chunks": [[chunk_hash(b"x"), 2]], "len": 1},  # the body's length is not the chunks'
    "too large": {"chunks": [[chunk_hash(b"x"), 40 << 20], [chunk_hash(b"y"), 40 << 20]], "len": 80 << 20},
}


@pytest.mark.parametrize(
    "op, bad",
    [
        (op, bad)
        for op in ("put_chunks", "get_chunks")
        for bad in BAD_BATCHES
        if (op, bad) != ("get_chunks", "length mismatch")
    ],
)  # a get has no body
async def test_a_malformed_batch_is_refused_before_its_body_is_read(nursery, tmp_path, op, bad):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n")
    header = {"op": op, **BAD_BATCHES[bad]}
    if op == "get_chunks":
        del header["len"]
    async with await trio.open_tcp_stream(*node.address) as s:
        await wire.client_handshake(s, job=JOB, secret=SECRET)
        await s.send_all(wire.encode_header(header) + (b"x" if op == "put_chunks" else b""))
        answer = await read_until_closed(s)  # answered, then closed
    assert b'"error"' in answer and op.encode() in answer
    assert node.files() == [] and node.space.used == 0


# -- manifests ------------------------------------------------------------------------------


async def test_manifest_is_refused_until_its_chunks_are_held(nursery, tmp_path):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n")
    manifest, where = make_step(tmp_path, 2, 10, {"a": randbytes(2 * CS + 5, 8), "b": b"tiny"})
    data = manifest.to_json()
    async with await node.connect() as client:
        with pytest.raises(PeerError, match="4 of the manifest's 4 chunks are missing"):
            await client.put_manifest(2, 10, data)
        with pytest.raises(PeerError, match="not rank 3"):
            await client.put_manifest(3, 10, data)
        with pytest.raises(PeerError, match="unusable manifest"):
            await client.put_manifest(2, 10, b'{"format": 1}')
        for h in list(where)[:2]:
            await client.put_chunk(h, *where[h])
        with pytest.raises(PeerError, match="2 of the manifest's 4"):
            await client.put_manifest(2, 10, data)
        assert await client.list() == []
        await push(client, manifest, where)
        assert await client.list() == [(2, 10)]
        assert await client.get_manifest(2, 10) == data
        with pytest.raises(PeerError, match="not found"):
            await client.get_manifest(2, 11)
    assert (node.root / "manifests" / "rank-2" / "step-000000000010.json").read_bytes() == data


async def test_other_jobs_manifests_are_refused(nursery, tmp_path):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n")
    manifest, where = make_step(tmp_path, 2, 10, {"a": b"data"})
    manifest.job = "other-job"
    async with await node.connect() as client:
        h, location = next(iter(where.items()))
        await client.put_chunk(h, *location)
        with pytest.raises(PeerError, match="for job 'other-job'"):
            await client.put_manifest(2, 10, manifest.to_json())


class OwnSteps:
    """This node's own committed chunks (a data-parallel twin's), as the daemon provides them."""

    def __init__(self, where: Where):
        self.where = where

    def find(self, h: str) -> tuple[str, int, int] | None:
        return self.where.get(h)


async def test_data_parallel_twin_replica_costs_no_chunk_bytes(nursery, tmp_path):
    files = {"model.safetensors": randbytes(3 * CS + 11, 9), "optim.pt": randbytes(2 * CS, 10)}
    _, own = make_step(tmp_path, 4, 50, files)  # rank 4's own step: same bytes as rank 0's
    node = await start_node(nursery, "127.0.0.3", tmp_path / "n", local=OwnSteps(own))
    manifest, where = make_step(tmp_path, 0, 50, files)
    async with await node.connect() as client:
        assert await client.have(list(where)) == [True] * len(where)
        await push(client, manifest, where)
        assert await client.list() == [(0, 50)]
        sent = client.bytes_sent
    chunk_bytes = sum(length for _, _, length in where.values())
    manifest_bytes = len(manifest.to_json())
    assert chunk_bytes > 5 * CS
    assert sent < manifest_bytes + 4096  # the manifest and a few headers, no chunk
    for h, location in where.items():
        assert (node.root / "chunks" / h[:2] / h).read_bytes() == read_range(location)
    assert node.store.stats() == {"chunks": len(where), "bytes": chunk_bytes, "manifests": 1}
    assert node.space.used >= chunk_bytes


async def test_newer_step_drops_older_and_collects_unreferenced_chunks(nursery, tmp_path):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n", grace=0)
    a, b, c = randbytes(CS, 11), randbytes(CS, 12), randbytes(CS, 13)
    m1, w1 = make_step(tmp_path, 1, 100, {"a": a, "b": b})
    m2, w2 = make_step(tmp_path, 1, 200, {"a": a, "b": c})
    other, w3 = make_step(tmp_path, 5, 100, {"x": b})  # another rank still needs b
    async with await node.connect() as client:
        await push(client, m1, w1)
        await push(client, other, w3)
        await push(client, m2, w2)
        assert await client.list() == [(1, 200), (5, 100)]
        assert await client.have([chunk_hash(x) for x in (a, b, c)]) == [True, True, True]
    async with await node.connect() as client:  # the first sender is gone: nothing pins b now
        m3, w4 = make_step(tmp_path, 5, 300, {"x": c})
        await push(client, m3, w4)
        assert await client.list() == [(1, 200), (5, 300)]
        assert await client.have([chunk_hash(x) for x in (a, b, c)]) == [True, False, True]
    assert {p.name for p in node.files()} == {chunk_hash(a), chunk_hash(c)}
    assert not (node.root / "manifests" / "rank-1" / "step-000000000100.json").exists()
    assert node.space.used == sum(os.stat(p).st_blocks * 512 for p in node.root.rglob("*") if p.is_file())


async def test_a_superseded_replica_stays_while_the_job_may_restore_it(nursery, tmp_path):
    floor = [None]  # the newest step complete on every rank: unknown at first
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n", grace=0, keep_from=lambda: floor[0])
    m1, w1 = make_step(tmp_path, 1, 100, {"a": randbytes(CS, 31)})
    m2, w2 = make_step(tmp_path, 1, 200, {"a": randbytes(CS, 32)})
    async with await node.connect() as client:
        await push(client, m1, w1)
        await push(client, m2, w2)
        assert await client.list() == [(1, 100), (1, 200)]  # unknown: nothing is superseded for sure
        floor[0] = 100  # another rank has not got step 200: 100 may be the only complete step
        node.store.retain()
        assert await client.list() == [(1, 100), (1, 200)]
        floor[0] = 200
        node.store.retain()
        assert await client.list() == [(1, 200)]
    assert not (node.root / "manifests" / "rank-1" / "step-000000000100.json").exists()


async def test_chunks_a_connected_sender_relies_on_outlive_a_zero_grace(nursery, tmp_path):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n", grace=0)
    m1, w1 = make_step(tmp_path, 1, 100, {"a": randbytes(CS, 21)})
    m2, w2 = make_step(tmp_path, 1, 200, {"a": randbytes(CS, 22)})
    async with await node.connect() as pusher:
        (h,) = w2
        path, offset, length = w2[h]
        await pusher.put_chunk(h, path, offset, length)  # its manifest is still to come
        async with await node.connect() as other:
            await push(other, m1, w1)  # a manifest lands: the collector runs
        assert await pusher.have([h]) == [True]
        await pusher.put_manifest(1, 200, m2.to_json())
        assert await pusher.list() == [(1, 200)]
    assert node.store.collect_garbage() == 0
    assert {p.name for p in node.files()} == set(w2)


async def test_unreferenced_chunks_survive_the_grace_period(nursery, tmp_path):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n", grace=600)
    m1, w1 = make_step(tmp_path, 1, 100, {"a": randbytes(CS, 14)})
    m2, w2 = make_step(tmp_path, 1, 200, {"a": randbytes(CS, 15)})
    async with await node.connect() as client:
        await push(client, m1, w1)
        await push(client, m2, w2)
        assert await client.list() == [(1, 200)]
        assert await client.have(list(w1) + list(w2)) == [True, True]  # a pusher may rely on it
    assert node.store.collect_garbage() == 0
    assert node.store.collect_garbage(now=time.time() + 601) == 1
    assert {p.name for p in node.files()} == set(w2)


def test_load_after_restart_cleans_up_and_accounts(tmp_path):
    root = tmp_path / "replicas"
    manifest, where = make_step(tmp_path, 2, 10, {"a": randbytes(CS + 3, 16)})
    for h, location in where.items():
        (root / "chunks" / h[:2]).mkdir(parents=True, exist_ok=True)
        (root / "chunks" / h[:2] / h).write_bytes(read_range(location))
    (root / "manifests" / "rank-2").mkdir(parents=True)
    (root / "manifests" / "rank-2" / "step-000000000010.json").write_bytes(manifest.to_json())
    (root / "manifests" / "rank-2" / "step-000000000009.json").write_bytes(b"garbage")
    (root / "chunks" / ".tmp-half-written").write_bytes(b"x" * 100)
    space = SpaceAccount(None, root)
    store = ReplicaStore(root, space, job=JOB, grace=0)
    store.load()
    assert store.manifests() == [(2, 10)]
    assert all(store.has(h) for h in where) and store.stats()["chunks"] == 2
    assert not (root / "chunks" / ".tmp-half-written").exists()
    assert not (root / "manifests" / "rank-2" / "step-000000000009.json").exists()
    assert space.used == sum(os.stat(p).st_blocks * 512 for p in root.rglob("*") if p.is_file())
    assert store.chunk_file(next(iter(where)))[0].startswith(str(root / "chunks"))


# -- failures -------------------------------------------------------------------------------


async def test_stalled_clients_do_not_block_others_and_are_dropped(nursery, tmp_path):
    node = await start_node(nursery, "127.0.0.2", tmp_path / "n", timeouts=Timeouts(handshake=1, idle=1))
    manifest, where = make_step(tmp_path, 2, 10, {"a": randbytes(3 * CS, 17)})
    # One stalls before authenticating, one after: each sends half a header and waits.
    started = trio.current_time()
    before = await trio.open_tcp_stream(*node.address)
    await before.send_all(b"\x00\x00")
    after = await trio.open_tcp_stream(*node.address)
    await wire.client_handshake(after, job=JOB, secret=SECRET)
    await after.send_all(struct.pack(">I", 50) + b'{"op":')
    async with await node.connect() as client:  # meanwhile, a normal client is served
        await push(client, manifest, where)
        assert await client.list() == [(2, 10)]
    async with before, after:
        for stalled in (before, after):  # served while both were still connected
            with trio.move_on_after(0.01) as waiting:
                await stalled.receive_some(100)
            assert waiting.cancelled_caught
        assert await read_until_closed(before, 3) == b""  # dropped by the handshake deadline
        assert await read_until_closed(after, 3) == b""  # dropped by the idle deadline
    assert 1 <= trio.current_time() - started < 3


async def test_unreachable_peers_fail_fast(tmp_path):
    # Nobody listening: refused at once.
    probe = trio.socket.socket()
    await probe.bind(("127.0.0.3", 0))
    address = probe.getsockname()
    probe.close()
    with trio.fail_after(2):
        with pytest.raises(PeerUnavailable, match="cannot connect"):
            await PeerClient.connect(address, job=JOB, secret=SECRET, tls=None, timeout=1)
    # Listening but never answering (a wedged process): the deadline ends the wait.
    sock = trio.socket.socket()
    await sock.bind(("127.0.0.3", 0))
    sock.listen(4)
    with sock, trio.fail_after(2):
        with pytest.raises(PeerUnavailable, match="within 0.3s"):
            await PeerClient.connect(sock.getsockname(), job=JOB, secret=SECRET, tls=None, timeout=0.3)


@pytest.mark.parametrize("vanish", [False, True])
async def test_a_server_that_stalls_or_dies_mid_transfer_gives_peer_unavailable(nursery, tmp_path, vanish):
    """An authentic peer that starts sending a chunk, then stops or goes away."""
    data = randbytes(4 << 20, 18)

    async def half_server(stream: trio.SocketStream) -> None:
        async with stream:
            await wire.authenticate(stream, job=JOB, secret=SECRET)
            await wire.recv_msg(stream)
            await wire.send_msg(stream, {"ok": True, "len": len(data)})
            await stream.send_all(data[: 1 << 20])
            if not vanish:
                await trio.sleep_forever()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, half_server, 0, host="127.0.0.3"))
    address = ("127.0.0.3", listeners[0].socket.getsockname()[1])
    for receive in ("bytes", "into"):
        async with await PeerClient.connect(address, job=JOB, secret=SECRET, tls=None, timeout=0.5) as client:
            started = trio.current_time()
            with pytest.raises(PeerUnavailable):
                if receive == "bytes":
                    await client.get_chunk(chunk_hash(data))
                else:
                    fd = os.open(tmp_path / "target", os.O_RDWR | os.O_CREAT)
                    try:
                        await client.get_chunk_into(chunk_hash(data), fd, 0)
                    finally:
                        os.close(fd)
            assert trio.current_time() - started < 2.0  # the 0.5 s deadline, plus a loaded CI box
            with pytest.raises(PeerUnavailable, match="unusable"):
                await client.info()


async def test_a_real_server_shut_down_mid_session(tmp_path):
    async with trio.open_nursery() as servers:
        node = await start_node(servers, "127.0.0.2", tmp_path / "n")
        client = await node.connect()
        assert await client.list() == []
        servers.cancel_scope.cancel()
    with trio.fail_after(3), pytest.raises(PeerUnavailable):
        await client.list()
    await client.aclose()


async def test_after_a_peer_restart_a_pool_drops_every_stale_connection_and_serves_from_a_fresh_one(nursery, tmp_path):
    """Replication keeps several connections to a peer; a restart of that peer breaks them all at once."""
    node = await start_node(nursery, "127.0.0.2", tmp_path / "node", timeouts=Timeouts(handshake=2, idle=60, request=5))
    made = []

    async def connect(timeout):
        made.append(await node.connect())
        return made[-1]

    pool = ConnectionPool(connect)
    both = trio.Event()

    async def hold(client):  # two requests at once: two connections, both idle afterwards
        if len(made) == 2:
            both.set()
        await both.wait()
        return await client.info()

    async with trio.open_nursery() as requests:
        for _ in range(2):
            requests.start_soon(pool.request, hold)
    assert len(pool) == 2
    for client in made:  # the peer's service restarted: both connections are dead
        client._stream.socket.shutdown(socket.SHUT_RDWR)
    assert (await pool.request(lambda client: client.info()))["rank"] == 1
    assert len(made) == 3 and len(pool) == 1
    await pool.aclose()
