"""Coordinators on a simulated network: reports, answers, takeover, late and restarted nodes.

The nodes run the real Coordination (member and coordinator sides) over SimNetwork, on
trio's MockClock: 30-second rounds pass in milliseconds, and the times asserted are
those of the protocol (timeouts, pulls, long polls), not of this machine.
"""

from __future__ import annotations

import json

import trio
import trio.testing
from tierfs_testing.sim import GcsModel, SimGcs, SimNetwork

from tierfs.coordination.coordinator import REFUSED_GRACE, Coordinator
from tierfs.coordination.gcs_listing import list_sharded, listing_prefixes
from tierfs.coordination.protocol import DECIDE_POLL, MAX_LISTED_HOLDERS, MAX_LISTED_STEPS, RPC_TIMEOUT
from tierfs.coordination.transport import MAX_MESSAGE, encoded
from tierfs.coordination.view import Holdings

from .harness import Cluster

COORD_OPS = ("coord_report", "coord_decide", "coord_pull")


def replicated(n: int, steps=(10, 20)) -> dict[int, Holdings]:
    """Each rank holds ``steps`` and keeps the replicas of the rank before it."""
    return {r: Holdings(r, tuple(steps), tuple(((r - 1) % n, s) for s in steps)) for r in range(n)}


async def test_a_lost_coordinator_is_replaced_by_the_next_and_the_answers_stay_the_same(autojump_clock):
    c = Cluster(30, replicated(30), gcs={r: [10] for r in range(30)})
    async with trio.open_nursery() as nursery:
        await nursery.start(c.net.run)
        await c.start(nursery)
        await trio.sleep(2 * c.interval)
        first, second, third, fourth = (c.coordinator(i) for i in range(4))
        truth = c.truth()
        before = {r: c.nodes[first].coordinator.answer(r)["ranks"][str(r)]["choice"] for r in range(30)}
        assert before == {r: truth.choose(r) for r in range(30)} == dict.fromkeys(range(30), 20)
        assert c.nodes[fourth].coordinator.received == 0  # not a coordinator while the first three are up

        c.kill(first)
        await trio.sleep(c.interval + 5)  # one round: every node times out on it once, then skips it
        live = [r for r in range(30) if r != first]
        assert all(c.addresses[first] not in c.nodes[r].member.reported_to for r in live)
        assert all(c.addresses[fourth] in c.nodes[r].member.reported_to for r in live)
        truth = c.truth(live)
        for k in (second, third, fourth):
            coordinator = c.nodes[k].coordinator
            assert coordinator.ready() and coordinator.coordinating()
            assert coordinator.view.newest_complete() == truth.newest_complete() == 20
            assert {r: coordinator.answer(r)["ranks"][str(r)]["choice"] for r in range(30)} == before

        c.net.stats.reset()
        await trio.sleep(2 * c.interval)  # it was found down and named in answers: no more timeouts
        assert c.net.stats.timeouts["coord_report"] == 0
        assert c.net.stats.requests["coord_report"] / 29 / 2 == (3 * 29 - 3) / 29  # k a round, no more

        t0 = trio.current_time()
        decision = await c.nodes[live[5]].member.decide(live[5], wait=15)
        assert decision.ready and decision.step == 20 and decision.coordinator == c.addresses[second]
        # Before answering, the coordinator confirmed the reports older than FRESH seconds:
        # the lost one's holdings went with it, and it is named.
        assert trio.current_time() - t0 < 5
        assert decision.down == [c.addresses[first]] and decision.reported == 29
        nursery.cancel_scope.cancel()


async def test_a_late_joiner_adopts_the_step_the_others_already_run_from(autojump_clock):
    n, late = 12, 7
    held = replicated(n, (30,))
    # Rank 7 alone holds its step 40 (not yet replicated): without it, 30 is the newest complete.
    for r in range(n):
        if r != late:
            held[r] = Holdings(r, (30, 40), tuple(((r - 1) % n, s) for s in (30, 40) if (r - 1) % n != late or s == 30))
    held[late] = Holdings(late, (30, 40), ((late - 1, 30), (late - 1, 40)))
    c = Cluster(n, held)
    async with trio.open_nursery() as nursery:
        await nursery.start(c.net.run)
        others = [r for r in range(n) if r != late]
        c.net.down(c.addresses[late], "timeout")  # its host is not there yet
        await c.start(nursery, others)
        decided = {}

        async def decide(r):
            d = await c.nodes[r].member.decide(r, wait=15)
            decided[r] = d.step
            h = c.held[r]
            c.held[r] = Holdings(h.rank, h.steps, h.replicas, d.step)  # runs from it, and says so
            await c.nodes[r].member.report()

        async with trio.open_nursery() as group:
            for r in others:
                group.start_soon(decide, r)
        assert set(decided.values()) == {30}  # rank 7 was found down: 40 is not complete without it

        await trio.sleep(3)
        await c.start(nursery, [late])  # now it comes: with it, 40 would be complete ...
        assert c.truth().newest_complete() == 40
        d = await c.nodes[late].member.decide(late, wait=15)
        assert d.ready and d.step == 30  # ... but the others run from 30: it adopts 30
        nursery.cancel_scope.cancel()


