"""The coordinators' view gives the answers of tierfs.pipeline.survey.Survey, on any holdings.

A Survey is built exactly as ClusterView builds one on some node X (X's own holdings as
"local", every other node's report as "peer <address>", the GCS listing as "gcs"); the
HoldingsView gets the same reports keyed by address. Every rule must agree: complete
steps, the newest one, the retention floor, the step each rank restores, and who holds
what. The view is also updated by difference: any sequence of reports must leave it as
a view built from the last reports alone.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs.coordination.transport import MAX_MESSAGE, BadMessage, encoded
from tierfs.coordination.view import GCS, MAX_REPLICAS, Holdings, HoldingsView, choose_step
from tierfs.pipeline.survey import Survey

STEPS = st.integers(0, 6).map(lambda s: s * 10)


@st.composite
def clusters(draw):
    nodes = draw(st.integers(1, 8))
    reports = {}
    for i in range(draw(st.integers(1, 10))):
        rank = draw(st.integers(0, nodes + 1))  # a few ranks beyond the job's size, like stale ones
        reports[f"10.0.0.{i}:7070"] = Holdings(
            rank,
            tuple(sorted(draw(st.sets(STEPS, max_size=4)))),
            tuple(sorted(draw(st.sets(st.tuples(st.integers(0, nodes + 1), STEPS), max_size=6)))),
            draw(st.none() | STEPS),
        )
    gcs = draw(st.dictionaries(st.integers(0, nodes + 1), st.lists(STEPS, max_size=4, unique=True), max_size=nodes + 2))
    me = draw(st.sampled_from(sorted(reports)))
    return nodes, reports, gcs, me


def survey_of(me: str, reports: dict[str, Holdings], gcs: dict[int, list[int]]) -> Survey:
    """What ClusterView.survey() returns on node ``me`` (tierfs/pipeline/survey.py, step by step)."""
    survey = Survey()
    here = reports[me]
    for step in here.steps:  # ClusterView._add_local
        survey.add(here.rank, step, "local")
    for rank, step in here.replicas:
        survey.add(rank, step, "local")
    if here.restore_step is not None:
        survey.decisions["local"] = here.restore_step
    for address, report in reports.items():  # ClusterView._ask_peers
        if address == me:
            continue
        name = f"peer {address}"
        for step in report.steps:
            survey.add(report.rank, step, name)
        for rank, step in report.replicas:
            survey.add(rank, step, name)
        if report.restore_step is not None:
            survey.decisions[name] = report.restore_step
    for rank, steps in gcs.items():  # ClusterView._ask_gcs
        for step in steps:
            survey.add(rank, step, "gcs")
    return survey


def view_of(nodes: int, reports: dict[str, Holdings], gcs: dict[int, list[int]]) -> HoldingsView:
    view = HoldingsView(nodes)
    for address, report in reports.items():
        view.put_holdings(address, report)
    view.put_listing(gcs)
    return view


@settings(max_examples=200, deadline=None)
@given(clusters())
def test_rules_agree_with_survey_on_random_holdings(cluster):
    nodes, reports, gcs, me = cluster
    survey, view = survey_of(me, reports, gcs), view_of(nodes, reports, gcs)

    assert view.complete_steps() == survey.complete_steps()
    assert view.newest_complete() == survey.newest_complete()
    assert view.retention_floor() == survey.newest_complete(range(nodes))  # ClusterView.retention_floor
    for rank in range(nodes + 3):
        assert view.choose(rank) == survey.choose(rank), rank
        mine = view.steps_of(rank)
        assert choose_step(view.newest_complete(), view.decisions(), None if mine is None else mine) == survey.choose(
            rank
        )
    named = {"local": me, "gcs": GCS}
    for rank, by_step in survey.holders.items():
        for step, tiers in by_step.items():
            assert set(view.steps_of(rank)[step]) == {named.get(t, t.removeprefix("peer ")) for t in tiers}
    assert set(view.steps_of(r) is not None for r in survey.holders) == ({True} if survey.holders else set())
    as_survey = Survey(holders=view.holders_by_rank(), decisions=view.decision_by_source())
    assert as_survey.newest_complete() == survey.newest_complete()


@settings(max_examples=120, deadline=None)
@given(clusters(), st.lists(st.tuples(st.integers(0, 9), st.booleans()), max_size=25), st.integers(1, 9))
def test_updates_by_difference_equal_a_view_built_afresh(cluster, changes, new_nodes):
    """Reports replaced, sources dropped, the job resized: the counters stay exact."""
    nodes, reports, gcs, _ = cluster
    view = view_of(nodes, reports, gcs)
    current = dict(reports)
    addresses = sorted(reports)
    for i, (pick, drop) in enumerate(changes):
        address = addresses[pick % len(addresses)]
        if drop:
            view.drop(address)
            current.pop(address, None)
        else:
            old = current.get(address) or Holdings(0)
            new = Holdings(
                old.rank,
                tuple(s + 10 * (i % 2) for s in old.steps)[:3],
                old.replicas[1:],
                None if old.restore_step else 10,
            )
            view.put_holdings(address, new)
            current[address] = new
    view.set_nodes(new_nodes)
    fresh = view_of(new_nodes, current, gcs)
    assert view.complete_steps() == fresh.complete_steps()
    assert view.newest_complete() == fresh.newest_complete()
    assert view.retention_floor() == fresh.retention_floor()
    assert view.decisions() == fresh.decisions()
    for rank in range(new_nodes + 3):
        assert view.steps_of(rank) == fresh.steps_of(rank)
        assert view.choose(rank) == fresh.choose(rank)


def test_adopts_the_step_peers_run_from_and_keeps_every_ranks_first_step():
    view = HoldingsView(3)
    view.put_holdings("a", Holdings(0, (10, 20)))
    view.put_holdings("b", Holdings(1, (10, 20), restore_step=10))  # already restored 10 and runs from it
    assert view.newest_complete() == 20
    assert view.choose(0) == 10  # adopts what a peer runs from
    assert view.choose(2) == 10  # a rank that holds nothing adopts too
    assert view.retention_floor() is None  # rank 2 has written nothing yet: keep everything
    view.put_holdings("c", Holdings(2, (20,)))
    assert view.retention_floor() == 20 and view.newest_complete() == 20
    assert view.choose(2) == 20  # rank 2 does not hold 10: the newest complete step


def test_report_round_trips_and_malformed_reports_are_refused():
    h = Holdings(7, (10, 20), ((3, 10), (4, 20)), 10, (("rack", "r1"),), inc=5, seq=9)
    assert Holdings.from_wire(json.loads(encoded(h.to_wire()))) == h
    bad = [
        None,
        [],
        {"rank": -1, "inc": 0, "seq": 0},
        {"rank": True, "inc": 0, "seq": 0},
        {"rank": 1, "steps": [1.5], "inc": 0, "seq": 0},
        {"rank": 1, "replicas": [[1]], "inc": 0, "seq": 0},
        {"rank": 1, "replicas": [[0, 1]] * (MAX_REPLICAS + 1), "inc": 0, "seq": 0},
        {"rank": 1, "topology": [["k", "v" * 200]], "inc": 0, "seq": 0},
        {"rank": 1, "inc": 0},
        {"rank": 1, "steps": [1 << 63], "inc": 0, "seq": 0},
    ]
    for data in bad:
        with pytest.raises(BadMessage):
            Holdings.from_wire(data)


def test_a_full_report_stays_under_the_wire_limit_and_bigger_messages_are_refused():
    biggest = Holdings(
        1 << 30,
        tuple(range(256)),
        tuple((1 << 30, 1 << 40) for _ in range(MAX_REPLICAS)),
        1 << 40,
        tuple((f"k{i}" * 30, "v" * 128) for i in range(16)),
        1 << 60,
        1 << 60,
    )
    assert len(encoded({"op": "coord_report", "report": biggest.to_wire()})) < MAX_MESSAGE // 4
    with pytest.raises(BadMessage, match="limit"):
        encoded({"op": "x", "pad": "x" * MAX_MESSAGE})


def test_older_reports_never_replace_newer_ones_and_a_restart_always_does():
    first = Holdings(1, (10,), inc=100, seq=5)
    assert Holdings(1, (20,), inc=100, seq=6).newer_than(first)
    assert not Holdings(1, (20,), inc=100, seq=4).newer_than(first)
    assert Holdings(1, (), inc=200, seq=1).newer_than(first)  # restarted daemon: counter from 1 again
