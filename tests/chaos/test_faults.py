"""The fault-schedule harness (:mod:`tests.chaos.schedule`) run against four real daemons.

``TIERFS_CHAOS_SEED`` replays one schedule; a failure names its seed.
"""

from __future__ import annotations

import os
import random
import shutil
import uuid
from pathlib import Path

import pytest

from tests.chaos.schedule import make_job, run_schedule

pytestmark = [pytest.mark.chaos, pytest.mark.expect_log(r" WARNING ")]


def seed() -> int:
    return int(os.environ.get("TIERFS_CHAOS_SEED", str(random.randrange(1 << 31))))


@pytest.fixture
def chaos_job(monkeypatch):
    """A job of 4 daemons and a GCS emulator of its own; everything stopped and removed afterwards."""
    made = []

    def make(nodes: int = 4, erasure: str | None = None):
        s = seed()
        base = Path("/dev/shm") / f"tierfs-chaos-{uuid.uuid4().hex[:10]}"
        job, closers = make_job(base, nodes, s, erasure)
        made.append((base, closers))
        for name, value in job.gcs.environ().items():
            monkeypatch.setenv(name, value)
        return job

    yield make
    for base, closers in made:
        for close in closers:
            close()
        shutil.rmtree(base, ignore_errors=True)


def run(job, faults: int) -> None:
    try:
        job.cluster.start_all()
        run_schedule(job, faults)
    except BaseException:
        print(f"chaos seed {job.seed} (replay: TIERFS_CHAOS_SEED={job.seed}); schedule so far:")
        print("\n".join(job.log))
        raise
    refused = sum("started fresh" in line for line in job.log)
    print(
        f"chaos seed {job.seed}: {sum(job.faults.values())} faults {dict(job.faults)}, {job.restarts} restarts"
        + (f", {refused} refused as beyond the group's parity" if refused else "")
    )


def test_a_seeded_schedule_of_faults_never_loses_the_newest_step(chaos_job):
    run(chaos_job(), int(os.environ.get("TIERFS_CHAOS_FAULTS", "40")))


def test_erasure_groups_under_faults_never_lose_the_newest_step(chaos_job):
    """Three daemons in one 2+1 group: a kill of two (wiped) is more than its parity covers."""
    run(chaos_job(3, erasure="2+1"), int(os.environ.get("TIERFS_CHAOS_FAULTS", "20")))


@pytest.mark.slow
def test_a_thousand_faults_never_lose_the_newest_step(chaos_job):
    run(chaos_job(), 1000)
