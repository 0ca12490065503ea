"""The simulated job the scenarios run: its shape, its settings, its nodes, and the clock.

The real coordination of every node (:class:`~tierfs.coordination.node.Coordination`)
and the real placement of its replicas (:func:`tierfs.peers.placement.choose`) over the
simulated wire and GCS of :mod:`tierfs_testing.sim`. It is apart from the scenarios
(:mod:`tierfs_testing.scenarios`) because more than they run on it: the twins' backups of
:mod:`tierfs_testing.backups` use the same job model, settings and MockClock.

The job: ``nodes`` ranks, ``data_parallel`` (D) twins per shard (ranks nodes/D apart hold
the same data), each rank's steps replicated to ``replicas`` peers. Twins come first in
placement, so a rank's replicas sit on its twins, as the placement policy wants.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
import trio.testing

from tierfs.coordination import broadcast
from tierfs.coordination.gcs_listing import list_sharded, listing_prefixes
from tierfs.coordination.node import Coordination
from tierfs.coordination.protocol import candidates
from tierfs.coordination.transport import Message
from tierfs.coordination.view import Holdings, HoldingsView
from tierfs.peers.placement import PeerInfo, choose
from tierfs_testing.sim import GcsModel, NetModel, SimGcs, SimNetwork

JOB = "sim"
MiB = 1 << 20


@dataclass
class JobModel:
    nodes: int
    data_parallel: int = 4
    replicas: int = 2
    ram_steps: tuple[int, ...] = (200, 300)  # each node's own committed steps (--keep-local 2)
    gcs_steps: tuple[int, ...] = (100, 200, 300)  # backed up for every rank
    chunks: int = 8  # per rank and step
    chunk_size: int = 16 * MiB
    _placement: dict[int, list[int]] | None = field(default=None, repr=False)

    def address(self, rank: int) -> str:
        return f"10.{rank >> 16 & 255}.{rank >> 8 & 255}.{rank & 255}:7070"

    @property
    def group(self) -> int:
        return self.nodes // self.data_parallel

    def twins(self, rank: int) -> list[int]:
        g = self.group
        return [rank % g + j * g for j in range(self.data_parallel) if rank % g + j * g != rank]

    def topology(self, rank: int) -> tuple[tuple[str, str], ...]:
        return (("slice", str(rank // 256)), ("rack", str(rank // 16)))

    def replica_holders(self, rank: int) -> list[int]:
        """The peers ``rank``'s steps are replicated to, by the real placement policy.

        Candidates are the rank's twins, its 8 ring neighbours and 8 ranks across the
        ring: a node configured with all 10,000 peers would sort them all for nothing,
        since twins come first.
        """
        n = self.nodes
        near = [(rank + d) % n for d in range(1, 9)]
        far = [(rank + n // 2 + d) % n for d in range(8)]
        pool = dict.fromkeys(self.twins(rank) + near + far)
        pool.pop(rank, None)
        infos = [PeerInfo(("10.0.0.0", 7070 + r), r, self.topology(r)) for r in pool]
        return [p.rank for p in choose(rank, self.topology(rank), infos, self.replicas, n, self.data_parallel)]

    def placement(self) -> dict[int, list[int]]:
        """holder rank -> ranks whose replicas it keeps."""
        if self._placement is None:
            held: dict[int, list[int]] = {}
            for r in range(self.nodes):
                for holder in self.replica_holders(r):
                    held.setdefault(holder, []).append(r)
            self._placement = held
        return self._placement

    def holdings(self, rank: int, ram: bool = True) -> Holdings:
        """What ``rank``'s node holds: its own steps and its replicas (nothing once its RAM is lost)."""
        if not ram:
            return Holdings(rank, topology=self.topology(rank))
        replicas = tuple((r, s) for r in self.placement().get(rank, []) for s in self.ram_steps)
        return Holdings(rank, self.ram_steps, replicas, None, self.topology(rank))

    def gcs_listing(self) -> dict[int, list[int]]:
        return {r: list(self.gcs_steps) for r in range(self.nodes)}

    def chunks_of(self, rank: int, step: int) -> list[str]:
        """The chunk names of ``rank``'s manifest of ``step``: the same for every twin."""
        g = rank % self.group
        return [hashlib.blake2b(f"{g}/{step}/{i}".encode(), digest_size=16).hexdigest() for i in range(self.chunks)]


@dataclass
class Settings:
    net: NetModel = field(default_factory=NetModel)
    gcs: GcsModel = field(default_factory=GcsModel)
    k: int = 3
    interval: float = 30.0
    restore_wait: float = 15.0
    fan_out: int = broadcast.FAN_OUT
    workers: int = 8  # concurrent chunk fetches per node
    seed: int = 0


