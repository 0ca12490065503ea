"""A few coordinators per job collect every node's holdings and answer for the whole job.

Why. Today every node asks every other node what it holds, at start and every
``--survey-interval``: N(N-1) connections a round, 10^8 at 10,000 nodes, and N listings
of GCS. Here each node sends one report to each of ``k`` coordinators a round (k = 3: 3N
requests in all), the coordinators list GCS (k listings), and a starting node asks one
coordinator for its step. The coordinators apply the rules of :mod:`tierfs.pipeline.survey` (see
:mod:`tierfs.coordination.view`) to what they received, so the answer is the one a
survey of every node would give.

Who. Every node orders the job's members the same way (:func:`candidates`: a hash of the
job and the address, so the coordinators are spread over racks, and rank 0 is not special)
and sends its report to the first ``k`` it can reach. One that does not answer is skipped
for a round and a half (one that refuses, its daemon starting, for a second) and the
next candidate gets the report: when a coordinator is gone, the next one takes over
within one request timeout. Members name the coordinators they found silent in their
next reports (``suspects``); the others check them at once and list those found down in
their answers (``down``), so every member skips a dead coordinator without a timeout of
its own.

A node *coordinates* while it is one of the first ``k`` candidates or most members send
it their reports. Then it lists the job's manifests in GCS every interval (in parallel
prefix shards, :func:`listing_prefixes`), pulls the report of every member that is silent
or overdue (no report for a round and a half), and counts a member *down* after two
pulls without an answer (its holdings leave the view), or after ``REFUSED_GRACE``
seconds of refused connections. A node that members reported to only while a candidate
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

Agreement. Nodes ask the coordinators in the same order, so they take the same one's
answer; every coordinator receives every report, so they agree unless a message was lost,
and a pull repairs that. A node whose view differs still adopts the step its peers
already run from.

Messages (JSON headers on the peer wire, no bodies; each well under 1 MiB)::

    {"op":"coord_report","report":REPORT,"suspects":[address,...]}        (suspects: <= 8, optional)
        -> {"ok":true,"summary":SUMMARY,"down":[address,...]}
    {"op":"coord_decide","rank":R,"group":[R,...],"wait":SECONDS,"q":ID,"report":REPORT}
            (group: the ranks holding the same data, <= 64; q: the question, the same in
             every poll of it (<= 64 characters); report: the asker's holdings)
        -> {"ok":true,"ready":bool,"you":bool,"coordinating":bool,"summary":SUMMARY,
            "reported":n,"members":m,"down":[address,...],"down_count":d,
            "gcs":{"listed":bool,"error":str|null},
            "ranks":{"R":{"choice":S|null,"steps":{"S":[holder,...]},"nodes":[address,...]}}}
    {"op":"coord_pull"}                                      (a coordinator to a member)
        -> {"ok":true,"report":REPORT}

REPORT is :class:`tierfs.coordination.view.Holdings` on the wire; SUMMARY is
``{"newest":S|null,"floor":S|null,"decisions":[S,...],"complete":[S,...],"ranks":n}``
(the newest complete step, the retention floor, the steps nodes run from). A holder is a
node's address or ``"gcs"``; ``nodes`` are the addresses reporting as that rank (or found
down since). ``coord_decide`` answers as soon as the view is ready, or after ``wait``
seconds (at most 30) with what it has; a stand-in answers at once (``coordinating``
false) and the member asks the next candidate. Answers list at most 16 steps per rank
(the newest), 16 holders per step and 64 down members; ``choice`` is computed over
everything, so it is exact where the lists are cut. Errors are ``{"error": one line}``.
Every field of a message or an answer is checked where it arrives (:mod:`.fields`): a
member that holds the job's secret is trusted to authenticate, not to tell the truth.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace

import trio

from tierfs.coordination import fields
from tierfs.coordination.transport import (
    BadMessage,
    Message,
    Refused,
    Transport,
    Unreachable,
)
from tierfs.coordination.view import GCS, Holdings, HoldingsView

log = logging.getLogger(__name__)

K = 3  # coordinators per job
RPC_TIMEOUT = 1.0  # a coordination answer is a few hundred bytes: a live node sends it in milliseconds
SUSPECT_FOR = 20.0  # a coordinator that did not answer is skipped this long (and at least a round and a half)
REFUSED_FOR = 1.0  # one that refused (its daemon is starting) is asked again this soon
INTERVAL = 30.0  # between reports (--survey-interval)
TTL_ROUNDS = 3  # a report older than this many intervals no longer counts
OVERDUE_ROUNDS = 1.5  # a coordinator pulls a member whose last report is older than this many intervals
TICK = 0.5  # a coordinator's duties (pulls, expiry, listings) run this often
PULL_AFTER = 1.0  # seconds as a coordinator before pulling the reports of silent members
DOWN_AFTER = 2  # pulls in a row without an answer before a member counts as down
REFUSED_GRACE = 5.0  # a member whose host refused a pull (its daemon may be starting) is down after this
REFUSED_RETRY = 0.25  # a round asks a member whose host refused again this soon
MAX_QUESTIONS = 4096  # questions remembered (each until answered or MAX_WAIT + DECIDE_POLL old)
PULLS_AT_ONCE = 64
DECIDE_POLL = 2.0  # one long poll of coord_decide
MAX_WAIT = 30.0
MAX_GROUP = 64
MAX_LISTED_STEPS = 16  # per rank in an answer: the newest
MAX_LISTED_HOLDERS = 16  # per step in an answer
MAX_LISTED_DOWN = 64
MAX_SUSPECTS = 8  # coordinators a member found unresponsive, named in its next report
LISTINGS_AT_ONCE = 32  # prefix listings of GCS in flight at once

Clock = Callable[[], float]


def candidates(job: str, members: Iterable[str]) -> list[str]:
    """The order in which members become coordinators: the same on every node of ``job``.

    Computed once per node (it hashes every member); pass it on as ``order``.
    """
    return sorted(set(members), key=lambda a: hashlib.blake2b(f"{job}|{a}".encode(), digest_size=8).digest())


# -- the coordinator --------------------------------------------------------------------


@dataclass
class _Report:
    holdings: Holdings
    at: float


class Coordinator:
    """The coordinator side of a node: receives reports, keeps the view, answers.

    ``list_gcs``: the job's manifests in GCS (rank -> committed steps), or None without GCS.
    """

    def __init__(self, address: str, order: Sequence[str], transport: Transport, *, nodes: int,
                 list_gcs: Callable[[], Awaitable[dict[int, list[int]]]] | None = None,
                 interval: float = INTERVAL, rpc_timeout: float = RPC_TIMEOUT, k: int = K,
                 pull_after: float = PULL_AFTER, down_after: int = DOWN_AFTER, clock: Clock = trio.current_time,
                 members: frozenset[str] | None = None):
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
        self._reports: dict[str, _Report] = {}  # in the order received: the oldest expire first
        self._ranks: dict[int, set[str]] = {}  # rank -> addresses reporting as it (or found down since)
        self._rank_of: dict[str, int] = {}
        self._fresh: set[str] = set()  # members with a report held
        self._down: dict[str, float] = {}  # members found down -> since
        self._failed: dict[str, int] = {}  # member -> pulls unanswered in a row
        self._starting: dict[str, float] = {}  # member whose host refused a pull -> since
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
        return len(self._fresh) + len(self._down) >= len(self.members)

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
        now = self.clock()
        self._round = r = _Round(now)
        self._next_round = False
        if self.own is not None:  # this node's holdings need no message: read them as they are
            self.accept(self.address, self.own())
            r.known.add(self.address)
        for member in self.members - r.known:
            self._nursery.start_soon(self._round_pull, member, r)
        if self.list_gcs is not None:
            self._wanted = max(self._wanted, now)
            if not self._listing:
                self._listing = True
                self._nursery.start_soon(self._list)
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
        if member not in self._down:
            log.info("member %s is down (%s)", member, why)
        self._starting.pop(member, None)
        self._forget(member, keep_rank=True)  # what it held went with it; its rank's plans still name it
        self._down[member] = self.clock()

    def accept(self, source: str, h: Holdings) -> bool:
        """Take ``source``'s report; False if it is older than the one held."""
        held = self._reports.get(source)
        if held is not None and not h.newer_than(held.holdings):
            return False
        now = self.clock()
        if held is not None:
            del self._reports[source]  # re-inserted last: the dict stays in order of arrival
        self._unrank(source, h.rank)
        self._reports[source] = _Report(h, now)
        self._ranks.setdefault(h.rank, set()).add(source)
        self._rank_of[source] = h.rank
        self.view.put_holdings(source, h)
        if source in self.members:
            self._fresh.add(source)
            self._down.pop(source, None)
            self._failed.pop(source, None)
            self._starting.pop(source, None)
        if self.active_since is None:
            self.active_since = now
            self._activated.set()
        self.received += 1
        return True

    def _forget(self, source: str, keep_rank: bool = False) -> None:
        """Drop ``source``'s holdings; ``keep_rank``: still list it as its rank's node (found down)."""
        self._reports.pop(source, None)
        if not keep_rank:
            self._unrank(source)
        self._fresh.discard(source)
        self.view.drop(source)

    def _unrank(self, source: str, rank: int | None = None) -> None:
        """Stop listing ``source`` as the node of the rank it had (unless that is ``rank``)."""
        old = self._rank_of.get(source)
        if old is None or old == rank:
            return
        del self._rank_of[source]
        nodes = self._ranks.get(old)
        if nodes is not None:
            nodes.discard(source)
            if not nodes:
                del self._ranks[old]

    def _expire(self) -> None:
        now = self.clock()
        while self._pushed:  # oldest first: stop at the first one recent enough
            source, at = next(iter(self._pushed.items()))
            if now - at <= OVERDUE_ROUNDS * self.interval:
                break
            del self._pushed[source]
        while self._reports:
            source, report = next(iter(self._reports.items()))
            if now - report.at <= self.ttl:
                break
            self._forget(source)
        if not self._reports and self.active_since is not None and now - self.active_since > self.ttl:
            log.info("no reports for %.0fs: no longer a coordinator", self.ttl)
            self.active_since = self.gcs_at = self.gcs_error = self._listed_from = self._answered_at = None
            self._down.clear()
            self._failed.clear()
            self._starting.clear()
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
            while len(self._questions) >= MAX_QUESTIONS or self._questions and \
                    now - next(iter(self._questions.values())) > MAX_WAIT + DECIDE_POLL:
                del self._questions[next(iter(self._questions))]
            self._questions[key] = now
        return self._questions[key]

    def _note_push(self, source: str, suspects: list[str]) -> None:
        """A member sent its own report: it counts toward this node being a coordinator."""
        if source in self.members:
            self._pushed.pop(source, None)
            self._pushed[source] = self.clock()
        for a in suspects:
            if a in self.members and a not in self._down:
                self._suspects.add(a)

    def down_members(self) -> list[str]:
        return sorted(self._down)

    def _silent(self) -> list[str]:
        """Members neither reported nor found down (at most MAX_LISTED_DOWN), worked out once per TICK."""
        now = self.clock()
        if self._silent_at is None or now - self._silent_at >= TICK:
            silent = []
            for a in self.order:
                if a not in self._fresh and a not in self._down:
                    silent.append(a)
                    if len(silent) == MAX_LISTED_DOWN:
                        break
            self._silent_cache, self._silent_at = silent, now
        return self._silent_cache

    def down_candidates(self) -> list[str]:
        """The leading coordinator candidates found down: members skip them without a timeout."""
        return sorted(a for a in self._down if a in self._leading) if self._down else []

    def answer(self, rank: int, group: Iterable[int] = (), source: str | None = None,
               asked: float | None = None) -> Message:
        """What ``coord_decide`` returns for ``rank`` and its ``group`` (the ranks holding the same data).

        Ready only when a round begun at or after ``asked`` is complete (None: the view as it is).
        """
        ranks = {}
        for r in dict.fromkeys([rank, *group]):
            steps = self.view.steps_of(r) or {}
            listed = sorted(steps)[-MAX_LISTED_STEPS:]
            ranks[str(r)] = {"choice": self.view.choose(r),
                             "steps": {str(s): steps[s][:MAX_LISTED_HOLDERS] for s in listed},
                             "nodes": sorted(self._ranks.get(r, ()))[:MAX_LISTED_HOLDERS]}
        down = sorted(self._down)
        ready = self.ready() if asked is None else self.answered(asked)
        return {"ok": True, "ready": ready, "you": source in self._reports, "silent": [] if ready else self._silent(),
                "coordinating": self.active_since is not None and self.coordinating(), "summary": self.view.summary(),
                "reported": len(self._fresh), "members": len(self.members),
                "down": down[:MAX_LISTED_DOWN], "down_count": len(down),
                "gcs": {"listed": self.gcs_at is not None, "error": self.gcs_error}, "ranks": ranks}

    # -- duties ---------------------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Wait to become a coordinator, then list GCS, pull silent members and expire old reports."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                await self._activated.wait()
                while self.active_since is not None:
                    self._duties(nursery)
                    await trio.sleep(TICK)
                    self._expire()

    def _duties(self, nursery: trio.Nursery) -> None:
        now = self.clock()
        coordinating = self.coordinating()
        # Periodic listings; a round starts its own (_begin_round, and _list once the running one ends).
        if (coordinating and self.list_gcs is not None and not self._listing
                and (self.gcs_at is None or now - self.gcs_at >= self.interval)):
            self._listing = True
            nursery.start_soon(self._list)
        for member in self._suspects - self._pulling - self._down.keys():  # a member could not reach it
            self._pulling.add(member)
            nursery.start_soon(self._pull, member)
        self._suspects.clear()
        if now - self.active_since < self.pull_after:
            return
        for member, since in list(self._starting.items()):
            if now - since >= REFUSED_GRACE:  # still not listening: it reports itself once it does
                self._found_down(member, f"refused pulls for {now - since:.0f}s")
        if not coordinating:
            return
        if len(self._fresh) + len(self._down) < len(self.members):  # silent members
            for member in self.members - self._fresh - self._down.keys() - self._pulling - self._starting.keys():
                self._pulling.add(member)
                nursery.start_soon(self._pull, member)
        for member, report in self._reports.items():  # overdue members (a gone node's holdings go soon)
            if now - report.at <= OVERDUE_ROUNDS * self.interval:
                break  # the rest are newer
            if member in self.members and member not in self._pulling:
                self._pulling.add(member)
                nursery.start_soon(self._pull, member)
        for member, since in self._down.items():
            if now - since >= self.ttl and member not in self._pulling:  # still down? it reports itself when back
                self._down[member] = now
                self._pulling.add(member)
                nursery.start_soon(self._pull, member)

    async def _list(self) -> None:
        started = self.clock()
        try:
            listing = await self.list_gcs()
        except Exception as e:  # any failure of the listing: the view goes on without GCS
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
            if member not in self._down:
                self._starting.setdefault(member, self.clock())  # not pulled again: it will report
        except (Unreachable, BadMessage) as e:
            failed = self._failed[member] = self._failed.get(member, 0) + 1
            if failed >= self.down_after and member not in self._down:
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


