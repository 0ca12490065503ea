"""A whole job's twins backing up a step to the simulated bucket: the bytes it costs, the time it takes.

The numbers ``scripts/bench_scale.py`` reports come from :mod:`tierfs_testing.backups`;
these runs check, on a small job, that the bucket counts what each way of backing up
sends and reads, and that a dead twin delays the others by the wait, not forever.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from tierfs_testing import backups
from tierfs_testing.sim import SimGcs, SimNetwork

MiB = 1 << 20


def test_the_code_before_moves_2d_minus_1_times_the_step_when_twins_commit_together():
    got = backups.backup(32, data_parallel=4, mode="today", chunks=8, chunk_size=MiB, spread=0.0)
    assert got["complete"]
    assert got["up_per_unique"] == pytest.approx(4.0, abs=0.01)  # every twin sent every chunk
    assert got["down_per_unique"] == pytest.approx(3.0)  # each loser read it back


def test_twins_upload_each_chunk_once_and_read_nothing_back():
    got = backups.backup(64, data_parallel=16, mode="twins", chunks=16, chunk_size=MiB)
    assert got["complete"]
    assert got["gcs_per_unique"] <= 1.05
    assert got["down_per_unique"] == 0.0
    assert got["chunks_uploaded_max"] < 16, "the uploads are split between the twins"


def test_a_dead_twin_delays_the_others_by_the_wait_and_its_chunks_still_go_up_once():
    alive = backups.backup(64, data_parallel=16, mode="twins", chunks=16, chunk_size=MiB)
    dead = backups.backup(64, data_parallel=16, mode="twins", dead=1, chunks=16, chunk_size=MiB)
    assert dead["complete"]
    assert dead["gcs_per_unique"] <= 1.5
    assert alive["backed_up_s_max"] < dead["backed_up_s_max"] < alive["backed_up_s_max"] + 30


def test_the_bucket_counts_a_create_that_lost_as_bytes_sent():
    async def main():
        net = SimNetwork()
        net.listen("a", None)
        net.listen("b", None)
        gcs = SimGcs(net)
        async with trio.open_nursery() as nursery:
            await nursery.start(net.run)
            assert await gcs.write("a", "x", MiB)
            assert not await gcs.write("b", "x", MiB)  # the body went; the object was there
            assert await gcs.exists("x") and not await gcs.exists("y")
            nursery.cancel_scope.cancel()
        return gcs

    gcs = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert (gcs.bytes_written, gcs.bytes_read, gcs.writes, gcs.metadata_requests) == (2 * MiB, 0, 2, 2)
    assert gcs.requests == 4
