"""The erasure-coded peer tier between six real daemons (``--erasure 4+2``): any two nodes lost come back
from the others' parity with no bucket; a third loss is more than the group can rebuild."""

from __future__ import annotations

import os
import re

import pytest

from tests.helpers import wait_for
from tests.multinode.test_peers import commit_step, replicated, sums
from tests.multinode.test_restore import files_of
from tests.prometheus import promtool_check_metrics
from tierfs.core import control_client, mounts

NODES = 6
# While members are down, the others' lanes find their steps no longer summed everywhere and
# put them again, retrying until the lost members are back: a warning each, as for replicas.
pytestmark = pytest.mark.expect_log(
    r"WARNING tierfs.pipeline.replicator: step \d+ is (no longer on|not confirmed by) erasure 4\+2",
    r"WARNING tierfs.pipeline.replicator: peers: step \d+ (delayed, retrying|did not reach erasure)",
)


def erasure(c, i: int) -> dict:
    """What node i's peers lane says of its group: its shape, members, and per step what it survives."""
    return c.status(i)["peers"]["erasure"]


def metrics(c, i: int) -> str:
    """Node i's Prometheus exposition, as the CSI plugin reads it from the control socket."""
    return control_client.request(mounts.Registration(c.nodes[i].mountpoint).socket_path, {"op": "metrics"})["text"]


def commit_everywhere(c, step: int) -> dict[int, dict[str, str]]:
    expected = {i: commit_step(c.nodes[i].mountpoint, step, files_of(i, step, big=3 << 20)) for i in range(NODES)}
    for i in expected:
        wait_for(lambda: replicated(c, i, step), what=f"rank {i}'s parts of step {step} summed at their holders")
    return expected


def survives(c, i: int, step: int) -> int | None:
    held = erasure(c, i)["steps"].get(str(step))
    return held["survives"] if held else None


@pytest.mark.parametrize("lost", [(1, 4), (0, 5)])
def test_two_nodes_lost_come_back_from_the_group_without_gcs(cluster, lost):
    c = cluster(NODES, erasure="4+2", capacity="256M")
    c.start_all()
    commit_everywhere(c, 1)
    expected = commit_everywhere(c, 2)
    wait_for(lambda: survives(c, 2, 2) == 2, what="step 2 encoded across the whole group")
    group = erasure(c, 2)
    assert group["shape"] == "4+2" and sorted(group["members"]) == list(range(NODES))
    # Once step 2 is encoded everywhere, step 1's parity goes: what a node holds for the others
    # is P/D of a shard (the shards here are equal), within 5%.
    shard = sum(len(b) for b in files_of(2, 2, big=3 << 20).values())
    wait_for(lambda: abs(erasure(c, 2)["parity_bytes"] / (shard * 2 / 4) - 1) < 0.05, what="P/D of a shard held")
    text = metrics(c, 2)
    promtool_check_metrics(text)
    assert 'tierfs_erasure_survivable_losses{job="job",rank="2"} 2.0' in text
    held = float(re.search(r'tierfs_erasure_parity_bytes\{job="job",rank="2"\} (\S+)', text).group(1))
    assert abs(held / (shard * 2 / 4) - 1) < 0.05
    for i in lost:
        c.kill(i)
        c.wipe(i)
    c.start_all()
    for i in range(NODES):
        assert sums(c.nodes[i].mountpoint, 2, files_of(i, 2, big=3 << 20)) == expected[i]
    for i in lost:
        restored = wait_for(lambda: c.status(i)["restored"], what=f"rank {i}'s restore")
        assert restored["step"] == 2 and restored["tier"] == "erasure"
    # The members' lanes find the restored ones lacking their sums of step 2 and send their windows
    # again: the group survives two losses again without waiting for a new step.
    wait_for(lambda: survives(c, 0, 2) == 2, what="step 2 encoded again across the whole group")


