"""The coordinator side of a node: it receives reports, keeps the view of the job's holdings, answers.

The protocol and why it exists: :mod:`tierfs.coordination.protocol`.

A node *coordinates* while it is one of the first ``k`` candidates or most members send
it their reports. Then it lists the job's manifests in GCS every interval (in parallel
prefix shards, :func:`tierfs.coordination.gcs_listing.listing_prefixes`), pulls the
report of every member that is silent or overdue (no report for a round and a half), and
counts a member *down* after two pulls without an answer (its holdings leave the view),
or after ``REFUSED_GRACE`` seconds of refused connections. A node that members reported to only while a candidate
was starting is a *stand-in*: it keeps and answers what it has, but does none of that,
and stops being one once the members go back.

Deciding. A starting node long-polls the first coordinator with ``coord_decide``. A
decision is never older than the question: the coordinator answers it from a *round*
begun after the question arrived, in which it read its own holdings as they are, pulled
every member's holdings afresh (a periodic report may predate the step a replica just
brought, or the member's death), and listed GCS. The answer is *ready* when every member
answered that round's pull or was found down in it (two pulls unanswered, or refusals for
``REFUSED_GRACE`` seconds), and the listing is done. Questions that arrive while a round
runs wait for the next one, which starts as soon as the running one ends, so a burst of
questions shares a few rounds instead of costing one each. The node waits up to ``--restore-wait`` for a
ready answer, then takes the best it has, naming the members still silent. Unlike the survey, which waits out the
whole ``--restore-wait`` for a peer that is gone, a member found down stops holding the
decision back: with thousands of nodes one is almost always down. Its data is restorable
all the same from replicas and GCS; when it comes back, it adopts the step the others
run from (the adopt rule of the view).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field

import trio

from tierfs.coordination import fields
from tierfs.coordination.protocol import (
    DECIDE_POLL,
    INTERVAL,
    MAX_GROUP,
    MAX_LISTED_DOWN,
    MAX_LISTED_HOLDERS,
    MAX_LISTED_STEPS,
    MAX_SUSPECTS,
    MAX_WAIT,
    RPC_TIMEOUT,
    TICK,
    Clock,
    K,
)
from tierfs.coordination.reports import Reports
from tierfs.coordination.transport import BadMessage, Message, Refused, Transport, Unreachable
from tierfs.coordination.view import GCS, Holdings, HoldingsView

log = logging.getLogger(__name__)

TTL_ROUNDS = 3  # a report older than this many intervals no longer counts
OVERDUE_ROUNDS = 1.5  # a coordinator pulls a member whose last report is older than this many intervals
PULL_AFTER = 1.0  # seconds as a coordinator before pulling the reports of silent members
DOWN_AFTER = 2  # pulls in a row without an answer before a member counts as down
REFUSED_GRACE = 5.0  # a member whose host refused a pull (its daemon may be starting) is down after this
REFUSED_RETRY = 0.25  # a round asks a member whose host refused again this soon
MAX_QUESTIONS = 4096  # questions remembered (each until answered or MAX_WAIT + DECIDE_POLL old)
PULLS_AT_ONCE = 64


class Coordinator:
    """The coordinator side of a node: receives reports, keeps the view, answers.

    ``list_gcs``: the job's manifests in GCS (rank -> committed steps), or None without GCS.
    """

    def __init__(
        self,
        address: str,
        order: Sequence[str],
        transport: Transport,
        *,
        nodes: int,
        list_gcs: Callable[[], Awaitable[dict[int, list[int]]]] | None = None,
        interval: float = INTERVAL,
        rpc_timeout: float = RPC_TIMEOUT,
        k: int = K,
        pull_after: float = PULL_AFTER,
        down_after: int = DOWN_AFTER,
        clock: Clock = trio.current_time,
        members: frozenset[str] | None = None,
    ):
        self.address, self.transport, self.list_gcs = address, transport, list_gcs
        self.members = frozenset(order) if members is None else members  # shared, never copied
        self.order, self.k = order, k
        self._leading = frozenset(order[: 4 * k])  # candidates whose being down is worth telling
        self._index: int | None = None  # this node's place in ``order``, once it coordinates
        self.interval, self.rpc_timeout = interval, rpc_timeout
        self.pull_after, self.down_after = pull_after, down_after
        self.ttl = TTL_ROUNDS * interval
        self.clock = clock
        self.view = HoldingsView(nodes)
        self.reports = Reports(self.view)
        self._pulling: set[str] = set()
        self._pushed: dict[str, float] = {}  # members that sent their own report -> when (oldest first)
        self._suspects: set[str] = set()  # members that members found unresponsive: pulled at once
        self._pulls = trio.CapacityLimiter(PULLS_AT_ONCE)
        self.active_since: float | None = None
        self.gcs_at: float | None = None  # when the last listing finished (None: none since active)
        self._listed_from: float | None = None  # when the last finished listing began
        self._wanted = float("-inf")  # a round needs a listing begun after this
        self._silent_cache: list[str] = []
        self._silent_at: float | None = None
        self.gcs_error: str | None = None
        self._listing = False
        self.own: Callable[[], Holdings] | None = None  # this node's holdings as they are now
        self._round: _Round | None = None  # the running round of fresh pulls, if any
        self._answered_at: float | None = None  # when the newest complete round began
        self._next_round = False  # a question came after the running round began
        self._questions: dict[tuple[str, str], float] = {}  # (asker, question) -> when first asked
        self._round_done = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._activated = trio.Event()
        self.received = 0  # reports, for tests and the simulation

    # -- state ----------------------------------------------------------------------------

    def coordinating(self) -> bool:
        """Whether this node is a coordinator, not a stand-in.

        It is one of the first ``k`` candidates, or most members sent it their reports
        themselves within the last round and a half (they found one of those down). A
        node that some members reported to while a candidate refused for a moment (its
        daemon was starting) is a stand-in: it keeps what it is sent and answers at once,
        but leaves listing GCS, pulling silent members and the long wait for a ready view
        to the coordinators. Reports it pulled do not count: a stand-in must not keep
        itself a coordinator.
        """
        if self._index is None:
            self._index = self.order.index(self.address) if self.address in self.members else len(self.order)
        return self._index < self.k or 2 * len(self._pushed) >= len(self.members)

    def ready(self) -> bool:
        """Whether the view is whole: every member reported or found down, GCS listed."""
        if self.active_since is None:
            return False
        if self.list_gcs is not None and self._listed_from is None:
            return False
        return len(self.reports.fresh) + len(self.reports.down) >= len(self.members)

    # -- rounds: the facts a decision is made from ------------------------------------------

    def answered(self, asked: float) -> bool:
        """Whether a round begun at or after ``asked`` is complete: a question of then can be answered."""
        return self._answered_at is not None and self._answered_at >= asked

    def _ask_round(self, asked: float) -> None:
        """A question asked at ``asked`` needs a round begun after it: start one, or the next."""
        if self.answered(asked) or self._nursery is None:
            return
        if self._round is None:
            self._begin_round()
        elif self._round.at < asked:
            self._next_round = True

    def _begin_round(self) -> None:
        nursery = self._nursery
        assert nursery is not None  # a round is asked for only once run() opened it (_ask_round)
        now = self.clock()
        self._round = r = _Round(now)
        self._next_round = False
        if self.own is not None:  # this node's holdings need no message: read them as they are
            self.accept(self.address, self.own())
            r.known.add(self.address)
        for member in self.members - r.known:
            nursery.start_soon(self._round_pull, member, r)
        if self.list_gcs is not None:
            self._wanted = max(self._wanted, now)
            if not self._listing:
                self._listing = True
                nursery.start_soon(self._list)
        self._check_round()

    def _check_round(self) -> None:
        """End the running round once every member is accounted for and GCS listed after it began."""
        r = self._round
        if r is None or len(r.known) + len(r.down) < len(self.members):
            return
        if self.list_gcs is not None and (self._listed_from is None or self._listed_from < r.at):
            return
        self._answered_at, self._round = r.at, None
        self._round_done.set()
        self._round_done = trio.Event()
        if self._next_round:
            self._begin_round()

    async def _round_pull(self, member: str, r: _Round) -> None:
        """Pull ``member``'s holdings for round ``r``: its answer, or its being down, settles it."""
        failures, refused_since = 0, None
        while self._round is r:
            try:
                h = await self._request_pull(member)
            except Refused:
                now = self.clock()
                refused_since = now if refused_since is None else refused_since
                if now - refused_since < REFUSED_GRACE:
                    await trio.sleep(REFUSED_RETRY)
                    continue
                self._found_down(member, f"refused pulls for {now - refused_since:.0f}s")
            except (Unreachable, BadMessage) as e:
                failures += 1
                if failures < self.down_after:
                    continue
                self._found_down(member, f"{failures} pulls unanswered: {e}")
            else:
                self.accept(member, h)
                r.known.add(member)
                self._check_round()
                return
            r.down.add(member)
            self._check_round()
            return

    def _found_down(self, member: str, why: str) -> None:
        if member not in self.reports.down:
            log.info("member %s is down (%s)", member, why)
        self.reports.found_down(member, self.clock())

    def accept(self, source: str, h: Holdings) -> bool:
        """Take ``source``'s report; False if it is older than the one held."""
        now = self.clock()
        if not self.reports.accept(source, h, now, source in self.members):
            return False
        if self.active_since is None:
            self.active_since = now
            self._activated.set()
        self.received += 1
        return True

    def _expire(self) -> None:
        now = self.clock()
        while self._pushed:  # oldest first: stop at the first one recent enough
            source, at = next(iter(self._pushed.items()))
            if now - at <= OVERDUE_ROUNDS * self.interval:
                break
            del self._pushed[source]
        self.reports.expire(now, self.ttl)
        if not self.reports.held and self.active_since is not None and now - self.active_since > self.ttl:
            log.info("no reports for %.0fs: no longer a coordinator", self.ttl)
            self.active_since = self.gcs_at = self.gcs_error = self._listed_from = self._answered_at = None
            self.reports.clear_standing()
            self.view.drop(GCS)
            self._activated = trio.Event()

    # -- answering ------------------------------------------------------------------------

    async def handle(self, source: str, message: Message) -> Message:
        op = message.get("op")
        try:
            if op == "coord_report":
                report = fields.report(message.get("report"), self.view.nodes)
                self._note_push(source, fields.suspects(message, MAX_SUSPECTS))
                self.accept(source, report)
                return {"ok": True, "summary": self.view.summary(), "down": self.down_candidates()}
            if op == "coord_decide":
                return await self._decide(source, message)
        except BadMessage as e:
            return {"error": f"malformed {op}: {e}"}
        return {"error": f"unknown op {op!r}"}

    async def _decide(self, source: str, message: Message) -> Message:
        q = fields.Question.parse(message, self.view.nodes, MAX_GROUP, MAX_WAIT)
        if q.report is not None:
            self._note_push(source, fields.suspects(message, MAX_SUSPECTS))
            self.accept(source, q.report)
        asked = self._asked(source, q.question)
        if self.active_since is not None and self.coordinating():
            self._ask_round(asked)
            with trio.move_on_after(q.wait):
                while not self.answered(asked):
                    await self._round_done.wait()
        return self.answer(q.rank, q.group, source, asked)

    def _asked(self, source: str, question: str) -> float:
        """When ``source`` first asked ``question``: its later polls of it need no newer round."""
        now = self.clock()
        if not question:
            return now
        key = (source, question)
        if key not in self._questions:
            while (
                len(self._questions) >= MAX_QUESTIONS
                or self._questions
                and now - next(iter(self._questions.values())) > MAX_WAIT + DECIDE_POLL
            ):
                del self._questions[next(iter(self._questions))]
            self._questions[key] = now
        return self._questions[key]

    def _note_push(self, source: str, suspects: list[str]) -> None:
        """A member sent its own report: it counts toward this node being a coordinator."""
        if source in self.members:
            self._pushed.pop(source, None)
            self._pushed[source] = self.clock()
        for a in suspects:
            if a in self.members and a not in self.reports.down:
                self._suspects.add(a)

    def down_members(self) -> list[str]:
        return sorted(self.reports.down)

    def _silent(self) -> list[str]:
        """Members neither reported nor found down (at most MAX_LISTED_DOWN), worked out once per TICK."""
        now = self.clock()
        if self._silent_at is None or now - self._silent_at >= TICK:
            silent = []
            for a in self.order:
                if a not in self.reports.fresh and a not in self.reports.down:
                    silent.append(a)
                    if len(silent) == MAX_LISTED_DOWN:
                        break
            self._silent_cache, self._silent_at = silent, now
        return self._silent_cache

    def down_candidates(self) -> list[str]:
        """The leading coordinator candidates found down: members skip them without a timeout."""
        return sorted(a for a in self.reports.down if a in self._leading) if self.reports.down else []

    def answer(
        self, rank: int, group: Iterable[int] = (), source: str | None = None, asked: float | None = None
    ) -> Message:
        """What ``coord_decide`` returns for ``rank`` and its ``group`` (the ranks holding the same data).

        Ready only when a round begun at or after ``asked`` is complete (None: the view as it is).
        """
        ranks = {}
        for r in dict.fromkeys([rank, *group]):
            steps = self.view.steps_of(r) or {}
            listed = sorted(steps)[-MAX_LISTED_STEPS:]
            ranks[str(r)] = {
                "choice": self.view.choose(r),
                "steps": {str(s): steps[s][:MAX_LISTED_HOLDERS] for s in listed},
                "nodes": sorted(self.reports.ranks.get(r, ()))[:MAX_LISTED_HOLDERS],
            }
        down = sorted(self.reports.down)
        ready = self.ready() if asked is None else self.answered(asked)
        return {
            "ok": True,
            "ready": ready,
            "you": source in self.reports.held,
            "silent": [] if ready else self._silent(),
            "coordinating": self.active_since is not None and self.coordinating(),
            "summary": self.view.summary(),
            "reported": len(self.reports.fresh),
            "members": len(self.members),
            "down": down[:MAX_LISTED_DOWN],
            "down_count": len(down),
            "gcs": {"listed": self.gcs_at is not None, "error": self.gcs_error},
            "ranks": ranks,
        }

    # -- duties ---------------------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Wait to become a coordinator, then list GCS, pull silent members and expire old reports."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                await self._activated.wait()
                while self.active_since is not None:
                    self._duties(nursery, self.active_since)
                    await trio.sleep(TICK)
                    self._expire()

    def _duties(self, nursery: trio.Nursery, active_since: float) -> None:
        now = self.clock()
        coordinating = self.coordinating()
        # Periodic listings; a round starts its own (_begin_round, and _list once the running one ends).
        if (
            coordinating
            and self.list_gcs is not None
            and not self._listing
            and (self.gcs_at is None or now - self.gcs_at >= self.interval)
        ):
            self._listing = True
            nursery.start_soon(self._list)
        for member in self._suspects - self._pulling - self.reports.down.keys():  # a member could not reach it
            self._pulling.add(member)
            nursery.start_soon(self._pull, member)
        self._suspects.clear()
        if now - active_since < self.pull_after:
            return
        for member, since in list(self.reports.starting.items()):
            if now - since >= REFUSED_GRACE:  # still not listening: it reports itself once it does
                self._found_down(member, f"refused pulls for {now - since:.0f}s")
        if not coordinating:
            return
        if len(self.reports.fresh) + len(self.reports.down) < len(self.members):  # silent members
            for member in (
                self.members
                - self.reports.fresh
                - self.reports.down.keys()
                - self._pulling
                - self.reports.starting.keys()
            ):
                self._pulling.add(member)
                nursery.start_soon(self._pull, member)
        for member, report in self.reports.held.items():  # overdue members (a gone node's holdings go soon)
            if now - report.at <= OVERDUE_ROUNDS * self.interval:
                break  # the rest are newer
            if member in self.members and member not in self._pulling:
                self._pulling.add(member)
                nursery.start_soon(self._pull, member)
        for member, since in self.reports.down.items():
            if now - since >= self.ttl and member not in self._pulling:  # still down? it reports itself when back
                self.reports.down[member] = now
                self._pulling.add(member)
                nursery.start_soon(self._pull, member)

    async def _list(self) -> None:
        list_gcs = self.list_gcs
        assert list_gcs is not None  # started only where there is a listing to run
        started = self.clock()
        try:
            listing = await list_gcs()
        except Exception as e:  # noqa: BLE001 (any failure of the listing: the view goes on without GCS)
            self.gcs_error = f"{type(e).__name__}: {e}".splitlines()[0]
            log.warning("coordinator without a GCS listing: %s", self.gcs_error)
        else:
            self.view.put_listing(listing)
            self.gcs_error = None
        finally:
            self._listing = False
        self.gcs_at, self._listed_from = self.clock(), started
        if started < self._wanted and self._nursery is not None:  # a round began during this listing
            self._listing = True
            self._nursery.start_soon(self._list)
        self._check_round()

    async def _request_pull(self, member: str) -> Holdings:
        async with self._pulls:
            reply = await self.transport.request(member, {"op": "coord_pull"}, self.rpc_timeout)
        if "error" in reply:
            raise BadMessage(str(reply["error"])[:200])
        return fields.report(reply.get("report"), self.view.nodes)

    async def _pull(self, member: str) -> None:
        try:
            h = await self._request_pull(member)
        except Refused:
            if member not in self.reports.down:
                self.reports.starting.setdefault(member, self.clock())  # not pulled again: it will report
        except (Unreachable, BadMessage) as e:
            failed = self.reports.failed[member] = self.reports.failed.get(member, 0) + 1
            if failed >= self.down_after and member not in self.reports.down:
                self._found_down(member, f"{failed} pulls unanswered: {e}")
        else:
            self.accept(member, h)
        finally:
            self._pulling.discard(member)


@dataclass
class _Round:
    """One round of fresh pulls: it answers every question asked before ``at``."""

    at: float
    known: set[str] = field(default_factory=set)  # members whose holdings were read in this round
    down: set[str] = field(default_factory=set)  # members found down in this round
