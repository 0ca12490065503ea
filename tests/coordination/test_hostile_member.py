"""A member holding the job's secret that sends what it likes: every field is checked before use.

The honest nodes run the real Coordination on the simulated network; the hostile member is
a handler (or a transport) of the test's that answers or sends malformed messages. Each
one must be refused with one line and no exception, the honest nodes must keep serving,
and nothing it sent may reach a decision or the retention floor.
"""

from __future__ import annotations

import hashlib
import logging

import pytest
import trio

from tierfs.coordination.broadcast import GCS_SOURCE, NodePlan, PlannedFetch, Source
from tierfs.coordination.protocol import MAX_GROUP, MAX_LISTED_STEPS, MAX_SUSPECTS
from tierfs.coordination.view import MAX_REPLICAS, MAX_STEP, MAX_STEPS, Holdings

from .harness import Cluster

N = 6


def honest(n: int = N) -> dict[int, Holdings]:
    """Every rank holds steps 10 and 20 itself and the replicas of the rank before it."""
    return {r: Holdings(r, (10, 20), (((r - 1) % n, 10), ((r - 1) % n, 20))) for r in range(n)}


def report(rank: int = 1, **fields) -> dict:
    return {**Holdings(rank, (10, 20)).to_wire(), "inc": 1, "seq": 1, **fields}


BAD_REPORTS = {
    "a rank that is not an integer": report(rank="1"),
    "a negative rank": report(rank=-1),
    "a rank beyond the job's nodes": report(rank=N),
    "a negative step": report(steps=[-1]),
    "a step past the bound": report(steps=[MAX_STEP + 1]),
    "a step that is a boolean": report(steps=[True]),
    "too many steps": report(steps=list(range(MAX_STEPS + 1))),
    "too many replicas": report(replicas=[[0, s] for s in range(MAX_REPLICAS + 1)]),
    "a restore step of the wrong type": report(restore="20"),
    "not an object": [1, 2, 3],
}
BAD_SUSPECTS = {
    "suspects that are not a list": "10.0.0.1:7070",
    "a suspect that is not an address": [7],
    "a suspect that is no HOST:PORT": ["10.0.0.1"],
    "too many suspects": [f"10.9.0.{i}:7070" for i in range(MAX_SUSPECTS + 1)],
}


def decide(**fields) -> dict:
    return {"op": "coord_decide", "rank": 1, "group": [], "wait": 0, "q": "ab", **fields}


BAD_QUESTIONS = {
    "a rank beyond the job's nodes": decide(rank=N),
    "a rank that is a boolean": decide(rank=True),
    "a group rank beyond the job's nodes": decide(group=[N + 1]),
    "a group that is too long": decide(group=[0] * (MAX_GROUP + 1)),
    "a group that is not a list": decide(group={"0": 1}),
    "a wait that is a boolean": decide(wait=True),
    "a wait past the limit": decide(wait=31),
    "a question id that is not a string": decide(q=5),
    "a question id too long": decide(q="q" * 65),
    "a malformed report": decide(report=report(rank=N)),
}


async def test_malformed_reports_and_questions_are_refused_and_the_coordinator_keeps_serving(autojump_clock):
    c = Cluster(N, honest())
    async with trio.open_nursery() as nursery:
        await nursery.start(c.net.run)
        await c.start(nursery)
        await trio.sleep(2)
        target = c.addresses[c.coordinator(0)]
        coordinator = c.nodes[c.coordinator(0)].coordinator
        hostile = c.net.transport(c.addresses[1])  # a member with the secret, sending what it likes
        before = coordinator.view.version
        messages = {
            **{f"coord_report with {k}": {"op": "coord_report", "report": v} for k, v in BAD_REPORTS.items()},
            **{
                f"coord_report with {k}": {"op": "coord_report", "report": report(), "suspects": v}
                for k, v in BAD_SUSPECTS.items()
            },
            **{f"coord_decide with {k}": v for k, v in BAD_QUESTIONS.items()},
        }
        for what, message in messages.items():
            answer = await hostile.request(target, message, 1.0)
            assert set(answer) == {"error"}, what
            assert answer["error"].startswith(f"malformed {message['op']}: ") and "\n" not in answer["error"], what
        assert coordinator.view.version == before, "nothing of the refused messages reached the view"
        assert coordinator.view.steps_of(N) is None and coordinator.view.steps_of(N + 5) is None
        # It goes on answering: the same member's well-formed question is answered from the view.
        answer = await hostile.request(target, decide(), 1.0)
        assert answer["ok"] and answer["ranks"]["1"]["choice"] == 20
        # Replicas it claims of a rank beyond the job are left out: that rank would hold every step back.
        answer = await hostile.request(
            target, {"op": "coord_report", "report": report(replicas=[[0, 10], [0, 20], [N + 5, 20]], inc=1 << 40)}, 1.0
        )
        assert answer["ok"] and answer["summary"]["newest"] == 20
        assert coordinator.view.steps_of(N + 5) is None and coordinator.view.holds(c.addresses[1], 0, 20)
        nursery.cancel_scope.cancel()