async def test_a_restarted_node_replaces_its_old_report_and_its_lost_ram_counts(autojump_clock):
    c = Cluster(10, {r: Holdings(r, (10, 20)) for r in range(10)})
    async with trio.open_nursery() as nursery:
        await nursery.start(c.net.run)
        await c.start(nursery)
        await trio.sleep(c.interval + 2)
        coordinator = c.nodes[c.coordinator(0)].coordinator
        assert coordinator.view.newest_complete() == 20
        victim = next(r for r in range(10) if r not in (c.coordinator(i) for i in range(3)))
        c.kill(victim)
        c.held[victim] = Holdings(victim, (10,))  # restarted with only step 10 left
        node = c.make(victim)
        assert node.member.seq == 0  # its counter starts again: the new incarnation must win anyway
        await nursery.start(c.run, victim)
        await trio.sleep(1)
        assert coordinator.view.steps_of(victim) == {10: [c.addresses[victim]]}
        assert coordinator.view.newest_complete() == 10
        nursery.cancel_scope.cancel()


async def test_a_coordinator_restarted_mid_round_rebuilds_its_view_and_answers_the_same(autojump_clock):
    c = Cluster(24, replicated(24), gcs={r: [10] for r in range(24)})
    async with trio.open_nursery() as nursery:
        await nursery.start(c.net.run)
        await c.start(nursery)
        await trio.sleep(c.interval + 10)  # mid-round
        first = c.coordinator(0)
        c.kill(first)
        node = c.make(first)  # back at once, with nothing: no report, no listing
        await nursery.start(c.run, first)
        assert node.coordinator.view.sources() == [c.addresses[first]]  # its own report only
        await trio.sleep(3)  # its own report woke it; it pulled every member and listed GCS
        truth = c.truth()
        assert node.coordinator.ready() and node.coordinator.view.newest_complete() == truth.newest_complete() == 20
        assert all(node.coordinator.view.steps_of(r) == truth.steps_of(r) for r in range(24))
        d = await c.nodes[3].member.decide(3, wait=15)
        assert d.ready and d.step == 20 and d.coordinator == c.addresses[first]
        nursery.cancel_scope.cancel()


async def requests_per_node_per_round(n: int, rounds: int = 3) -> float:
    c = Cluster(n, replicated(n))
    async with trio.open_nursery() as nursery:
        await nursery.start(c.net.run)
        await c.start(nursery)
        await trio.sleep(c.interval * 2 + 1)
        c.net.stats.reset()
        await trio.sleep(c.interval * rounds)
        nursery.cancel_scope.cancel()
    return sum(c.net.stats.requests[op] for op in COORD_OPS) / n / rounds


async def test_messages_per_node_per_round_are_bounded_and_flat_in_the_number_of_nodes(autojump_clock):
    for n in (16, 128):
        # One report to each of k = 3 coordinators; a coordinator's report to itself is no message.
        assert await requests_per_node_per_round(n) == (3 * n - 3) / n


async def test_a_cancelled_round_or_decision_leaves_no_task_behind(autojump_clock):
    c = Cluster(8, replicated(8))
    async with trio.open_nursery() as nursery:
        await nursery.start(c.net.run)
        first = c.coordinator(0)
        c.kill(first)  # a report to it waits for its timeout: a task to leave behind, if any
        member = next(c.nodes[r].member for r in range(8) if r != first)
        await trio.testing.wait_all_tasks_blocked()
        baseline = trio.lowlevel.current_statistics().tasks_living

        with trio.move_on_after(RPC_TIMEOUT / 2) as scope:
            await member.report()
        assert scope.cancelled_caught
        with trio.move_on_after(DECIDE_POLL / 2) as scope:
            await member.decide(3, [1, 2], wait=15)
        assert scope.cancelled_caught
        with trio.move_on_after(5) as scope:  # whole nodes, coordinators' duties and pulls included
            async with trio.open_nursery() as nodes:
                await c.start(nodes, [r for r in range(8) if r != first])
                await trio.sleep_forever()
        assert scope.cancelled_caught
        await trio.testing.wait_all_tasks_blocked()
        assert trio.lowlevel.current_statistics().tasks_living == baseline
        nursery.cancel_scope.cancel()


