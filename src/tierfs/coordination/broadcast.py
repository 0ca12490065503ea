"""Broadcast restores: each chunk leaves GCS (or a holder) once and spreads between the nodes that need it.

Why. When a whole job restarts from GCS, the D data-parallel twins of a rank restore the
same chunks. Each fetching everything itself reads every byte from GCS D times: D times
the egress bill, and D times the time when GCS is the bottleneck. Here the twins split
the work: each chunk has one *seed* that reads it from GCS, and the others get it from
the seed, or from a node that got it from the seed (a tree of bounded fan-out), as soon
as it is there.

The planner (:func:`~tierfs.coordination.broadcast_plan.plan`, pure and deterministic,
in :mod:`.broadcast_plan`) gives every node, for every chunk it needs, an ordered list of
sources; a rank's twins compute the same plan from the same inputs, so nothing is sent to
agree on it.

This module is the runtime side: :class:`ChunkBoard` records which chunks of the restore
a node has and answers ``await_chunk`` (wait until it has chunk h, up to a deadline);
:class:`PlannedFetch` walks a chunk's sources, waiting for a node that will have it,
moving on when a source is down, slow or gives up. Messages (JSON headers on the peer
wire; the chunk itself comes by the existing ``get_chunk``)::

    {"op":"await_chunk","hash":H,"wait":SECONDS}
        -> {"ok":true,"have":bool,"pending":bool,"fetching":bool,"progress":n,"via":[address,...]}

The answer comes when the chunk is in (``have``), or after ``wait`` seconds (at most 60)
with ``pending`` true if the node still means to fetch it, or at once with ``pending``
false when it will not (the chunk is not in its plan, or it gave up on it). A node asked
before it has planned (it is still deciding) holds the question until its plan is known.
A waiting node asks again every :data:`POLL` seconds up to its deadline, so a source that
dies while it waits is noticed within a poll, not at the deadline; sources a coordinator
already reported down are skipped at once. The deadline counts time without progress:
a poll that finds the source fetching that very chunk (``fetching``: its request is out),
or holding more chunks than before (``progress``), starts the wait again, up to
:data:`MAX_WAITS` waits in all. When GCS is the bottleneck every seed is slow, and a
waiter that went to GCS itself after a fixed time would only lengthen the queue.

Plans computed from different answers (a twin decided after another node was found
down) can disagree, and two nodes could then wait for each other. ``via`` (at most 16
addresses) is the chain of nodes the answering node itself waits on for that chunk: a
node that finds itself in its own chain is in a cycle, and the member of the cycle with
the lowest :func:`priority` leaves it for its next source, within a poll.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Generic, TypeVar

import trio

from tierfs.coordination import fields
from tierfs.coordination.broadcast_plan import FALLBACKS as FALLBACKS
from tierfs.coordination.broadcast_plan import FAN_OUT as FAN_OUT
from tierfs.coordination.broadcast_plan import GCS_SOURCE as GCS_SOURCE
from tierfs.coordination.broadcast_plan import NodePlan as NodePlan
from tierfs.coordination.broadcast_plan import Source as Source
from tierfs.coordination.broadcast_plan import plan as plan
from tierfs.coordination.broadcast_plan import plan_stats as plan_stats
from tierfs.coordination.transport import BadMessage, Message, Transport, Unreachable
from tierfs.coordination.view import GCS as GCS

log = logging.getLogger(__name__)

WAIT = 30.0  # longest wait without progress for a node that will have a chunk
MAX_WAITS = 10  # ... and at most this many such waits in all
POLL = 2.0  # one await_chunk waits at most this long: a dead source is noticed within a poll
RPC_TIMEOUT = 2.0
MAX_WAIT = 60.0
_HASH = re.compile(r"^[0-9a-f]{32}$")
MAX_VIA = 16


def priority(h: str, address: str) -> bytes:
    """Who leaves a cycle of waits for chunk ``h`` (the lowest): the same on every node."""
    return hashlib.blake2b(f"{h}|{address}".encode(), digest_size=8).digest()


class NoSource(Exception):
    """No source of a chunk's plan gave it."""


class SourceFailed(Exception):
    """A source answered but did not give the chunk (not found, wrong bytes, refused)."""


