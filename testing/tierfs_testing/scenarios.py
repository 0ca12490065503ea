"""Whole jobs on the simulated network: report rounds, a restart decision, a broadcast restore.

Every node runs the real :class:`~tierfs.coordination.node.Coordination`, asks
for its step with :meth:`~tierfs.coordination.member.Member.decide`, places
replicas with :func:`tierfs.peers.placement.choose`, plans a restore with
:func:`~tierfs.coordination.broadcast.plan` and fetches with
:class:`~tierfs.coordination.broadcast.PlannedFetch`. Only the wire (and GCS) is simulated
(:mod:`tierfs_testing.sim`). Each scenario is one ``trio.run`` on a MockClock and
returns what it measured as a JSON-able dict; ``scripts/bench_scale.py`` prints and plots
them. The job they run, its nodes and settings are :mod:`tierfs_testing.simjob`'s.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import trio

from tierfs.coordination import broadcast
from tierfs.coordination.view import GCS, Holdings
from tierfs_testing.simjob import Job, JobModel, MiB, Settings, SimNode, on_mock_clock

COORD_OPS = ("coord_report", "coord_decide", "coord_pull")


async def _poll_until(done: Callable[[], bool], every: float) -> None:
    """Wait until ``done()``, looking every ``every`` s of the mock clock. A poll and not an
    event: its cadence sets when a scenario acts next (a kill mid-restore, the end of a count),
    and so what the scenario measures."""
    while not done():  # noqa: ASYNC110 (the cadence is part of the scenario, as above)
        await trio.sleep(every)


def _per_node(stats, ops, nodes: int, rounds: float = 1.0) -> dict:
    requests = sum(stats.requests[o] for o in ops)
    answers = sum(stats.answers[o] for o in ops)
    size = sum(stats.request_bytes[o] + stats.answer_bytes[o] for o in ops)
    return {
        "requests_per_node": round(requests / nodes / rounds, 3),
        "messages_per_node": round((requests + answers) / nodes / rounds, 3),
        "bytes_per_node": round(size / nodes / rounds),
    }


# -- scenario 1: report rounds in a running job -----------------------------------------


def rounds(nodes: int, s: Settings | None = None, steady: int = 2, after: int = 3, lost: float = 0.001) -> dict:
    """A running job's report rounds: requests, messages and bytes per node per round.

    ``steady`` rounds with every node up, then the first coordinator and a ``lost`` share
    of the nodes go down and ``after`` rounds more are counted; by then every view must
    have dropped what the lost nodes held.
    """
    return on_mock_clock(_rounds, JobModel(nodes), s or Settings(), steady, after, lost)


async def _rounds(model: JobModel, s: Settings, steady: int, after: int, lost: float) -> dict:
    job = Job(model, s)
    for r in range(model.nodes):
        job.add(r)
    first = job.coordinator_ranks(1)[0]
    others = [r for r in range(model.nodes) if r != first]
    dead = {first, *job.rng.sample(others, int(lost * model.nodes))}
    live = [r for r in range(model.nodes) if r not in dead]
    out = {"nodes": model.nodes, "lost_nodes": len(dead) - 1}
    async with trio.open_nursery() as nursery:
        await nursery.start(job.net.run)
        for node in job.nodes.values():
            nursery.start_soon(job.run_node, node, job.rng.uniform(0, 5.0), None)
        await trio.sleep(2 * s.interval)  # everyone reported twice: the coordinators are settled
        coords = [model.address(r) for r in job.coordinator_ranks(s.k)]
        for phase, n_rounds in (("steady", steady), ("after_failures", after)):
            if phase == "after_failures":
                for r in dead:
                    job.kill(r)
                coords = [model.address(r) for r in job.coordinator_ranks(s.k + 1) if r != first]
            job.net.stats.reset()
            listings = job.gcs.list_requests
            await trio.sleep(n_rounds * s.interval)
            stats = job.net.stats
            out[phase] = {
                **_per_node(stats, COORD_OPS, model.nodes, n_rounds),
                "coordinator_requests_per_round": round(max(stats.received[a] for a in coords) / n_rounds),
                "gcs_list_requests_per_round": round((job.gcs.list_requests - listings) / n_rounds, 1),
                "timeouts_per_round": round(sum(stats.timeouts.values()) / n_rounds, 1),
            }
        truth = job.truth(live)
        summaries = [job.nodes[r].coordination.member.summary for r in live]
        out["views_agree"] = all(
            x is not None and x["newest"] == truth.newest_complete() and x["floor"] == truth.retention_floor()
            for x in summaries
        )
        nursery.cancel_scope.cancel()
    pages = max(1, -(-model.nodes * len(model.gcs_steps) // s.gcs.page_objects))
    out["today"] = {
        "requests_per_node": 4 * (model.nodes - 1),  # hello, auth, info, list to every peer
        "gcs_list_requests_per_round": model.nodes * pages,
    }
    return out


# -- scenario 2: a restart decision with a coordinator lost --------------------------------


def decision(
    nodes: int,
    s: Settings | None = None,
    coordinators_lost: int = 1,
    nodes_lost: int = 0,
    late: int = 1,
    late_at: float = 10.0,
) -> dict:
    """Every node asks for its step at once; ``coordinators_lost`` of the first coordinators
    and ``nodes_lost`` other nodes are down for good; ``late`` nodes start ``late_at`` s later."""
    return on_mock_clock(_decision, JobModel(nodes), s or Settings(), coordinators_lost, nodes_lost, late, late_at)


async def _decide_and_announce(node: SimNode, wait: float) -> None:
    t0 = trio.current_time()
    member = node.coordination.member
    d = await member.decide(node.rank, node.job.twins(node.rank), wait=wait)
    node.decision, node.decided_at = d, trio.current_time() - t0
    held = node.held
    node.held = Holdings(held.rank, held.steps, held.replicas, d.step, held.topology)
    await member.report()  # announce the step it runs from: nodes that come later adopt it


async def _decision(model: JobModel, s: Settings, c_lost: int, n_lost: int, late: int, late_at: float) -> dict:
    job = Job(model, s)
    for r in range(model.nodes):
        job.add(r)
    coords = job.coordinator_ranks(c_lost)
    others = [r for r in range(model.nodes) if r not in coords]
    dead = set(coords) | set(job.rng.sample(others, n_lost))
    late_ranks = set(job.rng.sample([r for r in others if r not in dead], late))
    live = [r for r in range(model.nodes) if r not in dead]
    truth = job.truth(live)
    starts = {r: (late_at if r in late_ranks else job.rng.uniform(0, 0.5)) for r in live}
    for r in late_ranks:
        job.nodes[r].coordination.member.inc = int(late_at * 1e6)
    script = lambda node: _decide_and_announce(node, s.restore_wait)  # noqa: E731
    async with trio.open_nursery() as nursery:
        await nursery.start(job.net.run)
        for r in dead:
            job.kill(r)
        for r in live:
            nursery.start_soon(
                job.run_node, job.nodes[r], starts[r], script, "timeout" if r in late_ranks else "refused"
            )
        await _poll_until(lambda: all(job.nodes[r].decided_at is not None for r in live), 0.25)
        nursery.cancel_scope.cancel()
    on_time = [r for r in live if r not in late_ranks]
    times = [starts[r] + job.nodes[r].decided_at for r in on_time]
    steps = {job.nodes[r].decision.step for r in live}
    expected = {truth.choose(r) for r in live}
    stats = job.net.stats
    return {
        "nodes": model.nodes,
        "coordinators_lost": c_lost,
        "nodes_lost": n_lost,
        "gcs_slow": s.gcs.slow,
        "decision_s_max": round(max(times), 3),
        "decision_s_median": round(statistics.median(times), 3),
        "late_decision_s": round(max((job.nodes[r].decided_at for r in late_ranks), default=0.0), 3),
        "all_ready": all(job.nodes[r].decision.ready for r in live),
        "agree": len(steps) == 1,
        "step": sorted(steps, key=lambda x: (x is None, x))[0],
        "matches_rules": steps == expected,
        **_per_node(stats, COORD_OPS, len(live)),
        "timeouts": sum(stats.timeouts.values()),
    }


# -- scenario 3: D twins restore from GCS together ----------------------------------------


def restore(
    nodes: int,
    s: Settings | None = None,
    mode: str = "broadcast",
    fail: float = 0.0,
    chunks: int = 8,
    chunk_size: int = 16 * MiB,
) -> dict:
    """Every RAM is lost; every rank restores the newest step from GCS, its twins at the same time.

    ``mode``: "broadcast" (planned) or "today" (every node reads all its chunks from GCS).
    ``fail``: the share of nodes that go down once the restores are under way.
    """
    model = JobModel(nodes, chunks=chunks, chunk_size=chunk_size)
    return on_mock_clock(_restore, model, s or Settings(), mode, fail)


async def _restore_node(node: SimNode, job: Job, mode: str) -> None:
    t0 = trio.current_time()
    model, s = job.model, job.s
    member = node.coordination.member
    group = model.twins(node.rank)
    d = await member.decide(node.rank, group, wait=s.restore_wait)
    node.decision, node.decided_at = d, trio.current_time() - t0
    node.decided_abs = trio.current_time()
    if d.step is None:
        return
    chunks = model.chunks_of(node.rank, d.step)
    sizes = dict.fromkeys(chunks, model.chunk_size)
    ranks = [node.rank, *group]
    if mode == "today":
        plan = broadcast.NodePlan(node.address, list(chunks), {h: (broadcast.GCS_SOURCE,) for h in chunks})
    else:
        needing = d.needing(ranks, d.step)
        needs = {a: chunks for addrs in needing.values() for a in addrs}
        holders = [a for r in ranks for a in d.holders(r, d.step) if a != GCS]
        in_gcs = any(GCS in d.holders(r, d.step) for r in ranks)
        plan = broadcast.plan(needs, sizes, dict.fromkeys(chunks, holders), in_gcs, fan_out=s.fan_out)[node.address]
    node.fetch = broadcast.PlannedFetch(plan, node.transport, node.read_peer, node.read_gcs, node.board, dead=d.down)
    await node.fetch.prefetch(sizes, s.workers)
    node.restored_at = trio.current_time()


async def _restore(model: JobModel, s: Settings, mode: str, fail: float) -> dict:
    job = Job(model, s, ram=False)
    for r in range(model.nodes):
        job.add(r)
    coordinators = set(job.coordinator_ranks(s.k + 1))
    victims = job.rng.sample([r for r in range(model.nodes) if r not in coordinators], int(fail * model.nodes))
    script = lambda node: _restore_node(node, job, mode)  # noqa: E731
    async with trio.open_nursery() as nursery:
        await nursery.start(job.net.run)
        for node in job.nodes.values():
            nursery.start_soon(job.run_node, node, job.rng.uniform(0, 0.5), script)
        if victims:
            await _poll_until(lambda: all(job.nodes[r].decided_at is not None for r in victims), 0.05)
            await trio.sleep(0.03)  # mid-restore: before their first chunk is in
            for r in victims:
                job.kill(r)
        live = [r for r in range(model.nodes) if r not in victims]
        await _poll_until(lambda: all(job.nodes[r].restored_at is not None for r in live), 0.25)
        nursery.cancel_scope.cancel()
    unique = model.group * model.chunks * model.chunk_size
    decided = [job.nodes[r].decided_at for r in live]
    done = [job.nodes[r].restored_at for r in live]
    transfer = [job.nodes[r].restored_at - job.nodes[r].decided_abs for r in live]
    failed = sum(len(job.nodes[r].fetch.failed) for r in live)
    peer_bytes = sum(v for r in live for a, v in job.nodes[r].fetch.bytes_from.items() if a != GCS)
    return {
        "nodes": model.nodes,
        "mode": mode,
        "fail": fail,
        "victims": len(victims),
        "gcs_slow": s.gcs.slow,
        "data_parallel": model.data_parallel,
        "rank_bytes": model.chunks * model.chunk_size,
        "unique_bytes": unique,
        "gcs_bytes": job.gcs.bytes_read,
        "gcs_per_unique": round(job.gcs.bytes_read / unique, 3),
        "peer_bytes": peer_bytes,
        "decision_s_max": round(max(decided), 3),
        "restore_s_max": round(max(done), 3),
        "restore_s_median": round(statistics.median(done), 3),
        "transfer_s_max": round(max(transfer), 3),
        "transfer_s_median": round(statistics.median(transfer), 3),
        "fallbacks": sum(job.nodes[r].fetch.fallbacks for r in live),
        "failed_chunks": failed,
        "messages_per_node": round(job.net.stats.messages() / model.nodes, 2),
    }
