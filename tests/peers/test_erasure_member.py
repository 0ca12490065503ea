"""How the members of an erasure group agree their grouping: real peer services on loopback, real stores.

A member has no group until every rank answers (or a peer hands it the record the others
use); then it keeps the record beside its parity, and a request sent under another grouping
is refused rather than summed in.
"""

from __future__ import annotations

import pytest
import trio

from tests.peers.test_stripe_service import agree, put_everywhere, start_members
from tierfs.core import stripes
from tierfs.core.erasure import Code
from tierfs.peers.grouping_record import GroupingRecord, form, legacy
from tierfs.peers.wire import PeerError
from tierfs.ramtier.space import SpaceAccount
from tierfs.store.erasure_member import RECORD, ErasureMember
from tierfs.store.parity import ParityStore
from tierfs.tiers.base import TierUnavailable

RACKS = {r: (("rack", f"r{r // 2}"),) for r in range(6)}  # ranks numbered rack by rack
SHAPE = stripes.Group(2, 1)


def member_at(root, rank: int = 0, nodes: int = 3, peers=None) -> ErasureMember:
    """A member on ``root`` with no peers answering (or those ``peers()`` gives)."""

    async def nobody() -> list:
        return []

    async def no_dial(rank: int):
        return None

    return ErasureMember(rank, nodes, SHAPE, 1, root, lambda s: None, list, no_dial, peers or nobody)


async def test_no_group_until_every_rank_answers(tmp_path):
    async with trio.open_nursery() as nursery:
        members = await start_members(nursery, tmp_path, 2, 1, dict.fromkeys(range(3), 1000))
        first = members[0]
        first.tier.members.by_rank.pop(2)  # rank 2 has not answered yet
        assert not await first.member.settle()
        assert first.member.describe() == "no erasure group yet: waiting for rank(s) 2 to answer"
        assert first.member.waiting == (2,)
        assert (await first.tier.holdings()).manifests == () and await first.tier.list_manifests() == []
        manifest, where = first.steps[7]
        with pytest.raises(TierUnavailable, match="waiting for rank"):
            await first.tier.put_step(manifest, where)
        with pytest.raises(PeerError, match="rank 0 has no erasure group yet"):  # asked by a member that has one
            await members[1].member.settle()
            await members[1].member.service.ask(0, {"op": "ec_status"}, 0)
        first.tier.members.by_rank[2] = members[2].address
        assert await first.member.settle()
        await agree(members.values())
        nursery.cancel_scope.cancel()


async def test_groups_follow_the_racks_and_a_wiped_member_takes_the_peers_record(tmp_path):
    async with trio.open_nursery() as nursery:
        members = await start_members(nursery, tmp_path, 2, 1, dict.fromkeys(range(6), 1000), labels=RACKS)
        digest = await agree(members.values())
        assert {m.member.service.group.members for m in members.values()} == {(0, 2, 4), (1, 3, 5)}
        kept = members[0].member.record
        # Rank 0 comes back wiped, in rack r1: formed from its labels now, the groups would differ.
        moved = {**RACKS, 0: (("rack", "r1"),)}
        assert form(6, SHAPE, 1, moved, {}).digest != digest
        (tmp_path / "node-0" / "parity" / RECORD).unlink()
        dialer = members[0].tier.members
        dialer.labels = moved
        again = ErasureMember(
            0, 6, SHAPE, 1, tmp_path / "node-0" / "parity", lambda s: None, list, dialer.dial, dialer.peers
        )
        again.load()
        assert again.service is None
        assert await again.settle()
        assert again.record == kept
        nursery.cancel_scope.cancel()


async def test_a_restarted_member_keeps_its_record_and_parity_without_asking(tmp_path):
    async with trio.open_nursery() as nursery:
        members = await start_members(nursery, tmp_path, 2, 1, dict.fromkeys(range(3), 3000))
        digest = await agree(members.values())
        await put_everywhere(members)
        root = tmp_path / "node-0" / "parity"
        held = members[0].service.parity.entries()
        assert held
        nursery.cancel_scope.cancel()
    again = member_at(root)  # no peer answers
    again.load()
    assert again.record is not None and again.record.digest == digest
    assert again.service is not None and again.service.parity.entries() == held


def test_a_record_of_another_shape_is_dropped_with_its_parity(tmp_path):
    root = tmp_path / "parity"
    old = legacy(4, SHAPE, 1)
    store = ParityStore(root, Code(old.group_of(0).layout))
    store.add(7, 0, 0, 0, 10, 0, b"0123456789")
    store.put_manifest(1, 7, b"{}")
    (root / RECORD).write_bytes(old.to_json())
    member = member_at(root, nodes=3)  # the job shrank to 3 ranks
    member.load()
    assert member.service is None and member.record is None
    assert not (root / RECORD).exists()
    assert not (root / "parity").exists() and not (root / "manifests").exists()


@pytest.mark.parametrize("content", [b"", b"not json", b'{"version": 1}', legacy(3, stripes.Group(1, 1), 1).to_json()])
def test_an_unusable_record_is_dropped(tmp_path, content):
    root = tmp_path / "parity"
    root.mkdir(mode=0o700)
    (root / RECORD).write_bytes(content)
    member = member_at(root)
    member.load()
    assert member.service is None and not (root / RECORD).exists()


def test_parity_from_before_records_is_taken_as_summed_by_rank_numbers(tmp_path):
    root = tmp_path / "parity"
    rank_order = legacy(3, SHAPE, 1)
    store = ParityStore(root, Code(rank_order.group_of(0).layout))
    for slot in range(SHAPE.d):  # a sum completed: kept across a restart
        store.add(7, 0, 0, slot, 10, 0, b"0123456789")
    member = member_at(root)
    member.load()
    assert member.record == rank_order
    assert GroupingRecord.from_json((root / RECORD).read_bytes()) == rank_order
    assert member.service is not None and member.service.parity.entries()


