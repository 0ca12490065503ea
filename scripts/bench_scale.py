#!/usr/bin/env python3
"""Scale benchmark: coordination and broadcast restores of 1,000 to 10,000 nodes, simulated.

The real code of tierfs.coordination (coordinators, the holdings view, the restore planner
and the planned fetches) and the real replica placement (tierfs.peers.placement) run in
one process over a simulated network and GCS (tierfs_testing.sim) on trio's
MockClock: times are those of the model (0.25-0.35 ms one way, 50 us of CPU per message
at the receiver, 25 Gb/s NICs, GCS reads at 50 ms to the first byte, 100 MB/s per stream
and 25 GB/s for the whole bucket, listings at 100 ms a page of 1000 objects), not of this
machine. Per job size N:

a. Report rounds of a running job (2 rounds counted with every node up; then the first
   coordinator and 0.1% of the nodes go down and 3 more rounds are counted): requests and
   messages (requests + answers) per node per round, the busiest coordinator's requests,
   GCS listing requests. "Today" is what tierfs.pipeline.survey's survey costs: a connection to
   every peer with 4 requests (hello, auth, info, list) per node per round, and every node
   listing GCS (pages of 1000 manifests).
b. A restart decision: every node starts within 0.5 s and asks for its step; the first
   coordinator and 0.1% of the nodes are down for good, GCS is 4x slow, and one node starts
   10 s late (its host appears then). Time from a node's start to its decision (the
   slowest node; target under 5 s), and whether all nodes agree and match the rules of
   tierfs.pipeline.survey on the live nodes' holdings.
c. A restore from GCS after every RAM is lost, D = 4 data-parallel twins per shard, 8
   chunks of 16 MiB per rank: GCS bytes read per unique byte (target <= 1.1; today every
   twin reads everything: 4.0), and the time from a node's decision to its last chunk
   (the slowest node), for every node reading from GCS ("today"), for the broadcast plan,
   and for the broadcast plan with 1% of the nodes lost mid-restore and GCS 4x slow.
d. A backup of one step to GCS, D = 16 data-parallel twins per shard (the job size rounded
   down to a multiple of 16), 32 chunks of 4 MiB per rank, every rank committing within
   0.5 s (tierfs_testing.backups): GCS bytes up and down per unique byte (target <= 1.05),
   GCS requests, and the time from the first commit until every live rank's manifest is
   in; for the twins sharing the upload (tierfs.tiers.twins), the same with one twin of
   every group dead from the start (the others wait for it, then take its chunks over;
   target <= 1.5), and for a model of the code before twins shared the upload (every twin
   uploads every chunk it does not find, losers read the object back: up to 2D-1).

    .venv/bin/python scripts/bench_scale.py [--nodes 1000,4000,10000] [--quick] [--backups-only]
        [--json scripts/results/bench-scale.json] [--plot docs/bench-scale.png]
    .venv/bin/python scripts/bench_scale.py --replot scripts/results/bench-scale.json --plot docs/bench-scale.png

The full run takes about 25 minutes of one core (18 of them for 10,000 nodes) and the
backups a few minutes more; ``--backups-only`` runs d alone; ``--quick`` runs 100 and 400
nodes in a few seconds. ``--plot`` needs matplotlib (``scripts/setup.sh``
installs it, the ``bench`` extra); without it the JSON and the tables are written all the
same, and ``--replot`` draws the plot from the JSON with any Python that has matplotlib (it
imports nothing of tierfs).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import shlex
import sys
import time

from benchlib import NO_MATPLOTLIB, pyplot, save_figure, write_json  # (scripts/ is on sys.path)

RESTORES = (  # (key, label, mode, GCS slowness, share of nodes lost mid-restore)
    ("today", "today (every twin reads GCS)", "today", 1.0, 0.0),
    ("broadcast", "broadcast plan", "broadcast", 1.0, 0.0),
    ("broadcast_lossy", "broadcast, 1% of nodes lost, GCS 4x slow", "broadcast", 4.0, 0.01),
)
BACKUP_TWINS = 16
BACKUPS = (  # (key, label, mode, twins dead per group)
    ("twins", "twins share the upload", "twins", 0),
    ("twins_dead", "twins, one of each group dead", "twins", 1),
    ("today", "model of the old code: every twin uploads", "today", 0),
    ("today_dead", "model of the old code, one of each group dead", "today", 1),
)


def progress(msg: str) -> None:
    print(f"# {time.strftime('%H:%M:%S')} {msg}", flush=True)


def measure(n: int, backups_only: bool = False) -> dict:
    from tierfs_testing import scenarios
    from tierfs_testing.sim import GcsModel

    t0 = time.time()
    out: dict = {"backup": measure_backups(n)}
    if backups_only:
        out["wall_s"] = round(time.time() - t0, 1)
        return out
    out["rounds"] = scenarios.rounds(n)
    progress(f"{n} nodes: report rounds ({out['rounds']['cpu_s']:.0f} CPU-s)")
    slow = scenarios.Settings(gcs=GcsModel(slow=4.0))
    out["decision"] = scenarios.decision(n, s=slow, coordinators_lost=1, nodes_lost=max(1, n // 1000))
    progress(
        f"{n} nodes: restart decision in {out['decision']['decision_s_max']:.2f} s "
        f"({out['decision']['cpu_s']:.0f} CPU-s)"
    )
    out["restore"] = {}
    for key, _label, mode, gcs_slow, lost in RESTORES:
        s = scenarios.Settings(gcs=GcsModel(slow=gcs_slow))
        r = out["restore"][key] = scenarios.restore(n, s=s, mode=mode, fail=lost)
        progress(
            f"{n} nodes: restore {key}: GCS {r['gcs_per_unique']:.3f}x unique, "
            f"{r['transfer_s_max']:.2f} s after the decision ({r['cpu_s']:.0f} CPU-s)"
        )
    out["wall_s"] = round(time.time() - t0, 1)
    return out


def measure_backups(n: int) -> dict:
    from tierfs_testing.backups import backup

    out = {}
    for key, _label, mode, dead in BACKUPS:
        b = out[key] = backup(n - n % BACKUP_TWINS, BACKUP_TWINS, mode, dead)
        progress(
            f"{b['nodes']} nodes: backup {key}: GCS {b['up_per_unique']:.3f}x up + {b['down_per_unique']:.3f}x "
            f"down, every rank backed up after {b['backed_up_s_max']:.2f} s ({b['cpu_s']:.0f} CPU-s)"
        )
    return out


def backup_settings() -> dict:
    """What every backup row shares: the job's shape per rank and the twins' patience."""
    from tierfs_testing import backups

    from tierfs.tiers.twins import Patience

    return {
        "data_parallel": BACKUP_TWINS,
        "chunks_per_rank": backups.CHUNKS,
        "chunk_size": backups.CHUNK_SIZE,
        "commit_spread_s": backups.COMMIT_SPREAD,
        "requests_at_once": backups.THREADS,
        "patience": vars(Patience()),
    }


def render_backups(results: dict) -> list[str]:
    lines = [
        f"### Backup of one step to GCS, {BACKUP_TWINS} data-parallel twins per shard",
        "",
        "| nodes | backup | GCS up / unique | GCS down / unique | (up + down) / unique | GCS requests / rank | "
        "every live rank backed up | every chunk and manifest in GCS |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for n in sorted(results, key=int):
        for key, label, *_ in BACKUPS:
            b = results[n]["backup"][key]
            lines.append(
                f"| {b['nodes']:,} | {label} | {b['up_per_unique']:.3f} | {b['down_per_unique']:.3f} | "
                f"{b['gcs_per_unique']:.3f} | {b['requests_per_rank']:.1f} | {b['backed_up_s_max']:.2f} s | "
                f"{'yes' if b['complete'] else 'NO'} |"
            )
    return lines


def render(results: dict) -> str:
    ns = sorted(results, key=int)
    if not all("rounds" in results[n] for n in ns):
        return "\n".join(render_backups(results))
    lines = [
        "### Coordination: messages per round and the restart decision",
        "",
        "| nodes | requests / node / round | messages / node / round | after losing a coordinator + 0.1% | "
        "busiest coordinator, requests / round | today: requests / node / round | GCS listings / round "
        "(today) | decision, slowest node | late node | all agree, rules match |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for n in ns:
        r, d = results[n]["rounds"], results[n]["decision"]
        st, af = r["steady"], r["after_failures"]
        lines.append(
            f"| {int(n):,} | {st['requests_per_node']:.2f} | {st['messages_per_node']:.2f} | "
            f"{af['requests_per_node']:.2f} | {st['coordinator_requests_per_round']:,} | "
            f"{r['today']['requests_per_node']:,} | {st['gcs_list_requests_per_round']:.0f} "
            f"({r['today']['gcs_list_requests_per_round']:,}) | {d['decision_s_max']:.2f} s | "
            f"{d['late_decision_s']:.2f} s | {'yes' if d['agree'] and d['matches_rules'] else 'NO'} |"
        )
    lines += [
        "",
        "### Restore from GCS, 4 data-parallel twins per shard",
        "",
        "| nodes | "
        + " | ".join(f"GCS bytes / unique: {label}" for _, label, *_ in RESTORES)
        + " | "
        + " | ".join(f"restore s: {label}" for _, label, *_ in RESTORES)
        + " |",
        "|---:|" + "---:|" * (2 * len(RESTORES)),
    ]
    for n in ns:
        rs = results[n]["restore"]
        lines.append(
            f"| {int(n):,} | "
            + " | ".join(f"{rs[k]['gcs_per_unique']:.3f}" for k, *_ in RESTORES)
            + " | "
            + " | ".join(f"{rs[k]['transfer_s_max']:.2f}" for k, *_ in RESTORES)
            + " |"
        )
    if all("backup" in results[n] for n in ns):
        lines += ["", *render_backups(results)]
    return "\n".join(lines)


def plot(path: str, results: dict, title: str) -> str | None:
    """Three panels of coordination and restores, two of backups, whichever the results hold."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    ns = sorted(results, key=int)
    coordination = all("rounds" in results[n] for n in ns)
    backups = all("backup" in results[n] for n in ns)
    panels = 3 * coordination + 2 * backups
    fig, axes = plt.subplots(1, panels, figsize=(4.4 * panels, 4.2), squeeze=False)
    axes = list(axes[0])
    if coordination:
        plot_coordination(axes[:3], results, ns)
    if backups:
        plot_backups(axes[-2:], results, ns)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)
    return None


