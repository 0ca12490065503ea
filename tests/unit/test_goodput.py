"""Checkpoint goodput from one rank's observations: hand-computed cases, and the optimum
checked against the model the module states."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs.core.goodput import MAX_RESTORES, WINDOW, Goodput, History, Observed, estimate

T0 = 1_763_900_000.0
HOURS_6 = 6 * 3600.0


def observed(
    every: float = 600.0,
    write: float = 30.0,
    n: int = 10,
    *,
    safe_at: dict | None = None,
    copy_s: dict | None = None,
    restore_s: float | None = 60.0,
    failures: int = 0,
    observed_s: float = 4 * HOURS_6,
    mtbf_s: float | None = HOURS_6,
) -> Observed:
    """A job that commits every ``every`` seconds from T0, each save blocking it ``write`` seconds."""
    commits = [(T0 + k * every, write) for k in range(n)]
    last = commits[-1][0] if commits else T0
    return Observed(
        commits,
        {"peers": last, "gcs": last - every} if safe_at is None else safe_at,
        {"peers": 2.0, "gcs": 120.0} if copy_s is None else copy_s,
        restore_s,
        failures,
        observed_s,
        mtbf_s,
    )


def test_commits_every_ten_minutes_with_a_six_hour_mtbf():
    g = estimate(observed(), now=T0 + 9 * 600 + 10)
    assert g.interval_s == 600 and g.cost_s == 30
    assert g.overhead_ratio == pytest.approx(0.05)  # 30 / 600
    assert g.mtbf_s == HOURS_6
    # Restoring from peers: half an interval, the peers' 2 s lag, a 60 s restore.
    assert g.expected_loss_s == pytest.approx(362)  # 300 + 2 + 60
    # 1 - 30/600 - 362/21600 = 1 - 0.05 - 0.0167593 = 0.9332407
    assert g.goodput_ratio == pytest.approx(0.9332407, abs=1e-7)
    # sqrt(2 * 30 * 21600) = sqrt(1,296,000) = 1138.42 s between commits: Daly's
    # sqrt(2*delta*M) - delta = 1108.42 s of training, then the 30 s save.
    assert g.optimal_interval_s == pytest.approx(1138.4200, abs=1e-4)
    assert g.optimal_interval_s - g.cost_s == pytest.approx(1108.4200, abs=1e-4)
    # At the optimum 30/1138.42 = 1138.42/(2*21600) = sqrt(30/43200) = 0.0263523 each, so
    # 1 - 2 * 0.0263523 - 62/21600 = 1 - 0.0527046 - 0.0028704 = 0.944425
    assert g.optimal_goodput_ratio == pytest.approx(0.944425, abs=1e-6)
    assert g.at_risk_s == {"peers": 10, "gcs": 610}


def test_restoring_from_gcs_counts_its_lag_and_not_the_peers():
    g = estimate(observed(), now=T0 + 9 * 600 + 10, restore_tier="gcs")
    assert g.expected_loss_s == pytest.approx(480)  # 300 + 120 + 60
    # 1 - 0.05 - 480/21600 = 1 - 0.05 - 0.0222222 = 0.9277778
    assert g.goodput_ratio == pytest.approx(0.9277778, abs=1e-7)
    assert g.optimal_interval_s == pytest.approx(1138.42, abs=1e-2)  # lag and restore do not move it
    # 1 - 0.0527046 - 180/21600 = 1 - 0.0527046 - 0.0083333 = 0.9389621
    assert g.optimal_goodput_ratio == pytest.approx(0.9389621, abs=1e-6)


@pytest.mark.parametrize(
    "tiers, used",
    [
        ({"disk": T0, "gcs": T0}, "disk"),  # no peers: the node's disk, then GCS
        ({"gcs": T0}, "gcs"),
        ({"gcs": T0, "disk": T0, "peers": T0}, "peers"),
    ],
)
def test_without_the_tier_asked_for_the_first_of_peers_disk_gcs_counts(tiers, used):
    lags = {"peers": 2.0, "disk": 5.0, "gcs": 120.0}
    g = estimate(observed(safe_at=tiers, copy_s=lags), now=T0)
    assert g.expected_loss_s == pytest.approx(300 + lags[used] + 60)


def test_a_job_without_remote_tiers_has_no_expected_loss_but_still_an_optimum():
    g = estimate(observed(safe_at={}, copy_s={}), now=T0)
    assert g.at_risk_s == {}
    assert g.expected_loss_s is None and g.goodput_ratio is None and g.optimal_goodput_ratio is None
    assert g.optimal_interval_s == pytest.approx(1138.42, abs=1e-2)


def test_a_tier_that_never_held_a_step_has_no_lag_yet():
    g = estimate(observed(safe_at={"peers": None, "gcs": T0}, copy_s={"gcs": 120.0}), now=T0 + 50)
    assert g.at_risk_s == {"peers": 4 * HOURS_6, "gcs": 50}  # nothing safe there: everything observed
    assert g.expected_loss_s is None and g.goodput_ratio is None  # the peers' lag is not known


def test_at_risk_is_never_negative_when_the_clock_steps_back():
    g = estimate(observed(safe_at={"peers": T0 + 100}), now=T0 + 40)
    assert g.at_risk_s == {"peers": 0}


def test_no_restore_seen_counts_none_in_the_loss():
    g = estimate(observed(restore_s=None), now=T0)
    assert g.expected_loss_s == pytest.approx(302)  # 300 + 2
    assert g.goodput_ratio == pytest.approx(1 - 0.05 - 302 / 21600)


@pytest.mark.parametrize("n", [0, 1])
def test_fewer_than_two_commits_have_no_interval(n):
    g = estimate(observed(n=n), now=T0)
    assert g.interval_s is None and g.overhead_ratio is None and g.expected_loss_s is None
    assert g.goodput_ratio is None
    assert g.cost_s == (30 if n else None)
    if n:  # the cost and the MTBF are enough for the optimum
        assert g.optimal_interval_s == pytest.approx(1138.42, abs=1e-2)
        assert g.optimal_goodput_ratio == pytest.approx(0.944425, abs=1e-6)


def test_two_commits_are_one_interval():
    assert estimate(observed(every=450, n=2), now=T0).interval_s == 450


def test_no_failure_and_no_mtbf_given_leave_goodput_unknown():
    g = estimate(observed(mtbf_s=None, failures=0), now=T0)
    assert g.mtbf_s is None
    assert g.expected_loss_s == pytest.approx(362)  # does not need the MTBF
    assert g.interval_s == 600 and g.overhead_ratio == pytest.approx(0.05)
    assert g.optimal_interval_s is None and g.goodput_ratio is None and g.optimal_goodput_ratio is None


def test_the_observed_mtbf_is_the_time_observed_per_failure_unless_the_operator_gives_one():
    assert estimate(observed(mtbf_s=None, failures=3, observed_s=64800), now=T0).mtbf_s == 21600
    assert estimate(observed(mtbf_s=3600, failures=3, observed_s=64800), now=T0).mtbf_s == 3600
    assert estimate(observed(mtbf_s=None, failures=2, observed_s=0), now=T0).mtbf_s is None


def test_unknown_write_windows_leave_the_cost_unknown():
    g = estimate(observed(write=0.0), now=T0)
    assert g.cost_s is None and g.overhead_ratio is None
    assert g.optimal_interval_s is None and g.goodput_ratio is None
    assert g.expected_loss_s == pytest.approx(362)


def test_a_save_longer_than_twice_the_mtbf_gets_an_interval_of_mtbf_plus_the_save():
    # delta = 7200 >= 2M = 7200: sqrt(2*7200*3600) = 7200 would be saving back to back;
    # Daly's tau = M = 3600 s of training, then the 7200 s save.
    g = estimate(observed(every=9000, write=7200, mtbf_s=3600), now=T0)
    assert g.optimal_interval_s == 3600 + 7200
    assert g.goodput_ratio == 0 and g.optimal_goodput_ratio == 0  # 1 - 0.8 - (4500+62)/3600 < 0
    just_below = estimate(observed(every=9000, write=7000, mtbf_s=3600), now=T0)
    assert just_below.optimal_interval_s == pytest.approx(math.sqrt(2 * 7000 * 3600))  # 7099.3


def test_clock_steps_and_zero_intervals_are_ignored():
    times = [1000, 1600, 1500, 2100, 2100, 2700, 3300]  # stepped back 100 s, then two commits at once
    commits = [(T0 + t, 30.0) for t in times]
    # gaps 600, -100, 600, 0, 600, 600: the positive ones are all 600
    assert estimate(Observed(commits, {}, {}, None, 0, 3600), now=T0).interval_s == 600


def test_the_median_ignores_a_restart_gap_and_a_slow_first_save():
    times = [0, 600, 1200, 6200, 6800, 7400]  # a failure between 1200 and 6200
    writes = [400, 30, 30, 30, 31, 29]  # the first save of the process was slow
    g = estimate(Observed([(T0 + t, w) for t, w in zip(times, writes, strict=True)], {}, {}, None, 0, 3600), now=T0)
    assert g.interval_s == 600  # median of 600, 600, 5000, 600, 600
    assert g.cost_s == 30  # median of 400, 30, 30, 30, 31, 29


def test_only_the_last_window_of_commits_counts():
    old = [(T0 + 100 * k, 5.0) for k in range(30)]  # every 100 s, 5 s saves
    new = [(old[-1][0] + 600 * (k + 1), 30.0) for k in range(WINDOW)]  # the job now saves every 600 s
    g = estimate(Observed(old + new, {}, {}, None, 0, 3600), now=T0)
    assert (g.interval_s, g.cost_s) == (600, 30)


def test_as_dict_is_rounded_json():
    d = estimate(observed(), now=T0 + 9 * 600 + 10.123456).as_dict()
    assert json.loads(json.dumps(d, allow_nan=False)) == d
    assert d == {
        "interval_s": 600.0,
        "cost_s": 30.0,
        "mtbf_s": 21600.0,
        "expected_loss_s": 362.0,
        "optimal_interval_s": 1138.42,
        "overhead_ratio": 0.05,
        "goodput_ratio": 0.9332,
        "optimal_goodput_ratio": 0.9444,
        "at_risk_s": {"gcs": 610.12, "peers": 10.12},
    }
    empty = Goodput(None, None, None, {}, None, None, None, None, None).as_dict()
    assert set(empty) == set(d) and empty["at_risk_s"] == {}
    assert all(v is None for k, v in empty.items() if k != "at_risk_s")


def test_non_finite_observations_are_skipped():
    commits = [(T0, 30.0), (math.nan, 30.0), (T0 + 600, math.inf), (T0 + 1200, 30.0)]
    g = estimate(Observed(commits, {"peers": math.nan}, {"peers": 2.0}, math.inf, 0, 3600, math.nan), now=T0 + 1200)
    assert g.interval_s == 600 and g.cost_s == 30 and g.mtbf_s is None
    assert g.at_risk_s == {"peers": 3600}  # a NaN time is no step
    assert g.expected_loss_s == pytest.approx(302)  # an infinite restore is no restore seen
    json.dumps(g.as_dict(), allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(cost=st.floats(0.1, 3600), mtbf=st.floats(60, 30 * 86400), lag=st.floats(0, 3600), restore=st.floats(0, 3600))
def test_the_optimal_interval_maximises_goodput_over_a_grid(cost, mtbf, lag, restore):
    def at(every: float) -> Goodput:
        return estimate(
            observed(every=every, write=cost, copy_s={"peers": lag}, restore_s=restore, mtbf_s=mtbf), now=T0
        )

    best = at(600).optimal_interval_s
    g = at(best)
    assert g.goodput_ratio == pytest.approx(g.optimal_goodput_ratio, abs=1e-9)
    if cost < 2 * mtbf:  # Young's sqrt(2*delta*M) between commits; Daly's form is that minus delta
        assert best == pytest.approx(math.sqrt(2 * cost * mtbf))
    # From just above one save back to back up to 100 times the optimum: nothing beats it.
    low, high = cost * 1.001, 100 * max(best, cost)
    grid = [low * (high / low) ** (i / 200) for i in range(201)]
    for every in grid:
        other = at(every)
        assert other.optimal_interval_s == pytest.approx(best)  # the optimum does not depend on where the job is
        assert other.goodput_ratio <= g.optimal_goodput_ratio + 1e-9


def test_history_round_trips_and_keeps_the_last_restores():
    h = History(first_seen=T0)
    for s in range(20):
        h.restored(float(s))
    h.restored(-3.0)  # the clock stepped during the restore: a failure, but no duration
    assert h.failures == 21
    assert h.restore_s == [float(s) for s in range(20 - MAX_RESTORES, 20)]
    assert h.typical_restore_s() == pytest.approx(11.5)  # median of 4..19
    assert h.observed_s(T0 + 100) == 100 and h.observed_s(T0 - 5) == 0
    again = History.from_json(json.loads(json.dumps(h.to_json())))  # what a restart reads
    assert again == h
    assert History.from_json({"first_seen": 1700000000}) == History(1700000000.0)
    assert History.from_json({"first_seen": T0, "later": "field"}) == History(T0)
    assert History(T0).typical_restore_s() is None


@pytest.mark.parametrize(
    "d",
    [
        [],
        None,
        "history",
        7,
        {},  # no first_seen
        {"first_seen": "yesterday"},
        {"first_seen": True},
        {"first_seen": math.nan},  # json.loads reads NaN
        {"first_seen": math.inf},
        {"first_seen": -1.0},
        {"first_seen": 10**400},
        {"first_seen": None},
        {"first_seen": T0, "failures": -1},
        {"first_seen": T0, "failures": 1.0},
        {"first_seen": T0, "failures": True},
        {"first_seen": T0, "failures": "3"},
        {"first_seen": T0, "failures": 2**40},
        {"first_seen": T0, "restore_s": [1.0] * (MAX_RESTORES + 1)},
        {"first_seen": T0, "restore_s": [0.0] * 1_000_000},
        {"first_seen": T0, "restore_s": {"a": 1}},
        {"first_seen": T0, "restore_s": "12"},
        {"first_seen": T0, "restore_s": [[1.0]]},
        {"first_seen": T0, "restore_s": [None]},
        {"first_seen": T0, "restore_s": [-1.0]},
        {"first_seen": T0, "restore_s": [False]},
    ],
)
def test_hostile_history_is_refused(d):
    with pytest.raises(ValueError):
        History.from_json(d)
