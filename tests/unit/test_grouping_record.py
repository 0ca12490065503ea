"""The grouping record (tierfs.peers.grouping_record): its JSON round trip and digest, from_json refusing
every malformed record with BadRecord alone, and form()/legacy() as they wrap form_groups.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tierfs.core import stripes
from tierfs.peers.grouping_record import MAX_BYTES, BadRecord, GroupingRecord, form, legacy
from tierfs.peers.groups import form_groups

SHAPE = stripes.parse_shape("2+1")
BY_PAIRS = {i: (("rack", f"r{i // 2}"),) for i in range(6)}  # racks {0,1} {2,3} {4,5}
ONE_RACK = {i: (("rack", "a"),) for i in range(6)}
VALID = {"version": 1, "nodes": 6, "erasure": "2+1", "groups": [[0, 2, 4], [1, 3, 5]]}
MISSING = object()


def doc(**changes: Any) -> bytes:
    """VALID as JSON, with keys replaced (or dropped, given MISSING)."""
    record = {**VALID, **changes}
    return json.dumps({k: v for k, v in record.items() if v is not MISSING}).encode()


def noted() -> GroupingRecord:
    """A record with weak spots (one rack) and twins that had to share (3 replicas, 2 groups)."""
    record = form(6, SHAPE, 3, ONE_RACK, {})
    assert record.weak_spots and record.twins_together
    return record


def test_valid_document_is_accepted() -> None:
    record = GroupingRecord.from_json(doc())
    assert (record.nodes, record.shape, record.groups) == (6, "2+1", ((0, 2, 4), (1, 3, 5)))


def test_round_trip_keeps_record_and_digest() -> None:
    record = noted()
    back = GroupingRecord.from_json(record.to_json())
    assert back == record
    assert back.digest == record.digest
    assert back.to_json() == record.to_json()


def test_digest_ignores_notes() -> None:
    record = noted()
    bare = GroupingRecord(record.nodes, record.d, record.p, record.groups)
    assert bare != record
    assert bare.digest == record.digest


@pytest.mark.parametrize(
    "other",
    [
        GroupingRecord(6, 2, 1, ((0, 1, 2), (3, 4, 5))),
        GroupingRecord(6, 1, 2, ((0, 2, 4), (1, 3, 5))),
        GroupingRecord(7, 2, 1, ((0, 2, 4), (1, 3, 5))),
    ],
    ids=["groups", "shape", "nodes"],
)
def test_digest_names_nodes_shape_and_groups(other: GroupingRecord) -> None:
    assert GroupingRecord(6, 2, 1, ((0, 2, 4), (1, 3, 5))).digest != other.digest


DEEP = 100_000
BAD = {
    "too-big": doc() + b" " * MAX_BYTES,  # valid JSON but for its size
    "not-json": b"{version: 1",
    "not-utf8": b"\xff\xfe{}",
    "list": b"[1, 2]",
    "string": b'"record"',
    "null": b"null",
    "version-2": doc(version=2),
    "no-version": doc(version=MISSING),
    "no-nodes": doc(nodes=MISSING),
    "no-erasure": doc(erasure=MISSING),
    "no-groups": doc(groups=MISSING),
    "shape-4x2": doc(erasure="4x2"),
    "shape-0+1": doc(erasure="0+1"),
    "rank-missing": doc(groups=[[0, 2, 4], [1, 3]]),
    "rank-twice": doc(groups=[[0, 2, 4], [1, 3, 4]]),
    "rank-out-of-range": doc(groups=[[0, 2, 4], [1, 3, 6]]),
    "rank-negative": doc(nodes=6, groups=[[-1, 0, 2, 4], [1, 3, 5]]),
    "group-unsorted": doc(groups=[[0, 4, 2], [1, 3, 5]]),
    "groups-unordered": doc(groups=[[1, 3, 5], [0, 2, 4]]),
    "group-below-p+1": doc(groups=[[0, 2, 4], [1], [3, 5]]),
    "p-equals-group": doc(erasure="2+3"),
    "rank-string": doc(groups=[[0, 2, 4], [1, 3, "5"]]),
    "rank-float": doc(groups=[[0, 2, 4], [1, 3, 5.0]]),
    "rank-null": doc(groups=[[0, 2, 4], [1, 3, None]]),
    "rank-bool": doc(groups=[[False, 2, 4], [True, 3, 5]]),
    "groups-not-list": doc(groups={"0": [0, 2, 4]}),
    "weak-domain-int": doc(weak_spots=[[0, 5, [0, 2]]]),
    "weak-domain-newline": doc(weak_spots=[[0, "rack=a\n", [0, 2]]]),
    "weak-domain-nul": doc(weak_spots=[[0, "rack=\x00", [0, 2]]]),
    "weak-short": doc(weak_spots=[[0, "rack=a"]]),
    "twins-not-ranks": doc(twins_together=[["a", "b"]]),
    "deep-document": b"[" * DEEP + b"]" * DEEP,
    "deep-groups": doc(groups=MISSING)[:-1] + b', "groups": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    "empty-group": doc(groups=[[0, 2, 4], [1, 3, 5], []]),
    "version-true": doc(version=True),
    "no-ranks": doc(nodes=0, groups=[]),
    "weak-spot-outside-its-group": doc(weak_spots=[[0, "rack=a", [1]]]),
}


@pytest.mark.parametrize("data", list(BAD.values()), ids=list(BAD))
def test_from_json_refuses(data: bytes) -> None:
    with pytest.raises(BadRecord):
        GroupingRecord.from_json(data)


def test_form_spreads_racks() -> None:
    record = form(6, SHAPE, 1, BY_PAIRS, {})
    assert record.groups == ((0, 2, 4), (1, 3, 5))
    assert record.weak_spots == ()
    assert record.twins_together == ()


def test_form_follows_labels_not_rank_numbers() -> None:
    by_parity = {i: (("rack", f"r{i % 2}"),) for i in range(6)}  # legacy groups would each be one rack
    assert legacy(6, SHAPE, 1).groups == ((0, 2, 4), (1, 3, 5))
    for members in form(6, SHAPE, 1, by_parity, {}).groups:
        assert {i % 2 for i in members} == {0, 1}


@pytest.mark.parametrize(
    ("nodes", "shape", "data_parallel"),
    [(6, "2+1", 1), (7, "2+1", 1), (10, "3+2", 1), (8, "2+2", 2), (12, "4+2", 3)],
    ids=["6-2+1", "7-2+1", "10-3+2", "8-2+2-dp2", "12-4+2-dp3"],
)
def test_form_without_labels_is_legacy(nodes: int, shape: str, data_parallel: int) -> None:
    group = stripes.parse_shape(shape)
    old = legacy(nodes, group, data_parallel)
    assert form(nodes, group, data_parallel, {}, {}) == old
    by_numbers = form_groups(nodes, group.d, group.p, data_parallel=data_parallel)
    assert old.groups == tuple(g.members for g in by_numbers.groups)


def test_form_names_weak_spots_of_one_rack() -> None:
    record = form(6, SHAPE, 1, ONE_RACK, {})
    assert record.weak_spots == ((0, "rack=a", (0, 2, 4)), (1, "rack=a", (1, 3, 5)))


@pytest.mark.parametrize(
    ("labels", "named"),
    [
        (BY_PAIRS, {0: [1], 1: [0]}),
        ({}, {0: [2], 2: [0]}),  # rank numbers alone deal 0 and 2 together
        ({}, {0: [2]}),  # named by one side only
        (ONE_RACK, {1: [3], 3: [1]}),
    ],
    ids=["0-1-racks", "0-2", "0-2-one-sided", "1-3-one-rack"],
)
def test_form_keeps_named_twins_apart(labels: dict[int, Any], named: dict[int, list[int]]) -> None:
    record = form(6, SHAPE, 1, labels, named)
    for rank, twins in named.items():
        for twin in twins:
            assert record.group_of(rank).number != record.group_of(twin).number
    assert record.twins_together == ()
    assert sorted(r for g in record.groups for r in g) == list(range(6))


def test_group_of() -> None:
    record = form(7, SHAPE, 1, {}, {})  # groups of 3, 2 and 2
    sizes = set()
    for rank in range(7):
        group = record.group_of(rank)
        assert rank in group.members
        assert group.members == record.groups[group.number]
        assert (group.layout.d, group.layout.p) == (len(group.members) - 1, 1)
        sizes.add(len(group.members))
    assert sizes == {2, 3}
    for outside in (7, -1, 100):
        with pytest.raises(BadRecord):
            record.group_of(outside)


def test_matches() -> None:
    record = form(6, SHAPE, 1, BY_PAIRS, {})
    assert record.matches(6, stripes.Group(2, 1))
    assert record.matches(6, stripes.parse_shape("2+1"))
    assert not record.matches(7, stripes.Group(2, 1))
    assert not record.matches(6, stripes.Group(1, 1))
    assert not record.matches(6, stripes.Group(2, 2))
    assert not record.matches(6, stripes.Group(1, 2))