def plot_coordination(axes: list, results: dict, ns: list[str]) -> None:
    mx, dx, gx = axes
    x = [int(n) for n in ns]
    mx.plot(x, [results[n]["rounds"]["steady"]["requests_per_node"] for n in ns], "o-", label="coordinators")
    mx.plot(
        x,
        [results[n]["rounds"]["after_failures"]["requests_per_node"] for n in ns],
        "s--",
        label="... after losing a coordinator + 0.1%",
    )
    mx.plot(x, [results[n]["rounds"]["today"]["requests_per_node"] for n in ns], "^:", label="today (every peer)")
    mx.set(
        xscale="log", yscale="log", xlabel="nodes", ylabel="requests per node per round", title="survey / report round"
    )
    mx.legend(fontsize=7)
    dx.plot(x, [results[n]["decision"]["decision_s_max"] for n in ns], "o-", label="slowest node")
    dx.plot(x, [results[n]["decision"]["decision_s_median"] for n in ns], "s--", label="median node")
    dx.axhline(5.0, color="tab:red", lw=0.8, ls="--", label="target")
    dx.set(
        xscale="log",
        xlabel="nodes",
        ylabel="seconds from start",
        ylim=(0, 6),
        title="restart decision, a coordinator lost,\n0.1% of nodes lost, GCS 4x slow",
    )
    dx.title.set_fontsize(9)
    dx.legend(fontsize=7)
    for key, label, *_ in RESTORES:
        gx.plot(x, [results[n]["restore"][key]["gcs_per_unique"] for n in ns], "o-", label=label)
    gx.axhline(1.1, color="tab:red", lw=0.8, ls="--", label="target 1.1")
    gx.set(
        xscale="log",
        xlabel="nodes",
        ylabel="GCS bytes read / unique bytes",
        ylim=(0, 4.5),
        title="restore from GCS, 4 twins per shard",
    )
    gx.legend(fontsize=7)


