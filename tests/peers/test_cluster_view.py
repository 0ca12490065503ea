"""The cluster view over 16 simulated nodes in one process, with real peer servers and GCS.

Each node is a real peer service on its own loopback address with a real replica store;
what it reports as its own committed steps and its restore decision is set by the test.
Replicas travel through the real protocol. Every node computes the view itself, and the
tests check that they agree, and keep agreeing when nodes that held answers are gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from tierfs.config import Config
from tierfs.core.manifest import Entry, Manifest
from tierfs.peers import network, tls
from tierfs.peers.network import PeerNetwork
from tierfs.pipeline.survey import ClusterView
from tierfs.store.replicas import ReplicaStore
from tierfs.store.server import Timeouts, serve
from tierfs.tiers.local import LocalTier, OwnSteps
from tierfs.tiers.peer import peer_tiers

JOB = "view"
SECRET = b"secret-of-the-view-test"
N = 16
# 16 servers and up to 16 surveys share this one process: 256 TLS handshakes at once, which
# on a loaded machine take more than the 5 s a node gets to answer a survey. A node that
# does not answer in time is silent, and a silent node's steps do not count, so a survey
# would rightly choose differently. These tests are about agreement among the nodes that
# answer (a stopped node refuses at once), so every timeout here is far from being reached.
TIMEOUT = 60
TIMEOUTS = Timeouts(handshake=TIMEOUT, idle=TIMEOUT, request=TIMEOUT)


@pytest.fixture(autouse=True)
def patient_surveys(monkeypatch):
    monkeypatch.setattr(network, "INFO_TIMEOUT", TIMEOUT)


@dataclass
class SimNode:
    rank: int
    host: str
    store: ReplicaStore
    steps: list[int] = field(default_factory=list)  # its own committed steps
    restore_step: int | None = None
    port: int = 0
    scope: trio.CancelScope | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def info(self) -> dict:
        return {"rank": self.rank, "topology": [], "steps": self.steps, "restore_step": self.restore_step}

    async def serve(self, port: int = 0, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as self.scope:
            await serve(
                (self.host, port),
                job=JOB,
                secret=SECRET,
                store=self.store,
                info=self.info,
                tls=tls.from_secret(JOB, SECRET),  # as the nodes' configs have it by default
                timeouts=TIMEOUTS,
                task_status=task_status,
            )

    def stop(self) -> None:
        self.scope.cancel()


def manifest(rank: int, step: int) -> bytes:
    """A step with no chunks: the view needs only the manifest's presence."""
    m = Manifest(
        job=JOB,
        rank=rank,
        step=step,
        chunk_size=1 << 20,
        roots=["ckpt"],
        entries=[Entry("ckpt", "dir", 0o755, 0, 0, 0, 0)],
        created=0.0,
    )
    return m.to_json()


async def start_cluster(nursery, tmp_path: Path) -> list[SimNode]:
    nodes = []
    for r in range(N):
        root = tmp_path / f"node-{r}"
        root.mkdir()
        store = ReplicaStore(root, None, job=JOB)
        store.load()
        node = SimNode(r, f"127.0.0.{10 + r}", store)
        node.port = await nursery.start(node.serve)
        nodes.append(node)
    return nodes


def view_of(node: SimNode, nodes: list[SimNode], gcs=None) -> ClusterView:
    cfg = Config.build(
        mountpoint="/nonexistent",
        job=JOB,
        rank=node.rank,
        nodes=N,
        listen=f"{node.host}:{node.port}",
        secret=SECRET.decode(),
        peers=",".join(f"{n.host}:{n.port}" for n in nodes),
    )
    local = LocalTier(
        node.store, OwnSteps(node.rank, steps=lambda: list(node.steps), restore_step=lambda: node.restore_step)
    )
    return ClusterView(N, [*peer_tiers(PeerNetwork(cfg, timeout=TIMEOUT)), *([gcs] if gcs else [])], local)


async def replicate(node: SimNode, to: SimNode, step: int) -> None:
    """Put ``node``'s step on ``to`` through the protocol, as the replicator does."""
    cfg = Config.build(mountpoint="/nonexistent", job=JOB, rank=node.rank, nodes=N, secret=SECRET.decode())
    async with await PeerNetwork(cfg, timeout=TIMEOUT).connect(to.address) as client:
        await client.put_manifest(node.rank, step, manifest(node.rank, step))


