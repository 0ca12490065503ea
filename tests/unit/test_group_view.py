"""The erasure group's arithmetic: which steps a group can rebuild, and how many more losses it survives."""

from __future__ import annotations

from tierfs.peers.groups import form_groups
from tierfs.store.group_view import GroupView, MemberHoldings


def full(group, rank: int, step: int) -> MemberHoldings:
    """A member holding every part of ``step``: its own shard and its complete parity sums."""
    parity = {(step, s, group.parity_holders(s).index(rank)) for s in group.parity_stripes(rank)}
    return MemberHoldings(rank, frozenset({step}), frozenset(parity), {}, frozenset({(r, step) for r in group.members}))


def view_of(d: int, p: int, holding: dict[int, MemberHoldings | None]) -> GroupView:
    group = form_groups(d + p, d, p).group_of(0)
    view = GroupView(group)
    view.update(holding)
    return view


def test_every_member_holding_survives_p_losses_and_rebuilds_each_rank():
    group = form_groups(6, 4, 2).group_of(0)
    view = view_of(4, 2, {r: full(group, r, 5) for r in range(6)})
    assert view.survives(5) == 2 and view.encoded(5)
    assert all(view.rebuildable(r, 5) for r in range(6))
    assert view.steps() == [5] and view.manifest_holders(3, 5) == list(range(6))


def test_losses_count_down_to_the_refusal():
    group = form_groups(6, 4, 2).group_of(0)
    holding = {r: full(group, r, 5) for r in range(6)}
    for lost, left in (((1,), 1), ((1, 4), 0), ((1, 4, 0), -1)):
        view = view_of(4, 2, {**holding, **dict.fromkeys(lost)})
        assert view.survives(5) == left
        assert all(view.rebuildable(r, 5) == (left >= 0) for r in lost)
        assert not view.encoded(5)


def test_a_member_without_its_parity_counts_only_where_it_gives_data():
    """A restored member holds its shard again but not the parity it summed before its loss."""
    group = form_groups(4, 3, 1).group_of(0)
    holding = {r: full(group, r, 2) for r in range(4)}
    holding[0] = MemberHoldings(0, frozenset({2}))  # data only
    holding[1] = None  # lost
    view = view_of(3, 1, holding)
    assert view.survives(2) == -1  # the stripe whose parity 0 held has lost two parts
    hurt = group.parity_stripes(0)[0]
    assert len(view.alive_slots(2, hurt)) == 2
    assert 1 in group.data_givers(hurt) and not view.rebuildable(1, 2)  # two of the three parts it needs


def test_a_newer_step_held_by_fewer_is_not_rebuildable_while_the_older_is():
    group = form_groups(4, 3, 1).group_of(0)
    holding = {r: full(group, r, 1) for r in range(4)}
    holding[3] = MemberHoldings(3, frozenset({1, 2}), holding[3].parity)  # only rank 3 committed step 2
    view = view_of(3, 1, holding)
    assert view.rebuildable(0, 1) and not view.rebuildable(0, 2)
    assert view.steps() == [1, 2]
