"""The step a restarting node restores is decided from facts as of its restart, never older.

A node that dies right after its step reached a peer, loses its RAM and comes back within
half a second must get that step back: the peer holds it, so it is complete for every
rank. The coordinator that answers may be that very peer, whose periodic report predates
the replica; the answer must come from holdings read after the question.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from tests.helpers import wait_for
from tests.multinode.test_peers import commit_step, replicated, sums
from tests.multinode.test_restore import files_of
from tierfs.coordination.protocol import candidates

# The kill can cut rank 1's own step short on its way to node 0 (even in the middle of the
# TLS handshake), or find node 0 gone before it starts; node 1 says so and retries.
pytestmark = pytest.mark.expect_log(
    "peers: step \\d+ delayed, retrying",
    "not answer yet",
    "peers: step \\d+ did not reach peer \\S+: (cannot connect|.*connection lost)",
)

ROUNDS = int(os.environ.get("TIERFS_TEST_ROUNDS", "20"))
SEED = int(os.environ.get("TIERFS_TEST_SEED", str(random.randrange(1 << 32))))


def peer_answers_first(c) -> None:
    """Name the job so that node 1, the peer holding rank 0's replica, is the first coordinator asked."""
    addresses = [n.address for n in c.nodes]
    c.job = next(job for job in (f"job-{i}" for i in range(1000)) if candidates(job, addresses)[0] == addresses[1])


def kill_soon_after_replication(c, step: int, rng: random.Random) -> dict[int, dict[str, str]]:
    """Commit ``step`` on every node, wait until rank 0's copy is confirmed on its peer, then
    kill node 0 within 0-500 ms (the delay is the fault's, drawn from the seed, mostly short:
    the sooner the restart, the staler a periodic report), and wipe its RAM."""
    expected = {
        i: commit_step(c.nodes[i].mountpoint, step, files_of(i, step, big=256 << 10)) for i in range(len(c.nodes))
    }
    wait_for(lambda: replicated(c, 0, step), what=f"replication of rank 0 step {step}", interval=0.02)
    time.sleep(rng.choice([0.0, rng.uniform(0.0, 0.1), rng.uniform(0.0, 0.5)]))
    c.kill(0)
    c.wipe(0)
    return expected


def restores(c, step: int, expected: dict[int, dict[str, str]]) -> None:
    c.start(0)
    status = c.status(0)
    assert status["cluster"]["restore_step"] == step, f"seed {SEED}: restored {status['cluster']['restore_step']}"
    assert sums(c.nodes[0].mountpoint, step, files_of(0, step)) == expected[0]


def test_a_node_killed_right_after_its_step_reached_a_peer_gets_it_back(cluster):
    rng = random.Random(SEED)
    c = cluster(2, replicas=1, capacity="128M", chunk_size="1M")
    peer_answers_first(c)
    c.start_all()
    for step in range(1, ROUNDS + 1):
        expected = kill_soon_after_replication(c, step, rng)
        restores(c, step, expected)


@pytest.mark.slow
def test_a_hundred_kills_right_after_replication_each_restore_the_step(cluster):
    rng = random.Random(SEED)
    c = cluster(2, replicas=1, capacity="128M", chunk_size="1M")
    peer_answers_first(c)
    c.start_all()
    for step in range(1, 101):
        expected = kill_soon_after_replication(c, step, rng)
        restores(c, step, expected)


def test_a_rank_that_wrote_nothing_does_not_hold_a_later_restart_back(cluster):
    """Rank 2 writes nothing; restarted after step 1, it "restores" step 1 with no file of it.
    Ranks 0 and 1 commit step 2 since, which it never would: a node restarted then restores 2,
    not the step a rank with nothing in it chose long before."""
    c = cluster(3, replicas=1, capacity="64M")
    c.start_all()
    for i in (0, 1):
        commit_step(c.nodes[i].mountpoint, 1, files_of(i, 1))
    c.kill(2)
    c.start(2)
    assert c.status(2)["cluster"]["restore_step"] == 1
    expected = commit_step(c.nodes[1].mountpoint, 2, files_of(1, 2))
    commit_step(c.nodes[0].mountpoint, 2, files_of(0, 2))
    c.kill(1)
    c.start(1)
    assert c.status(1)["cluster"]["restore_step"] == 2
    assert sums(c.nodes[1].mountpoint, 2, files_of(1, 2)) == expected