async def answers(nodes: list[SimNode], alive: list[SimNode], gcs=None) -> set:
    """The step every live node would restore for its own rank, as a set (one element = agreement)."""
    chosen = {}

    async def one(node):
        survey = await view_of(node, nodes, gcs).survey()
        chosen[node.rank] = survey.choose(node.rank)

    async with trio.open_nursery() as n:
        for node in alive:
            n.start_soon(one, node)
    assert len(chosen) == len(alive)
    return set(chosen.values())


async def test_sixteen_nodes_agree_and_keep_agreeing_when_holders_die(nursery, tmp_path):
    nodes = await start_cluster(nursery, tmp_path)
    # Every rank committed 10 and 20, and all but rank 7 committed 30; each step of rank r
    # is replicated on rank r+1.
    for node in nodes:
        node.steps = [10, 20] if node.rank == 7 else [10, 20, 30]
        for step in node.steps:
            await replicate(node, nodes[(node.rank + 1) % N], step)

    assert await answers(nodes, nodes) == {20}  # 30 is not complete: rank 7 lacks it

    # Rank 0, the node a leader-based design would ask, is gone: the others still agree,
    # because rank 0's steps are on rank 1 as replicas.
    nodes[0].stop()
    assert await answers(nodes, nodes[1:]) == {20}

    # Rank 7 and the holder of its replicas (rank 8) are gone: no step is complete for
    # rank 7 any more, so its silence does not hold the others back (see cluster.py).
    nodes[7].stop()
    nodes[8].stop()
    alive = [n for n in nodes if n.rank not in (0, 7, 8)]
    survey = await view_of(alive[0], nodes).survey()
    assert 7 not in survey.holders and set(survey.missing) == {
        f"peer {n.host}:{n.port}" for n in (nodes[0], nodes[7], nodes[8])
    }
    assert await answers(nodes, alive) == {30}


async def test_gcs_completes_what_peers_lack_and_every_node_sees_the_same(nursery, tmp_path, gcs_bucket):
    from tierfs.tiers.gcs import GcsTier

    gcs = GcsTier(f"gs://{gcs_bucket}/p", JOB)
    nodes = await start_cluster(nursery, tmp_path)
    for node in nodes:
        node.steps = [40]
        await gcs.put_manifest(node.rank, 30, manifest(node.rank, 30))
        if node.rank != 5:
            await gcs.put_manifest(node.rank, 40, manifest(node.rank, 40))
    assert await answers(nodes, nodes, gcs) == {40}  # rank 5's 40 is on rank 5 itself

    nodes[5].stop()  # with no replica anywhere, rank 5's step 40 is gone with it: back to 30
    assert await answers(nodes, [n for n in nodes if n.rank != 5], gcs) == {30}


async def test_a_step_a_peer_already_restored_is_adopted(nursery, tmp_path):
    nodes = await start_cluster(nursery, tmp_path)
    for node in nodes:
        node.steps = [10, 20]
    # Rank 3 started earlier, saw less, and restored step 10; its job runs from it.
    nodes[3].restore_step = 10
    assert await answers(nodes, nodes) == {10}
    # Once rank 3 commits a newer step it has moved on and no longer announces a decision.
    nodes[3].restore_step = None
    assert await answers(nodes, nodes) == {20}


async def test_waiting_for_a_late_peer(nursery, tmp_path):
    nodes = await start_cluster(nursery, tmp_path)
    for node in nodes:
        node.steps = [10] if node.rank == 2 else [10, 20]
    late = nodes[2]
    late.stop()
    view = view_of(nodes[0], nodes)
    survey = await view.survey(wait=0)
    assert survey.newest_complete() == 20  # rank 2 unheard of: it looks like a silent rank
    assert survey.missing == [f"peer {late.host}:{late.port}"]

    async def come_back_later():
        await trio.sleep(1.0)
        await nursery.start(late.serve, late.port)

    nursery.start_soon(come_back_later)
    survey = await view.survey(wait=10)
    assert survey.missing == [] and survey.newest_complete() == 10
