"""A rollback's decision rules that need no daemon: the refusal's one line, and the node's record."""

from __future__ import annotations

import json
import os

import pytest

from tierfs.config import Config
from tierfs.core.errors import UserError
from tierfs.pipeline.rollback import RECORD, Rollback, made_here
from tierfs.pipeline.survey import Survey


def rollback_to(step: int) -> Rollback:
    cfg = Config.build(mountpoint="/nonexistent", job="run", nodes=12, rank=0, restore_step=step)
    return Rollback(cfg, rank=None, steps=None, tiers=[], local=None)


def survey_of(held: dict[int, list[int]], missing: list[str] = ()) -> Survey:
    survey = Survey(missing=list(missing))
    for rank, steps in held.items():
        for step in steps:
            survey.add(rank, step, "gcs")
    return survey


def test_a_step_every_writing_rank_holds_passes():
    rollback_to(300).check(survey_of({0: [300, 900], 1: [300, 900], 2: [300]}))


def test_the_refusal_names_the_ranks_that_lack_the_step_and_who_did_not_answer():
    with pytest.raises(UserError) as e:
        rollback_to(500).check(
            survey_of({r: [300, 500] if r == 0 else [300] for r in range(12)}, ["peer 10.0.0.9:7420"])
        )
    assert str(e.value) == (
        "cannot roll job run back to step 500: rank(s) 1, 2, 3, 4, 5, 6, 7, 8 and 3 more hold no "
        "copy of it on any tier reached (not answering: peer 10.0.0.9:7420); pick a step "
        "'tierfs steps' shows complete for every rank"
    )


def test_a_job_with_no_step_anywhere_is_refused():
    with pytest.raises(UserError, match="cannot roll job run back to step 1: no tier holds any step of it"):
        rollback_to(1).check(survey_of({}))


class Rank:
    def __init__(self, path):
        self.path = path


@pytest.mark.parametrize("text", ["", "[]", '{"step": "300", "at": 1.0}', '{"step": 300}', "not json"])
def test_a_record_the_daemon_did_not_write_is_no_rollback(tmp_path, text):
    os.chmod(tmp_path, 0o700)
    (tmp_path / RECORD).write_text(text)
    os.chmod(tmp_path / RECORD, 0o600)
    assert made_here(Rank(tmp_path)) is None


def test_the_record_says_the_step_and_when(tmp_path):
    os.chmod(tmp_path, 0o700)
    assert made_here(Rank(tmp_path)) is None
    (tmp_path / RECORD).write_text(json.dumps({"step": 300, "at": 1700000000.5}))
    os.chmod(tmp_path / RECORD, 0o600)
    assert made_here(Rank(tmp_path)) == (300, 1700000000.5)
