"""Part 5 of scripts/bench_peers.py (``--parts erasure``): ``--erasure 4+2`` against ``--replicas 1`` and 2.

What a job pays for the peer tier's redundancy, and what it gets back, with the same six ranks:
three fresh 6-node LocalClusters per round (TLS on, no GCS, ``--capacity`` 4x the size), one
per scheme, each closed before the next starts; which scheme goes first alternates per round
(4+2, 1, 2 in even rounds, 2, 1, 4+2 in odd ones). In each:

1. Every rank gets a step of the size in fresh random bytes of its own (``--files`` files,
   untimed), then all six commit it at once (six threads rename their
   ``ckpt/<S>.orbax-checkpoint-tmp``). Timed from there until every rank's step is on its lane:
   with replicas, its lane record for the current version on that many peers; with erasure, that
   and ``peers.erasure.steps[S].survives == P`` on every node (the whole group encoded the step;
   the group's view is refreshed every ~2 s, tierfs.store.stripe_service.POLL, so this time
   carries up to that much of it: the last rank's own lane record, ``placed_s``, is kept too).
2. Per node, the RAM held for other ranks: the parity store's bytes (``parity_bytes``) with
   erasure, the replica store's (``replicas_held.bytes``) with replicas, over the shard size.
   Goals: P/D = 0.5 for 4+2, 1 and 2 for the replicas, each within 5%.
3. Per rank, the bytes its lane sent for the step (``replicas.sent_bytes``) over the shard size:
   a rank's D data parts go each to the P parity holders of its stripe, P x the shard in all.
4. CPU-s per GiB committed: the six daemons' utime + stime (/proc/PID/stat) over the period of 1.,
   over the six shards' bytes.
5. Rebuild: node 1 is killed (-9) and wiped, ``tierfs mount`` started again and its status polled
   every 20 ms until ``restored.state`` is "done": seconds from mount start and MiB/s of its shard;
   CPU-s per GiB of the shard over all six daemons (the new one over its whole life, start-up
   included, as in part 1b; the others over the same time, which includes anything of theirs node
   1 held and they put back). With erasure the shard is rebuilt window by window from chains of
   survivors (tier "erasure"), with replicas read from a peer that holds it (tier "peer"). Every
   restored file's sha256 is then checked (untimed).

Method as bench_peers.py's (warm-up right before each timed period, alternation, medians); the
rebuild ratio is of medians. Memory: ``--replicas 2`` holds each shard three times, 18x the size
across the six nodes, so the part refuses a size whose clusters would not fit in the RAM free now.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from bench_peers import STEP, TIMEOUT, GiB, MiB
from benchlib import (
    NO_MATPLOTLIB,
    BenchError,
    cpu_seconds,
    default_warmup,
    make_files,
    pyplot,
    render_table,
    save_figure,
    size_label,
)

if TYPE_CHECKING:
    from bench_peers import Bench
    from tierfs_testing.cluster import LocalCluster

SHAPE, D, P = "4+2", 4, 2
NODES, LOST = 6, 1  # six ranks, one 4+2 group; the node killed, wiped and rebuilt
ERASURE = f"erasure {SHAPE}"
SCHEMES: dict[str, dict[str, str | int]] = {
    ERASURE: {"erasure": SHAPE},
    "replicas 1": {"replicas": 1},
    "replicas 2": {"replicas": 2},
}
GOALS = {ERASURE: P / D, "replicas 1": 1.0, "replicas 2": 2.0}  # RAM held for others, in shards
TOLERANCE = 0.05
COLORS = {ERASURE: "tab:green", "replicas 1": "tab:blue", "replicas 2": "tab:orange"}
DESCRIPTION = f"erasure: 6 nodes, --erasure {SHAPE} vs --replicas 1 and 2, TLS, node {LOST} rebuilt"


# ----------------------------------------------------------------------------- a round


def run(bench: Bench, rnd: int, size: int) -> dict:
    """The round's three clusters, one at a time, in the order of the round."""
    check_memory(bench, size)
    order = list(SCHEMES) if rnd % 2 == 0 else list(SCHEMES)[::-1]
    out: dict = {"order": order}
    for name in order:
        out[name] = scheme(bench, name, size)
    return out


