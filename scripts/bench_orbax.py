#!/usr/bin/env python3
"""A real client on the volume: Orbax saving and restoring a 1 GiB pytree, against plain tmpfs.

orbax-checkpoint's ``StandardCheckpointer`` (JAX on its CPU backend) saves a dict of a few
float32 arrays (1 GiB in all, random values) into ``<root>/<step>`` and a fresh process then
restores it, on (a) a plain directory under /dev/shm and (b) a tierfs volume mounted with
``--data-path passthrough`` (``--data-paths`` adds the daemon path). Orbax writes into
``<step>.orbax-checkpoint-tmp-*`` and renames it when done: on the volume that rename
commits a step, as in training.

Every measurement runs in a process of its own (``--_child``): it imports JAX and Orbax and
builds its arrays (save) or their shapes (restore), says it is ready, and starts only when
told, right after the parent's tmpfs warm-up. Timed: ``save`` + ``wait_until_finished``
(until the step is committed), and ``restore`` + ``block_until_ready``. The restored bytes
are checked against the saved ones (a sha256 of every array, outside the timing).

The method is the one of ``bench_io.py`` (docs/benchmarks.md): a warm-up written and
deleted on tmpfs right before each timed part (3 GiB by default: a save or restore touches
about 2 GiB, Orbax's buffers and the files), the checkpoint deleted right after its restore,
the side that goes first alternating from round to round, medians of >= 5 rounds, ratios
taken between the medians of this run.

    .venv/bin/python scripts/bench_orbax.py --json scripts/results/bench-orbax.json
    .venv/bin/python scripts/bench_orbax.py --quick       # 256M, 2 rounds

About 2.5 minutes on 2 cores with the defaults, 3.5 with ``--data-paths passthrough,daemon``
(most of it starting JAX and making arrays).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchlib import (
    BenchError,
    TierfsMount,
    aligned,
    clean_up,
    interrupt_on_signals,
    parse_size,
    progress,
    warm_up,
    write_json,
)  # (scripts/ is on sys.path)

GiB = 1 << 30
MiB = 1 << 20
VOLUMES = ("passthrough", "daemon")
TARGET = 0.9
STEP0 = 100  # the step of round 0; each round saves the next one, as a training job would


# ----------------------------------------------------------------------------- the child process


def child(action: str, path: str, size: int, arrays: int, seed: int) -> None:
    """One timed save or restore; talks to the parent on stdin/stdout, one JSON line at the end."""
    import hashlib

    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    n = size // 4 // arrays
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    checkpointer = ocp.StandardCheckpointer()
    if action == "save":
        rng = np.random.default_rng(seed)
        tree = {f"layer_{i}": jax.device_put(rng.random(n, dtype=np.float32) * 2 - 1, sharding) for i in range(arrays)}
        jax.block_until_ready(tree)
    else:
        target = {f"layer_{i}": jax.ShapeDtypeStruct((n,), np.float32, sharding=sharding) for i in range(arrays)}
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    t0 = time.perf_counter()
    if action == "save":
        checkpointer.save(path, tree)
        blocking = time.perf_counter() - t0  # what the training step waits for
        checkpointer.wait_until_finished()
    else:
        tree = checkpointer.restore(path, target)
        jax.block_until_ready(tree)
        blocking = None
    seconds = time.perf_counter() - t0
    checkpointer.close()
    digest = hashlib.sha256()
    for key in sorted(tree):
        digest.update(memoryview(np.asarray(tree[key])).cast("B"))
    print(
        json.dumps({"seconds": seconds, "blocking_s": blocking, "bytes": n * 4 * arrays, "sha256": digest.hexdigest()}),
        flush=True,
    )


# ----------------------------------------------------------------------------- the parent


def measure(action: str, path: str, args, warm, mount: TierfsMount | None) -> dict:
    """Start a child, let it prepare, warm up, then time its save or restore."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--_child",
        action,
        path,
        str(args.size),
        str(args.arrays),
        str(args.seed),
    ]
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: JAX's warnings never block the child
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)

        def why() -> str:
            log.seek(0)
            return log.read().strip()[-2000:]

        try:
            if proc.stdout.readline().strip() != "ready":
                proc.wait(timeout=60)
                raise BenchError(f"the Orbax {action} process did not start: {why()}")
            warm()
            cpu0 = mount.daemon_cpu() if mount else None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            if mount:
                daemon_cpu = mount.daemon_cpu() - cpu0
            proc.wait(timeout=300)
            if proc.returncode != 0 or not line.strip():
                raise BenchError(f"the Orbax {action} of {path} failed: {why()}")
            res = json.loads(line)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    res["gib_s"] = res["bytes"] / GiB / res["seconds"]
    if mount:
        res["daemon_cpu_s_per_gib"] = daemon_cpu / (res["bytes"] / GiB)
    return res


