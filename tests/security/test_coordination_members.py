"""A member holding the job's secret answers as a coordinator: it must not roll a node back.

Against a real RAM tier (committed steps, their snapshots and manifests) and, for the
retention floor, a real daemon's coordination over the peer wire to a hostile peer service:

- an answer naming a step older than one this node holds complete is not followed on one
  coordinator's word: its newer step stays in the volume unless another coordinator (or the
  node's own survey) confirms, and the start is refused with one line otherwise;
- a floor a coordinator names never makes retention delete the newest step held complete
  here, and a floor that is no step at all is refused in one line, never a TypeError.

The first coordinator of the planner tests is a stand-in answering what the test says (a
hostile answer is the fault); everything it acts on is real.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from tests.coordination.harness import Answer, StandInCoordinators
from tests.helpers import free_port
from tierfs.config import Config
from tierfs.coordination.protocol import candidates
from tierfs.core.atomic import write_atomically
from tierfs.core.describe import build
from tierfs.core.errors import UserError
from tierfs.daemon.daemon import Daemon
from tierfs.pipeline.planning import RestorePlanner
from tierfs.pipeline.replicator import Replicator
from tierfs.pipeline.survey import Survey
from tierfs.ramtier.layout import RankDir
from tierfs.ramtier.snapshots import Snapshots
from tierfs.ramtier.space import SpaceAccount
from tierfs.ramtier.steps import Steps
from tierfs.store.replicas import ReplicaStore
from tierfs.store.server import Timeouts, serve

SECRET = b"the-jobs-secret-0123456789"


def commit(tree: Path, steps: Steps, step: int, cfg: Config, manifest: bool = True) -> None:
    """The job writes ``ckpt/<step>/w`` and commits it; the replicator's manifest follows (or not yet)."""
    root = tree / "ckpt" / str(step)
    root.mkdir(parents=True)
    (root / "w").write_bytes(f"step {step}".encode() * 100)
    steps.commit(f"ckpt/{step}", step)
    if manifest:
        m = build(
            steps.snapshots.step_tree(step),
            [f"ckpt/{step}"],
            job=cfg.job,
            rank=cfg.rank,
            step=step,
            chunk_size=cfg.chunk_size,
        )
        write_atomically(steps.snapshots.step_dir(step) / "manifest.json", m.to_json())  # as the replicator does


class RamTier:
    """Rank 0's real RAM tier under ``base``, with steps committed as a job commits them."""

    def __init__(self, base: Path, nodes: int = 2, start_fresh: bool = False):
        self.cfg = Config.build(
            mountpoint=base / "mnt", ramdisk=base / "ram", job="job", rank=0, nodes=nodes, start_fresh=start_fresh
        )
        self.rank = RankDir(self.cfg.rank_dir)
        self.rank.prepare_home()
        self.rank.prepare()
        self.snapshots = Snapshots(self.rank.path, self.rank.tree, lambda st: None)
        self.steps = Steps(self.snapshots, self.cfg.rules, set)
        self.steps.load()

    def commit(self, step: int, manifest: bool = True) -> None:
        commit(self.rank.tree, self.steps, step, self.cfg, manifest)

    def in_volume(self) -> list[str]:
        return sorted(os.listdir(self.rank.tree / "ckpt"))

    def aside(self) -> list[str]:
        top = self.rank.path / "aside"
        return sorted(name for d in (os.listdir(top) if top.exists() else ()) for name in os.listdir(top / d / "ckpt"))


def planner(ram: RamTier, coordinators: StandInCoordinators, seen: dict[tuple[int, int], str]) -> RestorePlanner:
    """The restore planner of a node with ``ram``; its own survey of the tiers it reaches shows ``seen``."""

    async def survey(wait: float = 0.0) -> Survey:
        s = Survey()
        for (rank, step), tier in seen.items():
            s.add(rank, step, tier)
        return s

    return RestorePlanner(
        ram.cfg,
        rank=ram.rank,
        steps=ram.steps,
        snapshots=ram.snapshots,
        space=None,
        tiers=[],
        local=None,
        view=SimpleNamespace(survey=survey),
        coordinating=coordinators,
        started=0.0,
    )


# Both ranks hold steps 1 and 2 complete: rank 0 here, rank 1 on its own node.
BOTH_COMPLETE = {(0, 1): "local", (0, 2): "local", (1, 1): "peer 127.0.0.3:7070", (1, 2): "peer 127.0.0.3:7070"}
# "Nodes already run from step 1": the claim that would explain the old answer.
CLAIM = {"decisions": [1]}


async def test_one_coordinator_naming_an_older_step_does_not_move_the_newer_complete_step_aside(shm_dir):
    ram = RamTier(shm_dir("tierfs-coord"))
    ram.commit(1)
    ram.commit(2)
    c = StandInCoordinators(Answer("10.9.9.9:7070", 1, CLAIM))  # and no other coordinator answers
    with pytest.raises(UserError) as e:
        await planner(ram, c, BOTH_COMPLETE).plan()
    line = str(e.value)
    assert "\n" not in line and "coordinator 10.9.9.9:7070 chose step 1" in line
    assert "older than step 2 that rank 0 holds complete here" in line and "--start-fresh" in line
    assert ram.in_volume() == ["1", "2"] and ram.aside() == []
    assert sorted(ram.steps.states) == [1, 2] and ram.steps.verifiable() == [1, 2]


async def test_with_a_larger_job_the_second_coordinator_is_asked_and_the_newer_answer_followed(shm_dir):
    ram = RamTier(shm_dir("tierfs-coord"), nodes=100)  # no survey of every peer: the coordinators alone
    ram.commit(1)
    ram.commit(2)
    c = StandInCoordinators(Answer("10.9.9.9:7070", 1, CLAIM), Answer("10.0.0.7:7070", 2))
    assert await planner(ram, c, {}).plan() is None  # step 2 is here
    assert c.asked == [(), ("10.9.9.9:7070",)]
    assert ram.in_volume() == ["1", "2"] and ram.aside() == []