async def test_a_member_answering_pulls_with_junk_counts_as_silent_and_its_claims_never_count(autojump_clock):
    c = Cluster(N, honest())
    liar = next(r for r in range(N) if r not in (c.coordinator(i) for i in range(3)))
    junk = iter(
        [
            {"ok": True, "report": report(rank=N + 1)},
            {"ok": True, "report": report(rank=liar, steps=["x"])},
            {"ok": True, "report": "everything"},
            {"ok": True},
        ]
        * 20
    )

    async def answers_junk(source, message):
        return next(junk)

    async with trio.open_nursery() as nursery:
        await nursery.start(c.net.run)
        await c.start(nursery, [r for r in range(N) if r != liar])
        c.net.listen(c.addresses[liar], answers_junk)
        asker = c.coordinator(1)
        d = await c.nodes[asker].member.decide(asker, wait=15)
        assert d.ready and d.step == 20, "the honest nodes still decide"
        assert c.addresses[liar] in d.down, "a member whose answers are malformed is found down"
        view = c.nodes[c.coordinator(0)].coordinator.view
        assert view.steps_of(N + 1) is None
        nursery.cancel_scope.cancel()


async def hostile_first(c: Cluster, op: str, answer) -> str:
    """Make the first coordinator candidate a member that answers ``op`` with ``answer(message)``
    and everything else as an honest node."""
    address = c.addresses[c.coordinator(0)]
    node = c.nodes[c.coordinator(0)]

    async def handle(source, message):
        return answer(message) if message.get("op") == op else await node.handle(source, message)

    c.net.listen(address, handle)
    return address


def honest_answer(c: Cluster, message: dict) -> dict:
    """What an honest coordinator would answer, for the hostile one to spoil a field of."""
    return c.nodes[c.coordinator(1)].coordinator.answer(message["rank"], message.get("group", []))


BAD_SUMMARIES = {
    "a floor that is not an integer": {"floor": "x"},
    "a negative floor": {"floor": -1},
    "a floor past the bound": {"floor": 1 << 70},
    "a floor that is a boolean": {"floor": True},
    "a newest step that is a float": {"newest": 20.5},
    "too many decisions": {"decisions": list(range(300))},
    "decisions that are not steps": {"decisions": ["20"]},
}


@pytest.mark.parametrize("what", BAD_SUMMARIES)
async def test_a_report_answer_with_a_malformed_summary_is_dropped_and_the_next_coordinator_taken(
    autojump_clock, what, caplog
):
    caplog.set_level(logging.INFO, "tierfs.coordination")
    c = Cluster(N, honest())
    spoil = BAD_SUMMARIES[what]
    async with trio.open_nursery() as nursery:
        await nursery.start(c.net.run)
        await c.start(nursery)
        await trio.sleep(c.interval + 2)
        bad = await hostile_first(
            c,
            "coord_report",
            lambda m: {
                "ok": True,
                "down": [],
                "summary": {"newest": 20, "floor": 20, "decisions": [], "complete": [10, 20], "ranks": N, **spoil},
            },
        )
        member = c.nodes[next(r for r in range(N) if c.addresses[r] != bad)].member
        summary = await member.report()
        assert summary is not None and summary["floor"] == 20 and summary["newest"] == 20, what
        assert member.summary_from != bad and bad not in member.reported_to
        assert f"coordinator {bad} does not answer (malformed coord_report answer: summary" in caplog.text
        nursery.cancel_scope.cancel()


def spoiled(field_path: tuple, value):
    def spoil(answer: dict) -> dict:
        target = answer
        for key in field_path[:-1]:
            target = target[key]
        target[field_path[-1]] = value
        return answer

    return spoil


