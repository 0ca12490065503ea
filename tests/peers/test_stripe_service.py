"""An erasure group end to end in one process: real peer services on loopback, real parity stores.

Four members (3+1) or six (4+2) serve on 127.0.0.2, ...; each puts its step through
:class:`~tierfs.tiers.erasure.ErasureTier` (its windows summed into parity where it is held),
and a member that "lost its RAM" gets its chunks back through the same tier: rebuilt window by
window from a chain of survivors, checked against their names.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from tests import helpers
from tierfs.core import stripes
from tierfs.core.manifest import Manifest
from tierfs.peers.client import PeerClient
from tierfs.peers.placement import PeerInfo
from tierfs.peers.pool import ConnectionPool
from tierfs.peers.wire import PeerError
from tierfs.ramtier.space import SpaceAccount
from tierfs.store import stripe_service
from tierfs.store.erasure_member import ErasureMember
from tierfs.store.replicas import ReplicaStore
from tierfs.store.server import Timeouts, serve
from tierfs.store.stripe_service import OwnShard, StripeService
from tierfs.tiers.base import NotHeld, TierError, TierUnavailable
from tierfs.tiers.erasure import ErasureTier

JOB = "ec"
SECRET = b"a-secret-of-the-job-0123"
CS = 256 << 10


@dataclass
class Member:
    rank: int
    address: tuple[str, int]
    member: ErasureMember
    tier: ErasureTier
    steps: dict[int, tuple[Manifest, dict]]  # its own committed steps: manifest, where

    @property
    def service(self) -> StripeService:
        assert self.member.service is not None, "no grouping agreed"
        return self.member.service


class Dialer:
    """The members' addresses by rank, as the daemon learns them from the peers' ``info``."""

    def __init__(self) -> None:
        self.by_rank: dict[int, tuple[str, int]] = {}
        self.labels: dict[int, tuple] = {}  # rank -> its topology labels, as its info tells them
        self.pools: dict[int, ConnectionPool] = {}
        self.counting: list[PeerClient] = []

    async def dial(self, rank: int) -> ConnectionPool | None:
        if rank not in self.by_rank:
            return None
        if rank not in self.pools:
            address = self.by_rank[rank]

            async def connect(timeout):
                client = await PeerClient.connect(address, job=JOB, secret=SECRET, tls=None, timeout=timeout or 5.0)
                self.counting.append(client)
                return client

            self.pools[rank] = ConnectionPool(connect)
        return self.pools[rank]

    def names(self) -> set[str]:
        return {f"{h}:{p}" for h, p in self.by_rank.values()}

    async def peers(self) -> list[PeerInfo]:
        return [PeerInfo(address, rank, self.labels.get(rank, ())) for rank, address in self.by_rank.items()]

    async def aclose(self) -> None:
        for pool in self.pools.values():
            await pool.aclose()


async def start_group(nursery: trio.Nursery, tmp: Path, d: int, p: int, shards: dict[int, int], step: int = 7):
    """D+P members, grouped as daemons starting together agree it."""
    members = await start_members(nursery, tmp, d, p, shards, step)
    await agree(members.values())
    return members


async def start_members(
    nursery: trio.Nursery,
    tmp: Path,
    d: int,
    p: int,
    shards: dict[int, int],
    step: int = 7,
    labels: dict[int, tuple] | None = None,
    spaces: dict[int, SpaceAccount] | None = None,
) -> dict[int, Member]:
    """One member per rank of ``shards``, serving, with no grouping agreed yet; rank r's step ``step``
    is one file of ``shards[r]`` random bytes (none for 0 bytes)."""
    n, labels = len(shards), labels or {}
    members: dict[int, Member] = {}
    for rank in range(n):
        root = tmp / f"node-{rank}"
        files = {"params": random.Random(rank).randbytes(shards[rank])} if shards[rank] else {}
        (root / "tree").mkdir(parents=True)
        manifest, where = helpers.make_step(root / "tree", files, job=JOB, rank=rank, step=step, chunk_size=CS)
        dialer = Dialer()
        steps = {step: (manifest, where)}

        def own(s, steps=steps):
            return OwnShard(list(steps[s][1].values())) if s in steps else None

        member = ErasureMember(
            rank,
            n,
            stripes.Group(d, p),
            1,
            root / "parity",
            own,
            lambda steps=steps: sorted(steps),
            dialer.dial,
            dialer.peers,
            labels=labels.get(rank, ()),
            space=(spaces or {}).get(rank),
        )
        member.load()
        store = ReplicaStore(root / "replicas", SpaceAccount(None, root), None, job=JOB, keep_from=lambda: 10**9)
        store.load()
        port = await nursery.start(
            functools.partial(
                serve,
                (f"127.0.0.{2 + rank}", 0),
                job=JOB,
                secret=SECRET,
                store=store,
                tls=None,
                timeouts=Timeouts(handshake=2.0, idle=5.0, request=10.0),
                info=lambda rank=rank: {"rank": rank},
                erasure=member,
            )
        )
        members[rank] = Member(rank, (f"127.0.0.{2 + rank}", port), member, ErasureTier(member, dialer), steps)
    for m in members.values():
        m.tier.members.by_rank = {r: o.address for r, o in members.items() if r != m.rank}
        m.tier.members.labels = labels
    return members


async def agree(members: Iterable[Member]) -> str:
    """Every member settles its grouping at once, as daemons starting together: the one digest they agree."""
    async with trio.open_nursery() as agreeing:
        for m in members:
            agreeing.start_soon(m.member.settle)
    digests = {m.member.record.digest if m.member.record else None for m in members}
    assert len(digests) == 1 and None not in digests, digests
    return digests.pop()


async def put_everywhere(members: dict[int, Member], step: int = 7) -> None:
    for m in members.values():
        manifest, where = m.steps[step]
        await m.tier.put_step(manifest, where)


def lose(member: Member) -> None:
    """The member's RAM is gone: its own step and the parity it held."""
    member.steps.clear()
    member.service.parity.forget_before(10**9)