# -- the member -------------------------------------------------------------------------


@dataclass
class RankView:
    """What a coordinator says about one rank."""

    choice: int | None
    steps: dict[int, list[str]]  # step -> holders (addresses, "gcs")
    nodes: list[str]  # addresses of the nodes reporting as this rank, or found down since


@dataclass
class Decision:
    """The step to restore, as a coordinator answered, with the holdings a restore plans from."""

    step: int | None
    ready: bool  # every member reported or was found down
    coordinator: str | None
    summary: dict = field(default_factory=dict)
    ranks: dict[int, RankView] = field(default_factory=dict)
    reported: int = 0
    members: int = 0
    down: list[str] = field(default_factory=list)
    at: float = 0.0
    silent: list[str] = field(default_factory=list)  # members that had not reported (when not ready)
    you: bool = False  # the coordinator holds the asker's report
    coordinating: bool = False  # it is a coordinator (it waited for its view), not a stand-in

    @classmethod
    def from_answer(cls, rank: int, group: Collection[int], answer: Message, coordinator: str, at: float) -> Decision:
        """A ``coord_decide`` answer about ``rank`` and its ``group``, every field checked (BadMessage)."""
        try:
            return cls._parse(rank, group, answer, coordinator, at)
        except BadMessage as e:
            raise BadMessage(f"malformed coord_decide answer from {coordinator}: {e}") from None

    @classmethod
    def _parse(cls, rank: int, group: Collection[int], answer: Message, coordinator: str, at: float) -> Decision:
        listed = fields.obj(answer.get("ranks"), "ranks")
        ranks = {}
        for key, value in listed.items():
            r = fields.number_key(key, "ranks")
            if r != rank and r not in group:
                raise BadMessage(f"ranks names rank {r}, which was not asked about")
            ranks[r] = RankView(*fields.rank_answer(value, f"rank {r}", MAX_LISTED_STEPS, MAX_LISTED_HOLDERS))
        if rank not in ranks:
            raise BadMessage(f"ranks does not answer for rank {rank}")
        gcs = fields.obj(answer.get("gcs", {}), "gcs")
        fields.flag(gcs.get("listed", False), "gcs listed")
        if not (gcs.get("error") is None or isinstance(gcs.get("error"), str)):
            raise BadMessage("gcs error must be a string or null")
        fields.count(answer.get("down_count", 0), "down_count")
        return cls(ranks[rank].choice, fields.flag(answer.get("ready"), "ready"), coordinator,
                   fields.summary(answer.get("summary")), ranks,
                   fields.count(answer.get("reported"), "reported"), fields.count(answer.get("members"), "members"),
                   fields.addresses(answer.get("down", []), "down", MAX_LISTED_DOWN), at,
                   fields.addresses(answer.get("silent", []), "silent", MAX_LISTED_DOWN),
                   fields.flag(answer.get("you", False), "you"),
                   fields.flag(answer.get("coordinating", False), "coordinating"))

    def holders(self, rank: int, step: int) -> list[str]:
        view = self.ranks.get(rank)
        return [] if view is None else view.steps.get(step, [])

    def needing(self, ranks: Iterable[int], step: int) -> dict[int, list[str]]:
        """The nodes of ``ranks`` that do not hold ``step`` of their own rank: they restore it."""
        out = {}
        for r in ranks:
            view = self.ranks.get(r)
            if view is not None:
                held = set(view.steps.get(step, ()))
                need = [a for a in view.nodes if a not in held]
                if need:
                    out[r] = need
        return out


