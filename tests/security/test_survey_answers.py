"""A peer holding the job's secret answers a node's survey with hostile ``info`` and ``list`` answers.

A node that surveys its peers itself (no coordinators, or as their cross-check) reads each
peer's ``info`` (its rank, own steps, restore step, topology) and ``list`` (the replicas it
keeps). Over the real wire, a real peer service whose answers carry what the test says
(its info callable and its store's listing are the fault): each malformed answer makes
that peer count as unanswered, costs one log line naming the peer and the field, raises
nothing, and moves neither the step this node restores nor the retention floor.

The job has 2 nodes: rank 0 (this node) holds steps 1 and 2, rank 1 (an honest peer)
holds step 1. So both the restore choice and the floor are step 1, and a hostile answer
that counted would move them (to 2, or to none).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import pytest
import trio

from tests.helpers import free_port
from tierfs.config import Config
from tierfs.coordination.view import MAX_REPLICAS
from tierfs.peers import tls
from tierfs.peers.network import PeerNetwork
from tierfs.pipeline.survey import ClusterView
from tierfs.store.replicas import ReplicaStore
from tierfs.store.server import Timeouts, serve
from tierfs.tiers.local import LocalTier, OwnSteps
from tierfs.tiers.peer import peer_tiers

JOB = "survey"
SECRET = b"secret-of-the-survey-test"
HONEST = {"rank": 1, "topology": [], "steps": [1], "restore_step": None}


class ListedStore(ReplicaStore):
    """A real replica store whose ``list`` answer is what the test says (the hostile peer's fault)."""

    def __init__(self, root: Path, listed: list):
        super().__init__(root, None, job=JOB)
        self.listed = listed

    def manifests(self) -> list:
        return self.listed


async def peer_service(nursery: trio.Nursery, root: Path, host: str, info: dict, listed: list) -> tuple[str, int]:
    """A peer service holding the job's secret, answering ``info`` and ``list`` with what it is given."""
    root.mkdir()
    store = ListedStore(root, listed)
    store.load()
    port = await nursery.start(
        functools.partial(
            serve,
            (host, 0),
            job=JOB,
            secret=SECRET,
            store=store,
            info=lambda: info,
            tls=tls.from_secret(JOB, SECRET),
            timeouts=Timeouts(handshake=2, idle=5, request=5),
        )
    )
    return host, port


async def view_with(nursery: trio.Nursery, base: Path, info: dict, listed: list) -> tuple[ClusterView, str]:
    """Rank 0's cluster view of the honest rank 1 and a hostile peer answering ``info`` and ``listed``."""
    honest = await peer_service(nursery, base / "honest", "127.0.0.41", HONEST, [])
    hostile = await peer_service(nursery, base / "hostile", "127.0.0.42", info, listed)
    cfg = Config.build(
        mountpoint="/nonexistent",
        job=JOB,
        rank=0,
        nodes=2,
        secret=SECRET.decode(),
        listen=f"127.0.0.40:{free_port('127.0.0.40')}",
        peers=",".join(f"{h}:{p}" for h, p in (honest, hostile)),
    )
    (base / "own").mkdir()
    store = ReplicaStore(base / "own", None, job=JOB)
    store.load()
    local = LocalTier(store, OwnSteps(0, steps=lambda: [1, 2]))
    return ClusterView(2, peer_tiers(PeerNetwork(cfg, timeout=2)), local), f"{hostile[0]}:{hostile[1]}"


def refusals(caplog, peer: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if peer in r.getMessage() and "malformed" in r.getMessage()]


HOSTILE = [  # (what, its info answer, its list answer, the field the one line names)
    ("a bool step", {**HONEST, "steps": [True, 2]}, [], "steps must be a step"),
    ("a negative step", HONEST, [[1, -1], [1, 2]], "a manifest's step must be a step"),
    ("a step past 2^62", {**HONEST, "restore_step": 2**62 + 1}, [[1, 2]], "restore_step must be a step"),
    ("a negative rank", HONEST, [[-1, 2], [1, 2]], "a manifest's rank must be a non-negative integer"),
    ("a bool rank", HONEST, [[True, 2]], "a manifest's rank must be a non-negative integer"),
    ("an oversized list", HONEST, [[1, 2]] * (MAX_REPLICAS + 1), f"at most {MAX_REPLICAS} [rank, step] pairs"),
    ("steps that are no list", {**HONEST, "steps": "12"}, [], "steps must be a list"),
    ("manifests of strings", HONEST, ["12"], "a manifest's rank must be a non-negative integer"),  # ["1", "2"]
    ("manifests that are no pairs", HONEST, ["123", [1, 2]], "each manifest must be a [rank, step] pair"),
    ("a rank of the wrong type", {**HONEST, "rank": "1", "steps": ["2"]}, [], "rank must be a rank"),
    ("a rank past any job", {**HONEST, "rank": 2**40, "steps": [2]}, [], "rank must be a rank"),
    (
        "a huge topology label",
        {**HONEST, "steps": [1, 2], "topology": [["zone", "x" * 100_000]]},
        [],
        "topology label must be a [key, value] pair",
    ),
    ("free bytes of the wrong type", {**HONEST, "steps": [1, 2], "free": "lots"}, [], "free must be"),
    (
        "a huge node name",
        {**HONEST, "steps": [1, 2], "node": "n" * 100_000, "instance": "i", "started": 1.0},
        [],
        "node must be a printable name",
    ),
]


@pytest.mark.parametrize("what,info,listed,field", HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_a_hostile_answer_makes_the_peer_count_as_unanswered_and_moves_nothing(
    nursery, shm_dir, caplog, what, info, listed, field
):
    caplog.set_level(logging.INFO, "tierfs")
    view, peer = await view_with(nursery, shm_dir("tierfs-survey"), info, listed)
    survey = await view.survey(wait=1.2)  # asked three times: still one line
    assert survey.missing == [f"peer {peer}"], f"{what}: the hostile peer counts as unanswered"
    assert field in survey.errors[f"peer {peer}"]
    lines = refusals(caplog, peer)
    assert len(lines) == 1 and field in lines[0] and "\n" not in lines[0], lines
    assert survey.choose(0) == 1 and view.retention_floor() == 1


async def test_replicas_of_ranks_beyond_the_job_are_left_out_and_the_peer_still_answers(nursery, shm_dir, caplog):
    # A job that shrank leaves them in replica stores; counted, rank 7 would be a writing rank
    # that holds step 2 alone, and no step would be complete.
    caplog.set_level(logging.INFO, "tierfs")
    view, peer = await view_with(nursery, shm_dir("tierfs-survey"), HONEST, [[7, 2], [1, 1]])
    survey = await view.survey()
    assert survey.missing == [] and survey.errors == {}
    assert 7 not in survey.holders and f"peer {peer}" in survey.tiers(1, 1)
    assert survey.choose(0) == 1 and view.retention_floor() == 1
    assert refusals(caplog, peer) == []


async def test_a_peer_beyond_the_job_answers_but_its_own_steps_and_decision_do_not_count(nursery, shm_dir, caplog):
    # A spare node that only keeps replicas (or one left from before the job shrank): it may
    # hold this job's replicas, but its own steps and restore step are no rank's of the job.
    caplog.set_level(logging.INFO, "tierfs")
    view, peer = await view_with(
        nursery, shm_dir("tierfs-survey"), {**HONEST, "rank": 2, "steps": [2], "restore_step": 2}, [[1, 1]]
    )
    survey = await view.survey()
    assert survey.missing == [] and survey.errors == {}
    assert 2 not in survey.holders and f"peer {peer}" not in survey.decisions
    assert f"peer {peer}" in survey.tiers(1, 1)
    assert survey.choose(0) == 1 and view.retention_floor() == 1
    assert refusals(caplog, peer) == []


async def test_placement_never_sees_a_peer_whose_info_is_malformed(nursery, shm_dir, caplog):
    caplog.set_level(logging.INFO, "tierfs")
    view, peer = await view_with(
        nursery, shm_dir("tierfs-survey"), {**HONEST, "rank": 5, "topology": [["zone", 1]]}, []
    )
    network = view.tiers[0].network
    known = await network.discover()
    assert [p.rank for p in known] == [1] and [p.name for p in known] != [peer]
    assert next(s for s in network.status() if s["address"] == peer)["state"] == "down"
    assert len(refusals(caplog, peer)) == 1