async def rebuilt(member: Member, helper: Member, step: int = 7) -> dict[str, bytes]:
    """Every chunk of ``member``'s step, read through ``helper``'s... own tier, as a restore would."""
    manifest = Manifest.from_json(await member.tier.get_manifest(member.rank, step))
    return {h: await member.tier.get_chunk(h, n) for h, n in manifest.chunk_sizes().items()}


def expected_chunks(member: Member, step: int = 7) -> dict[str, bytes]:
    manifest, where = member.steps[step]
    return {h: helpers_read(where[h]) for h in manifest.chunk_sizes()}


def helpers_read(location) -> bytes:
    path, offset, length = location
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


@pytest.mark.parametrize(("d", "p", "lost"), [(3, 1, (2,)), (4, 2, (0, 3)), (4, 2, (5,))])
async def test_lost_members_come_back_byte_identical_from_the_others(tmp_path, d, p, lost):
    sizes = [3 * CS + 17, 5 * CS, 1, 0, 2 * CS + 4095, 7 * CS][: d + p]
    async with trio.open_nursery() as nursery:
        members = await start_group(nursery, tmp_path, d, p, dict(enumerate(sizes)))
        await put_everywhere(members)
        await members[0].service.poll()
        assert members[0].service.view.survives(7) == p  # every member summed every part
        want = {r: expected_chunks(members[r]) for r in lost}
        for r in lost:
            lose(members[r])
        for r in lost:
            await members[r].service.poll()
            assert members[r].service.view.rebuildable(r, 7)
            assert await rebuilt(members[r], members[r]) == want[r]
        nursery.cancel_scope.cancel()