class ChunkBoard:
    """The chunks of the running restore this node has, and those it still means to fetch."""

    def __init__(self, planned: Iterable[str] | None = None):
        self._planned = set(planned or ())
        self._have: set[str] = set()
        self._events: dict[str, trio.Event] = {}
        self._upstream: dict[str, list[str]] = {}  # chunk -> the chain of nodes this one waits on for it
        self.progress = 0  # chunks received so far: waiters keep waiting while it grows
        self._fetching: Counter[str] = Counter()  # chunks this node's fetches are out for
        self._known = trio.Event()  # the plan is known: until then a wait cannot tell "never"
        if planned is not None:
            self._known.set()

    def waiting_on(self, h: str, chain: list[str] | None) -> None:
        """This node now waits on ``chain`` (its source first) for ``h``; None: it no longer waits."""
        if chain:
            self._upstream[h] = chain[:MAX_VIA]
        else:
            self._upstream.pop(h, None)

    def set_plan(self, planned: Iterable[str]) -> None:
        """The chunks this node will fetch (its plan's order): waits for others now get answers."""
        self._planned.update(h for h in planned if h not in self._have)
        self._known.set()

    def has(self, h: str) -> bool:
        return h in self._have

    def fetching(self, h: str, started: bool) -> None:
        """A fetch of ``h`` by this node started (or ended): waiters keep waiting meanwhile."""
        self._fetching[h] += 1 if started else -1
        if self._fetching[h] <= 0:
            del self._fetching[h]

    def arrived(self, h: str) -> None:
        if h not in self._have:
            self._have.add(h)
            self.progress += 1
        self._wake(h)

    def gave_up(self, h: str) -> None:
        """This node will not have ``h`` soon: nodes waiting for it go to their next source."""
        self._planned.discard(h)
        self._wake(h)

    def plan(self, h: str) -> None:
        """This node means to fetch ``h`` (again, after giving up on it)."""
        self._planned.add(h)

    def _wake(self, h: str) -> None:
        event = self._events.pop(h, None)
        if event is not None:
            event.set()

    def pending(self, h: str) -> bool:
        """Whether this node may still get ``h`` (it has not planned yet, or it is in its plan)."""
        return h not in self._have and (not self._known.is_set() or h in self._planned)

    async def wait(self, h: str, timeout: float) -> bool:
        """True once this node has ``h``; False after ``timeout``, or at once if it will not.

        A node asked before it has planned (it is still deciding) waits for its plan first:
        its twins compute theirs from the same answer at about the same time.
        """
        deadline = trio.current_time() + timeout
        if not self._known.is_set():
            with trio.move_on_at(deadline):
                await self._known.wait()
        while h not in self._have and h in self._planned:
            event = self._events.get(h)
            if event is None:
                event = self._events[h] = trio.Event()
            with trio.move_on_at(deadline) as scope:
                await event.wait()
            if scope.cancelled_caught:
                break
        return h in self._have

    async def handle(self, source: str, message: Message) -> Message:
        """Answer ``await_chunk``."""
        h, wait = message.get("hash"), message.get("wait", 0)
        if not (isinstance(h, str) and _HASH.match(h)):
            return {"error": "malformed await_chunk: hash must be 32 lowercase hex digits"}
        if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 <= wait <= MAX_WAIT:
            return {"error": f"malformed await_chunk: wait must be a number of seconds in [0, {MAX_WAIT:g}]"}
        have = await self.wait(h, wait)
        return {
            "ok": True,
            "have": have,
            "pending": self.pending(h),
            "fetching": h in self._fetching,
            "progress": self.progress,
            "via": self._upstream.get(h, []),
        }


ChunkT = TypeVar("ChunkT")  # what the readers give: the chunk's bytes (the simulation: a stand-in)
ReadPeer = Callable[[str, str, int], Awaitable[ChunkT]]  # (address, chunk, length) -> its bytes
ReadGcs = Callable[[str, int], Awaitable[ChunkT]]  # (chunk, length) -> its bytes


