"""Cluster restore between real daemons: the step every rank can restore, lazily, and safely."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest

from tests.helpers import wait_for
from tests.multinode.test_peers import MiB, commit_step, replicated, sums


def files_of(rank: int, step: int, big: int = 2 * MiB) -> dict[str, bytes]:
    """A small checkpoint whose bytes differ by rank and step."""
    seed = f"{rank}-{step}".encode()
    return {"params": hashlib.shake_256(seed).digest(big), "meta/opt": seed * 100}


def commit_everywhere(c, step: int, ranks=None) -> dict[int, dict[str, str]]:
    expected = {}
    for i in ranks if ranks is not None else range(len(c.nodes)):
        expected[i] = commit_step(c.nodes[i].mountpoint, step, files_of(i, step))
    for i in expected:
        wait_for(lambda: replicated(c, i, step), what=f"replication of rank {i} step {step}")
    return expected


def steps_listed(c, i: int) -> list[str]:
    return sorted(os.listdir(c.nodes[i].mountpoint / "ckpt"))


def test_all_nodes_lost_two_wiped_every_rank_restores_the_same_step(cluster):
    c = cluster(3, replicas=2, capacity="256M")
    c.start_all()
    commit_everywhere(c, 1)
    expected = commit_everywhere(c, 2)
    c.kill_all()
    c.wipe(0)
    c.wipe(1)
    c.start_all()
    for i in range(3):
        assert sums(c.nodes[i].mountpoint, 2, files_of(i, 2)) == expected[i]
        status = c.status(i)
        assert status["cluster"]["restore_step"] == 2
        assert "2" in steps_listed(c, i)
    for i in (0, 1):
        assert c.status(i)["restored"]["step"] == 2
        assert c.status(i)["restored"]["tier"] == "peer"
    assert c.status(2)["restored"] is None  # its RAM survived: nothing to fetch


@pytest.mark.expect_log('moved \\S+ out of the volume to .*is not complete on every rank')
def test_a_step_only_some_ranks_completed_is_not_chosen(cluster, gcs_bucket):
    c = cluster(3, replicas=1, capacity="256M", gcs=f"gs://{gcs_bucket}/b")
    c.start_all()
    expected = commit_everywhere(c, 1)
    commit_everywhere(c, 2, ranks=[0, 1])  # rank 2 dies before it commits step 2
    for i in (0, 1):
        wait_for(lambda: next(s for s in c.status(i)["steps"] if s["step"] == 2)["backed_up"], what="backup")
    c.kill_all()
    c.wipe(0)
    c.start_all()
    for i in range(3):
        assert c.status(i)["cluster"]["restore_step"] == 1
        assert sums(c.nodes[i].mountpoint, 1, files_of(i, 1)) == expected[i]
        # Step 2 exists only for ranks 0 and 1; showing it would split the job.
        assert steps_listed(c, i) == ["1"], (i, steps_listed(c, i))
    assert c.status(0)["restored"]["step"] == 1
    aside = list((c.nodes[1].ramdisk / c.job / "rank-1" / "aside").rglob("params"))
    assert len(aside) == 1, aside  # rank 1's step 2 was moved aside, not deleted


def test_namespace_appears_at_once_and_a_read_fetches_only_what_it_needs(cluster):
    c = cluster(2, replicas=1, capacity="512M", chunk_size="1M")
    c.start_all()
    mnt = c.nodes[0].mountpoint
    big = os.urandom(64 * MiB)
    expected = commit_step(mnt, 5, {"big": big, "small": b"s" * 100})
    os.symlink("big", mnt / "ckpt" / "5" / "link")
    os.chmod(mnt / "ckpt" / "5" / "small", 0o640)
    c.tierfs("commit", mnt / "ckpt" / "5", "--step", "5")
    wait_for(lambda: (r := replicated(c, 0, 5)) and r["version"] == 2, what="replication")
    before = {n: os.lstat(mnt / "ckpt" / "5" / n) for n in ("big", "small", "link")}
    c.kill(0)
    c.wipe(0)
    c.start(0, prefetch=0)
    step = mnt / "ckpt" / "5"
    after = {n: os.lstat(step / n) for n in ("big", "small", "link")}
    for n in before:
        assert (after[n].st_size, after[n].st_mode, after[n].st_mtime_ns) == (
            before[n].st_size,
            before[n].st_mode,
            before[n].st_mtime_ns,
        ), n
    assert os.readlink(step / "link") == "big"
    restored = c.status(0)["restored"]
    assert restored["bytes_missing"] == 64 * MiB + 100 and restored["bytes_from"] == {}

    with open(step / "big", "rb") as f:
        f.seek(63 * MiB)
        assert f.read() == big[63 * MiB :]
    restored = c.status(0)["restored"]
    assert sum(restored["bytes_from"].values()) == MiB  # one chunk, not the file
    assert restored["files_pending"] == 2 and restored["state"] == "on demand"
    assert not any(s["step"] == 5 for s in c.status(0)["steps"])  # not committed here until whole

    assert sums(mnt, 5, ["big", "small"]) == expected
    restored = c.status(0)["restored"]
    assert restored["state"] == "done" and restored["bytes_missing"] == 0
    assert sum(restored["bytes_from"].values()) == 64 * MiB + 100
    assert any(s["step"] == 5 and s["source"] == "peer" for s in c.status(0)["steps"])


def test_prefetch_pulls_the_whole_step_without_reads(cluster):
    c = cluster(2, replicas=1, capacity="256M", chunk_size="1M")
    c.start_all()
    expected = commit_everywhere(c, 3)
    c.kill(0)
    c.wipe(0)
    c.start(0)
    done = wait_for(lambda: (r := c.status(0)["restored"])["state"] == "done" and r, what="prefetch")
    assert done["bytes_missing"] == 0 and done["chunks_done"] == done["chunks_total"]
    assert done["demand_fetches"] == 0
    assert sums(c.nodes[0].mountpoint, 3, files_of(0, 3)) == expected[0]


@pytest.mark.expect_log('chunk \\w+ from \\S+( \\S+)? failed', 'trying the next tier')
def test_restore_falls_back_from_a_dead_peer_to_gcs_mid_file(cluster, gcs_bucket):
    c = cluster(2, replicas=1, capacity="256M", chunk_size="1M", gcs=f"gs://{gcs_bucket}/d")
    c.start_all()
    data = os.urandom(16 * MiB)
    expected = commit_step(c.nodes[0].mountpoint, 7, {"w": data})
    wait_for(lambda: replicated(c, 0, 7), what="replication")
    wait_for(lambda: next(s for s in c.status(0)["steps"] if s["step"] == 7)["backed_up"], what="backup")
    c.kill(0)
    c.wipe(0)
    c.start(0, prefetch=0)
    path = c.nodes[0].mountpoint / "ckpt" / "7" / "w"
    peer = f"peer {c.nodes[1].address}"
    with open(path, "rb") as f:
        assert f.read(4 * MiB) == data[: 4 * MiB]
        before = c.status(0)["restored"]["bytes_from"]
        assert list(before) == [peer] and 4 * MiB <= before[peer] <= 6 * MiB  # plus the kernel's read-ahead
        c.kill(1)  # the peer dies in the middle of the file
        assert f.read() == data[4 * MiB :]
    assert sums(c.nodes[0].mountpoint, 7, ["w"]) == expected
    after = c.status(0)["restored"]["bytes_from"]
    assert after == {peer: before[peer], "gcs": 16 * MiB - before[peer]}, after


def test_gc_never_removes_the_only_copy_of_the_newest_complete_step(cluster):
    c = cluster(3, replicas=1, capacity="256M", keep_local=1, survey_interval=1)
    c.start_all()
    expected = commit_everywhere(c, 1)
    commit_everywhere(c, 2, ranks=[0, 1])  # rank 2 has not committed step 2 yet
    # Rank 0's replicas are on node 1. Step 1 is the newest the job can restore, so neither
    # rank 0's own snapshot of it nor node 1's replica of it may go, though step 2 is newer.
    wait_for(lambda: c.status(0)["cluster"]["retention_floor"] == 1, what="a fresh cluster view")
    held = c.nodes[1].ramdisk / c.job / "rank-1" / "replicas" / "manifests" / "rank-0"
    assert sorted(p.name for p in held.iterdir()) == ["step-000000000001.json", "step-000000000002.json"]
    assert [s["step"] for s in c.status(0)["steps"]] == [1, 2]

    c.kill(0)
    c.wipe(0)  # rank 0 now exists only as node 1's replicas
    c.start(0)
    assert sums(c.nodes[0].mountpoint, 1, files_of(0, 1)) == expected[0]
    assert c.status(0)["restored"]["step"] == 1

    # Once step 2 is complete everywhere, the older copies are collected.
    commit_everywhere(c, 2, ranks=[2])
    wait_for(
        lambda: sorted(p.name for p in held.iterdir()) == ["step-000000000002.json"],
        what="the superseded replica to go",
    )
    wait_for(lambda: [s["step"] for s in c.status(1)["steps"]] == [2], what="local retention")


def test_a_killed_restore_resumes_without_refetching(cluster):
    c = cluster(2, replicas=1, capacity="256M", chunk_size="1M")
    c.start_all()
    data = os.urandom(8 * MiB)
    expected = commit_step(c.nodes[0].mountpoint, 4, {"w": data})
    wait_for(lambda: replicated(c, 0, 4), what="replication")
    c.kill(0)
    c.wipe(0)
    c.start(0, prefetch=0)
    path = c.nodes[0].mountpoint / "ckpt" / "4" / "w"
    with open(path, "rb") as f:
        assert f.read(3 * MiB) == data[: 3 * MiB]
    fetched = sum(c.status(0)["restored"]["bytes_from"].values())  # 3 MiB and the read-ahead
    assert 3 * MiB <= fetched < 8 * MiB
    c.kill(0)  # mid-restore
    # On the RAM tier the file is still a placeholder and the step is not committed.
    rank_dir = c.nodes[0].ramdisk / c.job / "rank-0"
    assert (rank_dir / "steps" / "4" / "restore.json").exists()
    assert not (rank_dir / "steps" / "4" / "state.json").exists()
    c.start(0, prefetch=0)
    restored = c.status(0)["restored"]
    assert restored["bytes_missing"] == 8 * MiB - fetched and restored["bytes_from"] == {}
    assert path.read_bytes() == data
    restored = c.status(0)["restored"]
    assert sum(restored["bytes_from"].values()) == 8 * MiB - fetched  # verified chunks were not fetched again
    assert sums(c.nodes[0].mountpoint, 4, ["w"]) == expected


def test_a_write_to_a_file_being_restored_waits_for_its_bytes(cluster):
    c = cluster(2, replicas=1, capacity="256M", chunk_size="1M")
    c.start_all()
    data = os.urandom(6 * MiB)
    commit_step(c.nodes[0].mountpoint, 6, {"w": data})
    wait_for(lambda: replicated(c, 0, 6), what="replication")
    c.kill(0)
    c.wipe(0)
    c.start(0, prefetch=0)
    path = c.nodes[0].mountpoint / "ckpt" / "6" / "w"
    with open(path, "r+b") as f:  # opening for writing completes the file first
        f.seek(MiB)
        f.write(b"new")
    assert path.read_bytes() == data[:MiB] + b"new" + data[MiB + 3 :]
    restored = c.status(0)["restored"]
    assert restored["state"] == "done" and sum(restored["bytes_from"].values()) == 6 * MiB
    # The committed step keeps the restored bytes: a replica made from it now is the original.
    snap = c.nodes[0].ramdisk / c.job / "rank-0" / "steps" / "6" / "tree" / "ckpt" / "6" / "w"
    assert snap.read_bytes() == data
    assert stat.S_IMODE(os.stat(path).st_mode) == stat.S_IMODE(os.stat(snap).st_mode)


@pytest.mark.expect_log(
    'not answer yet', 'peers: step \\d+ delayed, retrying', 'step \\d+ is not confirmed by peer'
)  # node 2 starts before the peers it replicated to
def test_a_replacement_node_given_another_rank_gets_that_ranks_data(cluster):
    c = cluster(3, replicas=2, capacity="256M", restore_wait="3s")  # started one by one below
    c.start_all()
    expected = commit_everywhere(c, 1)
    c.kill_all()
    # Nodes 0 and 1 come back with each other's rank: neither ever held that rank's files.
    c.start(2)
    for i, rank in ((0, 1), (1, 0)):
        c.start(i, rank=rank)
    for i, rank in ((0, 1), (1, 0)):
        assert c.status(i)["rank"] == rank
        assert sums(c.nodes[i].mountpoint, 1, files_of(rank, 1)) == expected[rank]
        assert c.status(i)["restored"]["step"] == 1
