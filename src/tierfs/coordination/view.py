"""The cluster's holdings as one coordinator keeps them, and the rules that pick a step from them.

The rules are those of :class:`tierfs.pipeline.survey.Survey`, unchanged; only the bookkeeping
differs. A survey is rebuilt from scratch each time one node asks every other; a
coordinator receives one report per node per round and must answer thousands of
questions in between, so :class:`HoldingsView` is updated by the difference each report
makes and answers from counters:

- a step is *complete* when the ranks holding it (on any tier) are all the writing ranks
  (those with at least one manifest anywhere): ``holding[step] == writing``;
- the *retention floor* is the newest step held by every rank ``0..nodes-1``, writers or
  not (so a slow rank's first step is kept);
- a rank *adopts* the newest step some node already restored and runs from, if that rank
  holds it (or holds nothing at all), else takes the newest complete step.

A report costs O(what changed); "newest complete step" costs O(distinct steps), a handful.
Tests check every answer against ``Survey`` on random holdings.

A node's report (:class:`Holdings`) travels as the JSON object below, capped so that a
report stays far under the peer wire's 1 MiB header limit::

    {"rank": R, "steps": [S, ...], "replicas": [[R, S], ...], "restore": S | null,
     "topology": [[key, value], ...], "inc": I, "seq": Q, "backed": [S, ...]}

``steps`` are the node's own committed steps, ``replicas`` the (rank, step) manifests it
keeps for others, ``restore`` the step it restored and still runs from (what the
daemon's ``info`` calls ``restore_step``), ``backed`` (optional) the node's own steps it
backed up to GCS: they count as GCS's at once, not only from the next listing. ``inc``
(the incarnation: the daemon's start time in microseconds) and ``seq`` (a counter) order
reports: an old report that arrives late never replaces a newer one, and a restarted
daemon's first report always does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

from tierfs.coordination.pairs import rank_step_pairs
from tierfs.coordination.transport import BadMessage, int_field, int_list

GCS = "gcs"  # the source name of what the GCS listing holds, in reports, answers and broadcast plans

MAX_STEPS = 256  # own committed steps in one report
MAX_REPLICAS = 4096  # (rank, step) replicas in one report
MAX_TOPOLOGY = 16  # topology labels, each at most MAX_LABEL characters
MAX_LABEL = 128
MAX_DECISIONS = 256  # distinct restore steps carried in an answer (the newest ones)
MAX_RANK = (1 << 31) - 1
MAX_STEP = 1 << 62

# SUMMARY of :mod:`tierfs.coordination.protocol`: newest and floor (a step or None), decisions
# and complete (steps), ranks (a count). A plain dict, not a TypedDict: the planner and
# the daemon read it as the dict a survey's summary is.
Summary: TypeAlias = dict[str, int | list[int] | None]


@dataclass(frozen=True)
class Holdings:
    """One node's report: what it holds and runs from, as ``info`` + ``list`` give it today."""

    rank: int
    steps: tuple[int, ...] = ()
    replicas: tuple[tuple[int, int], ...] = ()
    restore_step: int | None = None
    topology: tuple[tuple[str, str], ...] = ()
    inc: int = 0
    seq: int = 0
    backed: tuple[int, ...] = ()  # own steps this node backed up to GCS

    def pairs(self) -> set[tuple[int, int]]:
        """Every (rank, step) manifest this node holds."""
        return {(self.rank, s) for s in self.steps} | set(self.replicas)

    def newer_than(self, other: Holdings | None) -> bool:
        return other is None or (self.inc, self.seq) > (other.inc, other.seq)

    def to_wire(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "steps": list(self.steps),
            "replicas": [list(p) for p in self.replicas],
            "restore": self.restore_step,
            "topology": [list(t) for t in self.topology],
            "inc": self.inc,
            "seq": self.seq,
            **({"backed": list(self.backed)} if self.backed else {}),
        }

    @classmethod
    def from_wire(cls, data: object) -> Holdings:
        """A report as received from another node; BadMessage if it is not one."""
        if not isinstance(data, dict):
            raise BadMessage("a report must be a JSON object")
        rank = int_field(data, "rank", hi=MAX_RANK)
        steps = int_list(data.get("steps", []), "steps", MAX_STEPS)
        pairs = rank_step_pairs(data.get("replicas", []), "replica", MAX_REPLICAS, MAX_RANK, MAX_STEP)
        labels = topology_labels(data.get("topology", []))
        backed = int_list(data.get("backed", []), "backed", MAX_STEPS)
        if any(s > MAX_STEP for s in steps + backed):
            raise BadMessage("a step is out of range")
        return cls(
            rank,
            tuple(steps),
            tuple(pairs),
            int_field(data, "restore", hi=MAX_STEP, optional=True),
            labels,
            int_field(data, "inc", hi=1 << 62),
            int_field(data, "seq", hi=1 << 62),
            tuple(backed),
        )


