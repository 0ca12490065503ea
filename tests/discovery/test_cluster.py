"""Discovery between real daemons on loopback: patterns, DNS, late nodes, and a rank claimed twice."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest
from tierfs_testing import TIERFS

from tests.helpers import wait_for, write_orbax_step
from tierfs.core import mounts

# Nodes start one at a time here: the first ones warn of peers not up yet.
pytestmark = pytest.mark.expect_log(
    r"not answer yet", r"peer discovery: dns\+srv:\S+ failed", r"also serves rank", r"is already served by node"
)

MiB = 1 << 20


def replicated(c, i: int, step: int) -> dict | None:
    for s in c.status(i)["steps"]:
        if s["step"] == step and s["replicas"].get("version") == s["version"]:
            return s["replicas"]
    return None


def known(c, i: int) -> dict[str, str]:
    """Node i's peers, as its status lists them: address -> state."""
    return {p["address"]: p["state"] for p in c.status(i)["peers"]["known"]}


def test_three_nodes_from_one_brace_pattern_find_each_other_and_replicate(cluster):
    c = cluster(3, replicas=2, capacity="256M", restore_wait="5s")
    c.start_all(peers=f"127.0.0.{{2..4}}:{c.port}")
    files = {"shard": os.urandom(3 * MiB)}
    write_orbax_step(c.nodes[1].mountpoint, 5, files, "ckpt")
    rep = wait_for(lambda: replicated(c, 1, 5), what="replication of step 5")
    assert sorted(rep["peers"]) == sorted([c.nodes[0].address, c.nodes[2].address])
    for i in range(3):
        others = {n.address for n in c.nodes} - {c.nodes[i].address}
        assert set(known(c, i)) == others  # the pattern names this node too: it is left out
    for i in (0, 2):
        assert c.status(i)["replicas_held"]["manifests"] == 1


def test_dns_srv_names_the_peers_and_a_late_node_appears(cluster, dns_server):
    c = cluster(3, replicas=1, capacity="256M", restore_wait="2s", survey_interval="1s")
    name = "_tierfs._tcp.job.test"
    targets = [(f"node-{n.index}.job.test", n.host, n.port) for n in c.nodes]
    dns_server.set_srv(name, targets[:2])
    peers = f"dns+srv:{name}{dns_server.at}"
    for i in (0, 1):
        c.start(i, peers=peers)
    # Each node's own record is in the answer: it finds itself out and keeps the other.
    assert known(c, 1) == {c.nodes[0].address: "up"}
    wait_for(lambda: known(c, 0) == {c.nodes[1].address: "up"}, 30, "node 0 to see node 1 up")
    dns_server.set_srv(name, targets)
    c.start(2, peers=peers)
    assert set(known(c, 2)) == {c.nodes[0].address, c.nodes[1].address}
    wait_for(lambda: known(c, 0).get(c.nodes[2].address) == "up", 30, "node 2 to appear to node 0")
    # The newcomer is a peer like the others: rank 0's next step can go to it.
    write_orbax_step(c.nodes[2].mountpoint, 3, {"w": os.urandom(MiB)}, "ckpt")
    rep = wait_for(lambda: replicated(c, 2, 3), what="replication from the late node")
    assert rep["peers"][0] in {c.nodes[0].address, c.nodes[1].address}


def test_a_headless_service_a_records_name_the_peers(cluster, dns_server):
    c = cluster(2, replicas=1, capacity="256M", restore_wait="2s")
    dns_server.set_addresses("job.test", [n.host for n in c.nodes])
    c.start_all(peers=f"dns:job.test:{c.port}{dns_server.at}")
    write_orbax_step(c.nodes[0].mountpoint, 2, {"w": os.urandom(MiB)}, "ckpt")
    rep = wait_for(lambda: replicated(c, 0, 2), what="replication over A-record discovery")
    assert rep["peers"] == [c.nodes[1].address]


@pytest.mark.expect_log(r"peer discovery: dns\+srv:\S+ failed")
def test_a_dns_server_that_does_not_answer_is_one_log_line_not_a_failed_mount(cluster, dns_server):
    c = cluster(1, capacity="256M", restore_wait="1s", survey_interval="1s")
    dns_server.close()  # nobody answers at its address any more
    source = f"dns+srv:_tierfs._tcp.job.test{dns_server.at}"
    c.start(0, peers=source)
    (c.nodes[0].mountpoint / "f").write_bytes(b"works")
    log = mounts.Registration(c.nodes[0].mountpoint).log_path
    time.sleep(3)  # lookups go on (every second while no peer is known), each failing the same way
    failures = [line for line in log.read_text().splitlines() if "peer discovery:" in line]
    assert len(failures) == 1 and f"{source} failed (DNS server" in failures[0], failures
    assert c.status(0)["peers"]["known"] == []


def test_a_second_node_claiming_a_served_rank_is_refused(cluster):
    c = cluster(2, capacity="256M", restore_wait="1s")
    c.start(0, rank=0)
    (c.nodes[0].mountpoint / "kept").write_bytes(b"still here")
    proc = c.start(1, rank=0, check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"tierfs: rank 0 of job {c.job} is already served by node ")
    assert f"at {c.nodes[0].address} (up since " in lines[0]
    assert "give this node another --rank, or stop tierfs on" in lines[0]
    assert "Traceback" not in proc.stderr
    # The incumbent keeps serving; the newcomer mounted nothing.
    assert c.status(0)["rank"] == 0 and (c.nodes[0].mountpoint / "kept").read_bytes() == b"still here"
    assert not os.path.ismount(c.nodes[1].mountpoint)


def test_two_nodes_claiming_one_rank_at_once_leave_exactly_one(cluster):
    c = cluster(2, capacity="256M", restore_wait="1s")
    procs = [
        subprocess.Popen(
            [*TIERFS, *map(str, c.mount_args(i, rank=0))],
            env=c.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]
    results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    ok = [i for i, (_, _, code) in enumerate(results) if code == 0]
    assert len(ok) == 1, results
    winner, loser = ok[0], 1 - ok[0]
    c.refresh(winner)
    node = f"{socket.gethostname()}:{c.nodes[winner].ramdisk}"
    assert f"already served by node {node} at {c.nodes[winner].address}" in results[loser][1]
    assert not os.path.ismount(c.nodes[loser].mountpoint)


def test_a_restarted_node_and_a_replacement_retake_the_rank(cluster):
    c = cluster(3, capacity="256M", restore_wait="1s")
    c.start(0)
    c.start(1)
    c.kill(1)
    c.start(1)  # the same node again: its old daemon is gone
    assert c.status(1)["rank"] == 1
    c.kill(1)
    c.start(2, rank=1)  # another machine takes the rank of the dead one
    assert c.status(2)["rank"] == 1
