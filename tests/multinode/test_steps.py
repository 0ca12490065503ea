"""``tierfs steps`` in a job of two nodes: each node sees both ranks' steps through its peer."""

from __future__ import annotations

import json
import os
import signal
import time

from tests.helpers import wait_for
from tests.multinode.test_peers import commit_step, replicated
from tests.multinode.test_restore import files_of


def steps_seen(c, i: int) -> dict[int, dict]:
    return {s["step"]: s for s in json.loads(c.tierfs("steps", c.nodes[i].mountpoint, "--json").stdout)}


def test_every_node_counts_the_ranks_that_hold_each_step(cluster):
    c = cluster(2, replicas=1, capacity="256M")
    c.start_all()
    for i in (0, 1):
        commit_step(c.nodes[i].mountpoint, 1, files_of(i, 1))
    commit_step(c.nodes[0].mountpoint, 2, files_of(0, 2))  # rank 1 has not committed step 2
    for i, step in ((0, 1), (1, 1), (0, 2)):
        wait_for(lambda: replicated(c, i, step), what=f"replication of rank {i} step {step}")

    for i in (0, 1):  # the same answer from either node: each reaches the other's RAM as a peer
        seen = steps_seen(c, i)
        assert sorted(seen) == [1, 2], seen
        other = c.nodes[1 - i].address
        assert (seen[1]["complete"], seen[1]["nodes"], seen[1]["missing_ranks"]) == (2, 2, [])
        assert seen[1]["tiers"] == ["ram", "peers"] and seen[1]["peers"] == [other]
        assert (seen[2]["complete"], seen[2]["nodes"], seen[2]["missing_ranks"]) == (1, 2, [1])
        assert seen[2]["tiers"] == ["ram", "peers"]  # rank 0's own RAM, and its replica on node 1
    mine = steps_seen(c, 0)
    assert mine[2]["size"] == sum(map(len, files_of(0, 2).values())) and mine[2]["age_s"] is not None
    assert steps_seen(c, 1)[2]["size"] is None  # rank 1 has no step 2 to measure
    text = c.tierfs("steps", c.nodes[0].mountpoint).stdout.splitlines()
    assert [line.split()[:3] for line in text[1:]] == [["2", "ram,peers", "1/2"], ["1", "ram,peers", "2/2"]]

    os.kill(c.nodes[1].pid, signal.SIGSTOP)  # silent: a bounded wait and one line; the replica it left counts
    try:
        started = time.monotonic()
        proc = c.tierfs("steps", c.nodes[0].mountpoint, "--json")
        assert time.monotonic() - started < 8
    finally:
        os.kill(c.nodes[1].pid, signal.SIGCONT)
    seen = {s["step"]: s for s in json.loads(proc.stdout)}
    assert (seen[1]["complete"], seen[1]["tiers"], seen[2]["complete"]) == (2, ["ram"], 1)
    (note,) = proc.stderr.strip().splitlines()
    assert note.startswith(f"tierfs: note: peer {c.nodes[1].address} did not answer (") and note.endswith(
        "): what it holds is not counted"
    ), note
