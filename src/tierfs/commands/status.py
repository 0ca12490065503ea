"""``tierfs status``: what a mounted volume holds and where."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tierfs.core import control_client, mounts
from tierfs.core.errors import UserError
from tierfs.core.parse import format_size


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show a volume's tiers and state", description=__doc__)
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=run)


def fetch(mountpoint: Path) -> dict:
    entry = mounts.find_mount(mountpoint)
    if entry is None or entry.fstype != mounts.FSTYPE:
        raise UserError(f"{mountpoint} is not a tierfs mount: mount it with tierfs mount {mountpoint}")
    if mounts.is_dead(mountpoint):
        raise UserError(f"the daemon of {mountpoint} is gone: run tierfs mount again to recover it")
    return control_client.request(mounts.Registration(mountpoint).socket_path, {"op": "status"})


def run(args: argparse.Namespace) -> int:
    status = fetch(Path(args.mountpoint).absolute())
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(render(status))
    return 0


def _pages(ram: dict) -> str:
    if not ram["tmpfs"]:
        return "NOT tmpfs"
    if ram["large_folios"]:
        return "tmpfs, large folios"
    return "tmpfs, 4 KiB pages"


def render(s: dict) -> str:
    ram = s["tiers"]["ram"]
    cap = format_size(ram["capacity"]) + ("" if ram["capacity_bounded"] else " (ramdisk size)")
    lines = [
        f"tierfs {s['mountpoint']}  job {s['job']}  rank {s['rank']}/{s['nodes']}  "
        f"pid {s['pid']}  up {s['uptime_s']:.0f}s",
        *(
            [
                f"  UNAUTHENTICATED BUCKET: {s['gcs']['url']} is neither encrypted nor authenticated (no job secret): "
                "whoever can read it reads these checkpoints, whoever can write it chooses what restores"
            ]
            if s.get("gcs") and s["gcs"].get("sealed") is False
            else []
        ),
        f"  ram   {ram['path']}  ({_pages(ram)})",
        f"        used {format_size(ram['used'])} of {cap}",
        f"  io    data path {s['fuse']['data_path']} ({s['fuse']['engine']} engine; {s['fuse']['transfer']}): "
        f"{s['fuse']['passthrough_opens']} of {s['fuse']['opens']} opens passed through; through the daemon "
        f"written {format_size(s['fuse']['bytes_written'])}, read {format_size(s['fuse']['bytes_read'])}; "
        f"{s['fuse']['inodes']} inodes cached; idle CPUs kept awake in bursts: {s['fuse']['wake_cpus']}",
    ]
    if s.get("cluster"):
        v = s["cluster"]
        gone = f", unreachable: {', '.join(v['unreachable_peers'])}" if v["unreachable_peers"] else ""
        lines.append(
            f"  job   newest step complete on every rank: {v['newest_complete']}; "
            f"started from step {v['restore_step']}{gone}"
        )
        if v.get("rollback"):
            b = v["rollback"]
            lines.append(
                f"        rolled back to step {b['step']} (restore-step) at "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(b['at']))}"
            )
        if v.get("coordination"):
            c = v["coordination"]
            lines.append(
                f"        reports to {', '.join(c['reported_to']) or 'no coordinator yet'}"
                f"{'; coordinates the job' if c['coordinating'] else ''}"
            )
    if s.get("restored"):
        r = s["restored"]
        lines.append(
            f"  restore step {r['step']} ({r['state']}) from {r['from'] or 'this node'}: "
            f"{format_size(r['bytes'] - r['bytes_missing'])} of {format_size(r['bytes'])} here, "
            f"{r['files']} files, {r['seconds']:.1f}s"
        )
    lanes = s.get("lanes", ("peers", "gcs"))
    for tier in lanes:
        lane = s.get(tier)
        if not lane:
            continue
        state = lane["state"] + (f" ({lane['error']})" if lane.get("error") else "")
        label = lane.get("label") or lane.get("url") or f"{lane.get('replicas', 1)} replica(s)"
        lines.append(f"  {tier:<5} {label}  {state}, lag {lane['lag_s']:.1f}s")
        if lane.get("progress"):
            p = lane["progress"]
            lines.append(f"        step {p['step']}: {p['chunks_done']}/{p['chunks_total']} chunks")
        for peer in lane.get("known", ()):
            rank = "" if peer["rank"] is None else f" rank {peer['rank']}"
            lines.append(f"        {peer['address']}{rank}: {peer['state']}")
        if group := lane.get("erasure"):
            lines += erasure_lines(group)
    for st in s.get("steps", []):
        b, r = st["backup"], st["replicas"]
        where = [f"from {st['source']}" if st["source"] != "local" else "committed"]
        if st.get("refused"):
            lines.append(
                f"  step  {st['step']}  {', '.join(st['roots'])}  {where[0]}; on this node only, "
                f"no tier can take it: {st['refused']}"
            )
            continue
        if r.get("peers"):
            where.append(f"on {', '.join(r['peers'])} ({format_size(r['sent_bytes'])} sent)")
        elif s.get("peers"):
            where.append("not replicated yet")
        if st["backed_up"] and not b.get("restored"):
            where.append(
                f"in GCS after {b['seconds']:.1f}s: {format_size(b['uploaded_bytes'])} uploaded, "
                f"{format_size(b['dedup_bytes'])} deduplicated{shared_by_twins(b)}"
            )
        elif st["backed_up"]:
            where.append("in GCS")
        elif s.get("gcs"):
            where.append("not in GCS yet")
        for lane in lanes:
            if lane in ("peers", "gcs") or not s.get(lane):
                continue
            held = (st.get("copies") or {}).get(lane, {}).get("version") == st["version"]
            where.append(f"on {lane}" if held else f"not on {lane} yet")
        lines.append(f"  step  {st['step']}  {', '.join(st['roots'])}  {'; '.join(where)}")
    held = s.get("replicas_held")
    if held:
        lines.append(
            f"  holds {held.get('manifests', 0)} replica step(s) of other ranks, {format_size(held.get('bytes', 0))}"
        )
    if s.get("goodput"):
        lines += goodput_lines(s["goodput"], s.get("failures", 0))
    if s.get("metrics"):
        lines.append(f"  metrics {s['metrics']}")
    return "\n".join(lines)


def _seconds(x: float | None) -> str:
    if x is None:
        return "unknown"
    return f"{x:.0f}s" if x < 120 else f"{x / 60:.0f}m" if x < 7200 else f"{x / 3600:.1f}h"


def goodput_lines(g: dict, failures: int) -> list[str]:
    """The job's checkpointing as this rank sees it (docs/goodput.md says how it is computed)."""
    if g.get("interval_s") is None:
        return ["  goodput  too few commits yet to tell"]
    cost = f"{g['cost_s']:.1f}s" if g.get("cost_s") is not None else "unknown"
    overhead = f" ({g['overhead_ratio']:.1%})" if g.get("overhead_ratio") is not None else ""
    risk = ", ".join(f"{tier} {_seconds(sec)}" for tier, sec in sorted((g.get("at_risk_s") or {}).items()))
    lines = [
        f"  goodput  a step every {_seconds(g['interval_s'])}, each costing the job {cost}{overhead}; "
        f"work at risk now: {risk or 'all of it'}",
        f"           expected loss per failure {_seconds(g.get('expected_loss_s'))}; {failures} failure(s) seen",
    ]
    if g.get("mtbf_s") is not None and g.get("goodput_ratio") is not None:
        best = g.get("optimal_interval_s")
        lines.append(
            f"           at an MTBF of {_seconds(g['mtbf_s'])}: goodput {g['goodput_ratio']:.1%}; "
            f"a step every {_seconds(best)} would give {g.get('optimal_goodput_ratio') or 0:.1%}"
        )
    return lines


