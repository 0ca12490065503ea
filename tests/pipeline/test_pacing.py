"""The hashing of a committed step gives way to the job's writes, and stops waiting when cancelled.

A real RAM tier with a committed step and the replicator that hashes it; what stands in is
only the job's writing, which the replicator learns of from the mount (``last_write``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import trio

from tierfs.config import Config
from tierfs.core.describe import HASH_THREADS
from tierfs.pipeline.pacing import MAX_DEFER, Pacing
from tierfs.pipeline.replicator import Replicator
from tierfs.ramtier.layout import RankDir
from tierfs.ramtier.snapshots import Snapshots
from tierfs.ramtier.steps import Steps

CS = 64 << 10  # the smallest chunk size: many chunks for few bytes
FILES = 4


class Job:
    """Rank 0 with step 5 committed (``chunks`` chunks in four files), writing until told not to."""

    def __init__(self, base: Path, chunks: int):
        cfg = Config.build(mountpoint=base / "mnt", ramdisk=base / "ram", job="job", rank=0, nodes=1, chunk_size=CS)
        rank = RankDir(cfg.rank_dir)
        rank.prepare_home()
        rank.prepare()
        self.steps = Steps(Snapshots(rank.path, rank.tree, lambda st: None), cfg.rules, set)
        self.steps.load()
        root = rank.tree / "ckpt" / "5"
        root.mkdir(parents=True)
        for i in range(FILES):
            (root / f"shard-{i}").write_bytes(os.urandom(chunks // FILES * CS))
        self.steps.commit("ckpt/5", 5)
        self.writing, self.looks = True, 0
        self.replicator = Replicator(cfg, self.steps, [], last_write=self.last_write)

    def last_write(self) -> float:
        self.looks += 1
        return time.monotonic() if self.writing else 0.0

    async def waiting(self) -> None:
        """Until the hashing threads have looked at the job's writes many times: they wait for them."""
        while self.looks < 20:
            await trio.sleep(0.01)


async def test_a_step_is_hashed_once_the_job_pauses_its_writes(tmp_path):
    job = Job(tmp_path, chunks=8)  # while the job writes: 8 chunks at most one per MAX_DEFER and thread
    built = []

    async def build() -> None:
        built.append(await job.replicator.manifest_for(job.steps.states[5]))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(build)
        await job.waiting()
        assert not built, "the step was hashed while the job wrote"
        job.writing = False
    manifest, _ = built[0]
    assert manifest.step == 5 and sum(len(e.chunks) for e in manifest.entries if e.chunks) == 8


async def test_a_cancelled_hashing_stops_waiting_for_the_jobs_writes(tmp_path):
    chunks = 64
    job = Job(tmp_path, chunks)  # the job never stops writing
    async with trio.open_nursery() as nursery:
        nursery.start_soon(job.replicator.manifest_for, job.steps.states[5])
        await job.waiting()
        cancelled = time.monotonic()
        nursery.cancel_scope.cancel()
    waited = time.monotonic() - cancelled
    # Giving way to the writes to the end would take at least one MAX_DEFER per chunk and thread.
    assert waited < chunks / HASH_THREADS * MAX_DEFER / 4, f"the cancelled hashing went on for {waited:.1f} s"


async def test_what_the_thread_raises_is_raised_as_itself():
    """Callers tell a step no manifest can describe by the error's own type, never by a group."""

    def refuse(pace):
        pace()
        raise ValueError("no manifest can describe it")

    with pytest.raises(ValueError, match="no manifest"):
        await Pacing(lambda: 0.0).in_thread(refuse, trio.CapacityLimiter(1))