BAD_DECISIONS = {
    "a choice that is a string": spoiled(("ranks", "1", "choice"), "10"),
    "a negative choice": spoiled(("ranks", "1", "choice"), -1),
    "a choice past the bound": spoiled(("ranks", "1", "choice"), MAX_STEP + 1),
    "a choice newer than every step listed": spoiled(("ranks", "1", "choice"), 10**12),
    "a choice of a step the rank does not list": spoiled(("ranks", "1", "choice"), 15),
    "a holder that is not an address": spoiled(("ranks", "1", "steps"), {"20": ["somewhere"]}),
    "too many steps listed": spoiled(("ranks", "1", "steps"), {str(s): [] for s in range(MAX_LISTED_STEPS + 1)}),
    "a rank that was not asked about": spoiled(("ranks", str(N + 3)), {"choice": 20, "steps": {}, "nodes": []}),
    "ready that is not a boolean": spoiled(("ready",), "yes"),
    "a summary floor that is not an integer": spoiled(("summary", "floor"), "x"),
    "down members that are not addresses": spoiled(("down",), [1, 2]),
    "a member count that is negative": spoiled(("members",), -4),
}


@pytest.mark.parametrize("what", BAD_DECISIONS)
async def test_a_malformed_decide_answer_is_dropped_and_the_next_coordinator_asked(autojump_clock, what):
    c = Cluster(N, honest())
    async with trio.open_nursery() as nursery:
        await nursery.start(c.net.run)
        await c.start(nursery)
        await trio.sleep(c.interval + 2)
        bad = await hostile_first(c, "coord_decide", lambda m: BAD_DECISIONS[what](honest_answer(c, m)))
        asker = next(r for r in range(N) if c.addresses[r] != bad and r != 1)
        member = c.nodes[asker].member
        d = await member.decide(1, wait=15)  # as rank 1 would ask
        assert d.coordinator != bad and d.ready and d.step == 20, what
        nursery.cancel_scope.cancel()


def chunk(i: int) -> str:
    return hashlib.blake2b(f"c{i}".encode(), digest_size=16).hexdigest()


BAD_CHUNK_ANSWERS = {
    "have that is a string": {"ok": True, "have": "yes"},
    "have that is a number": {"ok": True, "have": 1, "pending": False},
}


@pytest.mark.parametrize("what", BAD_CHUNK_ANSWERS)
async def test_a_malformed_await_chunk_answer_fails_that_source_and_the_next_one_is_read(autojump_clock, what):
    from tierfs_testing.sim import NetModel, SimNetwork

    net = SimNetwork(NetModel(), seed=1)
    h, me, liar = chunk(1), "10.0.0.1:7070", "10.0.0.2:7070"

    async def answers_junk(source, message):
        return BAD_CHUNK_ANSWERS[what]

    net.listen(liar, answers_junk)
    read = []

    async def read_peer(address, h, length):
        read.append(address)
        return b"x" * length

    async def read_gcs(h, length):
        read.append("gcs")
        return b"x" * length

    plan = NodePlan(me, [h], {h: (Source(liar, after_fetch=True), GCS_SOURCE)}, {h: 1})
    fetch = PlannedFetch(plan, net.transport(me), read_peer, read_gcs)
    async with trio.open_nursery() as nursery:
        await nursery.start(net.run)
        assert await fetch.fetch(h, 4) == b"xxxx"
        nursery.cancel_scope.cancel()
    assert read == ["gcs"], "nothing was read from the source whose answer was malformed"
    assert "malformed await_chunk answer" in fetch.failed.get(h, "") or fetch.fallbacks == 1


async def test_when_the_job_grows_the_reports_of_its_new_ranks_are_taken(autojump_clock):
    c = Cluster(N, honest())
    async with trio.open_nursery() as nursery:
        await nursery.start(c.net.run)
        await c.start(nursery)
        node = c.nodes[c.coordinator(0)]
        sender = c.net.transport(c.addresses[1])
        grown = {"op": "coord_report", "report": report(rank=N, inc=1 << 40)}
        assert "error" in await sender.request(c.addresses[c.coordinator(0)], grown, 1.0)
        node.coordinator.view.set_nodes(N + 2)  # replicator.yaml says so (NodeCoordination.reconfigure)
        assert (await sender.request(c.addresses[c.coordinator(0)], grown, 1.0))["ok"]
        assert node.coordinator.view.steps_of(N) == {10: [c.addresses[1]], 20: [c.addresses[1]]}
        nursery.cancel_scope.cancel()
