"""Replica placement: twins first, then one close peer, then distant ones, spread in ring order."""

from tierfs.peers.placement import PeerInfo, choose, twins


def peers(n: int, labels=None) -> list[PeerInfo]:
    return [PeerInfo(("127.0.0.1", 7000 + r), r, tuple((labels or {}).get(r, ()))) for r in range(n)]


def ranks(chosen) -> list[int]:
    return [p.rank for p in chosen]


def test_without_topology_replicas_follow_the_ring_so_load_spreads():
    ps = peers(4)
    assert ranks(choose(0, (), ps, 1, 4)) == [1]
    assert ranks(choose(3, (), ps, 2, 4)) == [0, 1]
    targets = [ranks(choose(r, (), ps, 1, 4))[0] for r in range(4)]
    assert sorted(targets) == [0, 1, 2, 3], "every node holds exactly one other rank's replica"


def test_twins_hold_the_same_data_and_come_first():
    assert twins(1, 8, 2) == {5}
    assert twins(1, 8, 4) == {3, 5, 7}
    assert twins(1, 8, 1) == set()
    assert ranks(choose(1, (), peers(8), 2, 8, data_parallel=2)) == [5, 2]


def test_one_close_peer_then_the_most_distant():
    slice_a, slice_b = (("slice", "a"),), (("slice", "b"),)
    labels = {0: slice_a, 1: slice_a, 2: slice_b, 3: slice_b}
    ps = peers(4, labels)
    assert ranks(choose(0, slice_a, ps, 1, 4)) == [1]
    assert ranks(choose(0, slice_a, ps, 2, 4)) == [1, 2]
    assert ranks(choose(3, slice_b, ps, 3, 4)) == [2, 0, 1]


def test_unreachable_peers_are_simply_not_candidates():
    ps = [p for p in peers(4) if p.rank != 1]
    assert ranks(choose(0, (), ps, 2, 4)) == [2, 3]
    assert choose(0, (), [], 1, 4) == []