async def test_members_found_down_stop_holding_the_decision_back_starting_ones_only_for_a_grace(autojump_clock):
    for how, at_most in (("timeout", 5.0), ("refused", REFUSED_GRACE + 3.0)):
        c = Cluster(20, replicated(20))
        gone = next(r for r in range(20) if r not in (c.coordinator(i) for i in range(3)))
        async with trio.open_nursery() as nursery:
            await nursery.start(c.net.run)
            c.kill(gone, how)
            t0 = trio.current_time()
            await c.start(nursery, [r for r in range(20) if r != gone])
            d = await c.nodes[c.coordinator(1)].member.decide(c.coordinator(1), wait=15)
            took = trio.current_time() - t0
            assert d.ready and d.step == 20 and d.down == [c.addresses[gone]]
            assert took < at_most, (how, took)
            if how == "refused":
                assert took >= REFUSED_GRACE  # its daemon may be starting: it gets the grace
            nursery.cancel_scope.cancel()


async def test_without_a_ready_view_the_best_answer_comes_at_the_restore_wait(autojump_clock):
    c = Cluster(6, replicated(6), gcs={r: [30] for r in range(6)}, gcs_model=GcsModel(page=1000.0))
    async with trio.open_nursery() as nursery:
        await nursery.start(c.net.run)
        await c.start(nursery)
        t0 = trio.current_time()
        d = await c.nodes[0].member.decide(0, wait=4)
        assert 4 <= trio.current_time() - t0 < 4 + RPC_TIMEOUT + 0.5
        assert not d.ready and d.reported == 6 and d.step == 20  # GCS has not answered: what peers hold
        nursery.cancel_scope.cancel()


async def test_malformed_messages_get_one_line_errors(autojump_clock):
    coordinator = Coordinator("a:1", ["a:1", "b:1"], SimNetwork().transport("a:1"), nodes=2)
    for message in (
        {"op": "coord_report", "report": {"rank": "x"}},
        {"op": "coord_decide", "rank": -1},
        {"op": "coord_decide", "rank": 1, "wait": 1e9},
        {"op": "coord_decide", "rank": 1, "group": "x"},
        {"op": "nope"},
        {},
    ):
        answer = await coordinator.handle("b:1", message)
        assert set(answer) == {"error"} and "\n" not in answer["error"], message


async def test_a_decide_answer_stays_bounded_whatever_the_holdings(autojump_clock):
    coordinator = Coordinator("a:1", ["a:1"], SimNetwork().transport("a:1"), nodes=4096)
    for i in range(40):  # 40 nodes each holding 40 steps of each of ranks 0..63
        coordinator.accept(f"10.1.0.{i}:7070", Holdings(i, (), tuple((r, s) for r in range(64) for s in range(40))))
    answer = coordinator.answer(0, list(range(1, 64)))
    assert len(encoded(answer)) < MAX_MESSAGE
    for view in answer["ranks"].values():
        assert len(view["steps"]) <= MAX_LISTED_STEPS
        assert all(len(h) <= MAX_LISTED_HOLDERS for h in view["steps"].values())
    assert json.loads(encoded(answer)) == answer


