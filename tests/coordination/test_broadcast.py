"""The broadcast restore: the planner's guarantees, and the fetches that follow a plan.

The planner is checked on its own (D twins, many nodes under one holder, random needs),
then its plans are run by PlannedFetch over the simulated network with a simulated GCS
that counts every byte read, including when a planned source dies or never gets its chunk.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from tierfs_testing import scenarios
from tierfs_testing.sim import GcsModel, NetModel, SimGcs, SimNetwork

from tierfs.coordination.broadcast import (
    GCS,
    GCS_SOURCE,
    POLL,
    ChunkBoard,
    NodePlan,
    NoSource,
    PlannedFetch,
    Source,
    plan,
    plan_stats,
)

MiB = 1 << 20


def chunk(i: int, tag: str = "c") -> str:
    return hashlib.blake2b(f"{tag}{i}".encode(), digest_size=16).hexdigest()


def primaries(plans) -> Counter:
    """(first source, chunk) -> how many nodes it serves."""
    return Counter((p.sources[h][0].address, h) for p in plans.values() for h in p.sources if p.sources[h])


def test_d_twins_read_each_chunk_from_gcs_once_and_split_the_reads_evenly():
    chunks = [chunk(i) for i in range(16)]
    twins = [f"10.0.0.{i}:7070" for i in range(4)]
    sizes = dict.fromkeys(chunks, 4 * MiB)
    plans = plan(dict.fromkeys(twins, chunks), sizes, {}, True, fan_out=4)
    stats = plan_stats(plans, sizes)
    assert stats["gcs_bytes"] == stats["unique_bytes"] == 16 * 4 * MiB
    assert [len(plans[t].from_gcs()) for t in twins] == [4, 4, 4, 4]
    for t in twins:
        p = plans[t]
        assert sorted(p.order) == sorted(chunks)
        assert p.order[:4] == p.from_gcs()  # what it seeds comes first: the others wait for it
        for h in chunks:
            first = p.sources[h][0]
            assert first.is_gcs or (first.after_fetch and first.address in twins and first.address != t)
            assert p.sources[h][-1].is_gcs  # GCS stays the last resort
    assert plan(dict(reversed(dict.fromkeys(twins, chunks).items())), sizes, {}, True, fan_out=4) == plans


def test_a_peer_that_holds_the_chunks_serves_them_within_the_fan_out_and_gcs_is_not_read():
    chunks = [chunk(i) for i in range(6)]
    needers = [f"10.0.1.{i}:7070" for i in range(40)]
    holder = "10.0.2.1:7070"
    sizes = dict.fromkeys(chunks, MiB)
    plans = plan(dict.fromkeys(needers, chunks), sizes, dict.fromkeys(chunks, [holder]), True, fan_out=4)
    assert plan_stats(plans, sizes)["gcs_bytes"] == 0
    assert max(primaries(plans).values()) == 4
    assert sum(n for (a, _), n in primaries(plans).items() if a == holder) == 4 * len(chunks)
    assert plan_stats(plans, sizes)["max_depth"] == 3  # 4 + 16 + 64 >= 40 below the holder
    for p in plans.values():  # below the tree: ancestors, then the holder, then GCS
        for h in chunks:
            assert any(s.address == holder for s in p.sources[h]) and p.sources[h][-1].is_gcs


@st.composite
def restores(draw):
    nodes = [f"10.0.0.{i}:7070" for i in range(draw(st.integers(1, 12)))]
    chunks = [chunk(i) for i in range(draw(st.integers(1, 10)))]
    needs = {n: draw(st.lists(st.sampled_from(chunks), unique=True, max_size=len(chunks))) for n in nodes}
    holders = {h: draw(st.lists(st.sampled_from(nodes + ["10.9.9.9:7070"]), unique=True, max_size=3)) for h in chunks}
    in_gcs = set(draw(st.lists(st.sampled_from(chunks), unique=True)))
    return needs, holders, in_gcs, draw(st.integers(1, 5))


@settings(max_examples=150, deadline=None)
@given(restores())
def test_plans_hold_their_guarantees_on_random_restores(restore):
    needs, holders, in_gcs, fan_out = restore
    sizes = {h: 1000 + i for i, h in enumerate(sorted({h for hs in needs.values() for h in hs} | set(holders)))}
    plans = plan(needs, sizes, holders, in_gcs, fan_out=fan_out)
    assert plan(dict(reversed(needs.items())), sizes, holders, in_gcs, fan_out=fan_out) == plans  # deterministic
    for address, p in plans.items():
        for h in needs[address]:
            if address in holders[h]:
                assert h not in p.sources  # held here already: nothing to fetch
                continue
            reachable = bool(set(holders[h]) - {address}) or h in in_gcs
            assert bool(p.sources[h]) == reachable
            for s in p.sources[h]:
                assert s.address != address
                if s.after_fetch:  # a node that will have it: one that needs it too
                    assert h in needs[s.address] and s.address not in holders[h]
            if holders[h]:
                assert not p.sources[h][0].is_gcs  # a peer has it: GCS is never the first choice
            assert [s.is_gcs for s in p.sources[h]].count(True) == (h in in_gcs)
            if h in in_gcs:
                assert p.sources[h][-1].is_gcs
            seen, node = set(), address  # following first choices ends at a holder or GCS: no cycle
            while node in plans and h in plans[node].sources and plans[node].sources[h]:
                assert node not in seen
                seen.add(node)
                node = plans[node].sources[h][0].address
    for served in primaries(plans).values():
        assert served <= fan_out
    for h in in_gcs:
        seeds = [a for a, p in plans.items() if h in p.sources and p.sources[h] and p.sources[h][0].is_gcs]
        assert len(seeds) <= 1 or holders[h]


class Node:
    """A node of the runtime tests: a board, the two requests it answers, a PlannedFetch."""

    def __init__(self, net: SimNetwork, gcs: SimGcs, address: str):
        self.net, self.gcs, self.address = net, gcs, address
        self.transport = net.transport(address)
        self.board = ChunkBoard()
        net.listen(address, self.handle)

    async def handle(self, source, message):
        if message.get("op") == "await_chunk":
            return await self.board.handle(source, message)
        if message.get("op") == "get_chunk":
            return {"ok": True, "len": message["length"]} if self.board.has(message["hash"]) else {"error": "not found"}
        return {"error": "unknown op"}

    async def read_peer(self, address, h, length):
        reply = await self.transport.request(address, {"op": "get_chunk", "hash": h, "length": length}, 5)
        assert "error" not in reply
        return length

    async def read_gcs(self, h, length):
        return await self.gcs.read(self.address, h, length)

    def fetcher(self, p, **kw) -> PlannedFetch:
        return PlannedFetch(p, self.transport, self.read_peer, self.read_gcs, self.board, **kw)


async def test_when_a_planned_source_dies_its_chunks_come_from_the_next_source(autojump_clock):
    net = SimNetwork(NetModel())
    gcs = SimGcs(net, GcsModel())
    chunks = [chunk(i) for i in range(8)]
    sizes = dict.fromkeys(chunks, 16 * MiB)
    nodes = [Node(net, gcs, f"10.0.0.{i}:7070") for i in range(4)]
    plans = plan({n.address: chunks for n in nodes}, sizes, {}, True, fan_out=4)
    dead = nodes[2]
    net.down(dead.address)  # gone before it fetched anything it seeds
    fetches = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        t0 = trio.current_time()
        async with trio.open_nursery() as restore:
            for n in nodes:
                if n is not dead:
                    fetches[n.address] = f = n.fetcher(plans[n.address])
                    restore.start_soon(f.prefetch, sizes, 4)
        took = trio.current_time() - t0
        nursery.cancel_scope.cancel()
    orphaned = len(plans[dead.address].from_gcs())
    for f in fetches.values():
        assert not f.failed and all(f.board.has(h) for h in chunks)
        assert f.dead == {dead.address} and f.fallbacks == orphaned  # its seeds came from GCS instead
    assert gcs.bytes_read == sum(sizes.values()) + 2 * orphaned * 16 * MiB  # 3 read what 1 would have
    assert took < 5  # the dead source cost one timeout, not the 30-second wait


async def test_waiting_for_a_peer_ends_at_its_deadline_or_at_once_when_it_will_not_have_the_chunk(autojump_clock):
    h, other = chunk(1), chunk(2)
    board = ChunkBoard()
    async with trio.open_nursery() as nursery:
        answers = []

        async def ask(h):
            answers.append(await board.handle("x", {"op": "await_chunk", "hash": h, "wait": 3}))

        nursery.start_soon(ask, h)  # asked before the node has planned: waits for its plan
        await trio.sleep(1)
        assert answers == []
        board.set_plan([h])
        await trio.sleep(0.01)
        assert answers == []  # planned: waits for the chunk itself
        board.arrived(h)
        await trio.sleep(0.01)
        assert answers == [{"ok": True, "have": True, "pending": False, "fetching": False, "progress": 1, "via": []}]

        t0 = trio.current_time()
        assert await board.handle("x", {"op": "await_chunk", "hash": other, "wait": 3}) == {
            "ok": True,
            "have": False,
            "pending": False,
            "fetching": False,
            "progress": 1,
            "via": [],
        }
        assert trio.current_time() == t0  # not in its plan: no wait at all

        board.set_plan([other])
        t0 = trio.current_time()
        assert await board.handle("x", {"op": "await_chunk", "hash": other, "wait": 3}) == {
            "ok": True,
            "have": False,
            "pending": True,
            "fetching": False,
            "progress": 1,
            "via": [],
        }
        assert abs(trio.current_time() - t0 - 3) < 1e-9  # in its plan, not there: the whole wait

        nursery.start_soon(ask, other)
        await trio.sleep(1)
        board.gave_up(other)  # its sources failed: waiters go to their next source now
        await trio.sleep(0.01)
        assert answers[-1] == {"ok": True, "have": False, "pending": False, "fetching": False, "progress": 1, "via": []}
    for bad in ({"hash": "XYZ", "wait": 1}, {"hash": h, "wait": 1e9}, {"hash": h, "wait": True}):
        assert "error" in await board.handle("x", {"op": "await_chunk", **bad})


async def test_a_parent_that_never_gets_the_chunk_is_left_at_the_deadline_for_gcs(autojump_clock):
    net = SimNetwork(NetModel())
    gcs = SimGcs(net, GcsModel())
    h = chunk(7)
    seed, child = Node(net, gcs, "10.0.0.1:7070"), Node(net, gcs, "10.0.0.2:7070")
    plans = plan({seed.address: [h], child.address: [h]}, {h: MiB}, {}, True)
    if plans[child.address].sources[h][0].is_gcs:
        seed, child = child, seed
    seed.board.set_plan([h])  # it means to fetch it, but its fetch never ends
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        t0 = trio.current_time()
        f = child.fetcher(plans[child.address], wait=7)
        assert await f.fetch(h, MiB) == MiB
        took = trio.current_time() - t0
        assert 7 <= took < 7 + POLL + 1 and f.bytes_from == {GCS: MiB} and f.fallbacks == 1
        assert f.dead == set()  # slow is not dead: it is asked again for other chunks
        nursery.cancel_scope.cancel()


async def test_a_slow_source_that_keeps_receiving_chunks_is_waited_for_past_the_deadline(autojump_clock):
    """GCS is the bottleneck: the seed gets a chunk every 4 s, the child's deadline is 5 s."""
    net = SimNetwork(NetModel())
    gcs = SimGcs(net, GcsModel(first_byte=0.0, stream=MiB))
    first, second = chunk(1), chunk(2)
    seed, child = Node(net, gcs, "10.0.0.1:7070"), Node(net, gcs, "10.0.0.2:7070")
    seed_plan = NodePlan(
        seed.address, [first, second], {first: (GCS_SOURCE,), second: (GCS_SOURCE,)}, {first: 0, second: 0}
    )
    child_plan = NodePlan(
        child.address, [second], {second: (Source(seed.address, after_fetch=True), GCS_SOURCE)}, {second: 1}
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        nursery.start_soon(seed.fetcher(seed_plan).prefetch, dict.fromkeys([first, second], 4 * MiB), 1)
        f = child.fetcher(child_plan, wait=5)
        await f.fetch(second, 4 * MiB)
        assert 8 <= trio.current_time() < 9  # its second chunk, 8 s in: 3 s past the deadline
        assert f.bytes_from == {seed.address: 4 * MiB} and gcs.reads == 2  # and GCS was not read twice
        nursery.cancel_scope.cancel()


async def test_a_source_whose_fetch_of_the_chunk_is_under_way_is_waited_for_past_the_deadline(autojump_clock):
    """The seed's one GCS read takes 8 s (a queue at the bucket); the child's deadline is 3 s."""
    net = SimNetwork(NetModel())
    gcs = SimGcs(net, GcsModel(first_byte=0.0, stream=MiB))
    h = chunk(9)
    seed, child = Node(net, gcs, "10.0.0.1:7070"), Node(net, gcs, "10.0.0.2:7070")
    seed_plan = NodePlan(seed.address, [h], {h: (GCS_SOURCE,)}, {h: 0})
    child_plan = NodePlan(child.address, [h], {h: (Source(seed.address, after_fetch=True), GCS_SOURCE)}, {h: 1})
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        nursery.start_soon(seed.fetcher(seed_plan).fetch, h, 8 * MiB)
        f = child.fetcher(child_plan, wait=3)
        await f.fetch(h, 8 * MiB)
        assert 8 <= trio.current_time() < 9 and f.bytes_from == {seed.address: 8 * MiB} and gcs.reads == 1
        nursery.cancel_scope.cancel()


async def test_nodes_whose_plans_disagree_and_wait_for_each_other_break_the_cycle(autojump_clock):
    """Plans made from different answers: A waits for B, B for A, C for A. One poll, one GCS read."""
    net = SimNetwork(NetModel())
    gcs = SimGcs(net, GcsModel())
    h = chunk(5)
    a, b, c = (Node(net, gcs, f"10.0.0.{i}:7070") for i in (1, 2, 3))

    def waits_for(node, source):
        return NodePlan(node.address, [h], {h: (Source(source.address, after_fetch=True), GCS_SOURCE)}, {h: 1})

    fetches = [a.fetcher(waits_for(a, b)), b.fetcher(waits_for(b, a)), c.fetcher(waits_for(c, a))]
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        t0 = trio.current_time()
        async with trio.open_nursery() as restore:
            for f in fetches:
                restore.start_soon(f.fetch, h, MiB)
        assert trio.current_time() - t0 < 2 * POLL + 1  # not the 30-second deadline
        nursery.cancel_scope.cancel()
    assert gcs.reads == 1 and all(f.board.has(h) for f in fetches)
    assert sorted(f.fallbacks for f in fetches) == [0, 0, 1]  # only the one that left went to GCS


async def test_a_chunk_on_no_tier_is_reported_not_waited_for(autojump_clock):
    net = SimNetwork()
    node = Node(net, SimGcs(net), "10.0.0.1:7070")
    h = chunk(3)
    f = node.fetcher(plan({node.address: [h]}, {h: 1}, {}, in_gcs=False)[node.address])
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        try:
            await f.fetch(h, 1)
        except NoSource as e:
            assert h in str(e) and "\n" not in str(e)
        else:
            raise AssertionError("a chunk with no source was fetched")
        nursery.cancel_scope.cancel()


def test_four_twins_restoring_from_gcs_together_read_each_byte_once_today_four_times():
    broadcast = scenarios.restore(24, chunks=8, chunk_size=4 * MiB)
    today = scenarios.restore(24, mode="today", chunks=8, chunk_size=4 * MiB)
    assert broadcast["gcs_per_unique"] == 1.0 and today["gcs_per_unique"] == 4.0
    assert broadcast["failed_chunks"] == today["failed_chunks"] == 0
    lossy = scenarios.restore(24, fail=0.1, chunks=8, chunk_size=4 * MiB)  # 2 of 24 die mid-restore
    assert lossy["failed_chunks"] == 0 and lossy["fallbacks"] > 0 and lossy["gcs_per_unique"] <= 1.25