def plot_backups(axes: list, results: dict, ns: list[str]) -> None:
    from matplotlib.ticker import ScalarFormatter

    bx, tx = axes
    x = [results[n]["backup"][BACKUPS[0][0]]["nodes"] for n in ns]
    styles = ("o-", "s-", "^:", "v:")
    for (key, label, *_), style in zip(BACKUPS, styles, strict=True):
        bx.plot(x, [results[n]["backup"][key]["gcs_per_unique"] for n in ns], style, label=label)
        tx.plot(x, [results[n]["backup"][key]["backed_up_s_max"] for n in ns], style, label=label)
    bx.axhline(1.05, color="tab:red", lw=0.8, ls="--", label="target 1.05 (1.5 with a twin dead)")
    bx.axhline(1.5, color="tab:red", lw=0.8, ls=":")
    bx.set(
        xscale="log",
        yscale="log",
        xlabel="nodes",
        ylabel="GCS bytes (up + down) / unique bytes",
        title=f"backup to GCS, {BACKUP_TWINS} twins per shard",
    )
    tx.set(
        xscale="log",
        xlabel="nodes",
        ylabel="seconds from the first commit",
        ylim=(0, None),
        title="backup: until every live rank is backed up",
    )
    for ax in (bx, tx):
        ax.minorticks_off()
        ax.set_xticks(x, [f"{v:,}" for v in x])
        ax.legend(fontsize=7)
    bx.yaxis.set_major_formatter(ScalarFormatter())