def run_benchmark(args, dirs: dict, mounts: dict, progress) -> list[dict]:
    buf = aligned(4 * MiB)

    def warm() -> None:
        warm_up(os.path.join(dirs["warm"], "warmup"), args.warmup, buf)

    sides = ("tmpfs", *args.data_paths)
    raw: list[dict] = []
    total = args.rounds * len(sides) * 2
    for rnd in range(args.rounds):
        order = sides if rnd % 2 == 0 else sides[::-1]
        for pos, side in enumerate(order):
            path = os.path.join(dirs[side], str(STEP0 + rnd))
            try:
                saved = None
                for action in ("save", "restore"):
                    res = measure(action, path, args, warm, mounts.get(side))
                    if action == "save":
                        saved = res["sha256"]
                    elif res["sha256"] != saved:
                        raise BenchError(f"the restore of {path} gave other bytes than were saved")
                    res.update(round=rnd, side=side, action=action, position=pos)
                    raw.append(res)
                    cpu = (
                        f", daemon {res['daemon_cpu_s_per_gib']:.2f} CPU-s/GiB" if "daemon_cpu_s_per_gib" in res else ""
                    )
                    progress(
                        f"[{len(raw)}/{total}] round {rnd + 1} {side:11} {action:7}: "
                        f"{res['gib_s']:.3f} GiB/s ({res['seconds']:.2f} s){cpu}"
                    )
            finally:  # right after its restore, or on any failure
                shutil.rmtree(path, ignore_errors=True)
                for entry in os.scandir(dirs[side]):  # a save cut short leaves its tmp directory
                    if entry.name.startswith(f"{STEP0 + rnd}."):
                        shutil.rmtree(entry.path, ignore_errors=True)
    return raw


def summarize(raw: list[dict], sides: tuple[str, ...]) -> list[dict]:
    rows = []
    for action in ("save", "restore"):
        row = {"action": action}
        med = {}
        for side in sides:
            sel = [r for r in raw if r["action"] == action and r["side"] == side]
            med[side] = statistics.median(r["gib_s"] for r in sel) if sel else None
            row[f"{side}_gib_s"] = med[side]
            row[f"{side}_rounds"] = len(sel)
            if action == "save" and sel:
                row[f"{side}_blocking_s"] = statistics.median(r["blocking_s"] for r in sel)
            cpu = [r["daemon_cpu_s_per_gib"] for r in sel if "daemon_cpu_s_per_gib" in r]
            if cpu:
                row[f"{side}_cpu_s_per_gib"] = statistics.median(cpu)
        for side in sides[1:]:
            row[f"{side}_ratio"] = med[side] / med["tmpfs"] if med["tmpfs"] and med[side] else None
        row["target"] = TARGET
        pt = row.get("passthrough_ratio")
        row["meets_target"] = None if pt is None else pt >= TARGET
        rows.append(row)
    return rows


def render_table(rows: list[dict], sides: tuple[str, ...]) -> str:
    head = ["Orbax", "tmpfs GiB/s"]
    for v in sides[1:]:
        head += [f"{v} GiB/s", f"{v} ratio", f"{v} CPU s/GiB"]
    head += ["target", "met"]

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    body = []
    for r in rows:
        cells = [r["action"], f(r.get("tmpfs_gib_s"), ".3f")]
        for v in sides[1:]:
            cells += [
                f(r.get(f"{v}_gib_s"), ".3f"),
                f(r.get(f"{v}_ratio"), ".2f"),
                f(r.get(f"{v}_cpu_s_per_gib"), ".2f"),
            ]
        cells += [f">= {r['target']:.1f}", {True: "yes", False: "**no**", None: "-"}[r["meets_target"]]]
        body.append(cells)
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]

    def line(cells):
        return (
            "| "
            + " | ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            )
            + " |"
        )

    rule = "|" + "|".join("-" * (w + 1) + ("-" if i == 0 else ":") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(head), rule] + [line(b) for b in body])


