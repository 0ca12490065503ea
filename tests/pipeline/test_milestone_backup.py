"""Milestones (``--keep-every``) reach the tiers that keep them, though newer commits overtake them.

A lane puts only the newest committed step, at its schedule's pace (GCS: ``--backup-interval``).
A milestone committed meanwhile is put first, without waiting, and RAM keeps it until then.
Real parts: this rank's RAM tier with real commits, the replicator, a real ``--disk`` tier
on a directory and the GCS emulator. No sleeps: the tests wait for states, with a deadline.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import trio
import trio.testing

from tierfs.config import Config
from tierfs.pipeline.replicator import Replicator
from tierfs.ramtier.layout import RankDir
from tierfs.ramtier.snapshots import Snapshots
from tierfs.ramtier.steps import Steps
from tierfs.tiers.base import Tier
from tierfs.tiers.disk import DiskTier

JOB = "miles"
CS = 64 << 10
HOUR = 3600.0
DEADLINE = 30.0


class Rank:
    """Rank 0's RAM tier and its replicator, putting steps on ``tiers`` (made from the config)."""

    def __init__(self, base: Path, tiers: Callable[[Config], list[Tier]], **options):
        self.cfg = Config.build(
            mountpoint=base / "mnt", ramdisk=base / "ram", job=JOB, rank=0, nodes=1, chunk_size=CS, **options
        )
        rank = RankDir(self.cfg.rank_dir)
        rank.prepare_home()
        rank.prepare()
        self.tree = rank.tree
        self.steps = Steps(Snapshots(rank.path, rank.tree, lambda st: None), self.cfg.rules, set)
        self.steps.load()
        self.replicator = Replicator(self.cfg, self.steps, tiers(self.cfg))

    def commit(self, *steps: int) -> None:
        for step in steps:
            root = self.tree / "ckpt" / str(step)
            root.mkdir(parents=True)
            (root / "shard").write_bytes(os.urandom(CS))
            self.steps.commit(f"ckpt/{step}", step)

    def held(self, lane: str) -> list[int]:
        """The steps in RAM whose current version the lane holds."""
        return sorted(s.step for s in self.steps.states.values() if s.held_by(lane))

    async def stored(self, lane: str) -> list[int]:
        """The steps the lane's tier holds, as it says itself."""
        return [step for _, step in await self.replicator.lanes[lane].lead.list_manifests()]

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        """Until ``condition()`` holds, polled (there is no event to wait for), for DEADLINE seconds at most."""
        with trio.move_on_after(DEADLINE):
            while not condition():
                await trio.sleep(0.01)
            return
        raise AssertionError(f"timed out waiting for {what}")

    async def settled(self, lane: str) -> None:
        """Until the lane waits, putting nothing: every task blocked, and none of them in a put."""
        while True:
            await trio.testing.wait_all_tasks_blocked(0.05)
            if self.replicator.lanes[lane].busy is None:
                return
            await self.until(lambda: self.replicator.lanes[lane].busy is None, f"{lane} to finish its put")


def disk(cfg: Config) -> list[Tier]:
    return [DiskTier.open_for(cfg)]


async def test_a_milestone_overtaken_before_the_disk_lane_ran_is_kept_in_ram_and_put(tmp_path):
    rank = Rank(tmp_path, disk, disk=tmp_path / "disk", keep_every=300)
    rank.commit(100, 200, 300, 400)  # all before the lane's first turn: 400 is the newest
    assert sorted(rank.steps.states) == [300, 400], "RAM keeps the milestone the disk lacks"

    async with trio.open_nursery() as nursery:
        nursery.start_soon(rank.replicator.run)
        # The disk tier knows what it holds without being asked (it updates that after each put).
        on_disk = rank.replicator.lanes["disk"].lead.held
        await rank.until(lambda: on_disk() == ((0, 300), (0, 400)), "300 and 400 on the disk")
        await rank.settled("disk")
        nursery.cancel_scope.cancel()
    assert await rank.stored("disk") == [300, 400]
    assert sorted(rank.steps.states) == [400], "once on the disk, the milestone left RAM"


async def test_without_milestones_the_disk_lane_puts_only_the_newest(tmp_path):
    rank = Rank(tmp_path, disk, disk=tmp_path / "disk")
    rank.commit(100, 200, 300, 400)
    assert sorted(rank.steps.states) == [400]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(rank.replicator.run)
        await rank.until(lambda: rank.held("disk") == [400], "400 on the disk")
        await rank.settled("disk")
        nursery.cancel_scope.cancel()
    assert await rank.stored("disk") == [400]


def gcs(url: str) -> Callable[[Config], list[Tier]]:
    from tierfs.tiers.gcs import GcsTier

    return lambda cfg: [GcsTier(url, JOB)]


async def backed_up_an_hour_apart(tmp_path, url: str, **options) -> tuple[list[int], list[int], list[int]]:
    """Steps 100, then 200, 300 and 400 at once, backed up to GCS an hour apart.

    Returns the steps in RAM just after the commits, the steps in GCS once its lane waits,
    and the steps in GCS once the interval is over (the lane reconfigured to back up every commit).
    """
    rank = Rank(tmp_path, gcs(url), gcs=url, backup_interval=HOUR, **options)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rank.replicator.run)
        rank.commit(100)  # the first backup does not wait
        await rank.until(lambda: rank.held("gcs") == [100], "100 in GCS")
        rank.commit(200, 300, 400)
        in_ram = sorted(rank.steps.states)
        await rank.settled("gcs")
        waiting = await rank.stored("gcs")
        rank.replicator.reconfigure(dataclasses.replace(rank.cfg, backup_interval=0.0))
        await rank.until(lambda: rank.held("gcs") == [400], "400 in GCS")
        nursery.cancel_scope.cancel()
    return in_ram, waiting, await rank.stored("gcs")


async def test_a_milestone_goes_to_gcs_without_waiting_for_the_backup_interval(tmp_path, gcs_bucket):
    in_ram, waiting, after = await backed_up_an_hour_apart(tmp_path, f"gs://{gcs_bucket}/backups", keep_every=300)
    assert in_ram == [300, 400], "RAM keeps the milestone GCS lacks"
    assert waiting == [100, 300], "the milestone went at once; 200 and 400 wait for the interval"
    assert after == [100, 300, 400]


async def test_without_keep_every_a_milestone_waits_for_the_interval_like_any_step(tmp_path, gcs_bucket):
    in_ram, waiting, after = await backed_up_an_hour_apart(tmp_path, f"gs://{gcs_bucket}/backups")
    assert in_ram == [400], "300 was overtaken, and left RAM"
    assert waiting == [100]
    assert after == [100, 400]