def topology_labels(value: object) -> tuple[tuple[str, str], ...]:
    """A node's topology labels as another node sent them (a report, a peer's ``info``)."""
    if not isinstance(value, list) or len(value) > MAX_TOPOLOGY:
        raise BadMessage(f"topology must be a list of at most {MAX_TOPOLOGY} [key, value] pairs")
    labels = []
    for t in value:
        if not (isinstance(t, list) and len(t) == 2 and all(isinstance(x, str) and len(x) <= MAX_LABEL for x in t)):
            raise BadMessage(f"each topology label must be a [key, value] pair of strings of at most {MAX_LABEL}")
        labels.append((t[0], t[1]))
    return tuple(labels)


def choose_step(newest: int | None, decisions: Iterable[int], mine: Iterable[int] | None) -> int | None:
    """The step a rank restores: :meth:`tierfs.pipeline.survey.Survey.choose` on a summary.

    ``decisions``: the steps nodes restored and still run from; ``mine``: the steps the
    rank's manifest is held for anywhere, None if it holds none.
    """
    held = None if mine is None else set(mine)
    adoptable = sorted({d for d in decisions if held is None or d in held})
    if adoptable and adoptable[-1] != newest:
        return adoptable[-1]
    return newest


@dataclass
class HoldingsView:
    """Who holds which (rank, step) manifest, merged from every source, updated by difference."""

    nodes: int
    _pairs: dict[str, frozenset[tuple[int, int]]] = field(default_factory=dict)  # source -> what it holds
    _decision: dict[str, int] = field(default_factory=dict)  # source -> step it restored and runs from
    _holders: dict[int, dict[int, set[str]]] = field(default_factory=dict)  # rank -> step -> sources
    _holding: Counter[int] = field(default_factory=Counter)  # step -> ranks whose manifest of it is somewhere
    _in_range: Counter[int] = field(default_factory=Counter)  # the same, counting ranks 0..nodes-1 only
    _decisions: Counter[int] = field(default_factory=Counter)  # step -> sources that run from it
    version: int = 0  # bumped by every change: answers can be cached per version

    # -- updates ------------------------------------------------------------------------

    def put(self, source: str, pairs: Iterable[tuple[int, int]], decision: int | None = None) -> None:
        """Replace everything ``source`` contributed by ``pairs`` (and its restore decision)."""
        new = frozenset(pairs)
        old = self._pairs.get(source, frozenset())
        changed = new != old
        for rank, step in old - new:
            self._remove(source, rank, step)
        for rank, step in new - old:
            self._add(source, rank, step)
        if new:
            self._pairs[source] = new
        else:
            self._pairs.pop(source, None)
        before = self._decision.get(source)
        if before != decision:
            changed = True
            if before is not None:
                self._decisions[before] -= 1
                if not self._decisions[before]:
                    del self._decisions[before]
            if decision is None:
                del self._decision[source]
            else:
                self._decision[source] = decision
                self._decisions[decision] += 1
        if changed:
            self.version += 1

    def put_holdings(self, source: str, h: Holdings) -> None:
        self.put(source, h.pairs(), h.restore_step)
        backed = {(h.rank, s) for s in h.backed} - self._pairs.get(GCS, frozenset())
        if backed:  # in GCS now; the next listing confirms it (or not)
            self.put(GCS, self._pairs.get(GCS, frozenset()) | backed)

    def put_listing(self, listing: Mapping[int, Iterable[int]], source: str = GCS) -> None:
        """What a listing of the job's manifests in GCS shows (rank -> committed steps)."""
        self.put(source, ((r, s) for r, steps in listing.items() for s in steps))

    def drop(self, source: str) -> None:
        self.put(source, (), None)

    def set_nodes(self, nodes: int) -> None:
        """The job's size changed (replicator.yaml): recount the ranks the floor looks at."""
        if nodes == self.nodes:
            return
        self.nodes = nodes
        self._in_range = Counter()
        for rank, by_step in self._holders.items():
            if 0 <= rank < nodes:
                self._in_range.update(by_step.keys())
        self.version += 1

    def _add(self, source: str, rank: int, step: int) -> None:
        by_step = self._holders.get(rank)
        if by_step is None:
            by_step = self._holders[rank] = {}
        sources = by_step.get(step)
        if sources is None:
            sources = by_step[step] = set()
            self._holding[step] += 1
            if 0 <= rank < self.nodes:
                self._in_range[step] += 1
        sources.add(source)

    def _remove(self, source: str, rank: int, step: int) -> None:
        by_step = self._holders[rank]
        sources = by_step[step]
        sources.discard(source)
        if sources:
            return
        del by_step[step]
        for counter, counts in ((self._holding, True), (self._in_range, 0 <= rank < self.nodes)):
            if counts:
                counter[step] -= 1
                if not counter[step]:
                    del counter[step]
        if not by_step:
            del self._holders[rank]

    # -- the rules ----------------------------------------------------------------------

    @property
    def writing_ranks(self) -> int:
        return len(self._holders)

    def sources(self) -> list[str]:
        return list(self._pairs)

    def complete_steps(self) -> list[int]:
        """Steps whose manifest is on some tier for every writing rank."""
        writing = len(self._holders)
        return sorted(s for s, n in self._holding.items() if n == writing) if writing else []

    def newest_complete(self) -> int | None:
        writing = len(self._holders)
        if not writing:
            return None
        return max((s for s, n in self._holding.items() if n == writing), default=None)

    def retention_floor(self) -> int | None:
        """The newest step held for every rank ``0..nodes-1`` (None while some rank holds none)."""
        if self.nodes <= 0:
            return None
        return max((s for s, n in self._in_range.items() if n == self.nodes), default=None)

    def decisions(self) -> list[int]:
        """The distinct steps nodes restored and still run from, oldest first."""
        return sorted(self._decisions)

    def steps_of(self, rank: int) -> dict[int, list[str]] | None:
        """Step -> sources holding ``rank``'s manifest of it; None if the rank holds nothing."""
        by_step = self._holders.get(rank)
        return None if by_step is None else {s: sorted(src) for s, src in by_step.items()}

    def holds(self, source: str, rank: int, step: int) -> bool:
        return (rank, step) in self._pairs.get(source, ())

    def choose(self, rank: int) -> int | None:
        """The step ``rank`` restores (Survey.choose)."""
        by_step = self._holders.get(rank)
        return choose_step(self.newest_complete(), self._decisions, None if by_step is None else by_step.keys())

    def summary(self) -> Summary:
        """The rank-independent part of every answer (JSON-able, bounded)."""
        return {
            "newest": self.newest_complete(),
            "floor": self.retention_floor(),
            "decisions": self.decisions()[-MAX_DECISIONS:],
            "complete": self.complete_steps()[-5:],
            "ranks": len(self._holders),
        }

    def holders_by_rank(self) -> dict[int, dict[int, list[str]]]:
        """Rank -> step -> sources holding its manifest: what a survey of every source would record."""
        return {
            rank: {step: sorted(sources) for step, sources in by_step.items()}
            for rank, by_step in self._holders.items()
        }

    def decision_by_source(self) -> dict[str, int]:
        """Source -> the step it restored and still runs from."""
        return dict(self._decision)
