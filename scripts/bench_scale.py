#!/usr/bin/env python3
"""Scale benchmark: coordination and broadcast restores of 1,000 to 10,000 nodes, simulated.

The real code of tierfs.coordination (coordinators, the holdings view, the restore planner
and the planned fetches) and the real replica placement (tierfs.peers.placement) run in
one process over a simulated network and GCS (tierfs.testing.sim) on trio's
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

    .venv/bin/python scripts/bench_scale.py [--nodes 1000,4000,10000] [--quick]
        [--json docs/bench-scale.json] [--plot docs/bench-scale.png]
    .venv/bin/python scripts/bench_scale.py --replot docs/bench-scale.json --plot docs/bench-scale.png

The full run takes about 25 minutes of one core (18 of them for 10,000 nodes); ``--quick``
runs 100 and 400 nodes in a few seconds. ``--plot`` needs matplotlib (``scripts/setup.sh``
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


def progress(msg: str) -> None:
    print(f"# {time.strftime('%H:%M:%S')} {msg}", flush=True)


def measure(n: int) -> dict:
    from tierfs.testing import scenarios  # noqa: PLC0415 (--replot needs no tierfs)
    from tierfs.testing.sim import GcsModel

    out: dict = {}
    t0 = time.time()
    out["rounds"] = scenarios.rounds(n)
    progress(f"{n} nodes: report rounds ({out['rounds']['cpu_s']:.0f} CPU-s)")
    slow = scenarios.Settings(gcs=GcsModel(slow=4.0))
    out["decision"] = scenarios.decision(n, s=slow, coordinators_lost=1, nodes_lost=max(1, n // 1000))
    progress(f"{n} nodes: restart decision in {out['decision']['decision_s_max']:.2f} s "
             f"({out['decision']['cpu_s']:.0f} CPU-s)")
    out["restore"] = {}
    for key, _label, mode, gcs_slow, lost in RESTORES:
        s = scenarios.Settings(gcs=GcsModel(slow=gcs_slow))
        r = out["restore"][key] = scenarios.restore(n, s=s, mode=mode, fail=lost)
        progress(f"{n} nodes: restore {key}: GCS {r['gcs_per_unique']:.3f}x unique, "
                 f"{r['transfer_s_max']:.2f} s after the decision ({r['cpu_s']:.0f} CPU-s)")
    out["wall_s"] = round(time.time() - t0, 1)
    return out


def render(results: dict) -> str:
    ns = sorted(results, key=int)
    lines = ["### Coordination: messages per round and the restart decision", "",
             "| nodes | requests / node / round | messages / node / round | after losing a coordinator + 0.1% | "
             "busiest coordinator, requests / round | today: requests / node / round | GCS listings / round "
             "(today) | decision, slowest node | late node | all agree, rules match |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for n in ns:
        r, d = results[n]["rounds"], results[n]["decision"]
        st, af = r["steady"], r["after_failures"]
        lines.append(f"| {int(n):,} | {st['requests_per_node']:.2f} | {st['messages_per_node']:.2f} | "
                     f"{af['requests_per_node']:.2f} | {st['coordinator_requests_per_round']:,} | "
                     f"{r['today']['requests_per_node']:,} | {st['gcs_list_requests_per_round']:.0f} "
                     f"({r['today']['gcs_list_requests_per_round']:,}) | {d['decision_s_max']:.2f} s | "
                     f"{d['late_decision_s']:.2f} s | {'yes' if d['agree'] and d['matches_rules'] else 'NO'} |")
    lines += ["", "### Restore from GCS, 4 data-parallel twins per shard", "",
              "| nodes | " + " | ".join(f"GCS bytes / unique: {label}" for _, label, *_ in RESTORES) + " | "
              + " | ".join(f"restore s: {label}" for _, label, *_ in RESTORES) + " |",
              "|---:|" + "---:|" * (2 * len(RESTORES))]
    for n in ns:
        rs = results[n]["restore"]
        lines.append(f"| {int(n):,} | " + " | ".join(f"{rs[k]['gcs_per_unique']:.3f}" for k, *_ in RESTORES) + " | "
                     + " | ".join(f"{rs[k]['transfer_s_max']:.2f}" for k, *_ in RESTORES) + " |")
    return "\n".join(lines)


def plot(path: str, results: dict, title: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    ns = sorted(results, key=int)
    x = [int(n) for n in ns]
    fig, (mx, dx, gx) = plt.subplots(1, 3, figsize=(13, 4.2))
    mx.plot(x, [results[n]["rounds"]["steady"]["requests_per_node"] for n in ns], "o-", label="coordinators")
    mx.plot(x, [results[n]["rounds"]["after_failures"]["requests_per_node"] for n in ns], "s--",
            label="... after losing a coordinator + 0.1%")
    mx.plot(x, [results[n]["rounds"]["today"]["requests_per_node"] for n in ns], "^:", label="today (every peer)")
    mx.set(xscale="log", yscale="log", xlabel="nodes", ylabel="requests per node per round",
           title="survey / report round")
    mx.legend(fontsize=7)
    dx.plot(x, [results[n]["decision"]["decision_s_max"] for n in ns], "o-", label="slowest node")
    dx.plot(x, [results[n]["decision"]["decision_s_median"] for n in ns], "s--", label="median node")
    dx.axhline(5.0, color="tab:red", lw=0.8, ls="--", label="target")
    dx.set(xscale="log", xlabel="nodes", ylabel="seconds from start", ylim=(0, 6),
           title="restart decision, a coordinator lost,\n0.1% of nodes lost, GCS 4x slow")
    dx.title.set_fontsize(9)
    dx.legend(fontsize=7)
    for key, label, *_ in RESTORES:
        gx.plot(x, [results[n]["restore"][key]["gcs_per_unique"] for n in ns], "o-", label=label)
    gx.axhline(1.1, color="tab:red", lw=0.8, ls="--", label="target 1.1")
    gx.set(xscale="log", xlabel="nodes", ylabel="GCS bytes read / unique bytes", ylim=(0, 4.5),
           title="restore from GCS, 4 twins per shard")
    gx.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)
    return None


def main() -> int:
    p = argparse.ArgumentParser(description="Coordination and broadcast restores at 1,000-10,000 simulated nodes.")
    p.add_argument("--nodes", help="comma-separated job sizes (default 1000,4000,10000; --quick: 100,400)")
    p.add_argument("--quick", action="store_true", help="smoke run at 100 and 400 nodes")
    p.add_argument("--json", metavar="PATH", help="write the settings and every measurement")
    p.add_argument("--plot", metavar="PATH.png", help="three panels of the results (needs matplotlib)")
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
    if any(n < 8 or n % 4 for n in sizes):
        p.error("every job size must be a multiple of 4 (the data-parallel twins) and at least 8")
    logging.basicConfig(level=logging.ERROR, format="%(name)s: %(message)s")
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    cmd = shlex.join([sys.executable, *sys.argv])
    settings = {"nodes": sizes, "date": now, "command": cmd, "cores": os.cpu_count()}
    print(f"# bench_scale {now}  command: {cmd}", flush=True)
    results = {}
    try:
        for n in sizes:
            results[str(n)] = measure(n)
    except KeyboardInterrupt:
        print("bench_scale: interrupted", file=sys.stderr)
        return 130
    from tierfs.testing.scenarios import Settings  # noqa: PLC0415

    s = Settings()
    settings["model"] = {"net": vars(s.net), "gcs": vars(s.gcs), "k": s.k, "interval_s": s.interval,
                         "restore_wait_s": s.restore_wait, "fan_out": s.fan_out, "workers": s.workers}
    print(render(results))
    if args.json:
        write_json(args.json, {"settings": settings, "results": results})
    if args.plot:
        why = plot(args.plot, results, title(settings))
        print(f"# plot skipped: {why}" if why else f"# wrote {args.plot}")
    return 0


def title(settings: dict) -> str:
    return f"tierfs coordination at scale, simulated (MockClock), {settings['date'][:10]}"


if __name__ == "__main__":
    sys.exit(main())