async def test_listing_shards_cover_every_rank_exactly_once(autojump_clock):
    for nodes in (1, 9, 10, 11, 99, 100, 101, 999, 1000, 4000, 10000, 54321):
        prefixes = listing_prefixes(nodes)
        assert len(prefixes) <= max(10, nodes // 10)  # a shard holds up to 111 ranks
        for rank in [*range(min(nodes, 300)), *range(nodes - 1, 0, -max(1, nodes // 300)), nodes, 10 * nodes + 7]:
            name = f"rank-{rank}/step-000000000010.json"
            assert sum(name.startswith(p) for p in prefixes) == 1, (nodes, rank)
    net = SimNetwork()
    listing = {r: [10, 20] for r in range(5000)}
    gcs = SimGcs(net, GcsModel(page=0.1), listing)
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        t0 = trio.current_time()
        assert await list_sharded(gcs.list_prefix, listing_prefixes(5000)) == listing
        sharded = trio.current_time() - t0
        t0 = trio.current_time()
        assert await gcs.list_prefix("") == listing
        assert sharded < (trio.current_time() - t0) / 2  # 10 pages one after the other, against shards at once
        nursery.cancel_scope.cancel()


async def test_a_restarted_node_decides_on_a_listing_of_gcs_made_after_it_came_back(autojump_clock):
    """It may have backed a step up just before it died, too late to report it: a survey
    made then would see that step in GCS, so the answer does too."""
    c = Cluster(4, {r: Holdings(r) for r in range(4)}, gcs={r: [10] for r in range(4)})
    async with trio.open_nursery() as nursery:
        await nursery.start(c.net.run)
        await c.start(nursery)
        await trio.sleep(5)  # the round is done, GCS listed with step 10 only
        victim = next(r for r in range(4) if r not in (c.coordinator(i) for i in range(3)))
        c.kill(victim)
        c.gcs.set_listing({r: [10, 20] for r in range(4)})  # its last backup, never reported
        node = c.make(victim)
        await nursery.start(c.run, victim)
        decision = await node.member.decide(victim, wait=15)
        assert decision.ready and decision.step == 20
        nursery.cancel_scope.cancel()


async def test_a_reported_backup_counts_as_held_by_gcs_before_the_next_listing(autojump_clock):
    c = Cluster(4, {r: Holdings(r) for r in range(4)}, gcs={r: [10] for r in range(4)})
    async with trio.open_nursery() as nursery:
        await nursery.start(c.net.run)
        await c.start(nursery)
        await trio.sleep(5)
        for r in range(4):  # the nodes committed step 20 and backed it up, then reported it
            c.held[r] = Holdings(r, (20,), backed=(20,))
            await c.nodes[r].member.report()
        coordinator = c.nodes[c.coordinator(0)].coordinator
        assert coordinator.view.steps_of(2)[20] == sorted([c.addresses[2], "gcs"])
        assert Holdings.from_wire(c.held[2].to_wire()).backed == (20,)
        nursery.cancel_scope.cancel()


async def test_a_decision_counts_holdings_that_changed_after_the_last_report(autojump_clock):
    """A replica that reached the coordinator itself and another member since their last
    reports, which no report has carried yet, counts in the answer to a later question."""
    n = 6
    c = Cluster(n, replicated(n, (10,)))
    async with trio.open_nursery() as nursery:
        await nursery.start(c.net.run)
        await c.start(nursery)
        await trio.sleep(c.interval + 2)  # a round of reports went by two seconds ago
        first, asker = c.coordinator(0), c.coordinator(5)
        coordinator = c.nodes[first].coordinator
        assert coordinator.view.newest_complete() == 10
        for r in range(n):  # step 20 of every rank arrives everywhere, and nobody reports it
            c.held[r] = Holdings(r, (10, 20) if r != asker else (10,), c.held[r].replicas + (((r - 1) % n, 20),))
        assert coordinator.view.newest_complete() == 10  # what the last reports said
        c.net.stats.reset()
        decision = await c.nodes[asker].member.decide(asker, wait=15)
        assert decision.ready and decision.coordinator == c.addresses[first]
        assert decision.step == 20  # the asker's own step 20 is the replica its peer keeps
        assert c.net.stats.requests["coord_pull"] == n - 1  # every member but the coordinator itself
        nursery.cancel_scope.cancel()


async def test_a_burst_of_questions_shares_rounds_of_pulls(autojump_clock):
    n = 40
    c = Cluster(n, replicated(n))
    async with trio.open_nursery() as nursery:
        await nursery.start(c.net.run)
        await c.start(nursery)
        await trio.sleep(c.interval / 2)
        c.net.stats.reset()
        steps = {}

        async def ask(r):
            steps[r] = (await c.nodes[r].member.decide(r, wait=15)).step

        async with trio.open_nursery() as askers:  # a whole job restarting at once
            for r in range(n):
                askers.start_soon(ask, r)
        assert set(steps.values()) == {20}
        # Each round answers every question that arrived before it began; the questions reach
        # the coordinator over a few round trips, so a handful of rounds answer all 40.
        rounds = c.net.stats.requests["coord_pull"] / (n - 1)
        assert rounds == int(rounds) and rounds <= n / 8, rounds
        nursery.cancel_scope.cancel()
