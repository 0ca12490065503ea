"""Milestones' rules: which steps outlive --keep in GCS and on --disk, and for how long."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tierfs.config import Config
from tierfs.core.milestones import NO_MILESTONES, Milestones

NOW = 1_800_000_000.0
DAY = 86400.0


def test_every_step_divisible_by_every_is_a_milestone_for_good():
    m = Milestones(300)
    kept = [step for step in range(100, 1000, 100) if m.is_milestone(step, NOW - 1000 * DAY, NOW)]
    assert kept == [300, 600, 900]
    assert m.is_milestone(0, NOW, NOW)  # divisible, like any other


def test_none_without_every():
    assert not NO_MILESTONES and Milestones(1)
    assert not any(NO_MILESTONES.is_milestone(step, NOW, NOW) for step in (0, 1, 300))
    assert not Milestones(0, DAY).is_milestone(300, NOW, NOW)  # keep_for alone names no step


def test_a_milestone_expires_keep_for_after_its_commit():
    m = Milestones(300, 30 * DAY)
    assert m.is_milestone(300, NOW - 30 * DAY + 1, NOW)
    assert not m.is_milestone(300, NOW - 30 * DAY, NOW)
    assert not m.is_milestone(301, NOW, NOW)  # recent, but no milestone


def test_an_unknown_or_future_commit_time_keeps_the_milestone():
    """An age nobody can tell, or another host's clock ahead of ours, never loses a milestone."""
    m = Milestones(300, 1.0)
    assert m.is_milestone(600, None, NOW)
    assert m.is_milestone(600, NOW + DAY, NOW)
    assert not m.is_milestone(601, None, NOW)


@pytest.mark.parametrize(("every", "keep_for"), [(-1, 0.0), (3, -1.0)])
def test_negative_values_are_refused(every, keep_for):
    with pytest.raises(ValueError):
        Milestones(every, keep_for)


def test_from_config_reads_keep_every_and_keep_for():
    cfg = Config.build(mountpoint="/nonexistent", job="j", keep_every="1000", keep_for="30d")
    assert Milestones.from_config(cfg) == Milestones(1000, 30 * DAY)
    assert Milestones.from_config(Config.build(mountpoint="/nonexistent", job="j")) == NO_MILESTONES
    assert Milestones.from_config(SimpleNamespace(keep_every=5, keep_for=0.0)) == Milestones(5)
