"""A node's membership in its erasure group: the grouping it agreed with the job's nodes, then its part in it.

Until a node has a grouping record (:mod:`tierfs.peers.grouping_record`) it has no group: it
answers the others' requests for the record alone, sends no parts and reports nothing held.
It takes a record in this order:

1. its own, kept beside its parity: a daemon restarted or upgraded in place serves its group
   at once, under the groups its parity was summed by;
2. the one its peers hold: a node that lost its RAM, or one added, joins the groups the
   others use, whatever its labels say now;
3. one it forms itself, once every rank of the job answers with its labels and twins. Every
   node forming one at once forms the same, from the same answers.

The record then stays for as long as the job keeps its shape (``--nodes`` and D+P): a node
whose record is for another shape, or unreadable, drops it with its parity. Every request a
member sends names its record's digest, and a member using other groups is refused: its
parts are never summed in, nor its sums read, and the log says which ranks disagree.

Two records can exist at once only if nodes formed theirs from different answers (labels
changed while they formed, a partition). A node that holds one while more than half of the
job's ranks hold another takes theirs, dropping the parity it summed under its own: parity
is only good among the members that summed it, and a strict majority is one record at most,
whatever part of the job a node sees. It compares when a request comes under another
grouping, and otherwise now and then, asking the peers for their digests alone.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from tierfs.core import stripes
from tierfs.core.atomic import private_dir, read_state, write_atomically
from tierfs.core.erasure import Code
from tierfs.core.errors import UserError
from tierfs.peers.grouping_record import MAX_BYTES, BadRecord, GroupingRecord, form, legacy
from tierfs.peers.groups import Labels
from tierfs.peers.placement import PeerInfo
from tierfs.peers.wire import PeerError
from tierfs.ramtier.space import SpaceAccount
from tierfs.store.parity import ParityStore
from tierfs.store.stripe_service import POLL, STATUS_TIMEOUT, Dial, OwnShard, StripeService

log = logging.getLogger(__name__)

RECORD = "grouping.json"  # in the parity store's root
FAN_OUT = 64  # peers asked for their record at once
RECHECK = 60.0  # seconds between two comparisons with the peers' groupings, at least
RECHECK_PER_RANK = 0.1  # and this per rank: a survey asks every rank of the job


class ErasureMember:
    """This node in its erasure group: the agreed record, and the group's service once there is one."""

    def __init__(
        self,
        rank: int,
        nodes: int,
        shape: stripes.Group,
        data_parallel: int,
        root: Path,
        own: Callable[[int], OwnShard | None],
        own_steps: Callable[[], list[int]],
        dial: Dial,
        peers: Callable[[], Awaitable[list[PeerInfo]]],
        labels: Labels = (),
        twins: tuple[int, ...] | None = None,
        space: SpaceAccount | None = None,
    ):
        """``root``: the parity store's root directory (root-only); ``peers()``: the peers answering now,
        with their labels and twins; ``labels``, ``twins``: this node's own; ``space``: the RAM tier's
        account the parity counts against."""
        self.rank, self.nodes, self.shape, self.data_parallel = rank, nodes, shape, data_parallel
        self.root, self.own, self.own_steps, self.dial, self.peers = root, own, own_steps, dial, peers
        self.space = space
        self.mine = PeerInfo(("", 0), rank, labels, twins)
        self.record: GroupingRecord | None = None
        self.service: StripeService | None = None
        self.waiting: tuple[int, ...] = ()  # ranks not answering, while there is no record to take
        self._legacy: str | None = None
        self._lock = trio.Lock()
        self._disagreed = trio.Event()  # a request came under another grouping: compare now

    # -- the record -------------------------------------------------------------------------

    def load(self) -> None:
        """Take the record kept here, if it is one for this job's shape; else drop the parity it kept."""
        path = private_dir(self.root) / RECORD
        record: GroupingRecord | None = None
        try:
            record = GroupingRecord.from_json(read_state(path, MAX_BYTES))
        except FileNotFoundError:
            if _holds_parity(self.root):  # summed before records were kept: by rank numbers
                record = legacy(self.nodes, self.shape, self.data_parallel)
                write_atomically(path, record.to_json())
        except (OSError, UserError, BadRecord) as e:
            log.warning("erasure: the grouping kept in %s is unusable (%s): its parity is dropped", path, e)
        if record is not None and not record.matches(self.nodes, self.shape):
            log.warning(
                "erasure: the grouping kept here is for %d ranks in %s groups, and the job is %d in %d+%d: "
                "its parity is dropped",
                record.nodes,
                record.shape,
                self.nodes,
                self.shape.d,
                self.shape.p,
            )
            record = None
        if record is None:
            _clear(self.root)
        else:
            self._adopt(record)

    async def settle(self) -> bool:
        """One attempt at a record, unless there is one: the peers', or one formed from every rank's answer."""
        if self.service is not None:
            return True
        async with self._lock:
            if self.service is None:
                peers = await self.peers()
                record, silent = await self._peers_record(peers)
                if record is None:
                    record = self._form([p for p in peers if p.rank not in silent])
                if record is not None:
                    await self._take(record)
                    log.info("erasure: %s (grouping %s)", self.describe(), record.digest)
        return self.service is not None

    async def _peers_record(self, peers: list[PeerInfo]) -> tuple[GroupingRecord | None, set[int]]:
        """The record the answering peers hold (if they disagree, the one most hold, then the lowest digest),
        and the ranks that did not say whether they hold one: no record is formed while they may."""
        found: dict[str, GroupingRecord] = {}
        holders, silent = await self._survey(sorted({p.rank for p in peers}), found)
        if len(holders) > 1:
            log.warning("erasure: the peers hold %d different groupings (%s)", len(holders), _counts(holders))
        best = min(holders, key=lambda d: (-len(holders[d]), d), default=None)
        return (found[best] if best is not None else None), silent

    async def _survey(
        self, ranks: list[int], found: dict[str, GroupingRecord] | None = None
    ) -> tuple[dict[str, list[int]], set[int]]:
        """Ask ``ranks`` (the job's, this node's aside) for their grouping: digest -> the ranks holding it,
        and the ranks that did not answer. With ``found``, whole records (checked, of this job's shape)
        go there; without, only digests travel."""
        holders: dict[str, list[int]] = {}
        silent: set[int] = set()
        limiter = trio.CapacityLimiter(FAN_OUT)
        request = {"op": "ec_grouping"} if found is not None else {"op": "ec_grouping", "digest_only": True}

        async def ask(rank: int) -> None:
            async with limiter:
                try:
                    with trio.fail_after(STATUS_TIMEOUT):
                        pool = await self.dial(rank)
                        if pool is None:
                            raise PeerError(f"rank {rank} is not known yet")
                        reply, data = await pool.request(
                            lambda c: c.stripe_call(request, b"", MAX_BYTES, STATUS_TIMEOUT)
                        )
                    digest = reply.get("digest")
                    if digest is None:
                        return
                    if found is not None:
                        record = GroupingRecord.from_json(data)
                        if not record.matches(self.nodes, self.shape):
                            return
                        digest, found[record.digest] = record.digest, record
                    elif not isinstance(digest, str) or len(digest) > 64:
                        raise BadRecord(f"digest {str(digest)[:64]!r}")
                except BadRecord as e:
                    log.warning("erasure: rank %d holds no usable grouping: %s", rank, e)
                    return
                except (PeerError, OSError, trio.TooSlowError) as e:
                    log.debug("erasure: rank %d did not say its grouping: %s", rank, e)
                    silent.add(rank)
                    return
                holders.setdefault(digest, []).append(rank)

        async with trio.open_nursery() as nursery:
            for rank in ranks:
                if rank != self.rank and rank < self.nodes:
                    nursery.start_soon(ask, rank)
        return holders, silent

    async def reconcile(self) -> bool:
        """Compare this node's grouping with the job's once: take the one more than half of the job's
        ranks hold, if it is another (dropping this node's parity). Whether it took one."""
        if self.record is None:
            return False
        mine = self.record.digest
        holders, _ = await self._survey(list(range(self.nodes)))
        majority = [d for d, ranks in holders.items() if d != mine and 2 * len(ranks) > self.nodes]
        if not majority:
            return False
        ranks = sorted(holders[majority[0]])
        found: dict[str, GroupingRecord] = {}
        await self._survey(ranks[:1], found)
        record = found.get(majority[0])
        if record is None:
            return False  # the holder asked went away or changed meanwhile: compare again later
        async with self._lock:
            if self.record is None or self.record.digest != mine:
                return False
            log.warning(
                "erasure: ranks %s, more than half of the job's %d, group it by grouping %s, not this node's %s: "
                "this node takes theirs and drops the parity it summed under its own",
                _ranks(ranks),
                self.nodes,
                record.digest,
                mine,
            )
            old, self.service, self.record = self.service, None, None  # refuse requests while the parity goes
            if old is not None:
                await trio.to_thread.run_sync(old.parity.close)
            await trio.to_thread.run_sync(_clear, self.root)
            await self._take(record)
        return True

    def _form(self, peers: list[PeerInfo]) -> GroupingRecord | None:
        """The record of every rank's labels and twins, if every rank answered."""
        by_rank = {p.rank: p for p in peers if p.rank < self.nodes} | {self.rank: self.mine}
        waiting = tuple(r for r in range(self.nodes) if r not in by_rank)
        if waiting != self.waiting:
            log.info("erasure: the groups form once every rank answers; waiting for rank(s) %s", _ranks(waiting))
        self.waiting = waiting
        if waiting:
            return None
        labels = {r: p.topology for r, p in by_rank.items()}
        twins = {r: p.twins for r, p in by_rank.items() if p.twins is not None}
        try:
            return form(self.nodes, self.shape, self.data_parallel, labels, twins)
        except (ValueError, stripes.BadGroup) as e:
            log.warning("erasure: the groups cannot be formed from the ranks' answers: %s", e)
            return None

    async def _take(self, record: GroupingRecord) -> None:
        """Keep ``record`` beside the parity, then serve its group."""
        await trio.to_thread.run_sync(write_atomically, self.root / RECORD, record.to_json())
        self._adopt(record)

    def _adopt(self, record: GroupingRecord) -> None:
        group = record.group_of(self.rank)
        parity = ParityStore(self.root, Code(group.layout))
        parity.load()
        self.service = StripeService(
            self.rank, group, parity, self.own, self.own_steps, self.dial, grouping=record.digest, space=self.space
        )
        self.record, self.waiting = record, ()
        for number, domain, members in record.weak_spots:
            if number == group.number:
                log.warning(
                    "erasure: %s holds ranks %s of group %d, more than the %d it survives: one failure loses them",
                    domain,
                    _ranks(members),
                    number,
                    group.p,
                )

    def describe(self) -> str:
        """Where this node stands, in words: its group, or what it waits for."""
        if self.service is None:
            waiting = f": waiting for rank(s) {_ranks(self.waiting)} to answer" if self.waiting else ""
            return f"no erasure group yet{waiting}"
        group = self.service.group
        return f"erasure {group.d}+{group.p} group {group.number}: ranks {_ranks(group.members)}"

    # -- the group's requests ---------------------------------------------------------------

    async def handle(self, request: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes | bytearray]:
        """Answer one ``ec_*`` request, if it was sent under this node's grouping."""
        if request["op"] == "ec_grouping":
            if self.record is None:
                return {"ok": True, "digest": None}, b""
            whole = request.get("digest_only") is not True
            return {"ok": True, "digest": self.record.digest}, self.record.to_json() if whole else b""
        if self.service is None or self.record is None:
            raise PeerError(f"rank {self.rank} has {self.describe()}")
        theirs = request.get("grouping") or self._legacy_digest()  # a node from before records: rank order
        if theirs != self.record.digest:
            self._disagreed.set()
            raise PeerError(
                f"rank {self.rank} groups the job by grouping {self.record.digest}, the request by "
                f"{str(theirs)[:16]!r}: a node takes the grouping more than half of the job's ranks hold by "
                f"itself; without such a majority, stop the node that groups otherwise, remove its parity "
                f"directory (<ramdisk>/<job>/rank-<N>/parity) and mount it again"
            )
        return await self.service.handle(request, body)

    def _legacy_digest(self) -> str:
        if self._legacy is None:
            self._legacy = legacy(self.nodes, self.shape, self.data_parallel).digest
        return self._legacy

    # -- what the node's other parts ask ----------------------------------------------------

    async def run(self) -> None:
        """Agree a grouping (retrying while ranks are missing), then serve it: keep the group's view
        fresh, and take the majority's grouping should most of the job hold another."""
        while True:
            try:
                if await self.settle():
                    break
            except Exception as e:  # noqa: BLE001 (the group's trouble must never take the mount down)
                log.warning("erasure: no grouping agreed yet: %s", e)
            await trio.sleep(POLL)
        while True:
            assert self.service is not None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.service.watch)
                await self._until_outvoted()
                nursery.cancel_scope.cancel()  # that service's watch: the next one serves the new record

    async def _until_outvoted(self) -> None:
        """Compare with the peers' groupings when a request comes under another, and now and then;
        return once this node took the majority's."""
        while True:
            with trio.move_on_after(max(RECHECK, RECHECK_PER_RANK * self.nodes)):
                await self._disagreed.wait()
            self._disagreed = trio.Event()
            try:
                if await self.reconcile():
                    return
            except Exception as e:  # noqa: BLE001 (the group's trouble must never take the mount down)
                log.warning("erasure: the peers' groupings were not compared: %s", e)
            await trio.sleep(POLL)  # one survey at most per POLL, however many requests disagree

    def claims(self) -> list[tuple[int, int]]:
        return self.service.claims() if self.service is not None else []

    def newest_encoded(self) -> int | None:
        return self.service.newest_encoded() if self.service is not None else None


def _holds_parity(root: Path) -> bool:
    for sub in ("parity", "manifests"):
        try:
            with os.scandir(root / sub) as entries:
                if any(not e.name.startswith(".tmp.") for e in entries):
                    return True
        except FileNotFoundError:
            continue
    return False


def _clear(root: Path) -> None:
    """Drop the parity and manifests kept under ``root`` (the daemon's own root-only state)."""
    for sub in ("parity", "manifests"):
        shutil.rmtree(root / sub, ignore_errors=True)
    try:
        os.unlink(root / RECORD)
    except FileNotFoundError:
        pass


def _counts(holders: dict[str, list[int]]) -> str:
    return ", ".join(f"{digest[:16]} by {len(ranks)}" for digest, ranks in sorted(holders.items()))


def _ranks(ranks: tuple[int, ...] | list[int]) -> str:
    shown = ", ".join(map(str, ranks[:16]))
    return shown + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
