"""A start holds the coordinators' answer against what it sees itself.

The coordinators here are stand-ins that answer what each test tells them to: a stale or
wrong answer is a fault the real coordinators no longer produce, which is the point of
checking it at the node as well.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.coordination.harness import Answer, StandInCoordinators
from tierfs.core.errors import UserError
from tierfs.pipeline.planning import RestorePlanner
from tierfs.pipeline.survey import Survey


def survey_of(holdings: dict[tuple[int, int], str], decisions: dict[str, int] | None = None) -> Survey:
    s = Survey()
    for (rank, step), tier in holdings.items():
        s.add(rank, step, tier)
    s.decisions.update(decisions or {})
    return s


def planner(
    coordinators: StandInCoordinators, seen: Survey, start_fresh: bool = False, nodes: int = 2, steps=None
) -> RestorePlanner:
    """``steps``: this node's own committed steps (:class:`tierfs.ramtier.steps.Steps`), none by default."""

    async def survey(wait: float = 0.0) -> Survey:
        return seen

    return RestorePlanner(
        SimpleNamespace(rank=0, nodes=nodes, job="job", start_fresh=start_fresh),
        rank=None,
        steps=steps if steps is not None else SimpleNamespace(verifiable=list),
        snapshots=None,
        space=None,
        tiers=[],
        local=None,
        view=SimpleNamespace(survey=survey),
        coordinating=coordinators,
        started=0.0,
    )


# Step 3 of both ranks is on node 1: its own and rank 0's replica.
ON_PEER = {(0, 3): "peer 127.0.0.3:7070", (1, 3): "peer 127.0.0.3:7070", (0, 2): "gcs", (1, 2): "gcs"}


async def test_an_answer_that_agrees_is_followed_without_a_second_question():
    c = StandInCoordinators(Answer("a", 3), given=True)
    assert (await planner(c, survey_of(ON_PEER)).cross_check(Survey(), 3))[1] == 3
    assert c.asked == []


async def test_a_stale_answer_is_checked_with_a_second_coordinator_and_its_newer_answer_followed(caplog):
    c = StandInCoordinators(Answer("a", None), Answer("b", 3), given=True)
    _, step = await planner(c, survey_of(ON_PEER)).cross_check(Survey(), None)
    assert step == 3 and c.asked == [("a",)]
    assert "coordinators disagree: a chose step None, b chose step 3" in caplog.text


async def test_a_start_behind_a_complete_step_is_refused_with_one_line_naming_step_and_tier():
    c = StandInCoordinators(Answer("a", None), Answer("b", 2), given=True)
    with pytest.raises(UserError) as e:
        await planner(c, survey_of(ON_PEER)).cross_check(Survey(), None)
    message = str(e.value)
    assert "\n" not in message
    assert "step 3 is complete for every rank of job job" in message and "peer 127.0.0.3:7070" in message
    assert "not starting empty" in message and "--start-fresh" in message


async def test_start_fresh_follows_the_answer_anyway(caplog):
    c = StandInCoordinators(Answer("a", 2), Answer("b", 2), given=True)
    assert (await planner(c, survey_of(ON_PEER), start_fresh=True).cross_check(Survey(), 2))[1] == 2
    assert "as --start-fresh asks" in caplog.text


async def test_a_step_nodes_already_run_from_explains_an_older_answer():
    # The coordinator knows nodes that restored step 2 and run from it: rank 0 adopts it.
    c = StandInCoordinators(Answer("a", 2, {"decisions": [2]}), given=True)
    assert (await planner(c, survey_of(ON_PEER)).cross_check(Survey(), 2))[1] == 2
    assert c.asked == []


async def test_a_step_only_some_ranks_hold_is_no_contradiction():
    c = StandInCoordinators(Answer("a", 2), given=True)
    seen = survey_of({(0, 3): "peer 127.0.0.3:7070", (0, 2): "gcs", (1, 2): "gcs"})
    assert (await planner(c, seen).cross_check(Survey(), 2))[1] == 2
    assert c.asked == []