def check_memory(bench: Bench, size: int) -> None:
    """Refuse before starting what cannot fit: a cluster the balloon swaps out measures the swap."""
    need = NODES * (1 + max(GOALS.values())) * size + (bench.args.warmup or default_warmup(size))
    with open("/proc/meminfo") as f:
        free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    if need > free:
        raise BenchError(
            f"the erasure part at {size_label(size)} needs ~{need / GiB:.1f} GiB of RAM "
            f"({NODES} shards, their replicas and the warm-up); {free / GiB:.1f} GiB are free"
        )


def scheme(bench: Bench, name: str, size: int) -> dict:
    """One scheme in a fresh 6-node cluster: every rank's step onto its lane, then node LOST rebuilt."""
    tag = name.replace(" ", "").replace("+", "")
    with bench.cluster(tag, NODES, size, peer_tls="on", **SCHEMES[name]) as c:
        sums = [
            make_files(n.mountpoint / "ckpt" / f"{STEP}.orbax-checkpoint-tmp", size, bench.args.files) for n in c.nodes
        ]
        out = encode(bench, c, name, size)
        c.kill(LOST)
        c.wipe(LOST)
        out["rebuild"] = rebuild(bench, c, name, sums[LOST], size)
    return out


def on_lane(bench: Bench, name: str):
    """A status -> the rank's lane record for the step, once the step is where ``name`` keeps it."""
    placed = bench.replicated(STEP, int(SCHEMES[name].get("replicas", 1)))  # erasure: its one tier, the group
    if name != ERASURE:
        return placed

    def encoded(st: dict) -> dict | None:
        held = (((st.get("peers") or {}).get("erasure") or {}).get("steps") or {}).get(str(STEP))
        return placed(st) if held and held["survives"] == P else None

    return encoded


def encode(bench: Bench, c: LocalCluster, name: str, size: int) -> dict:
    """All six ranks commit at once; timed until the last one's step is on its lane."""
    bench.warm(size)
    pids, done = [n.pid for n in c.nodes], on_lane(bench, name)
    cpu0, t0 = [cpu_seconds(p) for p in pids], time.time()
    with ThreadPoolExecutor(NODES) as pool:  # as a job's ranks do: each its own rename, at once
        list(pool.map(lambda n: bench.commit(n.mountpoint, STEP), c.nodes))
    records = [  # one node at a time: the conditions hold once met, and each poll costs a daemon CPU
        bench.wait(n.mountpoint, f"rank {i}'s step {STEP} on its lane ({name})", done) for i, n in enumerate(c.nodes)
    ]
    seen, cpu1 = time.time(), [cpu_seconds(p) for p in pids]
    if any(r.get("sent_bytes") is None for r in records):
        raise BenchError(f"{name}: a lane record without sent_bytes: {records}")
    states = [bench.fetch(n.mountpoint) for n in c.nodes]
    if name == ERASURE:
        held = [st["peers"]["erasure"]["parity_bytes"] for st in states]
    else:
        held = [(st["replicas_held"] or {}).get("bytes", 0) for st in states]
    return {
        "bytes": size,
        "seen_s": seen - t0,
        "placed_s": max(r["at"] for r in records) - t0,
        "lane_seconds": [r["seconds"] for r in records],
        "tiers": records[0]["tiers"],
        "held": held,
        "sent": [r["sent_bytes"] for r in records],
        "cpu": sum(cpu1) - sum(cpu0),
        "cpu_nodes": [b - a for a, b in zip(cpu0, cpu1, strict=True)],
    }


