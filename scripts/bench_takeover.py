#!/usr/bin/env python3
"""The pause a job sees when its daemon crashes or is upgraded: how long a write waits.

A volume of each data path, and two writers in it, each in a process of its own: one
rewrites a 1 GiB file in 1 MiB writes through one descriptor held open (the bulk of a
checkpoint), the other creates, writes (4 KiB) and closes small files (a checkpoint's
metadata). Each records how long every call took. Once both run, the daemon is killed
(``kill -9``: its keeper starts a successor, which takes the connection over) or upgraded
(``tierfs upgrade``: the keeper executes the installed build, which takes it over). The
pause of a round is the longest call of each writer from the event until the successor
answers ``tierfs status``, less that writer's median call before the event. ``--rounds``
rounds per event and data path, alternating the events; median and maximum reported.

    .venv/bin/python scripts/bench_takeover.py [--rounds 5] [--json scripts/results/bench-takeover.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import BenchError, TierfsMount, render_table, write_json

WRITER = r"""
import json, os, sys, time
path, kind, out = sys.argv[1], sys.argv[2], sys.argv[3]
stop = out + ".stop"
calls = []
buf = os.urandom(1 << 20)
if kind == "write":
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    offset = 0
    while not os.path.exists(stop):
        t0 = time.monotonic()
        os.pwrite(fd, buf, offset)
        calls.append((t0, time.monotonic() - t0))
        offset = (offset + len(buf)) % (1 << 30)
    os.close(fd)
else:
    os.makedirs(path, exist_ok=True)
    i = 0
    while not os.path.exists(stop):
        t0 = time.monotonic()
        fd = os.open(os.path.join(path, f"f{i % 2000}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, buf[:4096])
        os.close(fd)
        calls.append((t0, time.monotonic() - t0))
        i += 1
with open(out, "w") as f:
    json.dump(calls, f)
"""
WRITERS = ("write", "create")


def registered(mountpoint: str) -> dict:
    from tierfs.core import mounts

    return mounts.Registration(mountpoint).read() or {}


def answers(mountpoint: str) -> bool:
    """Whether the daemon registered for ``mountpoint`` answers its control socket."""
    from tierfs.core import control_client, mounts
    from tierfs.core.errors import UserError

    try:
        control_client.request(mounts.Registration(mountpoint).socket_path, {"op": "status"}, timeout=5)
    except UserError:
        return False
    return True


def one_round(vol: TierfsMount, event: str, work: Path) -> dict:
    """One event while both writers run: each writer's pause, in seconds."""
    outs = {k: work / f"{k}.json" for k in WRITERS}
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(Path(vol.mountpoint) / k), k, str(outs[k])])
        for k in WRITERS
    ]
    try:
        time.sleep(2.0)  # both in their stride
        before = registered(vol.mountpoint)
        t0 = time.monotonic()
        if event == "crash":
            os.kill(before["pid"], signal.SIGKILL)
        else:
            done = vol.run("upgrade", vol.mountpoint)
            if done.returncode != 0:
                raise BenchError(f"tierfs upgrade failed: {done.stderr.strip()}")
        while registered(vol.mountpoint).get("pid") in (None, before["pid"]) or not answers(vol.mountpoint):
            time.sleep(0.005)
        t1 = time.monotonic()
        time.sleep(1.0)
    finally:
        for k in WRITERS:
            Path(str(outs[k]) + ".stop").touch()
        for p in procs:
            p.wait(timeout=120)
    pauses = {}
    for k in WRITERS:
        calls = json.loads(outs[k].read_text())
        usual = statistics.median(d for t, d in calls if t < t0)
        pauses[k] = max(d for t, d in calls if t + d >= t0 and t <= t1) - usual
        for suffix in ("", ".stop"):
            os.unlink(str(outs[k]) + suffix)
    shutil.rmtree(Path(vol.mountpoint) / "create")
    os.unlink(Path(vol.mountpoint) / "write")
    pauses["takeover"] = t1 - t0
    return pauses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    runtime = Path(f"/dev/shm/bench-takeover-run-{uuid.uuid4().hex[:6]}")
    os.environ["TIERFS_RUNTIME_DIR"] = str(runtime)
    results: dict = {"rounds": args.rounds, "paths": {}}
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="bench-takeover-") as base:
        for path in ("passthrough", "daemon"):
            mnt, ram, work = Path(base, path, "mnt"), Path(base, path, "ram"), Path(base, path, "work")
            for d in (mnt, ram, work):
                d.mkdir(parents=True)
            vol = TierfsMount(str(mnt), str(ram), str(runtime), data_path=path, job=f"pause-{path}")
            vol.mount()
            try:
                rows: dict[str, list[dict]] = {"crash": [], "upgrade": []}
                for r in range(args.rounds):
                    for event in ("crash", "upgrade") if r % 2 == 0 else ("upgrade", "crash"):
                        rows[event].append(one_round(vol, event, work))
                        print(f"{path} {event} round {r + 1}: {rows[event][-1]}", file=sys.stderr)
                results["paths"][path] = {
                    event: {
                        k: {"median_s": statistics.median(x[k] for x in rounds), "max_s": max(x[k] for x in rounds)}
                        for k in (*WRITERS, "takeover")
                    }
                    for event, rounds in rows.items()
                }
            finally:
                vol.unmount()
    shutil.rmtree(runtime, ignore_errors=True)
    body = [
        (path, event, *(f"{v[k]['median_s'] * 1000:.0f} / {v[k]['max_s'] * 1000:.0f}" for k in (*WRITERS, "takeover")))
        for path, events in results["paths"].items()
        for event, v in events.items()
    ]
    print(
        render_table(
            (
                "data path",
                "event",
                "1 MiB write (ms, median / max)",
                "create+write+close",
                "until the successor answers",
            ),
            body,
        )
    )
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"bench_takeover: {e}", file=sys.stderr)
        sys.exit(1)
