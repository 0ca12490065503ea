"""A whole job restarting from GCS: coordinators choose the step, data-parallel twins share the download.

Every node's RAM is lost (replicas included), so GCS holds the only copy. Ranks
``nodes/D`` apart are twins holding the same bytes; each chunk must leave GCS once and
reach the other twins from the one that read it. GCS bytes are counted by each daemon's
restore (``bytes_from``) and must stay within 1.1x of the unique bytes (without the
broadcast: D times).
"""

from __future__ import annotations

import os

import pytest

from tests.helpers import wait_for
from tests.multinode.test_peers import MiB, commit_step, sums

STEP = 5


def restore_twins_from_gcs(cluster, gcs_bucket: str, nodes: int, data_parallel: int, size: int) -> dict:
    c = cluster(
        nodes,
        replicas=1,
        capacity="512M",
        chunk_size="1M",
        gcs=f"gs://{gcs_bucket}/t",
        data_parallel=data_parallel,
        restore_wait="30s",
    )
    c.start_all()
    group = nodes // data_parallel
    shards = {g: os.urandom(size) for g in range(group)}
    expected = {i: commit_step(c.nodes[i].mountpoint, STEP, {"w": shards[i % group]}) for i in range(nodes)}
    for i in range(nodes):
        wait_for(
            lambda: any(s["step"] == STEP and s["backed_up"] for s in c.status(i)["steps"]),
            120,
            f"node {i} to back up step {STEP}",
        )
    c.kill_all()
    for i in range(nodes):
        c.wipe(i)
    c.start_all()
    restored = {}
    for i in range(nodes):
        restored[i] = wait_for(
            lambda: (r := c.status(i)["restored"]) and r["state"] == "done" and r,
            180,
            f"node {i} to restore step {STEP}",
        )
    for i in range(nodes):
        assert sums(c.nodes[i].mountpoint, STEP, ["w"]) == expected[i], f"node {i} restored other bytes"
        assert c.status(i)["cluster"]["restore_step"] == STEP
    gcs = sum(r["bytes_from"].get("gcs", 0) for r in restored.values())
    peers = sum(v for r in restored.values() for k, v in r["bytes_from"].items() if k.startswith("peer "))
    unique = group * size
    return {"gcs": gcs, "peers": peers, "unique": unique, "restored": restored}


# Killing the job one node at a time: the last ones may still be putting a replica on the
# first, or asking it to confirm one.
@pytest.mark.expect_log(
    "not answer yet", "delayed, retrying", "step 5 did not reach peer ", "step 5 is not confirmed by peer"
)
def test_eight_nodes_with_four_twins_read_each_chunk_from_gcs_once(cluster, gcs_bucket):
    got = restore_twins_from_gcs(cluster, gcs_bucket, nodes=8, data_parallel=4, size=8 * MiB)
    assert got["gcs"] <= 1.1 * got["unique"], f"GCS gave {got['gcs']} bytes for {got['unique']} unique"
    assert got["gcs"] + got["peers"] == 4 * got["unique"], "every twin got every byte, from GCS or a twin"
    assert all(r["bytes_from"].get("gcs", 0) < 8 * MiB for r in got["restored"].values()), (
        "the download is split between the twins, not done by one"
    )


@pytest.mark.slow
# 32 daemons on a few cores: a peer can be too busy to confirm a replica in time.
@pytest.mark.expect_log(
    "not answer yet", "delayed, retrying", "step 5 did not reach peer ", "step 5 is not confirmed by peer"
)
def test_thirty_two_nodes_with_four_twins_read_each_chunk_from_gcs_once(cluster, gcs_bucket):
    got = restore_twins_from_gcs(cluster, gcs_bucket, nodes=32, data_parallel=4, size=8 * MiB)
    assert got["gcs"] <= 1.1 * got["unique"], f"GCS gave {got['gcs']} bytes for {got['unique']} unique"
    assert got["gcs"] + got["peers"] == 4 * got["unique"]
    assert all(r["bytes_from"].get("gcs", 0) < 8 * MiB for r in got["restored"].values())