def rebuild(bench: Bench, c: LocalCluster, name: str, sums: dict[str, str], size: int) -> dict:
    """Start node LOST (killed and wiped) and time it until its restore is done; check every file."""
    node = c.nodes[LOST]
    bench.warm(size)
    others = {i: n.pid for i, n in enumerate(c.nodes) if i != LOST}
    cpu0, t0 = {i: cpu_seconds(p) for i, p in others.items()}, time.monotonic()
    try:
        c.tierfs(*c.mount_args(LOST), timeout=TIMEOUT)  # what LocalCluster.start runs, minus its status call
        mounted = time.monotonic() - t0
    finally:
        c.refresh(LOST)  # for the cleanup
    st = bench.fetch(node.mountpoint)
    if not st["restored"]:
        raise BenchError(f"{name}: node {LOST} restored nothing (cluster view: {st['cluster']})")
    while st["restored"]["state"] != "done":  # then at once the daemons' CPU, before the checks read
        if time.monotonic() > t0 + TIMEOUT:
            raise BenchError(f"{name}: node {LOST}'s restore did not finish within {TIMEOUT:.0f} s: {st['restored']}")
        time.sleep(0.02)
        st = bench.fetch(node.mountpoint)
    wall = time.monotonic() - t0
    cpu = {i: cpu_seconds(p) - cpu0[i] for i, p in others.items()} | {LOST: cpu_seconds(st["pid"])}
    r, want = st["restored"], "erasure" if name == ERASURE else "peer"
    if r.get("tier") != want or r.get("step") != STEP or r.get("bytes") != size or r.get("error"):
        raise BenchError(f"{name}: node {LOST} was not restored from the {want} tier: {r}")
    for file, digest in sums.items():
        with open(node.mountpoint / "ckpt" / str(STEP) / file, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != digest:
                raise BenchError(f"{name}: rebuilt ckpt/{STEP}/{file} differs from the original (sha256)")
    return {
        "bytes": size,
        "wall_s": wall,
        "mount_s": mounted,
        "seconds": r["seconds"],
        "from": r["from"],
        "bytes_from": {k: v for k, v in r["bytes_from"].items() if v},
        "cpu": sum(cpu.values()),
        "cpu_nodes": [cpu[i] for i in sorted(cpu)],
    }


def round_line(r: dict) -> str:
    """The round's numbers, for the person waiting; bench_peers.round_line appends " MiB/s"."""
    names = list(SCHEMES)

    def each(f) -> str:
        return " / ".join(f(r[n]) for n in names)

    return (
        f"{' / '.join(names)}: RAM for others "
        + each(lambda x: f"{statistics.mean(x['held']) / x['bytes']:.2f}")
        + " shards, on the lane in "
        + each(lambda x: f"{x['seen_s']:.1f}")
        + " s, rebuilt in "
        + each(lambda x: f"{x['rebuild']['wall_s']:.1f}")
        + " s, at "
        + each(lambda x: f"{x['bytes'] / x['rebuild']['wall_s'] / MiB:.0f}")
    )


# ----------------------------------------------------------------------------- report


def summarize(raw: list[dict]) -> dict[str, dict]:
    """Medians of one size's rounds per scheme (per round, nodes' and ranks' numbers are averaged)."""
    med, mean, out = statistics.median, statistics.mean, {}
    for name in SCHEMES:
        xs = [r[name] for r in raw]
        held = [h / x["bytes"] for x in xs for h in x["held"]]
        s = {
            "ram_per_shard": med(mean(x["held"]) / x["bytes"] for x in xs),
            "ram_per_shard_range": [min(held), max(held)],
            "ram_goal": GOALS[name],
            "wire_per_shard": med(mean(x["sent"]) / x["bytes"] for x in xs),
            "on_lane_s": med(x["seen_s"] for x in xs),
            "placed_s": med(x["placed_s"] for x in xs),
            "encode_cpu_s_per_gib": med(x["cpu"] / (NODES * x["bytes"]) * GiB for x in xs),
            "rebuild_s": med(x["rebuild"]["wall_s"] for x in xs),
            "rebuild_daemon_s": med(x["rebuild"]["seconds"] for x in xs),
            "rebuild_mib_s": med(x["bytes"] / x["rebuild"]["wall_s"] / MiB for x in xs),
            "rebuild_cpu_s_per_gib": med(x["rebuild"]["cpu"] / x["bytes"] * GiB for x in xs),
            "rebuilt_from": sorted({x["rebuild"]["from"] or "" for x in xs}),
        }
        s["ram_goal_met"] = abs(s["ram_per_shard"] / s["ram_goal"] - 1) <= TOLERANCE
        out[name] = s
    for s in out.values():
        s["rebuild_vs_replicas_1"] = s["rebuild_s"] / out["replicas 1"]["rebuild_s"]
    return out


def render(summaries: dict[int, dict]) -> str:
    """The table of every size's schemes, and notes on what the columns leave out."""
    head = (
        "size",
        "scheme",
        "RAM for others / shard",
        "wire / shard",
        "on the lane s",
        "encode CPU-s/GiB",
        "rebuild s",
        "rebuild MiB/s",
        "rebuild CPU-s/GiB",
        "rebuild time / replicas 1",
    )
    body, notes = [], []
    for size, summary in summaries.items():
        if "erasure" not in summary:
            continue
        for name, s in summary["erasure"].items():
            goal = f" ({'goal met' if s['ram_goal_met'] else 'NOT the goal'} {s['ram_goal']:.1f})"
            body.append(
                (
                    size_label(size),
                    name,
                    f"{s['ram_per_shard']:.3f}{goal}",
                    f"{s['wire_per_shard']:.2f}",
                    f"{s['on_lane_s']:.2f}",
                    f"{s['encode_cpu_s_per_gib']:.2f}",
                    f"{s['rebuild_s']:.2f}",
                    f"{s['rebuild_mib_s']:.0f}",
                    f"{s['rebuild_cpu_s_per_gib']:.2f}",
                    f"{s['rebuild_vs_replicas_1']:.2f}",
                )
            )
            lo, hi = s["ram_per_shard_range"]
            notes.append(
                f"#   {size_label(size)} {name}: RAM for others {lo:.3f}-{hi:.3f} shards across nodes and rounds; "
                f"the last rank's lane record {s['placed_s']:.2f} s after the commits; the daemon's own restore "
                f"{s['rebuild_daemon_s']:.2f} s, from {', '.join(s['rebuilt_from'])}"
            )
    return "\n".join(
        [
            render_table(head, body, left=2),
            f"# {NODES} nodes, every rank commits a step of the size at once; RAM goal within {TOLERANCE:.0%}; "
            "wire = the lane's sent bytes per rank; CPU-s per GiB: the six daemons' CPU over the encode (per GiB "
            f"of all six steps) and over node {LOST}'s rebuild (per GiB of its shard); medians",
            "# erasure's on-the-lane time waits for the group's view (refreshed every ~2 s): see the lane records",
            *notes,
        ]
    )


PANELS = (
    ("ram_per_shard", "RAM for others / shard"),
    ("wire_per_shard", "wire / shard"),
    ("encode_cpu_s_per_gib", "encode CPU-s/GiB"),
    ("rebuild_mib_s", "rebuild MiB/s"),
    ("rebuild_cpu_s_per_gib", "rebuild CPU-s/GiB"),
    ("rebuild_vs_replicas_1", "rebuild time / replicas 1"),
)


def plot(path: str, summaries: dict[int, dict], title: str) -> str | None:
    """A panel of bars per column of the table, one bar per size and scheme; RAM goals ticked."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    rows = [(size, name) for size, s in summaries.items() if "erasure" in s for name in SCHEMES]
    ys = list(range(len(rows)))[::-1]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(2.4 * len(PANELS), 0.4 * len(rows) + 1.6), sharey=True)
    for ax, (key, what) in zip(axes, PANELS, strict=True):
        values = [summaries[size]["erasure"][name][key] for size, name in rows]
        ax.barh(ys, values, 0.6, color=[COLORS[name] for _, name in rows])
        for y, v in zip(ys, values, strict=True):
            ax.annotate(
                f"{v:.2f}" if v < 10 else f"{v:.0f}",
                (v, y),
                xytext=(2, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
            )
        if key == "ram_per_shard":
            for y, (_, name) in zip(ys, rows, strict=True):
                ax.plot([GOALS[name]] * 2, [y - 0.4, y + 0.4], color="black", lw=1.5)
        ax.set_xlim(0, 1.3 * max(values))
        ax.set_title(what, fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].set_yticks(ys, [f"{size_label(size)} {name}" for size, name in rows], fontsize=8)
    fig.suptitle(f"{title} (black tick: goal)", fontsize=9)
    save_figure(fig, path)
    return None


def plot_path(path: str) -> str:
    """Where the erasure figure goes beside the other parts' figure: ``out.png`` -> ``out-erasure.png``."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}-erasure{p.suffix}"))
