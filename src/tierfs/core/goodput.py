"""A job's checkpoint goodput, estimated from what one rank's daemon observes.

Saving a checkpoint costs time the job does not train; not saving costs the work a failure
throws away. The daemon sees both sides: when steps are committed, how long their files
were being written, how long each tier takes to hold a step, and the restores it performs.
This module turns those observations into the numbers ``tierfs status`` and ``/metrics``
report (see ``docs/goodput.md``); it does no I/O, so the daemon calls it whenever asked.

The model (first order, failures arriving independently at rate ``1/M``). Let ``P`` be the
time between two commits, which includes ``delta``, the time a save blocks the job. Then

* a fraction ``delta / P`` of the time goes to saving;
* a failure strikes at a uniformly random moment of a period, so on average ``P / 2`` after
  the newest commit; that commit is only safe on the tier the job restores from ``L``
  seconds after it is made, which adds exactly ``L`` on average (for any ``L``, the newest
  safe step is the newest commit at or before ``now - L``); and restoring costs ``R``.
  Expected loss per failure: ``E(P) = P/2 + L + R``;
* goodput ``G(P) = 1 - delta/P - E(P)/M``, clamped to ``[0, 1]``.

``G`` is largest where ``delta/P**2 = 1/(2M)``: ``P* = sqrt(2 * delta * M)`` (Young, "A first
order approximation to the optimum checkpoint interval", CACM 17(9), 1974). ``L`` and ``R``
shift goodput but not the optimum. Daly ("A higher order estimate of the optimum checkpoint
interval for restart dumps", FGCS 22(3), 2006) writes the same first-order optimum as the
*compute* time between saves, ``tau = sqrt(2 * delta * M) - delta``; the time between
commits is ``tau + delta``, which is what :attr:`Goodput.interval_s` measures and so what
:attr:`Goodput.optimal_interval_s` reports, so both compare directly. Where
``delta >= 2M`` the first-order optimum is at or below ``delta`` itself (saving back to
back), and Daly's complete model gives ``tau = M``: the time between commits is then
``M + delta`` (goodput is 0 there anyway).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

# Commits the interval and the cost are taken over: enough that a median ignores a few odd
# saves (one after a restart, one slowed by a busy node), few enough that a job that changes
# how often it saves is followed within about eight saves.
WINDOW = 16
# Tiers a failure restores from, in order, when the one asked for is not the job's: a peer
# still holds the step when one node dies; the node's disk survives a restart on the same
# node; GCS survives everything but is the slowest to hold a step.
RESTORE_ORDER = ("peers", "disk", "gcs")
MAX_RESTORES = 16  # restore times History keeps
MAX_FAILURES = 2**31  # beyond any real job: a larger count in History is not the daemon's own


@dataclass(frozen=True)
class Observed:
    """What one rank's daemon has seen of the job, as of one moment."""

    # (committed_at unix s, write_s): recent new steps, oldest first. write_s is how long the
    # step's files were being written before the commit (commit time minus the earliest birth
    # time of its files), the time a synchronous save blocks the job; 0 if unknown.
    commits: Sequence[tuple[float, float]]
    # Tier name ("peers", "gcs", "disk") -> committed_at of the newest step held there (None: none yet).
    safe_at: Mapping[str, float | None]
    copy_s: Mapping[str, float]  # tier -> typical seconds from a commit until the tier holds the step
    restore_s: float | None  # typical seconds a restore took (None: none seen)
    failures: int  # failures this rank restored from, over observed_s
    observed_s: float  # how long the job has been observed (since its first commit or first start)
    mtbf_s: float | None = None  # the operator's mean time between the job's failures; overrides the observed rate


