"""A step's saved state: a refusal covers the version it was made for, and survives a restart."""

from __future__ import annotations

import json
from dataclasses import asdict

from tierfs.ramtier.steps import StepState


def test_a_refusal_is_saved_and_read_back_for_its_version_only():
    state = StepState(7, ["ckpt/7"], 1700000000.0, version=2)
    assert state.refusal() is None
    state.refused = {"version": 2, "error": "too large", "at": 1700000001.0}
    again = StepState.from_dict(json.loads(json.dumps(asdict(state))))  # what a restart reads
    assert again.refusal() == "too large"
    again.version += 1  # a new commit into the step: tried afresh
    assert again.refusal() is None


def test_state_saved_before_refusals_existed_reads_as_not_refused():
    saved = {"step": 3, "roots": ["ckpt/3"], "committed_at": 1.0, "version": 1, "source": "local", "copies": {}}
    assert StepState.from_dict(saved).refusal() is None
