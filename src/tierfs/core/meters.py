"""What a daemon counts as it works, kept for Prometheus (``tierfs_*`` series).

Counters and histograms live here because they must be recorded where the event happens
(a step put on a tier, a restore finished): the steps and the replicator's records are
dropped by retention, so nothing read later could add them up again. What the daemon
merely *is* at a moment (newest steps, lags, RAM, peers) is read from its status when
Prometheus scrapes (:mod:`tierfs.daemon.metrics`); FUSE requests are timed by the engine
in plain integers (:class:`RequestTimes`): about 0.3 µs a request, clock reads included,
where a prometheus_client histogram's ``labels().observe()`` takes a lock and about 0.9 µs.

Every series carries ``job`` and ``rank`` and at most one more label of a few values (a
lane, a restore's source, a FUSE operation), never a step or a path: a 10,000-rank job
stays a bounded number of series per node.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Iterable
from typing import TypeVar

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram

# A *_created series per counter doubles them for nothing. (prometheus_client leaves this
# function unannotated.)
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

# Seconds: a step on a peer takes tenths, a large one in GCS many minutes.
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
LABELS = ("job", "rank")
_Metric = TypeVar("_Metric", Counter, Histogram)


class Meters:
    """The daemon's counters, each already bound to its job and rank."""

    def __init__(self, job: str, rank: int, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.job, self.rank = job, rank
        r, by_tier = self.registry, (*LABELS, "tier")
        self._sent = Counter(
            "tierfs_tier_sent_bytes", "Bytes this node sent to the tier while putting steps", by_tier, registry=r
        )
        self._dedup = Counter(
            "tierfs_tier_dedup_bytes", "Bytes of steps the tier already held, so not sent", by_tier, registry=r
        )
        self._steps = Counter("tierfs_tier_steps", "Steps put on the tier", by_tier, registry=r)
        self._errors = Counter("tierfs_tier_errors", "Failed attempts to put a step on the tier", by_tier, registry=r)
        self._copy = Histogram(
            "tierfs_step_copy_duration_seconds",
            "Time to put one step on the tier",
            by_tier,
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self._restore = Histogram(
            "tierfs_restore_duration_seconds",
            "Time a finished restore took, by the tier most of its bytes came from",
            (*LABELS, "source"),
            buckets=DURATION_BUCKETS,
            registry=r,
        )

    def _bound(self, metric: _Metric, *extra: str) -> _Metric:
        return metric.labels(self.job, str(self.rank), *extra)

    def lanes(self, names: Iterable[str]) -> None:
        """Show every lane's counters from the start, at zero: an alert on their increase needs a series."""
        for name in names:
            for metric in (self._sent, self._dedup, self._steps, self._errors):
                self._bound(metric, name)
            self._bound(self._copy, name)

    def step_put(self, tier: str, seconds: float, sent_bytes: int, dedup_bytes: int) -> None:
        self._bound(self._steps, tier).inc()
        self._bound(self._sent, tier).inc(sent_bytes)
        self._bound(self._dedup, tier).inc(max(0, dedup_bytes))
        self._bound(self._copy, tier).observe(seconds)

    def put_failed(self, tier: str) -> None:
        self._bound(self._errors, tier).inc()

    def restored(self, source: str, seconds: float) -> None:
        self._bound(self._restore, source).observe(seconds)


# FUSE request times: log2 buckets from 8 µs (bucket k holds times below 8 µs * 2**k).
REQUEST_BUCKETS = 22  # the last is +Inf: 8 µs * 2**21 is about 17 s
MAX_OPCODE = 64  # FUSE's opcodes are below it (CUSE's, far above, are counted as 0)
_BASE_NS_SHIFT = 13  # 2**13 ns = 8.192 µs


class RequestTimes:
    """Counts and time histograms of FUSE requests by opcode, in plain lists of integers.

    Written by the request loop only (one thread), read by a scrape from another: a reader
    may see one request counted in its bucket and not yet in its sum, never a torn value.
    """

    SUM = REQUEST_BUCKETS  # the index of an opcode's total time (ns), after its buckets

    def __init__(self) -> None:
        self._by_opcode: list[list[int] | None] = [None] * MAX_OPCODE  # [bucket counts..., total ns]

    def record(self, opcode: int, ns: int) -> None:
        counts = self._by_opcode[opcode if opcode < MAX_OPCODE else 0]
        if counts is None:
            counts = self._by_opcode[opcode if opcode < MAX_OPCODE else 0] = [0] * (REQUEST_BUCKETS + 1)
        counts[min((ns >> _BASE_NS_SHIFT).bit_length(), REQUEST_BUCKETS - 1)] += 1
        counts[REQUEST_BUCKETS] += ns

    def items(self) -> list[tuple[int, list[int], int]]:
        """(opcode, bucket counts, total ns) of every opcode seen; 0 stands for any beyond MAX_OPCODE."""
        return [(op, c[:REQUEST_BUCKETS], c[REQUEST_BUCKETS]) for op, c in enumerate(self._by_opcode) if c]

    async def timed(self, waiting: Awaitable[None], opcode: int, started_ns: int) -> None:
        """Await a request that had to wait, and count it from when it was read."""
        try:
            await waiting
        finally:
            self.record(opcode, time.perf_counter_ns() - started_ns)

    @staticmethod
    def bounds() -> list[str]:
        """The buckets' upper bounds in seconds, as Prometheus spells them (``le``)."""
        return [repr((1 << (_BASE_NS_SHIFT + k)) / 1e9) for k in range(REQUEST_BUCKETS - 1)] + ["+Inf"]