@dataclass(frozen=True)
class Goodput:
    """The estimates; None where the observations do not support one yet."""

    interval_s: float | None  # median time between commits
    cost_s: float | None  # median blocking cost of a save (delta)
    overhead_ratio: float | None  # cost / interval
    at_risk_s: dict[str, float]  # tier -> work lost if a failure struck now and the job restored from that tier
    mtbf_s: float | None  # used: the operator's, else observed_s / failures
    expected_loss_s: float | None  # per failure at the current interval: interval/2 + lag of the restore tier + restore
    optimal_interval_s: float | None  # time between commits that maximises goodput (Young/Daly)
    goodput_ratio: float | None  # useful fraction of time at the current interval
    optimal_goodput_ratio: float | None  # the same at the optimal interval

    def as_dict(self) -> dict[str, float | None | dict[str, float | None]]:
        """Rounded and JSON-ready (no NaN or infinity), for ``tierfs status --json`` and the metrics."""
        seconds = ("interval_s", "cost_s", "mtbf_s", "expected_loss_s", "optimal_interval_s")
        ratios = ("overhead_ratio", "goodput_ratio", "optimal_goodput_ratio")
        out: dict[str, float | None | dict[str, float | None]] = {k: _round(getattr(self, k), 2) for k in seconds}
        out.update({k: _round(getattr(self, k), 4) for k in ratios})
        out["at_risk_s"] = {tier: _round(s, 2) for tier, s in sorted(self.at_risk_s.items())}
        return out


def estimate(obs: Observed, now: float, restore_tier: str = "peers") -> Goodput:
    """The job's goodput as ``obs`` shows it at ``now``, should a failure restore from ``restore_tier``.

    A single node's failure restores from its peers when the job has a peer tier, so that is
    the default; when the job has no tier of that name, the first of peers, disk and GCS it
    has is taken instead (see :data:`RESTORE_ORDER`). That tier's typical lag ``L`` is what
    counts in the expected loss, since the step a failure falls back to is the newest one
    *it* holds. Unknown restore times count as 0 (expected loss is then a lower bound).
    """
    interval, cost = _interval(obs.commits), _cost(obs.commits)
    mtbf = _mtbf(obs)
    tier = restoring_tier(obs.safe_at, restore_tier)
    lag = _finite(obs.copy_s.get(tier)) if tier is not None else None
    restore = _finite(obs.restore_s)
    restore = max(0.0, restore) if restore is not None else 0.0
    fixed = max(0.0, lag) + restore if lag is not None else None  # loss per failure that P does not change

    expected = interval / 2 + fixed if interval is not None and fixed is not None else None
    overhead = cost / interval if cost is not None and interval is not None else None
    optimal = optimal_interval(cost, mtbf) if cost is not None and mtbf is not None else None
    ratio = best = None
    if optimal is not None and cost is not None and mtbf is not None and fixed is not None:
        best = goodput(optimal, cost, fixed, mtbf)
        if interval is not None:
            ratio = goodput(interval, cost, fixed, mtbf)
    return Goodput(interval, cost, overhead, _at_risk(obs, now), mtbf, expected, optimal, ratio, best)


def goodput(interval: float, cost: float, fixed_loss: float, mtbf: float) -> float:
    """``1 - cost/interval - (interval/2 + fixed_loss)/mtbf`` in ``[0, 1]``: the model above, at one interval."""
    g = 1 - cost / interval - (interval / 2 + fixed_loss) / mtbf
    return min(1.0, max(0.0, g))


def optimal_interval(cost: float, mtbf: float) -> float:
    """Time between commits that maximises :func:`goodput`: ``sqrt(2*cost*mtbf)``, else ``mtbf + cost``.

    Daly's ``tau = sqrt(2*delta*M) - delta`` (``M`` where ``delta >= 2M``) is the training
    time between saves; a commit comes ``delta`` later.
    """
    if cost >= 2 * mtbf:
        return mtbf + cost
    return math.sqrt(2 * cost * mtbf)


def restoring_tier(safe_at: Mapping[str, float | None], wanted: str) -> str | None:
    """The tier a failure restores from: ``wanted`` if the job has it, else the first of :data:`RESTORE_ORDER`."""
    if wanted in safe_at:
        return wanted
    return next((t for t in RESTORE_ORDER if t in safe_at), None)


def _interval(commits: Sequence[tuple[float, float]]) -> float | None:
    """Median time between consecutive commits among the last :data:`WINDOW`.

    The first commit has no interval: the time from the job's start to it is start-up
    (loading, compiling, a restore), not a save interval, and is not counted. Intervals of
    zero or less come from the wall clock being stepped and are ignored; a commit with a
    non-finite time is skipped.
    """
    times = [t for t, _ in commits[-WINDOW:] if math.isfinite(t)]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b - a > 0]
    return statistics.median(gaps) if gaps else None


