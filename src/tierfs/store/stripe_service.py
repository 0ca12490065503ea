"""The erasure-coded side of the peer service: parity summed where it is kept, repair links, the group's view.

With ``--erasure D+P`` a node keeps no replicas of other ranks' steps. The members of its
group send it the data parts of the stripes it holds parity for, and it adds each window
into that parity as it comes (:class:`~tierfs.store.parity.ParityStore`): a part is never
stored whole, so what a node holds for the others is P/D of a shard.

A node that lost its RAM gets its parts back one window at a time, and the survivors answer
in a chain (``ec_repair``): the node asked first asks the next one for the sum of the terms
before its own, adds its own term and answers. Every link carries one window, whatever D is,
so the node rebuilding receives about its shard, not D times it. The ranks of a chain are
this node's own reading of the group (:mod:`tierfs.peers.groups`), never addresses a request
names.

Every node also keeps the group's view (:class:`~tierfs.store.group_view.GroupView`),
refreshed by :meth:`StripeService.watch`: from it come the (rank, step) it reports as
restorable for the others (:meth:`StripeService.claims`) and what ``tierfs status`` says
each step survives.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from tierfs.core import stripes
from tierfs.core.erasure import Code, accumulate
from tierfs.core.manifest import MAX_BYTES as MAX_MANIFEST
from tierfs.peers import wire
from tierfs.peers.client import PeerClient
from tierfs.peers.groups import RankGroup
from tierfs.peers.pool import ConnectionPool
from tierfs.peers.wire import PeerError, ProtocolError
from tierfs.ramtier.space import SpaceAccount
from tierfs.store.group_view import GroupView, MemberHoldings
from tierfs.store.parity import NotHeldParity, ParityError, ParityStore

log = logging.getLogger(__name__)

WINDOW = 4 << 20  # bytes of a part sent, summed or rebuilt per request
POLL = 2.0  # seconds between two views of the group
STATUS_TIMEOUT = 5.0
REPAIR_TIMEOUT = 30.0  # a chain of up to MAX_DATA links, each moving one window (the service allows 60 s)
OPS = frozenset({"ec_grouping", "ec_put", "ec_manifest", "ec_get_manifest", "ec_status", "ec_repair"})

Location = tuple[str, int, int]  # (path, offset, length) of a chunk of this node's own committed step
Dial = Callable[
    [int], Awaitable[ConnectionPool | None]
]  # a member's rank -> a pool of connections to it (None: unknown now)


class OwnShard:
    """A committed step of this node as its chunk stream: the chunks' bytes, in manifest order, end to end."""

    def __init__(self, places: Sequence[Location]):
        self.places = list(places)
        self.lengths = [n for _, _, n in self.places]
        self.length = sum(self.lengths)

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the stream (blocking: a worker thread's); past its end, zeros."""
        stop = min(end, self.length)
        out = bytearray()
        if start < stop:
            for chunk, offset, n in stripes.pieces(self.lengths, start, stop):
                path, at, _ = self.places[chunk]
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    data = os.pread(fd, n, at + offset)
                finally:
                    os.close(fd)
                if len(data) != n:
                    raise PeerError(f"{path} is shorter than its step's manifest says")
                out += data
        out += bytes(end - start - len(out))
        return bytes(out)


class StripeService:
    """One node's part in its erasure group: its parity, its own shards as sources, the group's view."""

    def __init__(
        self,
        rank: int,
        group: RankGroup,
        parity: ParityStore,
        own: Callable[[int], OwnShard | None],
        own_steps: Callable[[], list[int]],
        dial: Dial,
        grouping: str | None = None,
        space: SpaceAccount | None = None,
    ):
        """``own(step)``: this node's committed ``step`` as a stream, if its RAM holds it whole;
        ``own_steps()``: those steps; ``dial(rank)``: connections to a member; ``grouping``: the
        digest of the groups (:mod:`tierfs.peers.grouping_record`) its requests carry; ``space``: the
        RAM tier's account, which the parity counts against (``--capacity``)."""
        self.rank, self.group, self.parity, self.dial = rank, group, parity, dial
        self.grouping, self.space = grouping, space
        self._reserved = 0  # parity bytes promised to sums in progress
        self.account()
        self.own, self.own_steps = own, own_steps
        self.code = Code(group.layout)
        self.view = GroupView(group)
        self._changed = trio.Event()  # a sum completed, or a step was sent: look again now, not at the next poll

    # -- requests of the group's members ----------------------------------------------------

    async def handle(self, request: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes | bytearray]:
        """Answer one ``ec_*`` request: (answer header, answer body). Refusals raise PeerError."""
        op = request["op"]
        try:
            if op == "ec_put":
                return await self._put(request, body), b""
            if op == "ec_manifest":
                rank, step = self._member(request), _count(request, "step")
                await trio.to_thread.run_sync(self.parity.put_manifest, rank, step, body)
                return {"ok": True}, b""
            if op == "ec_get_manifest":
                return {"ok": True}, self.parity.get_manifest(self._member(request), _count(request, "step"))
            if op == "ec_status":
                return {"ok": True, **self.status_answer()}, b""
            if op == "ec_repair":
                return {"ok": True}, await self._repair(request)
        except NotHeldParity as e:
            raise PeerError(f"{e}: not found") from None
        except ParityError as e:
            raise PeerError(str(e)) from None
        raise ProtocolError(f"unknown op {wire.brief(op)}")

    async def _put(self, request: dict[str, Any], body: bytes) -> dict[str, Any]:
        step, stripe, j = _count(request, "step"), self._stripe(request), _count(request, "parity")
        holders = self.group.parity_holders(stripe)
        if j >= len(holders) or holders[j] != self.rank:
            raise PeerError(f"rank {self.rank} does not hold parity {j} of stripe {stripe}")
        slot, part, offset = _count(request, "slot"), _count(request, "part_length"), _count(request, "offset")
        grow = self.parity.growth(step, stripe, j, part)
        if self.space is not None and grow:
            try:
                self.space.check_growth(self._reserved + grow)
            except OSError:
                raise PeerError(
                    f"rank {self.rank} has no room for {grow} more bytes of parity: its RAM tier is full "
                    f"({self.space.used} of {self.space.capacity} bytes used)"
                ) from None
        self._reserved += grow
        try:
            complete = await trio.to_thread.run_sync(self.parity.add, step, stripe, j, slot, part, offset, body)
        finally:
            self._reserved -= grow
            self.account()
        if complete:
            self.changed()
        return {"ok": True, "complete": complete}

    def account(self) -> None:
        """Count the parity held against the RAM tier's capacity, as replicas are."""
        if self.space is not None:
            self.space.charge("parity", self.parity.held_bytes())

    def changed(self) -> None:
        """What the group holds changed here: the view (and so what this node reports) follows at once,
        so the job's coordinators never lag a restarting member's own look at the group."""
        self._changed.set()

    def status_answer(self) -> dict[str, Any]:
        """What this member holds for the group: ``ec_status``'s answer."""
        entries = self.parity.entries()
        received = [
            [step, stripe, j, [self.parity.received(step, stripe, j, slot) for slot in range(self.group.d)]]
            for step, held in entries.items()
            for (stripe, j), done in held.items()
            if not done
        ]
        return {
            "rank": self.rank,
            "data": self.own_steps(),
            "parity": [
                [step, stripe, j] for step, held in entries.items() for (stripe, j), done in held.items() if done
            ],
            "received": received,
            "manifests": [list(m) for m in self.parity.manifests()],
        }

    # -- the chain of a repair -----------------------------------------------------------

    async def _repair(self, request: dict[str, Any]) -> bytearray:
        """The sum of the terms named, this node's last: each earlier term is asked of its member first."""
        step, stripe, offset = _count(request, "step"), self._stripe(request), _count(request, "offset")
        length, terms = _count(request, "length"), request.get("terms")
        if length > WINDOW:
            raise PeerError(f"a repair window of {length} bytes: at most {WINDOW}")
        if not isinstance(terms, list) or not 1 <= len(terms) <= self.group.d:
            raise ProtocolError(f"ec_repair needs 1 to {self.group.d} terms")
        pairs = [_term(t, self.group.layout.size) for t in terms]
        slot, coefficient = pairs[-1]
        if self.group.rank(self.group.layout.member(stripe, slot)) != self.rank:
            raise PeerError(f"rank {self.rank} has no part in slot {slot} of stripe {stripe}")
        previous = b""
        mine: bytes = b""

        async def ask_previous() -> None:
            nonlocal previous
            rest = {**request, "terms": [list(p) for p in pairs[:-1]]}
            previous = await self.ask(self._slot_rank(stripe, pairs[-2][0]), rest, length)

        async def read_mine() -> None:
            nonlocal mine
            mine = await trio.to_thread.run_sync(self.part_window, step, stripe, slot, offset, length)

        async with trio.open_nursery() as nursery:  # this node's window is read while the chain before it works
            if len(pairs) > 1:
                nursery.start_soon(ask_previous)
            nursery.start_soon(read_mine)
        return await trio.to_thread.run_sync(_add, previous or bytes(length), mine, coefficient)

    def part_window(self, step: int, stripe: int, slot: int, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset+length)`` of this node's part in ``stripe`` of ``step``, zeros past its end."""
        if slot >= self.group.d:
            return self.parity.read(step, stripe, slot - self.group.d, offset, length)
        shard = self.own(step)
        if shard is None:
            raise NotHeldParity(f"rank {self.rank} does not hold its step {step}")
        part = stripes.parts(self.group.layout, self.group.member(self.rank), shard.length)[
            self.group.data_stripes(self.rank).index(stripe)
        ]
        start = min(part.start + offset, part.end)
        return shard.read(start, min(start + length, part.end)).ljust(length, b"\0")

    def _slot_rank(self, stripe: int, slot: int) -> int:
        return self.group.rank(self.group.layout.member(stripe, slot))

    async def ask(self, rank: int, header: dict[str, Any], length: int, body: bytes = b"") -> bytes:
        """One ``ec_*`` request to the member ``rank``; its answer's body (at most ``length`` bytes)."""
        pool = await self.dial(rank)
        if pool is None:
            raise PeerError(f"rank {rank} of the group is not known yet")
        header = self._stamped(header)
        timeout = REPAIR_TIMEOUT if header.get("op") == "ec_repair" else None

        async def call(client: PeerClient) -> bytes:
            reply, data = await client.stripe_call(header, body, length, timeout)
            if header.get("op") == "ec_repair" and len(data) != length:
                raise PeerError(f"rank {rank} answered {len(data)} bytes of a {length}-byte window")
            return data

        return await pool.request(call)

    # -- the group's view --------------------------------------------------------------------

    async def poll(self) -> None:
        """Ask every member what it holds now (this node answers itself)."""
        answers: dict[int, MemberHoldings | None] = {self.rank: _holdings(self.status_answer())}

        async def one(rank: int) -> None:
            try:
                with trio.fail_after(STATUS_TIMEOUT):
                    pool = await self.dial(rank)
                    if pool is None:
                        answers[rank] = None
                        return
                    reply = await pool.request(lambda c: c.stripe_call(self._stamped({"op": "ec_status"})))
                answers[rank] = _holdings(reply[0])
            except (PeerError, OSError, trio.TooSlowError, ValueError, KeyError, TypeError):
                answers[rank] = None

        async with trio.open_nursery() as nursery:
            for rank in self.group.members:
                if rank != self.rank:
                    nursery.start_soon(one, rank)
        self.view.update(answers)

    def _stamped(self, header: dict[str, Any]) -> dict[str, Any]:
        """The request under this node's grouping: a member grouped otherwise refuses it."""
        return header | ({"grouping": self.grouping} if self.grouping is not None else {})

    async def watch(self) -> None:
        """Keep the view fresh, and the parity of steps no longer needed gone: a newer step is fully encoded."""
        while True:
            try:
                await self.poll()
                newest = self.newest_encoded()
                if newest is not None:
                    freed = await trio.to_thread.run_sync(self.parity.forget_before, newest)
                    self.account()
                    if freed:
                        log.info("erasure: parity of steps before %d dropped (%d bytes)", newest, freed)
            except Exception as e:  # noqa: BLE001 (the group's trouble must never take the mount down)
                log.warning("erasure: the group's view was not refreshed: %s", e)
            with trio.move_on_after(POLL):
                await self._changed.wait()
            self._changed = trio.Event()

    def newest_encoded(self) -> int | None:
        """The newest step every member holds every part of: the group survives P losses of it."""
        return max((s for s in self.view.steps() if self.view.encoded(s)), default=None)

    def claims(self) -> list[tuple[int, int]]:
        """The (rank, step) of the group's other members this node reports as restorable: it holds the
        manifest, and its view has D parts of every stripe that rank gives data to."""
        return [
            (rank, step)
            for rank, step in self.parity.manifests()
            if rank != self.rank and self.view.rebuildable(rank, step)
        ]

    def _member(self, request: dict[str, Any]) -> int:
        rank = _count(request, "rank")
        if rank not in self.group.members:
            raise PeerError(f"rank {rank} is not in this node's group {list(self.group.members)}")
        return rank

    def _stripe(self, request: dict[str, Any]) -> int:
        stripe = _count(request, "stripe")
        if stripe >= self.group.layout.size:
            raise PeerError(f"stripe {stripe}: a {self.group.d}+{self.group.p} group has {self.group.layout.size}")
        return stripe


def _add(total: bytes, part: bytes, coefficient: int) -> bytearray:
    """``total + coefficient * part``, in a worker thread: the copies and the sum stay off the event loop."""
    out = bytearray(total)
    accumulate(out, part, coefficient)
    return out


def _count(request: dict[str, Any], key: str) -> int:
    value = request.get(key)
    if not isinstance(value, int) or not wire.is_count(value):
        raise ProtocolError(f"{wire.brief(request.get('op'))}: invalid {key} {wire.brief(value)}")
    return value


def _term(value: object, slots: int) -> tuple[int, int]:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(wire.is_count(v) for v in value)
        or value[0] >= slots
        or value[1] > 255
    ):
        raise ProtocolError(f"ec_repair: invalid term {wire.brief(value)}")
    return int(value[0]), int(value[1])