class Member:
    """The member side of a node: reports to the coordinators and asks them for decisions."""

    def __init__(self, address: str, order: Sequence[str], transport: Transport,
                 holdings: Callable[[], Holdings], *, k: int = K,
                 rpc_timeout: float = RPC_TIMEOUT, suspect_for: float = SUSPECT_FOR,
                 local: Coordinator | None = None, clock: Clock = trio.current_time, inc: int | None = None):
        self.address, self.transport, self._holdings = address, transport, holdings
        self.order = order  # candidates(job, members), shared
        self.k, self.rpc_timeout, self.suspect_for = k, rpc_timeout, suspect_for
        self.local, self.clock = local, clock
        self.inc = int(time.time() * 1e6) if inc is None else inc
        self.interval = INTERVAL  # between reports (run() sets it)
        self.seq = 0
        self._suspect: dict[str, float] = {}  # coordinator -> skipped until
        self._silent: dict[str, float] = {}  # coordinator -> when it last failed to answer
        self.summary: dict | None = None  # the newest summary a coordinator sent back
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

    async def report(self) -> dict | None:
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

    async def _report(self) -> dict | None:
        report = self.report_now().to_wire()
        walk = self.coordinators(extra=2 * self.k)
        order = iter(walk)
        answers: dict[str, dict] = {}

        async def lane() -> None:
            for address in order:  # shared: each lane takes the next candidate
                message = {"op": "coord_report", "report": report}
                suspects = self._unresponsive()
                if suspects:  # the coordinators check them at once, and tell everyone who is down
                    message["suspects"] = suspects
                try:
                    answers[address] = fields.report_answer(await self._ask(address, message, self.rpc_timeout),
                                                            MAX_LISTED_DOWN)
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

    async def decide(self, rank: int, group: Sequence[int] = (), wait: float = 15.0,
                     poll: float = DECIDE_POLL, exclude: Collection[str] = ()) -> Decision:
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
                message = {"op": "coord_decide", "rank": rank, "group": group, "wait": min(poll, left),
                           "q": question, "report": self.report_now().to_wire()}
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
        log.info("deciding on a view that is not ready: %d of %d members reported, %d down",
                 best.reported, best.members, len(best.down))
        return best

    async def run(self, interval: float = INTERVAL, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Report every ``interval`` seconds, for as long as the node runs."""
        self.interval = interval
        task_status.started()
        while True:
            await self.report()
            await trio.sleep(interval)


# -- one node's coordination, as the peer service would host it ----------------------------


class Coordination:
    """A node's member and coordinator sides together, behind one handler for the peer service."""

    def __init__(self, address: str, order: Sequence[str], transport: Transport,
                 holdings: Callable[[], Holdings], *, nodes: int,
                 list_gcs: Callable[[], Awaitable[dict[int, list[int]]]] | None = None,
                 interval: float = INTERVAL, k: int = K, rpc_timeout: float = RPC_TIMEOUT,
                 pull_after: float = PULL_AFTER, down_after: int = DOWN_AFTER,
                 suspect_for: float = SUSPECT_FOR, clock: Clock = trio.current_time, inc: int | None = None,
                 members: frozenset[str] | None = None):
        """``order``: :func:`candidates` of the job's members (this node included)."""
        self.interval = interval
        self.coordinator = Coordinator(address, order, transport, nodes=nodes, list_gcs=list_gcs,
                                       interval=interval, rpc_timeout=rpc_timeout, k=k, pull_after=pull_after,
                                       down_after=down_after, clock=clock, members=members)
        self.member = Member(address, order, transport, holdings, k=k, rpc_timeout=rpc_timeout,
                             suspect_for=suspect_for, local=self.coordinator, clock=clock, inc=inc)
        self.coordinator.own = self.member.report_now

    OPS = ("coord_report", "coord_decide", "coord_pull")

    def set_order(self, order: Sequence[str]) -> None:
        """The job's members changed (a DNS name found more nodes): ``candidates`` of the new set."""
        c = self.coordinator
        c.order, c.members, c._leading, c._index = order, frozenset(order), frozenset(order[: 4 * c.k]), None
        self.member.order = order

    async def handle(self, source: str, message: Message) -> Message:
        if message.get("op") == "coord_pull":
            return await self.member.handle_pull(source, message)
        return await self.coordinator.handle(source, message)

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.coordinator.run)
            await nursery.start(self.member.run, self.interval)
            task_status.started()