async def test_a_second_coordinator_cannot_take_the_node_further_back_than_the_first(shm_dir):
    ram = RamTier(shm_dir("tierfs-coord"), nodes=100)
    ram.commit(1)
    ram.commit(2)
    ram.commit(3)
    c = StandInCoordinators(Answer("10.0.0.7:7070", 2), Answer("10.9.9.9:7070", 1, CLAIM))
    assert await planner(ram, c, {}).plan() is None
    assert ram.in_volume() == ["1", "2"] and ram.aside() == ["3"]  # the newer of the two answers


async def test_an_older_answer_the_nodes_own_survey_confirms_is_followed_and_the_newer_step_kept_aside(shm_dir):
    # This rank committed step 2, rank 1 did not: the job runs from 1 (no second question needed).
    ram = RamTier(shm_dir("tierfs-coord"))
    ram.commit(1)
    ram.commit(2)
    c = StandInCoordinators(Answer("10.0.0.7:7070", 1))
    assert await planner(ram, c, {(0, 1): "local", (0, 2): "local", (1, 1): "peer 127.0.0.3:7070"}).plan() is None
    assert c.asked == [()]
    assert ram.in_volume() == ["1"] and ram.aside() == ["2"]
    assert sorted(ram.steps.states) == [1, 2], "the snapshot of step 2 stays too"


# -- the retention floor, from a hostile coordinator over the peer wire ---------------------


async def hostile_service(
    nursery: trio.Nursery, root: Path, address: tuple[str, int], job: str, summary: dict
) -> list[str]:
    """A peer service holding the job's secret whose coordination answers carry ``summary``; returns who it answered."""
    answered = []

    async def answer(source, message):
        if message.get("op") == "coord_report":
            answered.append(source)
            return {"ok": True, "summary": summary, "down": []}
        return {"error": "no"}

    root.mkdir(parents=True)
    store = ReplicaStore(root, SpaceAccount(None, root), None, job=job)
    store.load()
    await nursery.start(
        functools.partial(
            serve,
            address,
            job=job,
            secret=SECRET,
            store=store,
            tls=None,
            info=lambda: {"rank": 1},
            timeouts=Timeouts(handshake=2.0, idle=10.0, request=5.0),
            messages=answer,
        )
    )
    return answered


async def daemon_told(base: Path, nursery: trio.Nursery, summary: dict) -> Daemon:
    """Rank 0's daemon (its RAM tier and coordination, no mount) after reporting to a coordinator answering ``summary``.

    Steps 1 and 2 are committed with their manifests; step 3 is being written (no manifest yet).
    """
    host, port = "127.0.0.3", free_port("127.0.0.3")
    listen = ("127.0.0.2", free_port("127.0.0.2"))
    members = [f"{host}:{port}", f"{listen[0]}:{listen[1]}"]
    job = next(j for j in (f"job-{i}" for i in range(1000)) if candidates(j, members)[0] == members[0])
    answered = await hostile_service(nursery, base / "hostile", (host, port), job, summary)
    cfg = Config.build(
        mountpoint=base / "mnt",
        ramdisk=base / "ram",
        job=job,
        rank=0,
        nodes=2,
        keep_local=1,
        listen=f"{listen[0]}:{listen[1]}",
        peers=f"{host}:{port}",
        secret=SECRET,
        peer_tls="off",
    )
    d = Daemon(cfg)
    d.rank.prepare_home()
    d.rank.prepare()
    d.steps.load()
    d.replicator = Replicator(cfg, d.steps, d.tiers, lambda: 0.0, d.retention_floor)
    for step in (1, 2, 3):
        commit(d.rank.tree, d.steps, step, cfg, manifest=step < 3)
    await d.coordinating.join(nursery)
    member = d.coordinating.coordination.member
    for _ in range(5):  # a report that never reached it (a loaded machine): ask the hostile one again
        await member.report()
        if answered:
            break
        member._suspect.pop(members[0], None)
    return d


async def test_a_hostile_floor_never_makes_retention_delete_the_newest_step_held_complete_here(shm_dir, nursery):
    d = await daemon_told(
        shm_dir("tierfs-floor"),
        nursery,
        {"newest": 10**15, "floor": 10**15, "decisions": [], "complete": [10**15], "ranks": 2},
    )
    assert d.coordinating.summary()["floor"] == 10**15  # a well-formed floor, only not true
    assert d.retention_floor() == 2
    d.replicator.retain_local()
    assert sorted(d.steps.states) == [2, 3], "step 2, the newest with its manifest, is kept"
    await d.coordinating.transport.aclose()


async def test_a_floor_that_is_no_step_is_refused_in_one_line_and_retention_goes_on(shm_dir, nursery, caplog):
    caplog.set_level(logging.INFO, "tierfs")
    d = await daemon_told(
        shm_dir("tierfs-floor"), nursery, {"newest": 2, "floor": "2", "decisions": [], "complete": [2], "ranks": 2}
    )
    d.replicator.retain_local()  # no TypeError
    assert sorted(d.steps.states) == [1, 2, 3]
    summary = d.coordinating.summary()
    assert summary is None or summary["floor"] is None or isinstance(summary["floor"], int)
    refused = [r.getMessage() for r in caplog.records if "malformed coord_report answer" in r.getMessage()]
    assert len(refused) == 1 and "summary floor must be a step" in refused[0] and "\n" not in refused[0]
    await d.coordinating.transport.aclose()