class SimNode:
    """One node: its coordination, its restore board, and the handler the network calls."""

    def __init__(
        self,
        job: JobModel,
        rank: int,
        net: SimNetwork,
        gcs: SimGcs,
        s: Settings,
        ram: bool,
        order: list[str],
        members: frozenset[str],
        start: float = 0.0,
    ):
        self.job, self.rank, self.net, self.gcs = job, rank, net, gcs
        self.address = job.address(rank)
        self.transport = net.transport(self.address)
        self.held = job.holdings(rank, ram)
        prefixes = listing_prefixes(job.nodes)
        self.coordination = Coordination(
            self.address,
            order,
            self.transport,
            lambda: self.held,
            nodes=job.nodes,
            members=members,
            list_gcs=lambda: list_sharded(gcs.list_prefix, prefixes),
            interval=s.interval,
            k=s.k,
            inc=int(start * 1e6) + 1,
        )
        self.board = broadcast.ChunkBoard()
        self.decision = None
        self.decided_at: float | None = None  # seconds from its start to its decision
        self.decided_abs: float | None = None
        self.restored_at: float | None = None
        self.fetch: broadcast.PlannedFetch | None = None
        net.listen(self.address, self.handle)

    async def handle(self, source: str, message: Message) -> Message:
        op = message.get("op")
        if op in Coordination.OPS:
            return await self.coordination.handle(source, message)
        if op == "await_chunk":
            return await self.board.handle(source, message)
        if op == "get_chunk":
            h, n = message.get("hash"), message.get("length")
            return {"ok": True, "len": n} if self.board.has(h) else {"error": "not found"}
        return {"error": f"unknown op {op!r}"}

    async def read_peer(self, address: str, h: str, length: int) -> int:
        reply = await self.transport.request(
            address,
            {"op": "get_chunk", "hash": h, "length": length},
            broadcast.RPC_TIMEOUT + length / self.net.model.bandwidth * 4,
        )
        if "error" in reply:
            raise broadcast.SourceFailed(reply["error"])
        return length

    async def read_gcs(self, h: str, length: int) -> int:
        try:
            return await self.gcs.read(self.address, h, length)
        except OSError as e:
            raise broadcast.SourceFailed(str(e)) from None


class Job:
    """A simulated job: a network, GCS, and one :class:`SimNode` per rank."""

    def __init__(self, job: JobModel, s: Settings, ram: bool = True, gcs_listing: dict | None = None):
        self.model, self.s = job, s
        self.net = SimNetwork(s.net, seed=s.seed)
        self.gcs = SimGcs(self.net, s.gcs, job.gcs_listing() if gcs_listing is None else gcs_listing)
        self.rng = random.Random(s.seed)
        self.ram = ram
        self.nodes: dict[int, SimNode] = {}
        self.order = candidates(JOB, [job.address(r) for r in range(job.nodes)])
        self.members = frozenset(self.order)
        self.rank_of = {job.address(r): r for r in range(job.nodes)}

    def add(self, rank: int, start: float = 0.0) -> SimNode:
        node = self.nodes[rank] = SimNode(
            self.model, rank, self.net, self.gcs, self.s, self.ram, self.order, self.members, start
        )
        return node

    def coordinator_ranks(self, n: int) -> list[int]:
        return [self.rank_of[a] for a in self.order[:n]]

    def kill(self, rank: int) -> None:
        self.net.down(self.model.address(rank))

    async def run_node(
        self,
        node: SimNode,
        at: float,
        script: Callable | None,
        before: str = "refused",
        task_status=trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Start ``node`` at time ``at`` (its coordination, then ``script(node)``); stops when it goes down.

        ``before``: what others see until then: "refused" (its host is up, the daemon is
        starting) or "timeout" (its host is not there yet: a replacement node).
        """
        host = self.net.hosts[node.address]
        with trio.CancelScope() as host.scope:
            task_status.started()
            if host.down:
                return
            if at > trio.current_time():
                host.down = before
                await trio.sleep_until(at)
                host.down = None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(node.coordination.run)
                if script is not None:
                    await script(node)

    def truth(self, live: list[int]) -> HoldingsView:
        """The view every coordinator should reach: the live nodes' holdings and the GCS listing."""
        view = HoldingsView(self.model.nodes)
        for r in live:
            view.put_holdings(self.model.address(r), self.nodes[r].held)
        view.put_listing(self.gcs_listing_now())
        return view

    def gcs_listing_now(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for name in self.gcs._names:
            rank, step = name.split("/")
            out.setdefault(int(rank[5:]), []).append(int(step[5:17]))
        return out


def on_mock_clock(fn, *args):
    """Run a scenario on a MockClock; returns (its result, CPU seconds it took here)."""
    t0 = time.process_time()
    clock = trio.testing.MockClock(autojump_threshold=0)
    result = trio.run(fn, *args, clock=clock)
    result["cpu_s"] = round(time.process_time() - t0, 2)
    return result