async def test_requests_under_another_grouping_are_refused(tmp_path):
    async with trio.open_nursery() as nursery:
        members = await start_members(nursery, tmp_path, 2, 1, dict.fromkeys(range(3), 1000))
        digest = await agree(members.values())
        service = members[1].service
        service.grouping = "0" * 16
        with pytest.raises(PeerError, match=f"rank 0 groups the job by grouping {digest}"):
            await service.ask(0, {"op": "ec_status"}, 0)
        service.grouping = None  # a node from before records: its requests name no grouping
        assert digest == legacy(3, SHAPE, 1).digest  # rank numbers alone: the same groups
        await service.ask(0, {"op": "ec_status"}, 0)
        nursery.cancel_scope.cancel()


async def test_a_hostile_record_from_a_peer_is_ignored(tmp_path, monkeypatch):
    async with trio.open_nursery() as nursery:
        members = await start_members(nursery, tmp_path, 2, 1, dict.fromkeys(range(3), 1000))
        digest = await agree(members.values())

        async def garbage(request, body):
            return {"ok": True, "digest": "f" * 16}, b"[" * 100_000

        monkeypatch.setattr(members[1].member, "handle", garbage)
        (tmp_path / "node-0" / "parity" / RECORD).unlink()
        dialer = members[0].tier.members
        again = ErasureMember(
            0, 3, SHAPE, 1, tmp_path / "node-0" / "parity", lambda s: None, list, dialer.dial, dialer.peers
        )
        again.load()
        assert await again.settle()
        assert again.record is not None and again.record.digest == digest
        nursery.cancel_scope.cancel()


async def test_parity_counts_against_the_capacity_and_beyond_it_is_refused(tmp_path):
    spaces = {0: SpaceAccount(100_000, tmp_path), 1: SpaceAccount(None, tmp_path), 2: SpaceAccount(None, tmp_path)}
    async with trio.open_nursery() as nursery:
        members = await start_members(nursery, tmp_path, 2, 1, dict.fromkeys(range(3), 300_000), spaces=spaces)
        await agree(members.values())
        holder = members[0].service.group.parity_holders(members[1].service.group.data_stripes(1)[0])
        assert holder == (0,)  # rank 1's first part is summed at rank 0, which has room for 100,000 bytes
        manifest, where = members[1].steps[7]
        with pytest.raises(TierUnavailable, match="rank 0 has no room for 150000 more bytes of parity"):
            await members[1].tier.put_step(manifest, where)
        assert spaces[0].used == 0
        await members[0].tier.put_step(*members[0].steps[7])  # its parts go to ranks 1 and 2
        held = members[1].service.parity.held_bytes()
        assert held == 150_000 and spaces[1].used == held  # counted as it is summed
        members[1].service.parity.forget_before(8)
        members[1].service.account()
        assert spaces[1].used == 0
        nursery.cancel_scope.cancel()


OTHER = form(6, SHAPE, 1, {r: (("rack", f"r{r % 3}"),) for r in range(6)}, {})  # groups (0, 1, 2) and (3, 4, 5)


def hold(member, record: GroupingRecord) -> None:
    """``member`` restarted holding ``record``, as a node that formed its own from other answers."""
    (member.member.root / RECORD).write_bytes(record.to_json())
    member.member.load()
    assert member.member.record == record


async def test_a_member_outvoted_takes_the_majoritys_grouping_and_drops_its_parity(tmp_path):
    async with trio.open_nursery() as nursery:
        members = await start_members(nursery, tmp_path, 2, 1, dict.fromkeys(range(6), 3000), labels=RACKS)
        majority = await agree(members.values())
        await put_everywhere(members)
        assert OTHER.digest != majority
        for rank in (0, 1):
            hold(members[rank], OTHER)
        assert members[0].service.parity.entries()  # summed under the groups it no longer holds
        nursery.start_soon(members[0].member.run)
        with pytest.raises(PeerError, match="takes the grouping more than half of the job's ranks hold"):
            await members[2].service.ask(0, {"op": "ec_status"}, 0)  # rank 2 groups rank 0 with 4
        with trio.fail_after(10):
            while members[0].member.record is None or members[0].member.record.digest != majority:
                await trio.sleep(0.05)
        assert members[0].service.parity.entries() == {} and members[0].service.parity.manifests() == []
        assert GroupingRecord.from_json((tmp_path / "node-0" / "parity" / RECORD).read_bytes()).digest == majority
        assert await members[1].member.reconcile()  # asked directly: the same
        assert not await members[2].member.reconcile()  # in the majority: nothing to take
        await put_everywhere(members)  # no member refuses another now
        assert members[0].service.group.members == (0, 2, 4) and members[0].service.parity.entries()
        nursery.cancel_scope.cancel()


async def test_without_a_majority_no_member_changes_its_grouping(tmp_path):
    async with trio.open_nursery() as nursery:
        members = await start_members(nursery, tmp_path, 2, 1, dict.fromkeys(range(6), 1000), labels=RACKS)
        by_racks = await agree(members.values())
        for rank in (0, 1, 2):  # three of six: half, not more
            hold(members[rank], OTHER)
        for rank in range(6):
            assert not await members[rank].member.reconcile()
        assert [m.member.record.digest for m in members.values()] == [OTHER.digest] * 3 + [by_racks] * 3
        nursery.cancel_scope.cancel()
