#!/usr/bin/env python3
"""Rebuilding lost nodes at 1,000 to 10,000 nodes: erasure-coded stripes against replicas and GCS, simulated.

When nodes are lost, their replacements (fresh, empty hosts that take the lost ranks) need
their shards back before the job can restart, then their share of the redundancy before
the job survives the next losses. This benchmark times both, on the simulated network and
GCS of tierfs_testing.sim (trio's MockClock: the times are the model's, not this machine's),
for the peer tier's two ways of keeping redundancy, and for GCS when neither can help.

The model, and where each number comes from:

- The job: N nodes, one rank each, every rank with a shard of its own of S bytes (default
  4 GiB: a 70B-parameter model's training state, ~1.1 TB at 16 bytes a parameter for bf16
  weights, fp32 master weights and two Adam moments, spread over 256 hosts; no data-parallel
  twins, so no shard is anywhere but on its rank and its redundancy).
- The network (tierfs_testing.sim's NetModel): every NIC a FIFO each way at 25 Gb/s (a row
  at 100 Gb/s too), 0.25-0.35 ms one way, 50 us of CPU per message at its receiver. Bytes
  move in blocks, each pulled by a request and carried through the sender's and the
  receiver's NIC, 2 blocks in flight per link (more lets one chain's blocks queue ahead of
  the others' in the FIFOs). Blocks are 4 MiB, or 1/64 of a part where that is larger (to
  bound the simulation's events: 16 MiB for 4+2's 1 GiB parts); the flow estimate counts
  4 MiB blocks. With 1% lost at once, parts are cut in 16 blocks only, which makes a chain
  up to ~30% slower than finer blocks do: compare those rows with their "slowest alone".
- GCS (its GcsModel): 50 ms to the first byte, 100 MB/s a stream, 25 GB/s for the whole
  bucket; a rank restores with 8 reads at once (tierfs.tiers.gcs.THREADS) of 4 MiB chunks
  (tierfs' default chunk size): ~0.36 GB/s, 11.8 s for 4 GiB.
- CPU: 8 cores a node for the code, one FIFO at 8x the rate of a core. A term with a
  coefficient other than 1 (a multiply-add, a table lookup per two bytes) runs at 1.25 GiB/s
  a core, an XOR (coefficient 1) at 6 GiB/s a core: scripts/bench_erasure.py on this VM
  gave 1.26-1.40 GiB/s for a chain link and 7.0-7.9 GiB/s for the XOR rebuild of one part.
- Replication (--replicas r): rank x's copies are on ranks x+1..x+r (tierfs.peers.placement's
  ring order, without twins or topology labels). A replacement fetches its shard from the
  live holders, an equal share from each (r=2: half from each of two); with every holder
  lost too, from GCS. Its redundancy share is the r shards it held for its ring
  predecessors, each sent whole by its owner (by the owner's replacement once that has its
  shard back, if the owner was lost too): r x S.
- Erasure (--erasure D+P): groups of D+P consecutive ranks (the last N mod (D+P) ranks are in
  none and are never lost), laid out as tierfs.core.stripes lays them: a member has one part
  of ~S/D in each of D+P stripes, D of them its shard's parts and P of them parity. Every
  lost part has a repair plan from tierfs.core.erasure (D survivors and their coefficients;
  the code prefers data parts and the XOR parity, so one loss rebuilds by XOR alone).
  - chain: the plan's survivors pass a running sum along, each adding coefficient x its part
    and sending one part's worth on, the last one to the replacement; a survivor's CPU does
    its term. All chains run at once, pipelined by blocks, so the time is that of the
    busiest NIC or CPU. The replacement receives S for its shard and P x S/D of parity;
    each survivor sends ~one part per chain it is in. Of each chain's links, the survivor
    with the most bytes to receive so far starts it (the first link receives nothing).
  - all-to-one (the baseline the chain avoids): every survivor of a plan sends its part to
    the replacement, which computes: D parts for each lost part, so D x S for the shard and
    (D+P) x S in all, through one NIC and one CPU.
  - more than P members lost in a group: every stripe has lost more than P parts (a member
    has one in each), so nothing decodes: the lost members restore their shards from GCS,
    then their parity parts are encoded again by chains over the data givers.
- Phases: a replacement gets its shard first ("shard back": the job can restart), then its
  redundancy share ("redundant again": the next losses are survivable again). No training
  traffic shares the NICs meanwhile. Its redundancy phase waits for its shard and for the shards
  its sources need back first (a lost owner's; a GCS group's other members').
- Losses: "k in one domain" loses k consecutive ranks: k members of one erasure group, or a
  rank and its next holders (k = P+1, or r+1: what the redundancy cannot cover). Domains
  are disjoint for erasure groups, so this is the same at every N. "1% at once" loses
  round(N/100) ranks drawn at random (seeded), the same ranks for every scheme (all-to-one
  left out: its groups rebuild apart as the chain's do). "Slowest alone" simulates the
  slowest rank's domain (its group, or the lost ranks within 2r of it on the ring) by
  itself: the difference is what the other domains' rebuilds cost it. The odds that 1%
  lost at random leaves some domain with 2 losses, or beyond what it tolerates, are
  counted over 2000 random draws.

Each one-domain row gives the simulated times and a flow estimate: per phase, the busiest
NIC's bytes over its bandwidth, the busiest CPU's work or a GCS restore, whichever is the
longest, plus one block's trip per hop of the longest chain (the pipeline's fill).

    .venv/bin/python scripts/bench_erasure_scale.py [--nodes 1000,4000,10000] [--quick]
        [--erasure 4+2,8+2] [--replicas 1,2] [--nic 25,100] [--shard 4G]
        [--json scripts/results/bench-erasure-scale.json] [--plot docs/bench-erasure-scale.png]
    .venv/bin/python scripts/bench_erasure_scale.py --replot scripts/results/bench-erasure-scale.json \\
        --plot docs/bench-erasure-scale.png

The full run takes a few minutes of one core; ``--quick`` runs 100 and 400 nodes with
coarser blocks in seconds. ``--replot`` imports nothing of tierfs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import shlex
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

from benchlib import NO_MATPLOTLIB, parse_size, progress, pyplot, render_table, save_figure, size_label, write_json

GiB, MiB = 1 << 30, 1 << 20
LOSS_SHARE = 0.01  # of the nodes, lost at once in the "1% at once" case


@dataclass(frozen=True)
class Model:
    """What the rebuild runs on; the simulation's NetModel and GcsModel are made from it."""

    shard: int = 4 * GiB  # bytes of every rank's shard
    nic_gbit: float = 25.0  # each way, per node
    cores: int = 8  # a node's cores for the code
    mac_rate: float = 1.25 * GiB  # bytes/s a core, for a term whose coefficient is not 1
    xor_rate: float = 6.0 * GiB  # bytes/s a core, for a term whose coefficient is 1
    block: int = 4 * MiB  # bytes moved at a time along a chain or a copy
    max_blocks: int = 64  # the simulation cuts a part in at most this many blocks
    window: int = 2  # blocks in flight per link
    latency: float = 0.00025  # one way, seconds (NetModel)
    jitter: float = 0.0001  # uniform extra, one way (NetModel)
    service: float = 0.00005  # CPU seconds per message at its receiver (NetModel)
    gcs_first_byte: float = 0.05  # GcsModel
    gcs_stream: float = 100e6  # bytes/s of one read (GcsModel)
    gcs_total: float = 25e9  # bytes/s of the bucket to everyone (GcsModel)
    gcs_streams: int = 8  # reads at once per rank (tierfs.tiers.gcs.THREADS)
    gcs_chunk: int = 4 * MiB  # bytes per read (tierfs.core.chunks.DEFAULT_CHUNK_SIZE)

    @property
    def nic(self) -> float:
        """Bytes/s of a NIC, each way."""
        return self.nic_gbit * 1e9 / 8

    def rate(self, coefficient: int) -> float:
        """Bytes/s of a node's CPU for one term of a sum."""
        return self.cores * (self.xor_rate if coefficient == 1 else self.mac_rate)

    def hop(self, block: int) -> float:
        """Seconds for one block to cross one link with nothing queued: request, body, answer."""
        return block / self.nic + 2 * (self.latency + self.jitter / 2) + self.service

    def sim_blocks(self, length: int) -> list[int]:
        """The block sizes the simulation moves ``length`` bytes in."""
        if length <= 0:
            return []
        size = max(self.block, -(-length // self.max_blocks))
        return [size] * (length // size) + ([length % size] if length % size else [])


@dataclass(frozen=True)
class Scheme:
    """A way of keeping redundancy: ``replicas`` r, or an erasure code D+P repaired by chains or all-to-one."""

    kind: str  # "replicas", "chain" or "naive"
    r: int = 0
    d: int = 0
    p: int = 0

    @property
    def label(self) -> str:
        if self.kind == "replicas":
            return f"replicas {self.r}"
        return f"{self.d}+{self.p} " + ("chain" if self.kind == "chain" else "all-to-one")

    @property
    def key(self) -> str:
        return f"replicas{self.r}" if self.kind == "replicas" else f"ec{self.d}+{self.p}-{self.kind}"

    @property
    def tolerates(self) -> int:
        """Losses in one domain that need no GCS."""
        return self.r if self.kind == "replicas" else self.p

    @property
    def domain(self) -> int:
        """Ranks that share a fate: a rank and its holders, or a group."""
        return self.r + 1 if self.kind == "replicas" else self.d + self.p

    @property
    def overhead(self) -> float:
        """Redundancy bytes held per byte of shard."""
        return float(self.r) if self.kind == "replicas" else self.p / self.d


@dataclass(frozen=True)
class Chain:
    """One lost part: ``links`` (rank, coefficient) in chain order, the sum going to ``target``.

    ``naive``: every link sends its part to the target instead, which adds them up.
    """

    target: int
    links: tuple[tuple[int, int], ...]
    length: int
    naive: bool = False


@dataclass(frozen=True)
class Copy:
    """``length`` bytes of a shard from ``source`` to ``target``."""

    source: int
    target: int
    length: int


@dataclass(frozen=True)
class Restore:
    """``length`` bytes of ``target``'s shard from GCS."""

    target: int
    length: int


Item = Chain | Copy | Restore


@dataclass
class Rebuild:
    """One lost rank: what brings its shard back, then its redundancy share."""

    rank: int
    shard: list[Item]
    redundancy: list[Item]
    after: tuple[int, ...] = ()  # ranks whose shards must be back before the redundancy phase starts
    from_gcs: bool = False


def plan(scheme: Scheme, nodes: int, lost: set[int], shard: int) -> list[Rebuild]:
    """What rebuilds each lost rank under ``scheme``."""
    if not lost:
        return []
    if scheme.kind == "replicas":
        return replication_plan(scheme.r, nodes, lost, shard)
    return erasure_plan(scheme, nodes, lost, shard)


def replication_plan(r: int, nodes: int, lost: set[int], shard: int) -> list[Rebuild]:
    if not 1 <= r < nodes:
        raise ValueError(f"{r} replicas need more than {r} nodes")
    out = []
    for x in sorted(lost):
        live = [h for h in ((x + j) % nodes for j in range(1, r + 1)) if h not in lost]
        if live:
            share, extra = divmod(shard, len(live))
            items: list[Item] = [Copy(h, x, share + (i < extra)) for i, h in enumerate(live)]
        else:
            items = [Restore(x, shard)]
        owners = [(x - j) % nodes for j in range(1, r + 1)]
        out.append(
            Rebuild(
                x,
                items,
                [Copy(y, x, shard) for y in owners],
                after=tuple(y for y in owners if y in lost),
                from_gcs=not live,
            )
        )
    return out


def erasure_plan(scheme: Scheme, nodes: int, lost: set[int], shard: int) -> list[Rebuild]:
    from tierfs.core.erasure import Code
    from tierfs.core.stripes import Group, stripe_lengths

    group = Group(scheme.d, scheme.p)
    code = Code(group)
    n = group.size
    grouped = nodes - nodes % n
    if any(not 0 <= x < grouped for x in lost):
        raise ValueError(f"lost ranks must be among the {grouped} ranks in groups of {n}")
    lengths = stripe_lengths(group, [shard] * n)
    members: dict[int, list[int]] = defaultdict(list)
    for x in sorted(lost):
        members[x // n].append(x % n)
    received: Counter[int] = Counter()  # bytes each survivor receives along chains so far, for the links' order
    naive = scheme.kind == "naive"

    def chain(base: int, stripe: int, member: int, alive: list[int]) -> Chain:
        repair = code.repair_plan([group.slot(stripe, m) for m in alive], group.slot(stripe, member))
        links = [(base + group.member(stripe, t.slot), t.coefficient) for t in repair.terms]
        length = lengths[stripe]
        if not naive:
            first = max(range(len(links)), key=lambda i: (received[links[i][0]], -i))
            links = [links[first], *links[:first], *links[first + 1 :]]
            for rank, _ in links[1:]:
                received[rank] += length
        return Chain(base + member, tuple(links), length, naive)

    out = []
    for g, lost_members in sorted(members.items()):
        base = g * n
        if len(lost_members) > scheme.p:
            everyone = list(range(n))
            for m in lost_members:
                # Parity again from the data givers, once every member has its shard back.
                redundancy: list[Item] = [
                    chain(base, s, m, [k for k in everyone if k != m]) for s in group.parity_stripes(m)
                ]
                after = tuple(base + k for k in lost_members if k != m)
                out.append(Rebuild(base + m, [Restore(base + m, shard)], redundancy, after, from_gcs=True))
            continue
        alive = [k for k in range(n) if k not in lost_members]
        for m in lost_members:
            out.append(
                Rebuild(
                    base + m,
                    [chain(base, s, m, alive) for s in group.data_stripes(m)],
                    [chain(base, s, m, alive) for s in group.parity_stripes(m)],
                )
            )
    return out


@dataclass
class Loads:
    """Bytes through each NIC and seconds of each CPU for a set of items."""

    out: Counter = field(default_factory=Counter)
    into: Counter = field(default_factory=Counter)
    cpu: Counter = field(default_factory=Counter)
    hops: int = 0
    gcs: dict[int, int] = field(default_factory=dict)  # target -> bytes from GCS


def loads(model: Model, items: list[Item]) -> Loads:
    acc = Loads()
    for item in items:
        if isinstance(item, Restore):
            acc.gcs[item.target] = acc.gcs.get(item.target, 0) + item.length
            acc.into[item.target] += item.length
        elif isinstance(item, Copy):
            acc.out[item.source] += item.length
            acc.into[item.target] += item.length
            acc.hops = max(acc.hops, 1)
        elif item.naive:
            for rank, c in item.links:
                acc.out[rank] += item.length
                acc.into[item.target] += item.length
                acc.cpu[item.target] += item.length / model.rate(c)
            acc.hops = max(acc.hops, 1)
        else:
            for i, (rank, c) in enumerate(item.links):
                acc.out[rank] += item.length
                if i:
                    acc.into[rank] += item.length
                if i or c != 1:  # the first link of a sum sends its part as it is when its coefficient is 1
                    acc.cpu[rank] += item.length / model.rate(c)
            acc.into[item.target] += item.length
            acc.hops = max(acc.hops, len(item.links))
    return acc


def gcs_seconds(model: Model, length: int, readers: int = 1) -> float:
    """A rank's restore of ``length`` bytes from GCS, ``readers`` ranks restoring at once."""
    reads = -(-length // model.gcs_chunk)
    per_read = model.gcs_first_byte + min(model.gcs_chunk, length) / model.gcs_stream
    streams = -(-reads // model.gcs_streams) * per_read
    return max(streams, length / model.nic, readers * length / model.gcs_total)


def phase_seconds(model: Model, items: list[Item], block: int | None = None) -> float:
    """The flow estimate of a phase: its busiest NIC, CPU or GCS restore, plus the pipeline's fill."""
    acc = loads(model, items)
    nic = max([*acc.out.values(), *acc.into.values(), 0]) / model.nic
    cpu = max(acc.cpu.values(), default=0.0)
    gcs = max((gcs_seconds(model, n, len(acc.gcs)) for n in acc.gcs.values()), default=0.0)
    fill = acc.hops * model.hop(block or model.block)
    return max(nic, cpu, gcs) + fill


def estimate(model: Model, rebuilds: list[Rebuild], block: int | None = None) -> dict:
    """The flow estimate of a rebuild: every shard back, then every redundancy share, and the bytes that move."""
    shard_items = [i for r in rebuilds for i in r.shard]
    red_items = [i for r in rebuilds for i in r.redundancy]
    shard_s = phase_seconds(model, shard_items, block)
    first, second = loads(model, shard_items), loads(model, red_items)
    lost = {r.rank for r in rebuilds}
    survivors_out = Counter({k: v for k, v in (first.out + second.out).items() if k not in lost})
    return {
        "shard_s": round(shard_s, 3),
        "redundant_s": round(shard_s + phase_seconds(model, red_items, block), 3),
        "shard_in_max": max((first.into[x] for x in lost), default=0),
        "total_in_max": max((first.into[x] + second.into[x] for x in lost), default=0),
        "survivor_out_max": max(survivors_out.values(), default=0),
        "gcs_bytes": sum(first.gcs.values()) + sum(second.gcs.values()),
        "gcs_ranks": sum(r.from_gcs for r in rebuilds),
    }


def simulate(model: Model, rebuilds: list[Rebuild], seed: int = 0) -> dict:
    """Run the rebuilds on tierfs_testing.sim's network and GCS, on a MockClock."""
    from tierfs_testing.simjob import on_mock_clock

    return on_mock_clock(_simulate, model, rebuilds, seed)


async def _simulate(model: Model, rebuilds: list[Rebuild], seed: int) -> dict:
    import trio
    from tierfs_testing.sim import GcsModel, NetModel, SimGcs, SimNetwork

    net = SimNetwork(
        NetModel(latency=model.latency, jitter=model.jitter, service=model.service, bandwidth=model.nic), seed=seed
    )
    gcs = SimGcs(net, GcsModel(first_byte=model.gcs_first_byte, stream=model.gcs_stream, total=model.gcs_total))
    cpu_free: dict[int, float] = defaultdict(float)
    ready: dict[tuple[int, str, int], trio.Event] = {}
    back = {r.rank: trio.Event() for r in rebuilds}
    shard_at: dict[int, float] = {}
    redundant_at: dict[int, float] = {}

    def address(rank: int) -> str:
        return f"n{rank}"

    def event(rank: int, key: str, i: int) -> trio.Event:
        found = ready.get((rank, key, i))
        if found is None:
            found = ready[rank, key, i] = trio.Event()
        return found

    async def compute(rank: int, n: int, coefficient: int) -> None:
        now = trio.current_time()
        cpu_free[rank] = max(now, cpu_free[rank]) + n / model.rate(coefficient)
        await net.sleep_until(cpu_free[rank])

    def serve(rank: int):
        async def handle(source: str, message: dict) -> dict:
            key, i, n, c = message["key"], message["i"], message["n"], message["c"]
            if key.startswith("sum:"):
                await event(rank, key, i).wait()
            elif c != 1:
                await compute(rank, n, c)  # the first link of a sum: its part times its coefficient
            return {"ok": True, "len": n}

        return handle

    ranks = {x for r in rebuilds for x in (r.rank, *r.after)}
    for r in rebuilds:
        for item in (*r.shard, *r.redundancy):
            if isinstance(item, Copy):
                ranks.add(item.source)
            elif isinstance(item, Chain):
                ranks.update(rank for rank, _ in item.links)
    for rank in ranks:
        net.listen(address(rank), serve(rank))

    async def pull(dst: int, src: int, key: str, coefficient: int, sizes: list[int], then) -> None:
        """Every block of ``key`` from ``src`` to ``dst``, ``window`` at a time, each followed by ``then(i, n)``."""
        transport = net.transport(address(dst))

        async def worker(w: int) -> None:
            for i in range(w, len(sizes), model.window):
                message = {"op": "block", "key": key, "i": i, "n": sizes[i], "c": coefficient}
                await transport.request(address(src), message, timeout=1e9)
                await then(i, sizes[i])

        async with trio.open_nursery() as nursery:
            for w in range(min(model.window, len(sizes))):
                nursery.start_soon(worker, w)

    serial = iter(range(1 << 62))

    async def run_chain(item: Chain) -> None:
        sizes = model.sim_blocks(item.length)
        c = next(serial)
        async with trio.open_nursery() as nursery:
            if item.naive:
                for rank, coefficient in item.links:

                    async def add(i: int, n: int, coefficient: int = coefficient) -> None:
                        await compute(item.target, n, coefficient)

                    nursery.start_soon(pull, item.target, rank, f"raw:{c}", 1, sizes, add)
                return
            for k in range(1, len(item.links)):
                rank, coefficient = item.links[k]
                prev, prev_c = item.links[k - 1]
                source = f"sum:{c}:{k - 1}" if k > 1 else f"raw:{c}"

                async def link(i: int, n: int, rank: int = rank, coefficient: int = coefficient, k: int = k) -> None:
                    await compute(rank, n, coefficient)
                    event(rank, f"sum:{c}:{k}", i).set()

                nursery.start_soon(pull, rank, prev, source, prev_c, sizes, link)
            last, last_c = item.links[-1]
            final = f"sum:{c}:{len(item.links) - 1}" if len(item.links) > 1 else f"raw:{c}"

            async def arrived(i: int, n: int) -> None:
                pass

            nursery.start_soon(pull, item.target, last, final, last_c, sizes, arrived)

    async def run_item(item: Item) -> None:
        if isinstance(item, Chain):
            await run_chain(item)
        elif isinstance(item, Copy):

            async def arrived(i: int, n: int) -> None:
                pass

            await pull(item.target, item.source, "raw:copy", 1, model.sim_blocks(item.length), arrived)
        else:
            reads = [model.gcs_chunk] * (item.length // model.gcs_chunk)
            reads += [item.length % model.gcs_chunk] if item.length % model.gcs_chunk else []

            async def reader(w: int) -> None:
                for i in range(w, len(reads), model.gcs_streams):
                    await gcs.read(address(item.target), f"{item.target}/{i}", reads[i])

            async with trio.open_nursery() as nursery:
                for w in range(min(model.gcs_streams, len(reads))):
                    nursery.start_soon(reader, w)

    async def rebuild(r: Rebuild) -> None:
        async with trio.open_nursery() as nursery:
            for item in r.shard:
                nursery.start_soon(run_item, item)
        shard_at[r.rank] = trio.current_time()
        back[r.rank].set()
        for rank in r.after:
            await back[rank].wait()
        async with trio.open_nursery() as nursery:
            for item in r.redundancy:
                nursery.start_soon(run_item, item)
        redundant_at[r.rank] = trio.current_time()

    start = trio.current_time()
    async with trio.open_nursery() as outer:
        await outer.start(net.run)
        async with trio.open_nursery() as nursery:
            for r in rebuilds:
                nursery.start_soon(rebuild, r)
        outer.cancel_scope.cancel()
    shard = [t - start for t in shard_at.values()]
    redundant = [t - start for t in redundant_at.values()]
    return {
        "shard_s": round(max(shard, default=0.0), 3),
        "redundant_s": round(max(redundant, default=0.0), 3),
        "shard_s_median": round(sorted(shard)[len(shard) // 2], 3) if shard else 0.0,
        "slowest_rank": max(shard_at, key=lambda x: (shard_at[x], redundant_at[x]), default=None),
        "blocks_moved": sum(net.stats.answers.values()),
        "body_bytes": sum(net.stats.body_bytes.values()),
        "gcs_bytes_read": gcs.bytes_read,
    }


def domain_losses(scheme: Scheme, k: int) -> set[int]:
    """``k`` consecutive ranks from 0: members of one group, or a rank and its next holders."""
    return set(range(k))


def covered(nodes: int, schemes: list[Scheme]) -> int:
    """Ranks 0..covered-1 are in a group of every erasure scheme: the only ranks the random losses pick from."""
    return min((nodes - nodes % s.domain for s in schemes if s.kind != "replicas"), default=nodes)


def random_losses(nodes: int, schemes: list[Scheme], share: float, seed: int) -> set[int]:
    """round(nodes x share) ranks at random, all among the ranks every scheme's groups cover."""
    return set(random.Random(seed).sample(range(covered(nodes, schemes)), max(1, round(nodes * share))))


def domain_counts(scheme: Scheme, nodes: int, lost: set[int]) -> dict:
    """How the lost ranks fall: domains (groups, or a rank and its holders) that lost 2 up to what they
    tolerate, and domains that lost more."""
    if scheme.kind == "replicas":
        counts = [sum((x + j) % nodes in lost for j in range(scheme.r + 1)) for x in lost]
    else:
        counts = list(Counter(x // scheme.domain for x in lost).values())
    return {
        "several": sum(1 for c in counts if 2 <= c <= scheme.tolerates),
        "beyond": sum(1 for c in counts if c > scheme.tolerates),
    }


def component(scheme: Scheme, nodes: int, lost: set[int], rank: int) -> set[int]:
    """The lost ranks whose rebuilds can share a NIC with ``rank``'s: its group's, or, with replicas,
    those linked to it by ring distances of at most 2r (a holder of one is an owner of another)."""
    if scheme.kind != "replicas":
        return {x for x in lost if x // scheme.domain == rank // scheme.domain}
    linked, todo = {rank}, [rank]
    while todo:
        x = todo.pop()
        for y in lost - linked:
            if min((x - y) % nodes, (y - x) % nodes) <= 2 * scheme.r:
                linked.add(y)
                todo.append(y)
    return linked


def odds(scheme: Scheme, nodes: int, covered: int, share: float, draws: int, seed: int) -> dict:
    """Over ``draws`` random losses of ``share`` of the nodes: how often some domain loses 2 or more,
    and how often some domain loses more than it tolerates (so some rank comes from GCS)."""
    rng = random.Random(seed)
    count = max(1, round(nodes * share))
    several = beyond = 0
    for _ in range(draws):
        c = domain_counts(scheme, nodes, set(rng.sample(range(covered), count)))
        several += c["several"] > 0 or c["beyond"] > 0
        beyond += c["beyond"] > 0
    return {"draws": draws, "some_domain_2_or_more": several / draws, "some_domain_beyond": beyond / draws}


def run_case(model: Model, scheme: Scheme, nodes: int, lost: set[int], seed: int, alone: bool = False) -> dict:
    """Simulate the rebuild of ``lost`` and estimate it; ``alone``: also the slowest rank's component by itself."""
    rebuilds = plan(scheme, nodes, lost, model.shard)
    moved = [i.length for r in rebuilds for i in (*r.shard, *r.redundancy) if not isinstance(i, Restore)]
    out = {
        "scheme": scheme.key,
        "lost": len(lost),
        "sim": simulate(model, rebuilds, seed),
        "estimate": estimate(model, rebuilds),
        "sim_block": max((model.sim_blocks(n)[0] for n in moved if n), default=0),
    }
    out.update(domain_counts(scheme, nodes, lost))
    if alone and out["sim"]["slowest_rank"] is not None:
        part = component(scheme, nodes, lost, out["sim"]["slowest_rank"])
        out["alone"] = {"lost": sorted(part), "sim": simulate(model, plan(scheme, nodes, part, model.shard), seed)}
    return out


def parse_schemes(erasure: str, replicas: str) -> list[Scheme]:
    from tierfs.core.stripes import parse_shape

    schemes = [Scheme("replicas", r=int(r)) for r in replicas.split(",") if r.strip()]
    for text in (s for s in erasure.split(",") if s.strip()):
        g = parse_shape(text)
        schemes += [Scheme("chain", d=g.d, p=g.p), Scheme("naive", d=g.d, p=g.p)]
    return schemes


@dataclass(frozen=True)
class Run:
    """What a run measures, besides the model."""

    schemes: list[Scheme]
    sizes: list[int]
    nics: list[float]
    seed: int = 0
    at_once_blocks: int = 16  # blocks a part is cut in at most, when many domains rebuild at once
    draws: int = 2000  # random draws for the odds of a domain losing several


def measure(model: Model, run: Run) -> dict:
    """Every scheme at every NIC speed: k losses in one domain, then 1% of the nodes at once per job size.

    All-to-one is left out of the at-once runs: its groups rebuild apart as the chain's do, D times slower.
    """
    ks = sorted({1, 2, *(s.tolerates + 1 for s in run.schemes)})
    results: dict = {"domain": {}, "at_once": {}, "odds": {}}
    for n in run.sizes:
        for scheme in run.schemes:
            if scheme.kind != "naive":
                results["odds"][f"{scheme.key}/{n}"] = odds(
                    scheme, n, covered(n, run.schemes), LOSS_SHARE, run.draws, run.seed
                ) | {"label": scheme.label, "nodes": n}
    for nic in run.nics:
        m = Model(**{**asdict(model), "nic_gbit": nic})
        for scheme in run.schemes:
            for k in ks:
                t0 = time.process_time()
                case = run_case(m, scheme, max(run.sizes[0], scheme.domain * 4), domain_losses(scheme, k), run.seed)
                results["domain"][f"{nic:g}/{scheme.key}/{k}"] = case | {"nic_gbit": nic, "label": scheme.label, "k": k}
                progress(
                    f"{nic:g} Gb/s {scheme.label}, {k} lost in one domain: shard back {case['sim']['shard_s']:.2f} s, "
                    f"redundant {case['sim']['redundant_s']:.2f} s ({time.process_time() - t0:.1f} CPU-s)"
                )
        coarse = Model(**{**asdict(m), "max_blocks": run.at_once_blocks})
        for n in run.sizes:
            lost = random_losses(n, run.schemes, LOSS_SHARE, run.seed)
            for scheme in run.schemes:
                if scheme.kind == "naive":
                    continue
                t0 = time.process_time()
                case = run_case(coarse, scheme, n, lost, run.seed, alone=True)
                results["at_once"][f"{nic:g}/{scheme.key}/{n}"] = case | {
                    "nic_gbit": nic,
                    "label": scheme.label,
                    "nodes": n,
                }
                progress(
                    f"{nic:g} Gb/s {scheme.label}, {n} nodes, {len(lost)} lost at once: shard back "
                    f"{case['sim']['shard_s']:.2f} s, redundant {case['sim']['redundant_s']:.2f} s "
                    f"({time.process_time() - t0:.1f} CPU-s)"
                )
    return results


def _times(case: dict) -> tuple[str, str]:
    return f"{case['sim']['shard_s']:.2f}", f"{case['sim']['redundant_s']:.2f}"


def render(results: dict, settings: dict) -> str:
    shard = settings["model"]["shard"]
    lines = [
        f"### k ranks lost in one domain (a group, or a rank and its holders); shard {size_label(shard)} a rank",
        "",
        "times in seconds from the loss, simulated; estimate = the flow estimate; bytes in units of one shard",
        "",
    ]
    head = (
        "NIC",
        "scheme",
        "lost",
        "shard back",
        "redundant again",
        "estimate",
        "into a replacement (shard / all)",
        "busiest survivor out (both phases)",
        "from GCS",
    )
    body = []
    for case in results["domain"].values():
        e = case["estimate"]
        body.append(
            (
                f"{case['nic_gbit']:g} Gb/s",
                case["label"],
                str(case["k"]),
                *_times(case),
                f"{e['shard_s']:.2f} / {e['redundant_s']:.2f}",
                f"{e['shard_in_max'] / shard:.2f} / {e['total_in_max'] / shard:.2f}",
                f"{e['survivor_out_max'] / shard:.2f}",
                f"{e['gcs_ranks']} rank{'s' if e['gcs_ranks'] > 1 else ''}" if e["gcs_ranks"] else "-",
            )
        )
    lines.append(render_table(head, body, left=2))
    lines += [
        "",
        f"### {LOSS_SHARE:.0%} of the nodes lost at once (the same random ranks for every scheme)",
        "",
        "parts cut in at most {} blocks (coarser than above, so slower): compare with 'slowest alone', "
        "the slowest rank's domain simulated by itself at the same blocks".format(settings["at_once_blocks"]),
        "",
    ]
    head = (
        "NIC",
        "scheme",
        "nodes",
        "lost",
        "domains losing 2..tolerated / more",
        "shard back",
        "redundant again",
        "slowest alone",
    )
    body = []
    for case in results["at_once"].values():
        alone = case.get("alone")
        body.append(
            (
                f"{case['nic_gbit']:g} Gb/s",
                case["label"],
                f"{case['nodes']:,}",
                str(case["lost"]),
                f"{case['several']} / {case['beyond']}",
                *_times(case),
                " / ".join(_times(alone)) if alone else "-",
            )
        )
    lines.append(render_table(head, body, left=2))
    draws = {o["draws"] for o in results["odds"].values()}
    lines += [
        "",
        f"### How often {LOSS_SHARE:.0%} lost at random hits a domain twice or beyond what it tolerates "
        f"({', '.join(map(str, draws))} draws)",
        "",
    ]
    head = ("scheme", "nodes", "some domain loses 2+", "some domain beyond (a rank from GCS)")
    body = [
        (o["label"], f"{o['nodes']:,}", f"{o['some_domain_2_or_more']:.1%}", f"{o['some_domain_beyond']:.1%}")
        for o in results["odds"].values()
    ]
    lines.append(render_table(head, body, left=1))
    return "\n".join(lines)


def plot(path: str, results: dict, title: str) -> str | None:
    """Per NIC speed, k losses in one domain; then 1% lost at once by job size, and how often that needs GCS."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    from matplotlib.ticker import ScalarFormatter

    domain, at_once, odds = results["domain"], results["at_once"], results["odds"]
    nics = sorted({c["nic_gbit"] for c in domain.values()})
    labels = list(dict.fromkeys(c["label"] for c in domain.values()))
    colors = {label: f"C{i}" for i, label in enumerate(labels)}
    ks = sorted({c["k"] for c in domain.values()})
    fig, axes = plt.subplots(1, len(nics) + 2, figsize=(5.0 * (len(nics) + 2), 4.6), squeeze=False)
    axes = list(axes[0])
    width = 0.8 / len(labels)
    for ax, nic in zip(axes, nics, strict=False):
        for j, label in enumerate(labels):
            cases = {c["k"]: c for c in domain.values() if c["nic_gbit"] == nic and c["label"] == label}
            xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(ks))]
            ax.bar(xs, [cases[k]["sim"]["shard_s"] for k in ks], width, color=colors[label], label=label)
            ax.scatter(
                xs, [cases[k]["sim"]["redundant_s"] for k in ks], s=60, color=colors[label], marker="_", linewidths=2
            )
        ax.set_xticks(range(len(ks)), [f"{k} lost" for k in ks])
        ax.set(yscale="log", ylim=(0.1, 40), ylabel="seconds: bar, shard back; dash, redundant again")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.set_title(f"k ranks of one domain lost, {nic:g} Gb/s NICs", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    tx, ox = axes[-2:]
    sizes = sorted({c["nodes"] for c in at_once.values()} | {o["nodes"] for o in odds.values()})
    styles = ("o-", "s--", "^:", "v-.")
    for label in labels:
        for nic, style in zip(nics, styles, strict=False):
            cases = sorted(
                (c for c in at_once.values() if c["label"] == label and c["nic_gbit"] == nic), key=lambda c: c["nodes"]
            )
            if cases:
                tx.plot(
                    [c["nodes"] for c in cases],
                    [c["sim"]["shard_s"] for c in cases],
                    style,
                    color=colors[label],
                    label=f"{label}, {nic:g} Gb/s",
                )
        rows = sorted((o for o in odds.values() if o["label"] == label), key=lambda o: o["nodes"])
        if rows:
            ox.plot(
                [o["nodes"] for o in rows], [100 * o["some_domain_beyond"] for o in rows], "o-", color=colors[label]
            )
            ox.plot(
                [o["nodes"] for o in rows],
                [100 * o["some_domain_2_or_more"] for o in rows],
                "s:",
                color=colors[label],
                label=label,
            )
    tx.set(xscale="log", yscale="log", xlabel="nodes", ylabel="seconds until every lost shard is back")
    tx.set_title(f"{LOSS_SHARE:.0%} of the nodes lost at once", fontsize=9)
    tx.yaxis.set_major_formatter(ScalarFormatter())
    tx.legend(fontsize=6, ncol=2)
    ox.set(xscale="log", ylim=(0, 105), xlabel="nodes", ylabel="% of random draws")
    ox.set_title(
        f"{LOSS_SHARE:.0%} lost at random: some domain beyond its tolerance,\nso a rank from GCS (solid), "
        "or losing 2+ (dotted)",
        fontsize=9,
    )
    ox.legend(fontsize=7)
    for ax in (tx, ox):
        ax.minorticks_off()
        ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)
    return None


def title(settings: dict) -> str:
    m = settings["model"]
    return (
        f"tierfs rebuild after node losses, simulated (MockClock), shard {size_label(m['shard'])} a rank, "
        f"{m['cores']} cores a node, {settings['date'][:10]}"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", help="comma-separated job sizes (default 1000,4000,10000; --quick: 100,400)")
    p.add_argument("--quick", action="store_true", help="smoke run at 100 and 400 nodes, coarser blocks")
    p.add_argument("--erasure", default="4+2,8+2", help="comma-separated D+P shapes (default 4+2,8+2)")
    p.add_argument("--replicas", default="1,2", help="comma-separated replica counts (default 1,2)")
    p.add_argument("--nic", default="25,100", help="comma-separated NIC speeds, Gb/s each way (default 25,100)")
    p.add_argument("--shard", type=parse_size, default=Model.shard, help="bytes of a rank's shard (default 4G)")
    p.add_argument("--cores", type=int, default=Model.cores, help="a node's cores for the code (default 8)")
    p.add_argument("--mac-rate", type=float, default=Model.mac_rate / GiB, help="GiB/s a core, multiply-add")
    p.add_argument("--xor-rate", type=float, default=Model.xor_rate / GiB, help="GiB/s a core, XOR")
    p.add_argument("--max-blocks", type=int, help="blocks a part is cut in at most, one domain (default 64; quick 16)")
    p.add_argument("--at-once-blocks", type=int, help="... when 1%% are lost at once (default 16; quick 8)")
    p.add_argument("--seed", type=int, default=0, help="which ranks are lost at once, and the network's jitter")
    p.add_argument("--json", metavar="PATH", help="write the settings and every measurement")
    p.add_argument("--plot", metavar="PATH.png", help="panels of the results (needs matplotlib)")
    p.add_argument("--replot", metavar="JSON", help="print the tables and draw --plot from a saved --json")
    args = p.parse_args()
    if args.replot:
        import json

        with open(args.replot) as f:
            saved = json.load(f)
        print(f"# bench_erasure_scale {saved['settings']['date']}  command: {saved['settings']['command']}")
        print(render(saved["results"], saved["settings"]))
        if args.plot:
            why = plot(args.plot, saved["results"], title(saved["settings"]))
            print(f"# plot skipped: {why}" if why else f"# wrote {args.plot}")
        return 0
    try:
        sizes = [int(x) for x in (args.nodes or ("100,400" if args.quick else "1000,4000,10000")).split(",")]
        nics = [float(x) for x in args.nic.split(",")]
        schemes = parse_schemes(args.erasure, args.replicas)
    except ValueError as e:
        p.error(f"bad list: {e}")
    if not schemes or any(n < 2 * max(s.domain for s in schemes) for n in sizes) or args.cores < 1:
        p.error("give at least one scheme, job sizes of at least two domains, and at least one core")
    model = Model(
        shard=args.shard,
        cores=args.cores,
        mac_rate=args.mac_rate * GiB,
        xor_rate=args.xor_rate * GiB,
        max_blocks=args.max_blocks or (16 if args.quick else Model.max_blocks),
    )
    run = Run(
        schemes,
        sizes,
        nics,
        seed=args.seed,
        at_once_blocks=args.at_once_blocks or (8 if args.quick else Run.at_once_blocks),
        draws=500 if args.quick else Run.draws,
    )
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    cmd = shlex.join([sys.executable, *sys.argv])
    settings = {
        "nodes": sizes,
        "nics_gbit": nics,
        "schemes": [s.key for s in schemes],
        "at_once_blocks": run.at_once_blocks,
        "odds_draws": run.draws,
        "loss_share": LOSS_SHARE,
        "seed": args.seed,
        "date": now,
        "command": cmd,
        "cores": os.cpu_count(),
        "model": asdict(model),
    }
    print(f"# bench_erasure_scale {now}  command: {cmd}", flush=True)
    t0 = time.process_time()
    try:
        results = measure(model, run)
    except KeyboardInterrupt:
        print("bench_erasure_scale: interrupted", file=sys.stderr)
        return 130
    settings["cpu_s"] = round(time.process_time() - t0, 1)
    print(render(results, settings))
    if args.json:
        write_json(args.json, {"settings": settings, "results": results})
    if args.plot:
        why = plot(args.plot, results, title(settings))
        print(f"# plot skipped: {why}" if why else f"# wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