def parse_volumes(text: str) -> list[str]:
    values = [t.strip() for t in text.split(",") if t.strip()]
    if not values or any(v not in VOLUMES for v in values):
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: choose from {','.join(VOLUMES)}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Orbax StandardCheckpointer save and restore on a tierfs volume "
        "against plain tmpfs (medians of alternating rounds)."
    )
    p.add_argument("--size", type=parse_size, help="bytes in the pytree (default 1G)")
    p.add_argument("--arrays", type=int, default=4, help="float32 arrays the pytree holds (default 4)")
    p.add_argument("--rounds", type=int, help="rounds; medians are taken over them (default 5)")
    p.add_argument(
        "--data-paths",
        type=parse_volumes,
        default=["passthrough"],
        help="volumes to measure against tmpfs: passthrough and/or daemon (default passthrough)",
    )
    p.add_argument(
        "--warmup",
        type=parse_size,
        default=3 * GiB,
        help="warm-up written and deleted on tmpfs right before each timed part (default 3G)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the arrays' values")
    p.add_argument("--quick", action="store_true", help="smoke run: --size 256M --rounds 2 unless given")
    p.add_argument("--json", metavar="PATH", help="write settings, raw per-round numbers and medians")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.size is None:
        args.size = 256 * MiB if args.quick else GiB
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.rounds < 1 or args.arrays < 1:
        print("bench_orbax: error: --rounds and --arrays must be >= 1", file=sys.stderr)
        return 2
    interrupt_on_signals()

    created: list[str] = []
    mounts: dict[str, TierfsMount] = {}
    try:
        try:
            import orbax.checkpoint  # noqa: F401 (fail early, with one line)
        except ImportError as e:
            raise BenchError(f"orbax-checkpoint is not importable here ({e})") from None
        st = os.statvfs("/dev/shm")
        need = args.warmup + (1 + len(args.data_paths)) * args.size + 512 * MiB
        if st.f_bavail * st.f_frsize < need:
            raise BenchError(
                f"/dev/shm has {st.f_bavail * st.f_frsize / GiB:.1f} GiB free, the run needs {need / GiB:.1f} GiB"
            )

        def mkdtemp(prefix: str, where: str) -> str:
            path = tempfile.mkdtemp(prefix=prefix, dir=where)
            created.append(path)
            return path

        tmp_root = mkdtemp("bench-orbax-", "/tmp")
        runtime = mkdtemp("bench-orbax-run-", "/dev/shm")
        dirs = {"tmpfs": mkdtemp("bench-orbax-tmpfs-", "/dev/shm"), "warm": mkdtemp("bench-orbax-warm-", "/dev/shm")}
        for path in args.data_paths:
            mountpoint = os.path.join(tmp_root, path)
            os.mkdir(mountpoint)
            mounts[path] = TierfsMount(
                mountpoint,
                mkdtemp(f"bench-orbax-ram-{path}-", "/dev/shm"),
                runtime,
                data_path=path,
                job=f"bench-orbax-{path}",
            )
            dirs[path] = mountpoint

        cmdline = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        import jax
        import orbax.checkpoint as ocp

        header = {
            "date": now,
            "kernel": platform.release(),
            "cores": os.cpu_count(),
            "command": cmdline,
            "jax": jax.__version__,
            "orbax_checkpoint": ocp.__version__,
        }
        print(
            f"# bench_orbax {now}  kernel {header['kernel']}  cores {header['cores']}  "
            f"jax {header['jax']}  orbax-checkpoint {header['orbax_checkpoint']}  command: {cmdline}"
        )
        print(
            f"# StandardCheckpointer, {args.arrays} float32 arrays, {args.size / GiB:.2f} GiB, {args.rounds} rounds, "
            f"each timed part after a {args.warmup / GiB:.0f} GiB warm-up; medians; ratio = volume/tmpfs",
            flush=True,
        )
        settings = {
            "size": args.size,
            "arrays": args.arrays,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "data_paths": args.data_paths,
            "dirs": dirs,
        }
        for path, mount in mounts.items():
            mount.mount()
            settings[f"{path}_daemon_pid"] = mount.pid
            progress(f"mounted {mount.mountpoint} with --data-path {path} (daemon pid {mount.pid})")

        started = time.monotonic()
        raw = run_benchmark(args, dirs, mounts, progress)
        settings["elapsed_s"] = round(time.monotonic() - started, 1)
        for path, mount in mounts.items():  # Orbax's renames committed steps on the volumes
            steps = [s["step"] for s in mount.read_status().get("steps", [])]
            settings[f"{path}_committed_steps"] = steps
            if STEP0 + args.rounds - 1 not in steps:
                raise BenchError(f"Orbax's save did not commit a step on the {path} volume (steps held: {steps})")
        sides = ("tmpfs", *args.data_paths)
        rows = summarize(raw, sides)
        print(render_table(rows, sides))
        for side in sides:
            print(
                f"# {side}: save blocks the caller for {rows[0].get(f'{side}_blocking_s', 0):.2f} s (median), "
                "the rest runs in Orbax's background thread"
            )
        if args.rounds < 5:
            print(f"# note: only {args.rounds} rounds; use >= 5 for numbers to keep")
        if args.json:
            write_json(args.json, {"header": header, "settings": settings, "raw": raw, "medians": rows})
        return 0
    except BenchError as e:
        print(f"bench_orbax: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_orbax: interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        clean_up("bench_orbax", list(mounts.values()), created)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--_child"]:
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
    else:
        sys.exit(main())
