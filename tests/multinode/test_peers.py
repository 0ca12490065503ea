"""Replication between real daemons on loopback, and restore from peers after node loss."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import wait_for, write_orbax_step

MiB = 1 << 20


def commit_step(mnt: Path, step: int, files: dict[str, bytes]) -> dict[str, str]:
    """Commit ``files`` as Orbax step ``step`` under ckpt/; their sha256, by name."""
    write_orbax_step(mnt, step, files)
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


def sums(mnt: Path, step: int, names) -> dict[str, str]:
    return {n: hashlib.sha256((mnt / "ckpt" / str(step) / n).read_bytes()).hexdigest() for n in names}


def replicated(c, i: int, step: int) -> dict | None:
    for s in c.status(i)["steps"]:
        if s["step"] == step and s["replicas"].get("version") == s["version"]:
            return s["replicas"]
    return None


def test_node_loss_restores_from_a_peer_without_gcs(cluster):
    c = cluster(3, replicas=1, capacity="512M")
    c.start_all()
    files = {f"shard-{i}": os.urandom(3 * MiB + i) for i in range(5)}
    files["sub/meta"] = b"{}"
    expected = commit_step(c.nodes[0].mountpoint, 9, files)
    rep = wait_for(lambda: replicated(c, 0, 9), what="replication of step 9")
    assert len(rep["peers"]) == 1 and rep["sent_bytes"] >= 15 * MiB
    holder = next(i for i, n in enumerate(c.nodes) if n.address == rep["peers"][0])
    assert c.status(holder)["replicas_held"]["manifests"] == 1

    c.kill(0)
    c.wipe(0)
    c.start(0)
    assert sums(c.nodes[0].mountpoint, 9, files) == expected
    restored = c.status(0)["restored"]
    assert restored["tier"] == "peer" and restored["from"] == f"peer {rep['peers'][0]}"
    assert restored["step"] == 9 and restored["bytes"] == sum(map(len, files.values()))
    assert c.status(0)["gcs"] is None


@pytest.mark.expect_log(
    'replica chunk \\w+ in \\S+ is unusable', 'chunk \\w+ from \\S+( \\S+)? failed', 'trying the next tier'
)
def test_two_replicas_and_a_corrupt_one_is_never_used(cluster):
    c = cluster(3, replicas=2, capacity="512M", chunk_size="1M")
    c.start_all()
    files = {"w": os.urandom(6 * MiB)}
    expected = commit_step(c.nodes[0].mountpoint, 3, files)
    rep = wait_for(lambda: replicated(c, 0, 3), what="replication to two peers")
    assert sorted(rep["peers"]) == sorted([c.nodes[1].address, c.nodes[2].address])
    # Damage every chunk file node 1 holds.
    store = c.nodes[1].ramdisk / c.job / "rank-1" / "replicas" / "chunks"
    damaged = 0
    for path in store.rglob("*"):
        if path.is_file() and not path.name.startswith("."):
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
            damaged += 1
    assert damaged == 6
    c.kill(0)
    c.wipe(0)
    c.start(0)
    assert sums(c.nodes[0].mountpoint, 3, files) == expected
    sources = c.status(0)["restored"]["bytes_from"]
    assert sources == {f"peer {c.nodes[2].address}": 6 * MiB}, sources


# Placement remembers who answered until a request fails: the first put finds the peer gone.
@pytest.mark.expect_log("step 4 did not reach peer \\S+: cannot connect")
def test_a_peer_that_is_down_is_replaced(cluster):
    c = cluster(3, replicas=1, capacity="256M")
    c.start_all()
    c.kill(1)  # the first choice of rank 0 in ring order
    commit_step(c.nodes[0].mountpoint, 4, {"a": os.urandom(MiB)})
    rep = wait_for(lambda: replicated(c, 0, 4), what="replication around the dead peer")
    assert rep["peers"] == [c.nodes[2].address]
    known = {p["address"]: p["state"] for p in c.status(0)["peers"]["known"]}
    assert known[c.nodes[1].address] == "down"


@pytest.mark.expect_log('not answer yet', 'peers: step \\d+ delayed, retrying')
def test_replication_waits_for_a_peer_and_never_blocks_the_writer(cluster):
    c = cluster(2, replicas=1, capacity="256M", restore_wait="1s")
    c.start(0)  # node 1 is not up yet
    started = time.monotonic()
    commit_step(c.nodes[0].mountpoint, 1, {"a": os.urandom(4 * MiB)})
    (c.nodes[0].mountpoint / "more").write_bytes(os.urandom(4 * MiB))
    assert time.monotonic() - started < 5
    wait_for(lambda: c.status(0)["peers"]["state"] == "unavailable", 30, "the missing peer to show")
    c.start(1)
    rep = wait_for(lambda: replicated(c, 0, 1), 60, "replication once the peer is up")
    assert rep["peers"] == [c.nodes[1].address]


def test_a_job_that_logs_all_the_time_does_not_hold_replication_back(cluster):
    c = cluster(2, replicas=1, capacity="256M", chunk_size="1M")
    c.start_all()
    mnt = c.nodes[0].mountpoint
    stop = threading.Event()

    def log() -> None:  # a training loop's log: a line every 10 ms, for as long as the test runs
        with open(mnt / "train.log", "ab", buffering=0) as f:
            while not stop.wait(0.01):
                f.write(b"step 7 loss 0.25\n")

    logger = threading.Thread(target=log)
    logger.start()
    try:
        # 24 chunks in one file: hashed and sent one per second if each gave way to the log
        commit_step(mnt, 7, {"shard": os.urandom(24 * MiB)})
        rep = wait_for(lambda: replicated(c, 0, 7), 12, "replication beside a job that keeps logging")
    finally:
        stop.set()
        logger.join()
    assert rep["peers"] == [c.nodes[1].address] and rep["sent_bytes"] == 24 * MiB
    assert (mnt / "train.log").stat().st_size > 0


def test_data_parallel_twins_replicate_by_hash_comparison(cluster):
    c = cluster(2, replicas=1, capacity="256M", data_parallel=2)
    c.start_all()
    files = {f"s{i}": os.urandom(2 * MiB) for i in range(4)}
    commit_step(c.nodes[1].mountpoint, 5, files)
    wait_for(lambda: replicated(c, 1, 5), what="rank 1's replication")
    expected = commit_step(c.nodes[0].mountpoint, 5, files)
    rep = wait_for(lambda: replicated(c, 0, 5), what="rank 0's replication")
    assert rep["sent_bytes"] == 0 and rep["skipped_bytes"] == 8 * MiB
    c.kill(0)
    c.wipe(0)
    c.start(0)
    assert sums(c.nodes[0].mountpoint, 5, files) == expected


@pytest.mark.expect_log('refused: TLS handshake failed', 'not answer yet', 'delayed, retrying', 'refused')
def test_a_wrong_secret_gets_nothing(cluster):
    c = cluster(2, replicas=1, capacity="256M", restore_wait="1s")
    c.start(1)
    real = c.secret
    c.secret = "not-the-job-secret-at-all"
    proc = c.start(0)
    assert "does not answer" in proc.stderr  # the peer refuses the handshake
    commit_step(c.nodes[0].mountpoint, 2, {"a": os.urandom(MiB)})
    wait_for(lambda: c.status(0)["peers"]["state"] == "unavailable", 30, "the refusal to show")
    c.secret = real
    assert c.status(1)["replicas_held"]["manifests"] == 0
    assert not any((c.nodes[1].ramdisk / c.job / "rank-1" / "replicas" / "chunks").rglob("*[0-9a-f]"))


@pytest.mark.expect_log('is no longer on .*: (replicating|putting) it', 'not answer yet', 'delayed, retrying')
def test_a_replica_lost_with_its_peer_is_made_again(cluster):
    c = cluster(3, replicas=1, capacity="256M")
    c.start_all()
    commit_step(c.nodes[0].mountpoint, 6, {"a": os.urandom(2 * MiB)})
    first = wait_for(lambda: replicated(c, 0, 6), what="replication")["peers"][0]
    holder = next(i for i, n in enumerate(c.nodes) if n.address == first)
    c.kill(holder)
    c.wipe(holder)
    c.start(holder)

    def held_again():
        return any(c.status(i)["replicas_held"]["manifests"] for i in (1, 2))

    wait_for(held_again, 40, "rank 0's step to be replicated again")


@pytest.mark.slow
def test_one_gib_checkpoint_comes_back_from_a_peer_without_gcs(cluster):
    c = cluster(3, replicas=1, capacity="3G")
    c.start_all()
    mnt = c.nodes[0].mountpoint
    tmp = mnt / "ckpt" / "77.orbax-checkpoint-tmp"
    expected = {}
    for i in range(16):
        h = hashlib.sha256()
        (tmp / f"layer-{i:02d}").mkdir(parents=True)
        with open(tmp / f"layer-{i:02d}" / "shard", "wb") as f:
            for _ in range(16):
                block = os.urandom(4 * MiB)
                h.update(block)
                f.write(block)
        expected[f"layer-{i:02d}/shard"] = h.hexdigest()
    os.rename(tmp, mnt / "ckpt" / "77")
    rep = wait_for(lambda: replicated(c, 0, 77), 300, "replication of 1 GiB")
    print(f"1 GiB replicated to {rep['peers'][0]} in {rep['seconds']:.1f}s")
    c.kill(0)
    c.wipe(0)
    c.start(0)
    assert sums(mnt, 77, expected) == expected
    restored = c.status(0)["restored"]
    assert restored["tier"] == "peer" and restored["bytes"] == 1 << 30 and c.status(0)["gcs"] is None
    print(f"1 GiB restored from {restored['from']} in {restored['seconds']:.1f}s")


@pytest.mark.expect_log(
    'replica chunk \\w+ in \\S+ is unusable', 'chunk \\w+ from \\S+( \\S+)? failed', 'trying the next tier'
)
def test_chunks_no_peer_can_give_come_from_gcs(cluster, gcs_bucket):
    c = cluster(2, replicas=1, capacity="256M", chunk_size="1M", gcs=f"gs://{gcs_bucket}/m")
    c.start_all()
    files = {"w": os.urandom(4 * MiB)}
    expected = commit_step(c.nodes[0].mountpoint, 8, files)
    wait_for(lambda: replicated(c, 0, 8), what="replication")
    wait_for(lambda: next(s for s in c.status(0)["steps"] if s["step"] == 8)["backed_up"], what="backup")
    chunk_files = sorted(
        p for p in (c.nodes[1].ramdisk / c.job / "rank-1" / "replicas" / "chunks").rglob("*") if p.is_file()
    )
    assert len(chunk_files) == 4
    damaged = chunk_files[0]
    damaged.write_bytes(bytes(MiB))  # the peer's copy of one chunk rots
    c.kill(0)
    c.wipe(0)
    c.start(0, prefetch=0)  # on demand only: every chunk is fetched peer first
    assert sums(c.nodes[0].mountpoint, 8, files) == expected
    fetched = c.status(0)["restored"]["bytes_from"]
    assert sum(fetched.values()) == 4 * MiB and fetched.get("gcs", 0) >= MiB, fetched
