"""Where a restore's chunks come from (tiers/fetch.py): many to a request from the peers,
this node's own copies first, and what no peer gives left for the chunk-by-chunk path.

Real peer services on loopback addresses behind real peer tiers, and a real RAM store.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import trio
from tierfs_testing import free_port

from tests.tiers.conftest import JOB, peer_tier
from tierfs.core.chunks import chunk_hash
from tierfs.ramtier.space import SpaceAccount
from tierfs.store.replicas import ReplicaStore
from tierfs.tiers.fetch import ChunkSources
from tierfs.tiers.local import LocalTier
from tierfs.tiers.peer import PeerTier

CS = 64 << 10


def store_in(root) -> ReplicaStore:
    store = ReplicaStore(root, SpaceAccount(None, root.parent), job=JOB)
    store.load()
    return store


async def peer(nursery, host: str, root, port: int | None = None) -> PeerTier:
    return await peer_tier(nursery, host, store_in(root), port)


def chunks(tmp_path, n: int) -> list[tuple[str, tuple[str, int, int]]]:
    out = []
    for i in range(n):
        data = random.Random(i).randbytes(CS - i)
        path = tmp_path / f"src-{i}"
        path.write_bytes(data)
        out.append((chunk_hash(data), (str(path), 0, len(data))))
    return out


async def test_a_batch_comes_from_the_peers_in_order_and_the_rest_is_left_for_one_by_one(nursery, tmp_path):
    c = chunks(tmp_path, 5)
    local = LocalTier(store_in(tmp_path / "local"))
    a = await peer(nursery, "127.0.0.2", tmp_path / "a")
    b = await peer(nursery, "127.0.0.3", tmp_path / "b")
    await local.put_chunks([c[0]])  # this node's own copy: fetched from here, not from a peer
    await a.put_chunks(c[1:3])
    await b.put_chunks(c[1:4])  # c[4]: no one holds it
    sources = ChunkSources([local, a, b])
    fd = os.open(tmp_path / "target", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        wanted = [(h, n, fd, i * CS) for i, (h, (_, _, n)) in enumerate(c)]
        assert sources.batch() == (a.batch_bytes, a.batch_chunks)
        left = await sources.fetch_many_into(wanted, prefer=0)
        assert sorted(left) == sorted([wanted[0], wanted[4]])
        for i, (_, (path, _, n)) in enumerate(c[1:4], 1):
            assert os.pread(fd, n, i * CS) == Path(path).read_bytes()
    finally:
        os.close(fd)
    assert sources.bytes_from == {a.name: c[1][1][2] + c[2][1][2], b.name: c[3][1][2]}


async def test_a_peer_that_fails_a_batch_is_set_aside_and_the_next_one_gives_it(nursery, tmp_path):
    c = chunks(tmp_path, 3)
    down = await peer(nursery, "127.0.0.2", tmp_path / "down", port=free_port("127.0.0.2"))
    up = await peer(nursery, "127.0.0.3", tmp_path / "up")
    await up.put_chunks(c)
    sources = ChunkSources([down, up])
    fd = os.open(tmp_path / "target", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with trio.fail_after(10):
            assert await sources.fetch_many_into([(h, n, fd, i * CS) for i, (h, (_, _, n)) in enumerate(c)]) == []
        for i, (_, (path, _, n)) in enumerate(c):
            assert os.pread(fd, n, i * CS) == Path(path).read_bytes()
    finally:
        os.close(fd)
    assert sources.alive == [up] and sources.bytes_from == {up.name: sum(n for _, (_, _, n) in c)}