async def test_a_rebuild_receives_about_its_shard_not_d_times_it(tmp_path):
    d, p = 4, 2
    size = 8 * CS
    async with trio.open_nursery() as nursery:
        members = await start_group(nursery, tmp_path, d, p, dict.fromkeys(range(d + p), size))
        await put_everywhere(members)
        lost = members[1]
        want = expected_chunks(lost)
        lose(lost)
        await lost.service.poll()
        dialer = lost.tier.members
        before = sum(c.bytes_received for c in dialer.counting)
        assert await rebuilt(lost, lost) == want
        received = sum(c.bytes_received for c in dialer.counting) - before
        assert size <= received < size * 1.1  # a chain: one window per window lost, not D of them
        nursery.cancel_scope.cancel()


async def test_more_losses_than_parity_are_refused_not_rebuilt_wrong(tmp_path):
    async with trio.open_nursery() as nursery:
        members = await start_group(nursery, tmp_path, 3, 1, dict.fromkeys(range(4), 3 * CS))
        await put_everywhere(members)
        lose(members[0])
        lose(members[1])
        await members[0].service.poll()
        assert not members[0].service.view.rebuildable(0, 7)
        assert "erasure-coded in erasure 3+1 group 0" in await members[0].tier.lost(0, 7)
        manifest = Manifest.from_json(await members[0].tier.get_manifest(0, 7))
        h, n = next(iter(manifest.chunk_sizes().items()))
        with pytest.raises(TierUnavailable, match="rebuilds at most 1"):
            await members[0].tier.get_chunk(h, n)
        nursery.cancel_scope.cancel()


async def test_a_parity_summed_wrong_fails_the_chunk_check(tmp_path):
    async with trio.open_nursery() as nursery:
        members = await start_group(nursery, tmp_path, 3, 1, dict.fromkeys(range(4), 2 * CS))
        await put_everywhere(members)
        # A window summed twice under another offset: the holder's parity no longer matches.
        holder = members[members[0].service.group.parity_holders(1)[0]]
        await holder.service.poll()
        lose(members[2])  # stripe 1's data from rank 2 must now come through that parity
        key = next(k for k in holder.service.parity.entries()[7] if k[0] == 1)
        path = tmp_path / f"node-{holder.rank}" / "parity" / "parity" / f"7.{key[0]}.{key[1]}"
        data = bytearray(path.read_bytes())
        data[0] ^= 0xFF
        path.write_bytes(bytes(data))
        await members[2].service.poll()
        manifest = Manifest.from_json(await members[2].tier.get_manifest(2, 7))
        failures = 0
        for h, n in manifest.chunk_sizes().items():
            try:
                await members[2].tier.get_chunk(h, n)
            except TierError as e:
                assert "not it" in str(e)
                failures += 1
        assert failures == 1
        nursery.cancel_scope.cancel()


async def test_requests_out_of_the_group_are_refused(tmp_path):
    async with trio.open_nursery() as nursery:
        members = await start_group(nursery, tmp_path, 3, 1, dict.fromkeys(range(4), CS))
        service = members[0].service
        not_held = service.group.data_stripes(0)[0]  # rank 0 gives data there: holds no parity of it
        header = {"op": "ec_put", "step": 1, "stripe": not_held, "parity": 0, "slot": 0, "part_length": 4, "offset": 0}
        with pytest.raises(PeerError, match="does not hold parity 0"):
            await members[1].service.ask(0, header, 0, b"abcd")
        with pytest.raises(PeerError, match="not in this node's group"):
            await members[1].service.ask(0, {"op": "ec_get_manifest", "rank": 9, "step": 7}, 1 << 20)
        with pytest.raises(PeerError, match="at most"):
            big = stripe_service.WINDOW + 1
            await members[1].service.ask(
                0, {"op": "ec_repair", "step": 7, "stripe": 0, "offset": 0, "length": big, "terms": [[0, 1]]}, big
            )
        with pytest.raises(NotHeld):
            await members[1].tier.get_chunk("0" * 32, 10)
        nursery.cancel_scope.cancel()
