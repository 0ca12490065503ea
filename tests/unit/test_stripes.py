"""The erasure-coded layout (tierfs.core.stripes): rotating parity, one slot per member per stripe,
shards cut into D parts padded virtually, and P/D of a shard of parity on every member."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs.core.stripes import (
    MAX_SHARD,
    BadGroup,
    Group,
    data_lengths,
    held_bytes,
    parity_bytes,
    parse_shape,
    part_size,
    parts,
    pieces,
    stripe_lengths,
)

GiB = 1 << 30
EVERY_GROUP = [Group(d, p) for d in range(1, 33) for p in range(1, 5)]
groups = st.sampled_from(EVERY_GROUP)


@pytest.mark.parametrize("group", EVERY_GROUP, ids=lambda g: f"{g.d}+{g.p}")
def test_every_member_gives_d_parts_holds_p_parities_and_has_one_slot_per_stripe(group):
    n = group.size
    for s in range(n):
        holders, givers = group.parity_holders(s), group.data_givers(s)
        assert holders == tuple((s + j) % n for j in range(group.p)), "parity rotates as in RAID 5"
        assert givers == tuple(sorted(set(range(n)) - set(holders)))
        assert sorted(holders + givers) == list(range(n))
        assert [group.slot(s, m) for m in givers + holders] == list(range(n))
        assert [group.member(s, slot) for slot in range(n)] == list(givers + holders)
    for m in range(n):
        assert len(group.data_stripes(m)) == group.d
        assert len(group.parity_stripes(m)) == group.p
        assert sorted(group.data_stripes(m) + group.parity_stripes(m)) == list(range(n))


@pytest.mark.parametrize("shape", [(4, 2), (8, 2), (3, 1), (5, 4)])
def test_losing_any_p_members_costs_no_stripe_more_than_p_parts(shape):
    group = Group(*shape)
    for lost in itertools.combinations(range(group.size), group.p):
        survivors = [m for m in range(group.size) if m not in lost]
        for s in range(group.size):
            assert len({group.slot(s, m) for m in lost}) == group.p
            assert len({group.slot(s, m) for m in survivors}) == group.d


def test_the_worked_example_of_the_formats_doc():
    group = Group(4, 2)
    assert [group.parity_holders(s) for s in range(6)] == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 0)]
    assert [group.data_givers(s) for s in range(6)] == [
        (2, 3, 4, 5),
        (0, 3, 4, 5),
        (0, 1, 4, 5),
        (0, 1, 2, 5),
        (0, 1, 2, 3),
        (1, 2, 3, 4),
    ]
    assert group.data_stripes(0) == (1, 2, 3, 4) and group.parity_stripes(0) == (0, 5)
    assert group.data_stripes(4) == (0, 1, 2, 5) and group.parity_stripes(4) == (3, 4)
    shards = [1000, 1000, 1000, 1000, 600, 0]
    assert [(p.stripe, p.slot, p.start, p.end) for p in parts(group, 4, 600)] == [
        (0, 2, 0, 150),
        (1, 2, 150, 300),
        (2, 2, 300, 450),
        (5, 3, 450, 600),
    ]
    assert data_lengths(group, shards)[0] == (250, 250, 150, 0)
    assert data_lengths(group, shards)[5] == (250, 250, 250, 150)
    assert stripe_lengths(group, shards) == (250,) * 6
    assert parity_bytes(group, shards) == (500,) * 6
    assert held_bytes(group, shards) == (1500, 1500, 1500, 1500, 1100, 500)


@settings(deadline=None)
@given(group=groups, length=st.integers(0, 10_000))
def test_a_shards_parts_cover_it_in_order(group, length):
    for m in (0, group.size - 1):
        cut = parts(group, m, length)
        assert [p.index for p in cut] == list(range(group.d))
        assert [p.stripe for p in cut] == list(group.data_stripes(m))
        assert cut[0].start == 0 and cut[-1].end == length
        assert all(a.end == b.start for a, b in itertools.pairwise(cut))
        size = part_size(group, length)
        assert size == -(-length // group.d)
        assert all(p.length == size for p in cut if p.end < length)
        assert all(0 <= p.length <= size for p in cut)
        assert all(group.member(p.stripe, p.slot) == m for p in cut)


def test_a_shard_shorter_than_d_leaves_empty_parts():
    assert [p.length for p in parts(Group(4, 2), 0, 2)] == [1, 1, 0, 0]
    assert [p.length for p in parts(Group(4, 2), 0, 0)] == [0, 0, 0, 0]
    assert [(p.start, p.end) for p in parts(Group(3, 1), 1, 7)] == [(0, 3), (3, 6), (6, 7)]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), group=groups)
def test_a_stripe_is_as_long_as_its_longest_data_part(data, group):
    shards = data.draw(st.lists(st.integers(0, 1 << 40), min_size=group.size, max_size=group.size))
    by_member = {m: parts(group, m, n) for m, n in enumerate(shards)}
    lengths = data_lengths(group, shards)
    for s in range(group.size):
        expected = [next(p.length for p in by_member[m] if p.stripe == s) for m in group.data_givers(s)]
        assert lengths[s] == tuple(expected)
    stripes = stripe_lengths(group, shards)
    assert stripes == tuple(max(x) for x in lengths)
    assert parity_bytes(group, shards) == tuple(
        sum(stripes[s] for s in group.parity_stripes(m)) for m in range(group.size)
    )


def test_zero_length_shards_make_empty_stripes():
    group = Group(8, 2)
    assert stripe_lengths(group, [0] * 10) == (0,) * 10
    assert parity_bytes(group, [0] * 10) == (0,) * 10
    # A member with nothing of its own still holds parity for the stripes it is given.
    assert parity_bytes(group, [0] * 9 + [800])[5] == 200


@pytest.mark.parametrize("shape", [(4, 1), (4, 2), (8, 2), (3, 1), (6, 3), (32, 4), (1, 1)])
@pytest.mark.parametrize("shard", [7 * GiB + 12_345, 64 * GiB, 1 << 20])
def test_with_equal_shards_every_member_holds_p_over_d_of_a_shard(shape, shard):
    group = Group(*shape)
    parity = parity_bytes(group, [shard] * group.size)
    target = shard * group.p / group.d
    assert all(abs(b - target) <= 0.05 * target for b in parity)
    # P stripes of ceil(L / D) bytes, or of the last part's L - (D-1) * ceil(L / D) where every
    # giver gives its last part: off P/D of a shard by less than P * D bytes either way.
    assert all(b <= group.p * -(-shard // group.d) for b in parity)
    assert all(abs(b - target) < group.p * group.d for b in parity)


@settings(max_examples=300)
@given(chunk_lengths=st.lists(st.integers(0, 50), max_size=12), data=st.data())
def test_pieces_of_chunks_read_a_byte_range_of_the_shard(chunk_lengths, data):
    chunks = [bytes([i]) * n for i, n in enumerate(chunk_lengths)]
    shard = b"".join(chunks)
    start = data.draw(st.integers(0, len(shard)))
    end = data.draw(st.integers(start, len(shard)))
    got = list(pieces(chunk_lengths, start, end))
    assert b"".join(chunks[c][o : o + n] for c, o, n in got) == shard[start:end]
    assert all(n > 0 for _, _, n in got), "no empty pieces"


def test_pieces_refuse_ranges_outside_the_shard():
    with pytest.raises(BadGroup, match="not within"):
        list(pieces([10, 10], 5, 21))
    with pytest.raises(BadGroup, match="not a range"):
        list(pieces([10, 10], 5, 4))
    with pytest.raises(BadGroup, match="not within"):
        list(pieces([10, -5], 0, 5))


@pytest.mark.parametrize(
    ("d", "p", "message"),
    [
        (0, 1, "D=0"),
        (33, 1, "D=33"),
        (-1, 2, "D=-1"),
        (4, 0, "P=0"),
        (4, 5, "P=5"),
        (1 << 40, 2, "D="),
        (4.0, 2, "whole numbers"),
        (True, 1, "whole numbers"),
        ("4", 2, "whole numbers"),
    ],
)
def test_shapes_no_group_has_are_refused(d, p, message):
    with pytest.raises(BadGroup, match=message):
        Group(d, p)


def test_members_stripes_and_lengths_outside_the_group_are_refused():
    group = Group(4, 2)
    for bad in (-1, 6, 1 << 62):
        with pytest.raises(BadGroup, match="member"):
            group.data_stripes(bad)
        with pytest.raises(BadGroup, match="stripe"):
            group.data_givers(bad)
        with pytest.raises(BadGroup, match="member"):
            parts(group, bad, 10)
    with pytest.raises(BadGroup, match="slot"):
        group.member(0, 6)
    with pytest.raises(BadGroup, match="5 shard lengths"):
        stripe_lengths(group, [1] * 5)
    for bad in (-1, MAX_SHARD + 1, 1.5, None, True):
        with pytest.raises(BadGroup, match="shard length"):
            parity_bytes(group, [1] * 5 + [bad])
        with pytest.raises(BadGroup, match="shard length"):
            parts(group, 0, bad)


def test_erasure_shapes_are_read_as_d_plus_p():
    assert parse_shape("4+2") == Group(4, 2)
    assert parse_shape(" 8 + 2 ") == Group(8, 2)
    for bad in ("4", "4+", "+2", "4-2", "4+2+1", "a+b", "4+2.0", "9" * 5000 + "+1", "-4+2"):
        with pytest.raises(BadGroup):
            parse_shape(bad)
    with pytest.raises(BadGroup, match="P=9"):
        parse_shape("4+9")