def main() -> int:
    p = argparse.ArgumentParser(description="Coordination and broadcast restores at 1,000-10,000 simulated nodes.")
    p.add_argument("--nodes", help="comma-separated job sizes (default 1000,4000,10000; --quick: 100,400)")
    p.add_argument("--quick", action="store_true", help="smoke run at 100 and 400 nodes")
    p.add_argument("--json", metavar="PATH", help="write the settings and every measurement")
    p.add_argument("--plot", metavar="PATH.png", help="panels of the results (needs matplotlib)")
    p.add_argument("--backups-only", action="store_true", help="measure the backups alone (d)")
    p.add_argument("--replot", metavar="JSON", help="print the tables and draw --plot from a saved --json")
    args = p.parse_args()
    if args.replot:
        import json

        with open(args.replot) as f:
            saved = json.load(f)
        print(f"# bench_scale {saved['settings']['date']}  command: {saved['settings']['command']}")
        print(render(saved["results"]))
        if args.plot:
            why = plot(args.plot, saved["results"], title(saved["settings"]))
            print(f"# plot skipped: {why}" if why else f"# wrote {args.plot}")
        return 0
    try:
        sizes = [int(x) for x in (args.nodes or ("100,400" if args.quick else "1000,4000,10000")).split(",")]
    except ValueError:
        p.error("--nodes must be comma-separated integers, e.g. 1000,4000,10000")
    if any(n < BACKUP_TWINS or n % 4 for n in sizes):
        p.error(
            f"every job size must be a multiple of 4 (the data-parallel twins of a restore) and at least "
            f"{BACKUP_TWINS} (those of a backup)"
        )
    logging.basicConfig(level=logging.ERROR, format="%(name)s: %(message)s")
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    cmd = shlex.join([sys.executable, *sys.argv])
    settings = {"nodes": sizes, "date": now, "command": cmd, "cores": os.cpu_count(), "backups_only": args.backups_only}
    print(f"# bench_scale {now}  command: {cmd}", flush=True)
    results = {}
    try:
        for n in sizes:
            results[str(n)] = measure(n, args.backups_only)
    except KeyboardInterrupt:
        print("bench_scale: interrupted", file=sys.stderr)
        return 130
    from tierfs_testing.scenarios import Settings

    s = Settings()
    settings["model"] = {
        "net": vars(s.net),
        "gcs": vars(s.gcs),
        "k": s.k,
        "interval_s": s.interval,
        "restore_wait_s": s.restore_wait,
        "fan_out": s.fan_out,
        "workers": s.workers,
    }
    settings["backup"] = backup_settings()
    print(render(results))
    if args.json:
        write_json(args.json, {"settings": settings, "results": results})
    if args.plot:
        why = plot(args.plot, results, title(settings))
        print(f"# plot skipped: {why}" if why else f"# wrote {args.plot}")
    return 0


def title(settings: dict) -> str:
    what = "backups" if settings.get("backups_only") else "coordination"
    return f"tierfs {what} at scale, simulated (MockClock), {settings['date'][:10]}"


if __name__ == "__main__":
    sys.exit(main())