def erasure_lines(group: dict) -> list[str]:
    """The erasure group under its lane: who answers, and per step how many more losses it survives."""
    if "grouping" not in group:
        waiting = group.get("waiting_for") or []
        why = f"forms once rank(s) {', '.join(map(str, waiting))} answer" if waiting else "is not agreed yet"
        return [f"        no group yet: the grouping {why}"]
    lines = [
        f"        group {group['group']} of ranks {', '.join(map(str, group['members']))} "
        f"(grouping {group['grouping']}): "
        f"{len(group['answering'])} answering, {format_size(group['parity_bytes'])} of parity held here"
    ]
    for domain, members in group.get("weak_spots", []):
        lines.append(f"        weak spot: {domain} holds ranks {', '.join(map(str, members))}, more than it survives")
    for twins in group.get("twins_together", []):
        lines.append(f"        twins {', '.join(map(str, twins))} share the group: there were fewer groups than twins")
    for step, held in group["steps"].items():
        left = held["survives"]
        state = f"survives {left} more loss(es)" if left >= 0 else f"cannot be rebuilt ({-left} part(s) short)"
        lines.append(f"        step {step}: {state}; rebuildable ranks {held['rebuildable'] or 'none'}")
    return lines


def shared_by_twins(backup: dict) -> str:
    """How a backup was split with the step's data-parallel twins, when it was:
    " (12 chunks sent here, 36 by twins)"."""
    twins, taken = backup.get("twin_chunks", 0), backup.get("taken_over", 0)
    if not twins and not taken:
        return ""
    over = f", {taken} taken over from twins that did not send them" if taken else ""
    return f" ({backup.get('sent_chunks', 0)} chunks sent here, {twins} by twins{over})"
