"""Milestones on --disk: kept beyond --keep with their chunks until --keep-for; peers' replicas in RAM keep none."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from tests import helpers
from tierfs.config import Config
from tierfs.core.chunks import chunk_hash
from tierfs.core.milestones import Milestones
from tierfs.pipeline.policy import DiskPolicy
from tierfs.ramtier.space import SpaceAccount
from tierfs.store.replicas import GRACE, ReplicaStore
from tierfs.tiers.base import put_step
from tierfs.tiers.disk import DiskTier
from tierfs.tiers.local import LocalTier

JOB = "miles"
CS = 64 << 10
STEPS = range(100, 1000, 100)
SHARED = random.Random(0).randbytes(CS)  # in every step: one file on the disk for all of them


def own(step: int) -> bytes:
    return random.Random(step).randbytes(CS)


async def commit_steps(tier, tmp_path: Path, rank: int = 0) -> None:
    """Steps 100..900 of ``rank``, each a chunk of its own and the shared one, put as the replicator puts them."""
    for step in STEPS:
        manifest, where = helpers.make_step(
            tmp_path, {"shared": SHARED, "own": own(step)}, job=JOB, rank=rank, step=step, chunk_size=CS
        )
        await put_step(tier, manifest, where)


def chunk_files(store: ReplicaStore) -> set[str]:
    """The chunk files left once the store's grace for unreferenced chunks has passed."""
    store.collect_garbage(now=time.time() + GRACE + 1)
    return {p.name for p in (store.root / "chunks").glob("*/*")}


def chunks_of(steps) -> set[str]:
    return {chunk_hash(SHARED)} | {chunk_hash(own(step)) for step in steps}


async def test_disk_keeps_milestones_besides_the_newest_with_their_chunks(tmp_path):
    cfg = Config.build(mountpoint="/nonexistent", job=JOB, rank=0, disk=tmp_path / "disk", keep=3, keep_every=300)
    tier = DiskTier.open_for(cfg, keep_from=lambda: 900)
    await commit_steps(tier, tmp_path)
    await DiskPolicy(cfg).retain(tier)

    assert tier.store.manifests() == [(0, 300), (0, 600), (0, 700), (0, 800), (0, 900)]
    assert chunk_files(tier.store) == chunks_of([300, 600, 700, 800, 900])


async def test_a_milestone_on_disk_goes_once_keep_for_has_passed_since_it_was_written(tmp_path):
    tier = DiskTier(
        tmp_path / "disk", JOB, 0, keep_from=lambda: 900, keep_newest=3, milestones=Milestones(300, keep_for=3600)
    )
    tier.open()
    await commit_steps(tier, tmp_path)
    old = time.time() - 7200
    os.utime(tier.store.root / "manifests" / "rank-0" / "step-000000000300.json", (old, old))
    await tier.retain(3, Milestones(300, keep_for=3600))
    assert tier.store.manifests() == [(0, 600), (0, 700), (0, 800), (0, 900)]

    tier.store.retain(now=time.time() + 7200)  # and two hours on, 600 too
    assert tier.store.manifests() == [(0, 700), (0, 800), (0, 900)]
    assert chunk_files(tier.store) == chunks_of([700, 800, 900])


async def test_peers_replicas_in_ram_keep_no_milestones(tmp_path):
    """RAM is the scarce tier: a replica store without milestones, as the daemon makes for peers."""
    root = tmp_path / "replicas"
    store = ReplicaStore(root, SpaceAccount(None, tmp_path), job=JOB, keep_from=lambda: 900, keep_newest=2)
    store.load()
    await commit_steps(LocalTier(store), tmp_path, rank=1)
    assert store.manifests() == [(1, 800), (1, 900)]


async def test_the_nodes_disk_keeps_no_more_milestones_than_keep(tmp_path):
    """--disk is every job's on the node: the plugin's max-keep bounds its milestones as its steps."""
    cfg = Config.build(mountpoint="/nonexistent", job=JOB, rank=0, disk=tmp_path / "disk", keep=2, keep_every=100)
    tier = DiskTier.open_for(cfg, keep_from=lambda: 900)
    await commit_steps(tier, tmp_path)
    await DiskPolicy(cfg).retain(tier)
    assert tier.store.manifests() == [(0, 800), (0, 900)]
    assert chunk_files(tier.store) == chunks_of([800, 900])
