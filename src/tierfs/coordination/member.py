"""The member side of a node: it reports its holdings to the coordinators and asks them for decisions.

The protocol and why it exists: :mod:`tierfs.coordination.protocol`.

Who. Every node orders the job's members the same way
(:func:`~tierfs.coordination.protocol.candidates`: a hash of the job and the address, so
the coordinators are spread over racks, and rank 0 is not special) and sends its report
to the first ``k`` it can reach. One that does not answer is skipped
for a round and a half (one that refuses, its daemon starting, for a second) and the
next candidate gets the report: when a coordinator is gone, the next one takes over
within one request timeout. Members name the coordinators they found silent in their
next reports (``suspects``); the others check them at once and list those found down in
their answers (``down``), so every member skips a dead coordinator without a timeout of
its own.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

import trio

from tierfs.coordination import fields
from tierfs.coordination.coordinator import Coordinator
from tierfs.coordination.decision import Decision
from tierfs.coordination.protocol import (
    DECIDE_POLL,
    INTERVAL,
    MAX_GROUP,
    MAX_LISTED_DOWN,
    MAX_SUSPECTS,
    RPC_TIMEOUT,
    TICK,
    Clock,
    K,
)
from tierfs.coordination.transport import BadMessage, Message, Refused, Transport, Unreachable
from tierfs.coordination.view import Holdings, Summary

log = logging.getLogger(__name__)

SUSPECT_FOR = 20.0  # a coordinator that did not answer is skipped this long (and at least a round and a half)
REFUSED_FOR = 1.0  # one that refused (its daemon is starting) is asked again this soon


class Member:
    """The member side of a node: reports to the coordinators and asks them for decisions."""

    def __init__(
        self,
        address: str,
        order: Sequence[str],
        transport: Transport,
        holdings: Callable[[], Holdings],
        *,
        k: int = K,
        rpc_timeout: float = RPC_TIMEOUT,
        suspect_for: float = SUSPECT_FOR,
        local: Coordinator | None = None,
        clock: Clock = trio.current_time,
        inc: int | None = None,
    ):
        self.address, self.transport, self._holdings = address, transport, holdings
        self.order = order  # candidates(job, members), shared
        self.k, self.rpc_timeout, self.suspect_for = k, rpc_timeout, suspect_for
        self.local, self.clock = local, clock
        self.inc = int(time.time() * 1e6) if inc is None else inc
        self.interval = INTERVAL  # between reports (run() sets it)
        self.seq = 0
        self._suspect: dict[str, float] = {}  # coordinator -> skipped until
        self._silent: dict[str, float] = {}  # coordinator -> when it last failed to answer
        self.summary: Summary | None = None  # the newest summary a coordinator sent back
        self.summary_from: str | None = None
        self.reported_to: list[str] = []
        self._reporting: trio.Event | None = None

    def report_now(self) -> Holdings:
        """This node's holdings, numbered: each report replaces the previous one everywhere."""
        self.seq += 1
        h = self._holdings()
        return replace(h, inc=self.inc, seq=self.seq)

    def coordinators(self, extra: int = 0) -> list[str]:
        """The first ``k + extra`` candidates not under suspicion, in order."""
        now = self.clock()
        out = []
        for a in self.order:
            until = self._suspect.get(a)
            if until is not None and now < until:
                continue
            out.append(a)
            if len(out) == self.k + extra:
                break
        return out

    def suspect(self, address: str, why: Exception | None = None, until: float | None = None) -> None:
        """Skip ``address`` for a while: briefly if it refused (starting up), else ``suspect_for``."""
        now = self.clock()
        if until is None:
            until = now + (REFUSED_FOR if isinstance(why, Refused) else max(self.suspect_for, 1.5 * self.interval))
        if why is not None and not isinstance(why, Refused):
            self._silent[address] = now
        if why is not None and self._suspect.get(address, 0.0) <= now and not isinstance(why, Refused):
            log.info("coordinator %s does not answer (%s): asking the next one for %.0fs", address, why, until - now)
        self._suspect[address] = max(until, self._suspect.get(address, 0.0))

    async def _ask(self, address: str, message: Message, timeout: float) -> Message:
        if address == self.address and self.local is not None:
            reply = await self.local.handle(self.address, message)
        else:
            reply = await self.transport.request(address, message, timeout)
        if not isinstance(reply, dict):
            raise BadMessage(f"{address} answered {message.get('op')} with {type(reply).__name__}, not an object")
        if "error" in reply:
            raise Unreachable(f"{address} refused {message.get('op')}: {str(reply['error'])[:200]}")
        return reply

    async def handle_pull(self, source: str, message: Message) -> Message:
        return {"ok": True, "report": self.report_now().to_wire()}

    async def report(self) -> Summary | None:
        """Send this node's holdings to ``k`` coordinators; one that fails is replaced by the next.

        Returns the summary of the first coordinator (in order) that answered, None if none did.
        """
        if self._reporting is not None:  # one report at a time: a second caller shares the first's
            await self._reporting.wait()
            return self.summary
        self._reporting = trio.Event()
        try:
            return await self._report()
        finally:
            self._reporting.set()
            self._reporting = None

    async def _report(self) -> Summary | None:
        report = self.report_now().to_wire()
        walk = self.coordinators(extra=2 * self.k)
        order = iter(walk)
        answers: dict[str, tuple[Summary, list[str]]] = {}

        async def lane() -> None:
            for address in order:  # shared: each lane takes the next candidate
                message = {"op": "coord_report", "report": report}
                suspects = self._unresponsive()
                if suspects:  # the coordinators check them at once, and tell everyone who is down
                    message["suspects"] = suspects
                try:
                    answers[address] = fields.report_answer(
                        await self._ask(address, message, self.rpc_timeout), MAX_LISTED_DOWN
                    )
                except BadMessage as e:
                    self.suspect(address, BadMessage(f"malformed coord_report answer: {e}"))
                    continue
                except Unreachable as e:
                    self.suspect(address, e)
                    continue
                return

        async with trio.open_nursery() as nursery:
            for _ in range(self.k):
                nursery.start_soon(lane)
        self.reported_to = [a for a in walk if a in answers]
        if not self.reported_to:
            log.info("no coordinator took this node's report yet (%d candidates skipped)", len(self._suspect))
            return None
        first = self.reported_to[0]
        self.summary, self.summary_from = answers[first][0], first
        for _, down in answers.values():  # skipped until the round after next, without a timeout each round
            for address in down:
                if address not in answers:
                    self.suspect(address, until=self.clock() + max(self.suspect_for, 2 * self.interval))
        return self.summary

    def _unresponsive(self) -> list[str]:
        """Coordinators this node found silent (not refusing) within the last round."""
        now = self.clock()
        return [a for a, at in self._silent.items() if now - at <= 2 * self.interval][:MAX_SUSPECTS]

    async def decide(
        self,
        rank: int,
        group: Sequence[int] = (),
        wait: float = 15.0,
        poll: float = DECIDE_POLL,
        exclude: Collection[str] = (),
    ) -> Decision:
        """The step ``rank`` restores, from the first coordinator (not in ``exclude``) whose answer is ready.

        Waits up to ``wait`` seconds for a ready answer (--restore-wait), then takes the
        most complete answer it has (``ready`` False), or ``step`` None if no coordinator
        answered at all: then the caller falls back to what it sees itself.
        """
        deadline = self.clock() + wait
        if self.seq == 0 or not self.reported_to:
            await self.report()
        best: Decision | None = None
        group = [g for g in group if g != rank][:MAX_GROUP]
        question = secrets.token_hex(8)
        while True:
            left = max(0.0, deadline - self.clock())
            polled = False
            for address in self.coordinators(extra=len(exclude)):
                if address in exclude:
                    continue
                message = {
                    "op": "coord_decide",
                    "rank": rank,
                    "group": group,
                    "wait": min(poll, left),
                    "q": question,
                    "report": self.report_now().to_wire(),
                }
                try:
                    answer = await self._ask(address, message, min(poll, left) + self.rpc_timeout)
                    decision = Decision.from_answer(rank, group, answer, address, self.clock())
                except (Unreachable, BadMessage) as e:
                    self.suspect(address, e)
                    continue
                if decision.you and address not in self.reported_to:
                    self.reported_to.append(address)
                if decision.ready:
                    return decision
                if best is None or decision.reported > best.reported:
                    best = decision
                if decision.coordinating:
                    polled = True
                    break  # it waited for its view: ask again from the top
                # a stand-in that does not wait: the next candidate may be the coordinator
            if self.clock() >= deadline:
                break
            if not polled:
                await trio.sleep(min(TICK, max(0.0, deadline - self.clock())))
        if best is None:
            log.warning("no coordinator answered within %.0fs", wait)
            return Decision(None, False, None, at=self.clock())
        log.info(
            "deciding on a view that is not ready: %d of %d members reported, %d down",
            best.reported,
            best.members,
            len(best.down),
        )
        return best

    async def run(self, interval: float = INTERVAL, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Report every ``interval`` seconds, for as long as the node runs."""
        self.interval = interval
        task_status.started()
        while True:
            await self.report()
            await trio.sleep(interval)