class PlannedFetch(Generic[ChunkT]):
    """Fetch chunks the way a node's plan says, falling back source by source.

    ``read_peer`` / ``read_gcs`` get the verified bytes (the daemon's ChunkSources does
    that today); they raise :class:`Unreachable` (the source is then not asked again
    during this restore) or :class:`SourceFailed` (it is, for other chunks).

    ``announce`` False: a fetched chunk is not put on the board; the caller does that once
    the chunk is where this node's service reads it from (written, in the daemon).
    """

    def __init__(
        self,
        plan: NodePlan,
        transport: Transport,
        read_peer: ReadPeer[ChunkT],
        read_gcs: ReadGcs[ChunkT] | None,
        board: ChunkBoard | None = None,
        *,
        wait: float = WAIT,
        rpc_timeout: float = RPC_TIMEOUT,
        dead: Iterable[str] = (),
        announce: bool = True,
    ):
        self.plan, self.transport, self.read_peer, self.read_gcs = plan, transport, read_peer, read_gcs
        self.announce = announce
        self.board = board if board is not None else ChunkBoard()
        self.board.set_plan(plan.order)
        self.wait, self.rpc_timeout = wait, rpc_timeout
        self.dead: set[str] = set(dead)  # known down (a coordinator said so): skipped without a timeout
        self.bytes_from: Counter[str] = Counter()  # "gcs" or a node -> bytes it gave
        self.failed: dict[str, str] = {}  # chunk -> why no source gave it
        self.fallbacks = 0  # chunks that came from another source than the planned one

    async def fetch(self, h: str, length: int) -> ChunkT:
        """Chunk ``h`` from the first source of its plan that gives it; NoSource if none does."""
        self.board.fetching(h, True)
        try:
            return await self._fetch(h, length)
        finally:
            self.board.fetching(h, False)

    async def _fetch(self, h: str, length: int) -> ChunkT:
        errors = []
        for i, src in enumerate(self.plan.sources.get(h, ())):
            if src.address in self.dead or (src.is_gcs and self.read_gcs is None):
                continue
            try:
                data = await self._from(src, h, length)
            except Unreachable as e:
                self.dead.add(src.address)
                errors.append(f"{src.address}: {e}")
                continue
            except SourceFailed as e:
                errors.append(f"{src.address}: {e}")
                continue
            if data is None:
                errors.append(f"{src.address}: did not have it in time")
                continue
            if i:
                self.fallbacks += 1
            self.bytes_from[src.address] += length
            if self.announce:
                self.board.arrived(h)
            return data
        self.board.gave_up(h)
        why = "; ".join(errors) or "the plan has no source for it"
        self.failed[h] = why
        raise NoSource(f"chunk {h}: no planned source gave it ({why})")

    async def _from(self, src: Source, h: str, length: int) -> ChunkT | None:
        if src.is_gcs:
            assert self.read_gcs is not None  # _fetch skips GCS sources when there is no reader
            return await self.read_gcs(h, length)
        if src.after_fetch and not await self._await(src.address, h):
            return None
        return await self.read_peer(src.address, h, length)

    async def _await(self, source: str, h: str) -> bool:
        """Wait until ``source`` has ``h``: False after ``wait`` s without progress, when it will not, in a cycle."""
        me = self.plan.address
        start = trio.current_time()
        deadline, last = start + self.wait, start + MAX_WAITS * self.wait
        progress = None
        self.board.waiting_on(h, [source])
        try:
            while True:
                wait = min(POLL, max(0.0, deadline - trio.current_time()))
                reply = await self.transport.request(
                    source, {"op": "await_chunk", "hash": h, "wait": wait}, wait + self.rpc_timeout
                )
                if "error" in reply:
                    raise SourceFailed(str(reply["error"])[:200])
                try:
                    have, pending, fetching, seen, via = fields.chunk_status(reply, MAX_VIA)
                except BadMessage as e:
                    raise SourceFailed(f"malformed await_chunk answer: {e}") from None
                if have:
                    return True
                now = trio.current_time()
                if fetching or (seen is not None and progress is not None and seen > progress):
                    deadline = min(now + self.wait, last)  # it is on its way, only slowly
                progress = seen if seen is not None else progress
                if not pending or now >= deadline:
                    return False
                chain = [source, *via]
                self.board.waiting_on(h, chain)
                if me in chain:
                    cycle = [*chain[: chain.index(me)], me]
                    if min(cycle, key=lambda a: priority(h, a)) == me:
                        log.info(
                            "chunk %s: %s waits in a cycle (%s): going to the next source", h, me, " -> ".join(cycle)
                        )
                        return False
        finally:
            self.board.waiting_on(h, None)

    async def prefetch(self, lengths: Mapping[str, int], workers: int = 8) -> None:
        """Fetch every chunk of the plan in its order, ``workers`` at a time; failures go to ``failed``."""
        order = iter(self.plan.order)

        async def worker() -> None:
            for h in order:
                if self.board.has(h):
                    continue
                try:
                    await self.fetch(h, lengths[h])
                except NoSource as e:
                    log.warning("%s", e)

        async with trio.open_nursery() as nursery:
            for _ in range(workers):
                nursery.start_soon(worker)
