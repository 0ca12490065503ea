"""Erasure-coding groups (tierfs.peers.groups): every rank in one group, twins apart, failure
domains spread, uneven jobs shrunk evenly, and the same groups on every node."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs.core import stripes
from tierfs.peers import groups
from tierfs.peers.groups import Grouping, form_groups, group_count
from tierfs.peers.placement import twins as placement_twins

shapes = st.tuples(st.integers(1, 8), st.integers(1, 4))


def members(grouping: Grouping) -> list[tuple[int, ...]]:
    return [g.members for g in grouping]


def partition(n: int, labels: list[int]) -> dict[int, list[int]]:
    """Twin sets from a label per rank: ranks with the same label hold the same data."""
    sets: dict[int, list[int]] = {}
    for rank, label in enumerate(labels):
        sets.setdefault(label, []).append(rank)
    return {rank: sets[labels[rank]] for rank in range(n)}


@st.composite
def jobs(draw, max_ranks: int = 90):
    d, p = draw(shapes)
    n = draw(st.integers(p + 1, max_ranks))
    zones = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    racks = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    labelled = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    topology = {r: (("zone", f"z{zones[r]}"), ("rack", f"r{racks[r]}")) for r in range(n) if labelled[r] or r % 3}
    twin_labels = draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n))
    return n, d, p, topology, partition(n, twin_labels)


# Every rank in exactly one group, of the sizes the rules give


@settings(max_examples=300, deadline=None)
@given(shapes, st.integers(1, 400))
def test_every_rank_is_in_exactly_one_group_of_p_parity(shape, n):
    d, p = shape
    if n < p + 1:
        with pytest.raises(ValueError, match=f"{n} ranks .* {d}\\+{p} .* P\\+1 = {p + 1}"):
            form_groups(n, d, p)
        return
    grouping = form_groups(n, d, p)
    assert len(grouping) == group_count(n, d, p)
    everyone = [rank for g in grouping for rank in g.members]
    assert sorted(everyone) == list(range(n))
    sizes = [len(g.members) for g in grouping]
    assert max(sizes) - min(sizes) <= 1
    for number, g in enumerate(grouping):
        assert g.number == number and g.p == p and g.d >= 1 and g.d == len(g.members) - p
        assert list(g.members) == sorted(g.members)
        for rank in g.members:
            assert grouping.group_of(rank) is g
    assert [g.members[0] for g in grouping] == sorted(g.members[0] for g in grouping), "numbered by lowest rank"
    if max(sizes) > d + p:
        assert d <= p + 1 and -(-n // (d + p)) * (p + 1) > n, "groups exceed D+P only when N is too small otherwise"


@pytest.mark.parametrize("d", range(1, 9))
@pytest.mark.parametrize("p", range(1, 5))
def test_the_group_count_is_the_fewest_within_d_plus_p_else_the_most_of_p_plus_1(d, p):
    for n in range(p + 1, 200):
        possible = [g for g in range(1, n + 1) if g * (p + 1) <= n <= g * (d + p)]
        expected = min(possible) if possible else n // (p + 1)
        assert group_count(n, d, p) == expected, n
        if n >= (d + p) ** 2:
            assert all(abs(g.d - d) <= 1 for g in form_groups(n, d, p)), "the shortfall spread thin"


def test_an_uneven_job_shrinks_every_group_a_little_rather_than_one_a_lot():
    grouping = form_groups(13, 4, 2)
    assert sorted((g.d, g.p) for g in grouping) == [(2, 2), (2, 2), (3, 2)]
    assert [(g.d, g.p) for g in form_groups(12, 4, 2)] == [(4, 2), (4, 2)]
    big = form_groups(1003, 4, 2)
    assert Counter(g.d for g in big) == {4: 163, 3: 5}, "168 groups, 5 short of 168 full ones"


def test_a_job_too_small_for_groups_of_p_plus_1_grows_its_groups_instead():
    assert [(g.d, g.p) for g in form_groups(5, 2, 2)] == [(3, 2)]
    assert [(g.d, g.p) for g in form_groups(6, 1, 4)] == [(2, 4)]
    assert [(g.d, g.p) for g in form_groups(3, 1, 2)] == [(1, 2)]


def test_impossible_inputs_are_refused_with_their_numbers():
    with pytest.raises(ValueError, match="2 ranks cannot make a 4\\+2 group"):
        form_groups(2, 4, 2)
    with pytest.raises(stripes.BadGroup):
        form_groups(10, 0, 2)
    with pytest.raises(stripes.BadGroup):
        form_groups(100, 4, 5)
    with pytest.raises(ValueError, match="must divide the 10 ranks"):
        form_groups(10, 2, 1, data_parallel=3)
    with pytest.raises(ValueError, match="give one"):
        form_groups(10, 2, 1, data_parallel=2, twins=lambda r: ())
    with pytest.raises(ValueError, match="rank 3's twin 10"):
        form_groups(10, 2, 1, twins=lambda r: [10] if r == 3 else [])
    with pytest.raises(ValueError, match="names rank 12"):
        form_groups(10, 2, 1, topology={12: (("zone", "a"),)})
    with pytest.raises(ValueError, match="'zone' twice"):
        form_groups(10, 2, 1, topology={1: (("zone", "a"), ("zone", "b"))})
    grouping = form_groups(10, 2, 1)
    with pytest.raises(stripes.BadGroup):
        grouping.group_of(10)
    with pytest.raises(stripes.BadGroup):
        grouping.groups[0].member(grouping.groups[1].members[0])


# The same groups on every node


@settings(max_examples=100, deadline=None)
@given(jobs(), st.randoms(use_true_random=False))
def test_every_node_computes_the_same_groups_whatever_order_its_inputs_come_in(job, rng):
    n, d, p, topology, twin_sets = job
    first = form_groups(n, d, p, topology=topology, twins=lambda r: twin_sets[r])

    shuffled_ranks = list(topology)
    rng.shuffle(shuffled_ranks)
    topology_again = {r: topology[r] for r in shuffled_ranks}
    one_way = {r: [min(twin_sets[r])] for r in range(n)}  # each names only its set's lowest rank
    shuffled_sets = {r: rng.sample(twin_sets[r], len(twin_sets[r])) for r in range(n)}
    for twins in (lambda r: one_way[r], lambda r: set(shuffled_sets[r])):
        again = form_groups(n, d, p, topology=topology_again, twins=twins)
        assert again == first


def test_the_significance_of_labels_survives_one_rank_listing_them_in_another_order():
    topology = {r: (("zone", "ab"[r % 2]), ("rack", f"r{r % 4}")) for r in range(12)}
    topology[5] = (topology[5][1], topology[5][0])
    grouping = form_groups(12, 2, 1, topology=topology)
    assert grouping.levels == ("zone", "rack")
    assert grouping.domains(5) == ((("zone", "b"),), (("zone", "b"), ("rack", "r1")))


# Twins apart


@settings(max_examples=300, deadline=None)
@given(jobs())
def test_a_group_holds_at_most_one_rank_of_each_twin_set_unless_the_set_outnumbers_the_groups(job):
    n, d, p, topology, twin_sets = job
    grouping = form_groups(n, d, p, topology=topology, twins=lambda r: twin_sets[r])
    count = len(grouping)
    for g in grouping:
        held = Counter(min(twin_sets[r]) for r in g.members)
        for lowest, k in held.items():
            assert k <= math.ceil(len(twin_sets[lowest]) / count), (g, lowest)
    if max(len(s) for s in twin_sets.values()) <= count:
        assert grouping.twins_together() == ()
    together = {tuple(t) for t in grouping.twins_together()}
    for g in grouping:
        for lowest, k in Counter(min(twin_sets[r]) for r in g.members).items():
            if k > 1:
                assert tuple(r for r in g.members if min(twin_sets[r]) == lowest) in together


@settings(max_examples=150, deadline=None)
@given(shapes, st.integers(1, 8), st.integers(1, 40))
def test_data_parallel_twins_are_placements_and_never_share_a_group(shape, replicas, width):
    d, p = shape
    n = replicas * width
    if n < p + 1:
        return
    grouping = form_groups(n, d, p, data_parallel=replicas)
    if replicas <= len(grouping):
        for rank in range(n):
            assert not set(grouping.group_of(rank).members) & placement_twins(rank, n, replicas)
        assert grouping.twins_together() == ()
    assert grouping == form_groups(n, d, p, twins=lambda r: placement_twins(r, n, replicas))


def test_ranks_a_multiple_of_the_group_count_apart_are_still_kept_from_their_twins():
    # 12 ranks of 4+2 make 2 groups; dealt in turn, rank r and its twin r+6 would share one
    grouping = form_groups(12, 4, 2, data_parallel=2)
    for g in grouping:
        assert len({r % 6 for r in g.members}) == 6


def test_a_job_that_is_all_twins_still_gets_groups_spread_as_evenly_as_it_can():
    grouping = form_groups(12, 2, 1, data_parallel=12)  # every rank holds the same data: one twin set
    assert len(grouping) == 4
    assert sorted(len(t) for t in grouping.twins_together()) == [3, 3, 3, 3]
    grouping = form_groups(12, 2, 1, data_parallel=6)  # sets of 6 over 4 groups: 2, 2, 1, 1 each
    for g in grouping:
        assert max(Counter(r % 2 for r in g.members).values()) <= 2


def test_twins_are_kept_apart_even_when_no_trade_is_found(monkeypatch):
    monkeypatch.setattr(groups._Dealing, "repair", lambda self, position, runs: False)
    grouping = form_groups(12, 4, 2, data_parallel=2)
    assert grouping.twins_together() == ()
    rng = random.Random(4)
    for _ in range(200):
        n = rng.randint(3, 60)
        twin_sets = partition(n, [rng.randrange(n) for _ in range(n)])
        grouping = form_groups(n, rng.randint(1, 6), rng.randint(1, 2), twins=lambda r, s=twin_sets: s[r])
        for g in grouping:
            for rank in g.members:
                k = sum(1 for r in g.members if r in twin_sets[rank])
                assert k <= math.ceil(len(twin_sets[rank]) / len(grouping))


# Failure domains spread


@st.composite
def hierarchies(draw):
    d, p = draw(shapes)
    n = draw(st.integers(p + 1, 120))
    zones = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    racks = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    topology = {r: (("zone", f"z{zones[r]}"), ("rack", f"r{racks[r]}"), ("host", f"h{r // 4}")) for r in range(n)}
    return n, d, p, topology


@settings(max_examples=200, deadline=None)
@given(hierarchies())
def test_every_domain_is_spread_over_the_groups_as_evenly_as_any_grouping_could(job):
    n, d, p, topology = job
    grouping = form_groups(n, d, p, topology=topology)
    count = len(grouping)
    ranks_in: Counter[tuple[tuple[str, str], ...]] = Counter()
    for r in range(n):
        ranks_in.update(grouping.domains(r))
    for g in grouping:
        held: Counter[tuple[tuple[str, str], ...]] = Counter()
        for r in g.members:
            held.update(grouping.domains(r))
        for domain, k in ranks_in.items():
            assert k // count <= held[domain] <= -(-k // count), (domain, g)


def test_one_rank_per_zone_and_rack_where_the_topology_has_enough():
    topology = {r: (("zone", "abc"[r % 3]), ("rack", f"r{r % 2}")) for r in range(18)}
    grouping = form_groups(18, 4, 2, topology=topology)
    for g in grouping:
        assert Counter(topology[r][0] for r in g.members) == {("zone", z): 2 for z in "abc"}
        assert len({topology[r] for r in g.members}) == 6, "no two members share both labels"
    assert grouping.weak_spots() == ()


def test_a_domain_holding_more_than_p_of_a_group_is_reported_once_at_its_outermost():
    topology = {r: (("zone", "ab"[r % 2]), ("rack", f"r{r % 2}")) for r in range(12)}
    grouping = form_groups(12, 4, 2, topology=topology)
    spots = grouping.weak_spots()
    assert [(s.group, s.domain) for s in spots] == [
        (0, (("zone", "a"),)),
        (0, (("zone", "b"),)),
        (1, (("zone", "a"),)),
        (1, (("zone", "b"),)),
    ], "each rack holds the same members as its zone: nothing more to say"
    for spot in spots:
        assert len(spot.members) == 3
        assert all(topology[r][0] == spot.domain[0] for r in spot.members)
    topology = {r: (("zone", "a"), ("rack", f"r{r % 4}")) for r in range(12)}
    spots = form_groups(12, 4, 2, topology=topology).weak_spots()
    assert {s.domain for s in spots} == {(("zone", "a"),)}, "a rack of 1 or 2 members is no weak spot at P=2"


@settings(max_examples=150, deadline=None)
@given(jobs())
def test_weak_spots_are_every_domain_over_p_that_its_parent_does_not_already_name(job):
    n, d, p, topology, twin_sets = job
    grouping = form_groups(n, d, p, topology=topology, twins=lambda r: twin_sets[r])
    expected = set()
    for g in grouping:
        inside: dict[tuple[tuple[str, str], ...], list[int]] = {}
        for r in g.members:
            for domain in grouping.domains(r):
                inside.setdefault(domain, []).append(r)
        for domain, ranks in inside.items():
            if len(ranks) > p and not (len(domain) > 1 and inside[domain[:-1]] == ranks):
                expected.add((g.number, domain, tuple(ranks)))
    assert {(s.group, s.domain, s.members) for s in grouping.weak_spots()} == expected


def test_twins_in_their_own_slices_cost_the_spreading_nothing():
    # two data-parallel replicas, each a slice of hosts of 4: twins share no domain
    topology = {r: (("slice", f"s{r // 48}"), ("host", f"h{r // 4}")) for r in range(96)}
    grouping = form_groups(96, 4, 2, topology=topology, data_parallel=2)
    assert grouping.twins_together() == ()
    for g in grouping:
        assert Counter(topology[r][0] for r in g.members) == {("slice", "s0"): 3, ("slice", "s1"): 3}
        assert len({topology[r][1] for r in g.members}) == 6


def test_without_a_topology_neighbouring_ranks_go_to_different_groups():
    grouping = form_groups(12, 4, 2)
    assert members(grouping) == [(0, 2, 4, 6, 8, 10), (1, 3, 5, 7, 9, 11)]


# Slots as core.stripes lays them out


@settings(max_examples=100, deadline=None)
@given(jobs(max_ranks=60))
def test_members_hold_the_parity_and_give_the_data_core_stripes_says(job):
    n, d, p, topology, twin_sets = job
    grouping = form_groups(n, d, p, topology=topology, twins=lambda r: twin_sets[r])
    parity_count: Counter[int] = Counter()
    for g in grouping:
        size = len(g.members)
        assert g.layout == stripes.Group(size - p, p)
        for stripe in range(size):
            holders, givers = g.parity_holders(stripe), g.data_givers(stripe)
            assert holders == tuple(g.members[(stripe + j) % size] for j in range(p))
            assert givers == tuple(sorted(set(g.members) - set(holders), key=g.members.index))
            for slot, rank in enumerate(givers + holders):
                assert g.layout.slot(stripe, g.member(rank)) == slot
            parity_count.update(holders)
        for member, rank in enumerate(g.members):
            assert g.member(rank) == member and g.rank(member) == rank
            assert len(g.parity_stripes(rank)) == p and len(g.data_stripes(rank)) == g.d
            assert all(rank in g.parity_holders(s) for s in g.parity_stripes(rank))
            assert all(rank in g.data_givers(s) for s in g.data_stripes(rank))
    assert parity_count == Counter({r: p for r in range(n)}), "every rank holds parity for P stripes"


def test_a_6_member_group_follows_the_formats_example():
    grouping = form_groups(6, 4, 2)
    (g,) = grouping.groups
    assert g.members == (0, 1, 2, 3, 4, 5)
    assert [g.parity_holders(s) for s in range(6)] == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 0)]
    assert g.data_givers(0) == (2, 3, 4, 5) and g.data_givers(5) == (1, 2, 3, 4)