def test_three_nodes_lost_are_restored_from_gcs(cluster, gcs_bucket):
    c = cluster(NODES, erasure="4+2", capacity="256M", gcs=f"gs://{gcs_bucket}/ec")
    c.start_all()
    expected = commit_everywhere(c, 3)
    for i in range(NODES):
        wait_for(lambda: c.status(i)["steps"][-1]["backed_up"], what=f"rank {i}'s step 3 in GCS")
    lost = (0, 2, 3)
    for i in lost:
        c.kill(i)
        c.wipe(i)
    wait_for(lambda: survives(c, 1, 3) is not None and survives(c, 1, 3) < 0, what="the group seeing three losses")
    c.start_all()
    for i in lost:
        assert sums(c.nodes[i].mountpoint, 3, files_of(i, 3, big=3 << 20)) == expected[i]
        restored = wait_for(lambda: c.status(i)["restored"], what=f"rank {i}'s restore")
        assert restored["step"] == 3 and restored["tier"] == "gcs"


@pytest.mark.expect_log(r"ERROR tierfs: rank \d's step 4 was erasure-coded in erasure 4\+2 group 0")
def test_three_nodes_lost_without_gcs_refuse_to_start_empty(cluster):
    c = cluster(NODES, erasure="4+2", capacity="256M", restore_wait="5s")
    c.start_all()
    expected = commit_everywhere(c, 4)
    wait_for(lambda: survives(c, 1, 4) == 2, what="step 4 encoded across the whole group")
    lost = (0, 2, 3)
    for i in lost:
        c.kill(i)
        c.wipe(i)
    with pytest.raises(AssertionError) as refused:
        c.start_all()
    for i in lost:
        line = next(part for part in str(refused.value).split("; node ") if part.lstrip("node ").startswith(f"{i}:"))
        assert f"rank {i}'s step 4 was erasure-coded in erasure 4+2 group 0" in line
        assert "mount with --gcs" in line and "Traceback" not in line
        assert not os.path.ismount(c.nodes[i].mountpoint)
    for i in (1, 4, 5):  # the survivors serve on, their step whole
        assert sums(c.nodes[i].mountpoint, 4, files_of(i, 4, big=3 << 20)) == expected[i]


def test_groups_follow_the_topology_and_a_lost_rack_comes_back(cluster):
    """Ranks numbered rack by rack: by rank numbers alone a 2+1 group would hold two ranks of one rack,
    and losing that rack would lose the group's shards. Placed by topology, every group has one rank
    per rack, so a whole rack lost comes back from the others; the wiped nodes take the grouping their
    peers kept, whatever rack they come back in."""
    c = cluster(NODES, erasure="2+1", capacity="256M")
    for i in range(NODES):
        c.nodes[i].environ["TIERFS_TOPOLOGY"] = f"rack=r{i // 2}"
    c.start_all()
    expected = commit_everywhere(c, 1)
    groups = {i: erasure(c, i) for i in range(NODES)}
    assert {g["grouping"] for g in groups.values()} == {groups[0]["grouping"]}, "every node agreed one grouping"
    assert {tuple(g["members"]) for g in groups.values()} == {(0, 2, 4), (1, 3, 5)}
    assert all(not g["weak_spots"] for g in groups.values())
    line = f"group 0 of ranks 0, 2, 4 (grouping {groups[0]['grouping']}): 3 answering"
    wait_for(lambda: line in c.tierfs("status", c.nodes[2].mountpoint, node=2).stdout, what="the group in status")
    for i in range(NODES):
        wait_for(lambda: survives(c, i, 1) == 1, what=f"step 1 encoded in rank {i}'s group")
    for i in (0, 1):  # rack r0: a rank of each group
        c.kill(i)
        c.wipe(i)
    # Rank 0 comes back in rack r1: formed anew from the labels, the groups would be (0, 3, 5) and (1, 2, 4).
    c.nodes[0].environ["TIERFS_TOPOLOGY"] = "rack=r1"
    c.start_all()
    for i in (0, 1):
        assert sums(c.nodes[i].mountpoint, 1, files_of(i, 1, big=3 << 20)) == expected[i]
        restored = wait_for(lambda: c.status(i)["restored"], what=f"rank {i}'s restore")
        assert restored["step"] == 1 and restored["tier"] == "erasure"
        assert erasure(c, i)["grouping"] == groups[0]["grouping"]
        assert erasure(c, i)["members"] == groups[i]["members"]