def _holdings(answer: dict[str, Any]) -> MemberHoldings:
    """A member's ``ec_status`` answer, checked as it is read (ValueError, KeyError, TypeError if malformed)."""

    def ints(value: object, n: int, limit: int = 100_000) -> list[tuple[int, ...]]:
        if not isinstance(value, list) or len(value) > limit:
            raise ValueError("not a list")
        out = []
        for item in value:
            if not isinstance(item, list) or len(item) != n or not all(wire.is_count(v) for v in item):
                raise ValueError("malformed entry")
            out.append(tuple(int(v) for v in item))
        return out

    received = {}
    for item in answer.get("received", [])[:100_000]:
        step, stripe, j, counts = item
        received[(int(step), int(stripe), int(j))] = tuple(int(c) for c in counts[: stripes.MAX_DATA])
    data = answer["data"]
    if not isinstance(data, list) or not all(wire.is_count(s) for s in data):
        raise ValueError("malformed data steps")
    return MemberHoldings(
        rank=int(answer["rank"]),
        data=frozenset(int(s) for s in data),
        parity=frozenset(ints(answer["parity"], 3)),  # type: ignore[arg-type]
        received=received,
        manifests=frozenset(ints(answer["manifests"], 2)),  # type: ignore[arg-type]
    )


MAX_ANSWER = max(WINDOW, MAX_MANIFEST)  # the largest body an ec_* answer carries
