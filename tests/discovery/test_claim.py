"""Who keeps a rank two nodes claim: the decision itself (the daemons' side is in test_cluster)."""

from __future__ import annotations

import pytest

from tierfs.core.errors import UserError
from tierfs.peers.claim import Identity, check, rivals

A = ("127.0.0.2", 7000)
B = ("127.0.0.3", 7000)


def ident(node: str, started: float, instance: str | None = None) -> Identity:
    return Identity(node, instance or f"{node}-{started}", started)


def info(who: Identity, rank: int) -> dict:
    return {"rank": rank, "topology": [], **who.info()}


def test_the_later_claimant_is_refused_in_one_line_naming_the_other():
    incumbent, newcomer = ident("host-a:/dev/shm/tierfs", 1000.0), ident("host-b:/dev/shm/tierfs", 2000.0)
    with pytest.raises(UserError) as e:
        check(newcomer, "llama", 3, {A: info(incumbent, 3)})
    assert str(e.value) == (
        "rank 3 of job llama is already served by node host-a:/dev/shm/tierfs at 127.0.0.2:7000 (up since "
        "1970-01-01 00:16:40 UTC): not starting a second one; give this node another --rank, or stop tierfs on "
        "host-a:/dev/shm/tierfs first"
    )
    check(incumbent, "llama", 3, {B: info(newcomer, 3)})  # the incumbent goes on


def test_both_sides_agree_on_who_yields():
    for a, b in [
        (ident("a", 5.0), ident("b", 5.5)),
        (ident("b", 5.0), ident("a", 5.0)),
        (ident("a", 5.0, "x2"), ident("a2", 5.0, "x1")),
    ]:
        assert a.precedes(b) != b.precedes(a)
        refused = []
        for me, other, where in ((a, b, B), (b, a, A)):
            try:
                check(me, "j", 0, {where: info(other, 0)})
            except UserError:
                refused.append(me)
        assert len(refused) == 1


def test_a_restart_of_the_same_node_is_no_rival():
    old, new = ident("host-a:/ram", 10.0, "old"), ident("host-a:/ram", 20.0, "new")
    assert rivals(new, 0, {A: info(old, 0)}) == []
    check(new, "j", 0, {A: info(old, 0)})


def test_other_ranks_this_daemon_and_peers_that_do_not_say_are_no_rivals():
    me = ident("b", 20.0)
    answers = {
        A: info(ident("a", 1.0), 4),
        B: info(me, 3),
        ("127.0.0.4", 1): {"rank": 3},
        ("127.0.0.5", 1): {"rank": 3, "node": 5, "instance": "x", "started": "soon"},
    }
    assert rivals(me, 3, answers) == []


def test_identity_round_trips_through_info():
    me = Identity.create("/dev/shm/tierfs")
    assert Identity.of(me.info()) == me and me.node.endswith(":/dev/shm/tierfs")
    before = me.started
    me.listening()
    assert me.started >= before