# -- listing GCS in parallel --------------------------------------------------------------


def listing_prefixes(nodes: int) -> list[str]:
    """Prefixes under ``manifests/`` that split a listing of ``rank-<R>/...`` into shards.

    Ranks are not zero-padded, so ``rank-57`` also covers ranks 570-579 and 5700-5799; the
    ranks too short for a shard of their own get an exact ``rank-<R>/``. With shards of
    ``digits`` = (digits of the largest rank) - 2 leading digits, each covers at most 111
    ranks of the job, and every rank number, in the job or not, falls in exactly one.
    """
    digits = max(1, len(str(max(nodes - 1, 0))) - 2)
    exact = [f"rank-{r}/" for r in range(10 ** (digits - 1))]
    shared = [f"rank-{p}" for p in range(10 ** (digits - 1), 10**digits)]
    return exact + shared


async def list_sharded(list_prefix: Callable[[str], Awaitable[dict[int, list[int]]]],
                       prefixes: Sequence[str], at_once: int = LISTINGS_AT_ONCE) -> dict[int, list[int]]:
    """One listing from many prefix listings run concurrently (any failure fails the listing)."""
    merged: dict[int, list[int]] = {}
    limit = trio.CapacityLimiter(at_once)

    async def one(prefix: str) -> None:
        async with limit:
            for rank, steps in (await list_prefix(prefix)).items():
                merged.setdefault(rank, []).extend(steps)

    async with trio.open_nursery() as nursery:
        for prefix in prefixes:
            nursery.start_soon(one, prefix)
    return {r: sorted(set(s)) for r, s in merged.items()}