def _cost(commits: Sequence[tuple[float, float]]) -> float | None:
    """Median write window of the last :data:`WINDOW` commits that know theirs (0 means unknown)."""
    known = [w for _, w in commits[-WINDOW:] if math.isfinite(w) and w > 0]
    return statistics.median(known) if known else None


def _mtbf(obs: Observed) -> float | None:
    """The operator's MTBF, else the observed one; None without either (no failure seen, none given)."""
    given = _finite(obs.mtbf_s)
    if given is not None and given > 0:
        return given
    observed = _finite(obs.observed_s)
    if obs.failures > 0 and observed is not None and observed > 0:
        return observed / obs.failures
    return None


def _at_risk(obs: Observed, now: float) -> dict[str, float]:
    """Per tier, the work a failure now would lose restoring from it: ``now - safe_at``, never negative.

    A tier that holds no step yet puts everything observed at risk (``observed_s``, a lower
    bound: work before the first commit is not seen): the gauge then grows with the job
    rather than disappearing.
    """
    everything = max(0.0, _finite(obs.observed_s) or 0.0)
    risk = {}
    for tier, at in obs.safe_at.items():
        at = _finite(at)
        risk[tier] = max(0.0, now - at) if at is not None else everything
    return risk


def _finite(x: float | None) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def _round(x: float | None, digits: int) -> float | None:
    return round(x, digits) if x is not None and math.isfinite(x) else None


@dataclass
class History:
    """What a rank remembers across daemon restarts, saved by the daemon as JSON.

    Failures are rare: counted only in memory, a daemon restarted by the failure itself (or
    by an upgrade) would forget them and the observed MTBF would never form.
    """

    first_seen: float  # unix s when the daemon first saw this job on this rank
    failures: int = 0  # failures this rank restored from since first_seen
    restore_s: list[float] = field(default_factory=list)  # the last MAX_RESTORES restore durations, oldest first

    def restored(self, seconds: float) -> None:
        """Count a failure this rank restored from, which took ``seconds`` (not kept if the clock made it negative)."""
        self.failures = min(self.failures + 1, MAX_FAILURES)
        if math.isfinite(seconds) and seconds >= 0:
            self.restore_s = [*self.restore_s, float(seconds)][-MAX_RESTORES:]

    def typical_restore_s(self) -> float | None:
        """Median of the restores kept (None: none seen), for :attr:`Observed.restore_s`."""
        return statistics.median(self.restore_s) if self.restore_s else None

    def observed_s(self, now: float) -> float:
        """How long this rank has watched the job, for :attr:`Observed.observed_s`."""
        return max(0.0, now - self.first_seen)

    def to_json(self) -> dict[str, object]:
        return {"first_seen": self.first_seen, "failures": self.failures, "restore_s": list(self.restore_s)}

    @classmethod
    def from_json(cls, d: object) -> History:
        """A History read from disk; ``ValueError`` unless every field has its type and bounds.

        Keys it does not know (a newer version's) are ignored.
        """
        if not isinstance(d, dict):
            raise ValueError(f"history: an object expected, not {type(d).__name__}")
        if "first_seen" not in d:
            raise ValueError("history: first_seen missing")
        first_seen = _number(d["first_seen"], "first_seen")
        failures = d.get("failures", 0)
        if type(failures) is not int or not 0 <= failures <= MAX_FAILURES:
            raise ValueError(f"history: failures must be an integer from 0 to {MAX_FAILURES}")
        restores = d.get("restore_s", [])
        if not isinstance(restores, list) or len(restores) > MAX_RESTORES:
            raise ValueError(f"history: restore_s must be a list of at most {MAX_RESTORES} durations")
        return cls(first_seen, failures, [_number(s, "restore_s") for s in restores])


def _number(x: object, name: str) -> float:
    """``x`` as a finite, non-negative float; ``ValueError`` for anything else (bool, string, NaN...)."""
    try:
        # bool is an int, but not a duration; the cast holds as type(x) is int or float
        value = float(cast(float, x)) if type(x) in (int, float) else math.nan
    except OverflowError:  # an integer of hundreds of digits
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"history: {name} must be a finite number of seconds, not {x!r:.40}")
    return value
