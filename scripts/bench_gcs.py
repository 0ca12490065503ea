#!/usr/bin/env python3
"""GCS tier benchmark: tierfs backup and restore against plain google-cloud-storage.

Runs fake-gcs-server (memory backend: no disk speed enters) on 127.0.0.1. Per round:

1. Backup. Baseline: ``transfer_manager.upload_many_from_filenames`` (8 threads, a pool of
   32 connections as in ``tierfs.tiers.gcs_http``) of the checkpoint files into a fresh bucket. tierfs:
   a fresh volume with ``--gcs``; the files are copied into ``ckpt/1.orbax-checkpoint-tmp``
   (untimed), renamed to ``ckpt/1`` (t0: the commit) and the status is polled every 50 ms
   until step 1 is backed up. Throughput = bytes / ``backup.seconds`` (the daemon's timing)
   and bytes / (observed - t0).
2. Dedup. Step 2 = the same files with random 4 MiB-aligned 4 MiB regions (10% of all
   chunks) rewritten, committed the same way: uploaded_bytes / bytes should be ~0.10.
3. Restore. Unmount, wipe the rank directory, start ``tierfs mount`` and poll the status every
   20 ms until ``restored.state`` is "done" (the mount returns once step 2's namespace is in
   place and its bytes follow; timing to "done" keeps the span the figure always had), check
   every file's sha256. Baseline: ``download_many_to_path`` (8 threads) of the baseline's
   objects into tmpfs.

This VM's memory balloon makes naive A/B runs lie (docs/benchmarks.md), so the files (random
bytes: incompressible, fair to both sides) are generated per round into tmpfs, deleted right
after their measurements, the side that goes first alternates per round, and the table
shows medians of ``--rounds`` with ratio = tierfs / baseline from this run's medians. Each
round's buckets are emptied and deleted; the emulator's RSS is reported, and so is the CPU
time of the emulator and of the client side (this process, or the tierfs daemon) per transfer.

The status comes from the daemon's control socket in this process: the reply ``tierfs
status --json`` prints, without starting a Python process every 50 ms on 2 cores (that
would take CPU from the daemon under test). Usage (``--quick``: 256M, 2 rounds)::

    .venv/bin/python scripts/bench_gcs.py [--quick] [--json out.json] [--plot out.png]

The daemon runs with a job secret, as a job should: chunks and manifests are sealed
(``tierfs.core.bucket_seal``); ``--no-secret`` measures them in clear, as before sealing.

Everything it creates (/dev/shm/bench-gcs-*, /tmp/bench-gcs-*, its mount, the emulator) is
removed on exit, also on errors and Ctrl-C.

``--twins 1,2,4 --reference DIR`` measures the twins row instead (``scripts/gcs_twins.py``):
D data-parallel twins on D real daemons backing up one step of ``--size`` per rank
(default 128M) through a byte-counting proxy, against the code before the twins shared
the upload, run from the checkout DIR (e.g. ``git worktree add --detach DIR <commit>``);
``--sim-twins 8`` adds D values from the scale simulation::

    .venv/bin/python scripts/bench_gcs.py --twins 1,2,4 --sim-twins 8 --reference /tmp/tierfs-base \
        [--json out.json] [--plot out.png]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchlib import (
    GCS_POOL,
    GCS_WORKERS,
    NO_MATPLOTLIB,
    BenchError,
    cpu_seconds,
    drop_bucket,
    gcs_client,
    interrupt_on_signals,
    is_mounted,
    no_interruptions,
    parse_size,
    progress,
    pyplot,
    save_figure,
    write_json,
)  # (scripts/ is on sys.path)
from google.cloud import storage
from google.cloud.storage import transfer_manager
from tierfs_testing.gcs_emulator import GcsEmulator

from tierfs.commands.status import fetch as fetch_status
from tierfs.core.keys import new_secret
from tierfs.ramtier.tmpfs import delete_ram_data

MiB, GiB = 1 << 20, 1 << 30
CHUNK = 4 * MiB  # tierfs's default chunk size, and the unit step 2 rewrites
WORKERS, POOL = GCS_WORKERS, GCS_POOL
JOB = "bench"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def verify(directory: Path, expected: dict[str, str], what: str) -> None:
    bad = sorted(n for n in expected if sha256(directory / n) != expected[n])
    extra = sorted(set(os.listdir(directory)) - set(expected))
    if bad or extra:
        raise BenchError(f"{what}: wrong content in {bad[:3]}, unexpected files {extra[:3]}")


def make_files(src: Path, names: list[str], per_file: int) -> dict[str, str]:
    """Random (incompressible) files; returns their sha256."""
    for n in names:
        with open(src / n, "wb") as f:
            for off in range(0, per_file, CHUNK):
                f.write(os.urandom(min(CHUNK, per_file - off)))
    return {n: sha256(src / n) for n in names}


def mutate(src: Path, names: list[str], per_file: int, fraction: float, rng: random.Random) -> int:
    """Rewrite ``fraction`` of all 4 MiB chunks, chosen at random; returns the bytes changed."""
    slots = [(n, off) for n in names for off in range(0, per_file, CHUNK)]
    picked = rng.sample(slots, max(1, round(fraction * len(slots))))
    for n, off in picked:
        with open(src / n, "r+b") as f:
            f.seek(off)
            f.write(os.urandom(min(CHUNK, per_file - off)))
    return sum(min(CHUNK, per_file - off) for _, off in picked)


class Volume:
    """One tierfs mount driven through the CLI; Ctrl-C never cuts a mount in half."""

    def __init__(self, tierfs: str, mountpoint: Path, ramdisk: Path, capacity: str):
        self.tierfs, self.mountpoint, self.ramdisk, self.capacity = tierfs, mountpoint, ramdisk, capacity

    def _run(self, *args: str, timeout: float = 900) -> float:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [self.tierfs, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        interrupted, deadline = False, time.monotonic() + timeout
        while True:
            try:
                _, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
                break
            except KeyboardInterrupt:
                interrupted = True  # let it finish, then stop
            except subprocess.TimeoutExpired:
                proc.kill()
                raise BenchError(f"tierfs {args[0]} did not return within {timeout:.0f} s") from None
        if interrupted:
            raise KeyboardInterrupt
        if proc.returncode != 0:
            raise BenchError(f"tierfs {args[0]} failed: {(err or '').strip()[-300:]}")
        return time.perf_counter() - t0

    def mount(self, gcs_url: str) -> float:
        return self._run(
            "mount",
            str(self.mountpoint),
            "--ramdisk",
            str(self.ramdisk),
            "--job",
            JOB,
            "--rank",
            "0",
            "--capacity",
            self.capacity,
            "--gcs",
            gcs_url,
        )

    def wait_restored(self, timeout: float = 1800) -> dict:
        """The status once the restore started by the mount is done (polled every 20 ms)."""
        deadline = time.perf_counter() + timeout
        while (st := fetch_status(self.mountpoint)).get("restored") and st["restored"]["state"] != "done":
            if time.perf_counter() > deadline:
                raise BenchError(f"the restore did not finish within {timeout:.0f} s: {st['restored']}")
            time.sleep(0.02)
        return st

    def unmount_and_wipe(self) -> None:
        if is_mounted(self.mountpoint):
            self._run("unmount", str(self.mountpoint), timeout=120)
        shutil.rmtree(self.ramdisk / JOB / "rank-0", ignore_errors=True)

    def commit(self, step: int, src: Path, names: list[str], emu_pid: int) -> dict:
        """Copy into <step>.orbax-checkpoint-tmp, rename (t0), wait until backed up."""
        tmp = self.mountpoint / "ckpt" / f"{step}.orbax-checkpoint-tmp"
        tmp.mkdir(parents=True)
        c0 = time.perf_counter()
        for n in names:  # 1 MiB writes, as a checkpoint writer does (sendfile into FUSE is ~2.5x slower)
            with open(src / n, "rb") as fin, open(tmp / n, "wb") as fout:
                shutil.copyfileobj(fin, fout, MiB)
        copy_s = time.perf_counter() - c0
        daemon = fetch_status(self.mountpoint)["pid"]
        cpu0 = cpu_seconds(emu_pid), cpu_seconds(daemon)
        t0 = time.perf_counter()
        os.rename(tmp, self.mountpoint / "ckpt" / str(step))
        while time.perf_counter() - t0 < 1800:
            st = next((s for s in fetch_status(self.mountpoint)["steps"] if s["step"] == step), None)
            if st and st["backed_up"]:
                return {
                    **st["backup"],
                    "observed_s": time.perf_counter() - t0,
                    "copy_s": copy_s,
                    "cpu_s": [cpu_seconds(emu_pid) - cpu0[0], cpu_seconds(daemon) - cpu0[1]],
                }
            time.sleep(0.05)
        raise BenchError(f"step {step} was not backed up within 30 minutes")


def run_round(rnd: int, args, client: storage.Client, emu: GcsEmulator, vol: Volume) -> dict:
    order = ("baseline", "tierfs") if rnd % 2 == 0 else ("tierfs", "baseline")
    tag = uuid.uuid4().hex[:8]
    base_bucket, tier_bucket = f"bench-{tag}-base", f"bench-{tag}-tier"
    names = [f"shard-{i:03d}" for i in range(args.files)]
    per_file = args.size // args.files
    src = Path(tempfile.mkdtemp(prefix="bench-gcs-src-", dir="/dev/shm"))
    dl = Path(tempfile.mkdtemp(prefix="bench-gcs-dl-", dir="/dev/shm"))
    r: dict = {"round": rnd, "order": list(order), "bytes": per_file * args.files}
    mib, buckets, emu_pid = r["bytes"] / MiB, [], emu._process.pid
    try:
        hashes1 = make_files(src, names, per_file)
        for b in (base_bucket, tier_bucket):
            emu.make_bucket(b)
            buckets.append(b)
        for side in order:  # 1. backup
            if side == "baseline":
                cpu0, t0 = (cpu_seconds(emu_pid), cpu_seconds()), time.perf_counter()
                transfer_manager.upload_many_from_filenames(
                    client.bucket(base_bucket),
                    names,
                    source_directory=str(src),
                    max_workers=WORKERS,
                    worker_type=transfer_manager.THREAD,
                    raise_exception=True,
                )
                r["base_upload_s"] = time.perf_counter() - t0
                r["base_upload_cpu_s"] = [cpu_seconds(emu_pid) - cpu0[0], cpu_seconds() - cpu0[1]]
                progress(f"round {rnd + 1} baseline upload: {mib / r['base_upload_s']:.0f} MiB/s")
            else:
                r["tier_empty_mount_s"] = vol.mount(f"gs://{tier_bucket}/b")
                b1 = r["tier_step1"] = vol.commit(1, src, names, emu_pid)
                progress(
                    f"round {rnd + 1} tierfs backup: {mib / b1['seconds']:.0f} MiB/s "
                    f"(commit to backed up {b1['observed_s']:.2f} s, lag_s {b1['lag_s']})"
                )
        # 2. dedup: step 2 = step 1 with a tenth of its chunks rewritten
        r["changed_bytes"] = mutate(src, names, per_file, args.change, random.Random(rnd))
        hashes2 = {n: sha256(src / n) for n in names}
        b2 = r["tier_step2"] = vol.commit(2, src, names, emu_pid)
        progress(
            f"round {rnd + 1} step 2: uploaded {b2['uploaded_bytes'] / b2['bytes']:.3f} of its bytes, "
            f"dedup {b2['dedup_bytes'] / MiB:.0f} MiB, backup {b2['seconds']:.2f} s"
        )
        shutil.rmtree(src)  # from here on both sides read from GCS
        vol.unmount_and_wipe()
        for side in order:  # 3. restore
            if side == "baseline":
                cpu0, t0 = (cpu_seconds(emu_pid), cpu_seconds()), time.perf_counter()
                transfer_manager.download_many_to_path(
                    client.bucket(base_bucket),
                    names,
                    destination_directory=str(dl),
                    max_workers=WORKERS,
                    worker_type=transfer_manager.THREAD,
                    raise_exception=True,
                )
                r["base_download_s"] = time.perf_counter() - t0
                r["base_download_cpu_s"] = [cpu_seconds(emu_pid) - cpu0[0], cpu_seconds() - cpu0[1]]
                verify(dl, hashes1, "baseline download")
                shutil.rmtree(dl)
                progress(f"round {rnd + 1} baseline download: {mib / r['base_download_s']:.0f} MiB/s")
            else:
                cpu0, t0 = cpu_seconds(emu_pid), time.perf_counter()
                r["tier_namespace_s"] = vol.mount(f"gs://{tier_bucket}/b")
                status = vol.wait_restored()
                r["tier_mount_s"] = time.perf_counter() - t0  # mount start to restored.state "done"
                r["tier_restore_cpu_s"] = [
                    cpu_seconds(emu_pid) - cpu0,
                    cpu_seconds(status["pid"]),
                ]  # daemon: all of its life
                got = r["tier_restored"] = status.get("restored") or {}
                if got.get("step") != 2 or got.get("bytes") != r["bytes"]:
                    raise BenchError(f"the mount restored {got}, expected step 2 of {r['bytes']} bytes")
                verify(vol.mountpoint / "ckpt" / "2", hashes2, "tierfs restore of step 2")
                vol.unmount_and_wipe()
                progress(
                    f"round {rnd + 1} tierfs restore: {mib / r['tier_mount_s']:.0f} MiB/s "
                    f"(mount start to done {r['tier_mount_s']:.2f} s, of it restore {got['seconds']:.2f} s; "
                    f"the mount returned after {r['tier_namespace_s']:.2f} s)"
                )
    finally:
        vol.unmount_and_wipe()
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dl, ignore_errors=True)
        for b in buckets:
            try:
                drop_bucket(client, b)
            except Exception as e:  # noqa: BLE001 (cleanup: the emulator goes away at exit anyway)
                progress(f"bench_gcs: warning: cannot delete bucket {b}: {e}")
    with open(f"/proc/{emu_pid}/status") as f:  # the emulator keeps every object in RAM
        kv = dict(ln.split(":", 1) for ln in f)
    r["emulator_mib"] = {k: int(kv[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM")}
    progress(
        f"round {rnd + 1} done; emulator RSS {r['emulator_mib']['VmRSS']} MiB "
        f"(peak so far {r['emulator_mib']['VmHWM']} MiB)"
    )
    return r


METRICS = [  # row name, baseline seconds, tierfs seconds
    ("backup MiB/s (daemon backup.seconds)", "base_upload_s", lambda r: r["tier_step1"]["seconds"]),
    ("backup MiB/s (commit to backed up)", "base_upload_s", lambda r: r["tier_step1"]["observed_s"]),
    ("restore MiB/s (mount start to done)", "base_download_s", lambda r: r["tier_mount_s"]),
    ("restore MiB/s (daemon restored.seconds)", "base_download_s", lambda r: r["tier_restored"]["seconds"]),
]


def summarize(raw: list[dict]) -> dict:
    med = statistics.median
    rows = []
    for name, base_key, tier in METRICS:
        b, t = med(r["bytes"] / MiB / r[base_key] for r in raw), med(r["bytes"] / MiB / tier(r) for r in raw)
        rows.append({"metric": name, "baseline": b, "tierfs": t, "ratio": t / b})
    s1, s2 = [r["tier_step1"] for r in raw], [r["tier_step2"] for r in raw]
    return {
        "rows": rows,
        "commit_to_backed_up_s": med(b["observed_s"] for b in s1),
        "lag_s": med(b["lag_s"] for b in s1),
        "copy_in_s": med(b["copy_s"] for b in s1),
        "empty_mount_s": med(r["tier_empty_mount_s"] for r in raw),
        "step2_changed_fraction": med(r["changed_bytes"] / r["bytes"] for r in raw),
        "step2_uploaded_fraction": med(b["uploaded_bytes"] / b["bytes"] for b in s2),
        "step2_dedup_mib": med(b["dedup_bytes"] / MiB for b in s2),
        "step2_backup_s": med(b["seconds"] for b in s2),
        "cpu_s": {
            k: [med(get(r)[i] for r in raw) for i in (0, 1)]
            for k, get in (
                ("baseline upload", lambda r: r["base_upload_cpu_s"]),
                ("tierfs backup", lambda r: r["tier_step1"]["cpu_s"]),
                ("baseline download", lambda r: r["base_download_cpu_s"]),
                ("tierfs restore", lambda r: r["tier_restore_cpu_s"]),
            )
        },
        "emulator_rss_mib_max": max(r["emulator_mib"]["VmRSS"] for r in raw),
        "emulator_peak_mib": max(r["emulator_mib"]["VmHWM"] for r in raw),
    }


def render(s: dict) -> str:
    w = max(len(r["metric"]) for r in s["rows"])
    out = [f"{'metric':<{w}}  {'baseline':>9}  {'tierfs':>9}  {'ratio':>6}", "-" * (w + 32)]
    out += [f"{r['metric']:<{w}}  {r['baseline']:9.1f}  {r['tierfs']:9.1f}  {r['ratio']:6.2f}" for r in s["rows"]]
    out += [
        f"# commit to backed up {s['commit_to_backed_up_s']:.2f} s (lag_s {s['lag_s']:.2f}); copy into the "
        f"mount (untimed) {s['copy_in_s']:.2f} s; mount of an empty volume {s['empty_mount_s']:.2f} s",
        f"# dedup: step 2 changed {s['step2_changed_fraction']:.3f} of the bytes and uploaded "
        f"{s['step2_uploaded_fraction']:.3f} (dedup {s['step2_dedup_mib']:.0f} MiB, "
        f"backup {s['step2_backup_s']:.2f} s)",
        "# CPU seconds, emulator + client (this process, or the tierfs daemon): "
        + "; ".join(f"{k} {e:.1f} + {c:.1f}" for k, (e, c) in s["cpu_s"].items()),
        f"# emulator RSS after each round's cleanup <= {s['emulator_rss_mib_max']} MiB, "
        f"peak {s['emulator_peak_mib']} MiB",
    ]
    return "\n".join(out)


def plot(path: str, s: dict, title: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    rows = [s["rows"][0], s["rows"][2]]  # backup (daemon's timing), restore (mount start to done)
    top = max(max(r["baseline"], r["tierfs"]) for r in rows)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for k, (side, label) in enumerate((("baseline", "google-cloud-storage, 8 threads"), ("tierfs", "tierfs"))):
        bars = ax.bar([i + (k - 0.5) * 0.38 for i in range(2)], [r[side] for r in rows], 0.38, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    for i, r in enumerate(rows):
        ax.annotate(f"ratio {r['ratio']:.2f}", (i, max(r["baseline"], r["tierfs"]) + top * 0.08), ha="center")
    ax.set_xticks([0, 1], ["backup\n(daemon backup.seconds)", "restore\n(mount start to done)"])
    ax.set_ylim(0, top * 1.35)
    ax.set_ylabel("MiB/s (median)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    save_figure(fig, path)


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: comma-separated integers, e.g. 1,2,4") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: every value at least 1")
    return values


def main_twins(args) -> int:
    """The twins row (scripts/gcs_twins.py): D daemons through a counting proxy, against --reference."""
    import gcs_twins

    interrupt_on_signals()
    tmp = Path(tempfile.mkdtemp(prefix="bench-gcs-", dir="/tmp"))
    emu = GcsEmulator(tmp / "emulator", backend="memory")
    try:
        args.reference_src = gcs_twins.reference_src(args.reference)
        emu.start()
        os.environ.update(emu.environ(), TIERFS_RUNTIME_DIR=str(tmp / "run"))  # for the daemons too
        if args.secret:
            os.environ["TIERFS_SECRET"] = new_secret()  # sealed chunks and manifests (core.bucket_seal)
        else:
            os.environ.pop("TIERFS_SECRET", None)
        client = gcs_client()
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        cmd = shlex.join([sys.executable, *sys.argv])
        print(f"# bench_gcs twins {now}  cores {os.cpu_count()}  command: {cmd}")
        print(
            f"# {args.size / MiB:.0f} MiB per rank, D = {args.twins} on daemons, {args.sim_twins} simulated, "
            f"{args.rounds} rounds; baseline: {args.reference}; medians",
            flush=True,
        )
        result = gcs_twins.run(args, emu, client)
        print(gcs_twins.render(result))
        if args.json:
            settings = {
                "size": args.size,
                "rounds": args.rounds,
                "twins": args.twins,
                "sim_twins": args.sim_twins,
                "reference": args.reference,
                "capacity": args.capacity,
                "date": now,
                "command": cmd,
                "cores": os.cpu_count(),
            }
            write_json(args.json, {"settings": settings, **result})
        if args.plot:
            why = gcs_twins.plot(
                args.plot,
                result,
                f"tierfs backup of D twins through GCS (fake-gcs-server), "
                f"{args.size / MiB:.0f} MiB per rank, {now[:10]}",
                pyplot,
                save_figure,
            )
            print(f"# plot skipped: {why}" if why else f"# wrote {args.plot}")
        return 0
    except (BenchError, OSError, AssertionError) as e:
        return _failed(e, tmp, emu)
    except KeyboardInterrupt:
        print("bench_gcs: interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        with no_interruptions():
            emu.stop()
            shutil.rmtree(tmp, ignore_errors=True)


def _failed(e: BaseException, tmp: Path, emu: GcsEmulator) -> int:
    """One line for the error, then the last lines of every daemon's log and the emulator's."""
    print(f"bench_gcs: error: {e}", file=sys.stderr)
    for log in sorted((tmp / "run").glob("*.log")) + [emu.log_path]:  # they go with tmp afterwards
        if log.exists():
            tail = log.read_text(errors="replace").splitlines()[-15:]
            print(f"--- last lines of {log.name}:", *tail, sep="\n", file=sys.stderr)
    return 1


def main() -> int:
    p = argparse.ArgumentParser(
        description="tierfs GCS backup/restore against plain google-cloud-storage "
        "(fake-gcs-server, medians of alternating rounds)"
    )
    p.add_argument("--size", type=parse_size, help="checkpoint bytes per round (default 1G)")
    p.add_argument("--files", type=int, default=16, help="files the checkpoint is split into (default 16)")
    p.add_argument("--rounds", type=int, help="rounds; medians are taken over them (default 3)")
    p.add_argument("--change", type=float, default=0.10, help="fraction of chunks step 2 rewrites (default 0.10)")
    p.add_argument("--capacity", help="tierfs mount --capacity (default 4G, or 3x --size if larger)")
    p.add_argument("--quick", action="store_true", help="smoke run: --size 256M --rounds 2 unless given")
    p.add_argument("--json", metavar="PATH", help="write settings, raw per-round numbers and medians")
    p.add_argument("--plot", metavar="PATH.png", help="grouped bars of the throughputs (needs matplotlib)")
    p.add_argument(
        "--twins",
        type=parse_int_list,
        metavar="D,...",
        help="the twins row instead: D data-parallel twins on D daemons (e.g. 1,2,4); needs --reference",
    )
    p.add_argument(
        "--sim-twins",
        type=parse_int_list,
        default=[],
        metavar="D,...",
        help="with --twins: D values taken from the scale simulation (e.g. 8)",
    )
    p.add_argument(
        "--reference",
        metavar="DIR",
        help="with --twins: a checkout of the code before the twins shared the upload (the baseline)",
    )
    p.add_argument("--timeout", type=float, default=600, help="with --twins: seconds a backup may take (600)")
    p.add_argument(
        "--no-secret",
        dest="secret",
        action="store_false",
        help="run the daemon without the job's secret: chunks and manifests in clear, as before sealing "
        "(default: with a secret, as a job should run)",
    )
    args = p.parse_args()
    if args.twins:
        if not args.reference:
            p.error("--twins needs --reference DIR, a checkout of the code to compare with")
        args.size = args.size or (32 * MiB if args.quick else 128 * MiB)
        args.rounds = args.rounds or (2 if args.quick else 3)
        args.capacity = args.capacity or f"{max(GiB, 4 * args.size) // MiB}M"
        return main_twins(args)
    args.size = args.size or (256 * MiB if args.quick else GiB)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.capacity = args.capacity or f"{max(4 * GiB, 3 * args.size) // MiB}M"
    if args.files < 1 or args.rounds < 1 or args.size < args.files or not 0 < args.change <= 1:
        p.error("--files and --rounds must be >= 1, --size >= --files bytes, 0 < --change <= 1")

    interrupt_on_signals()

    tmp = Path(tempfile.mkdtemp(prefix="bench-gcs-", dir="/tmp"))
    ram = Path(tempfile.mkdtemp(prefix="bench-gcs-ram-", dir="/dev/shm"))
    emu = GcsEmulator(tmp / "emulator", backend="memory")
    vol = Volume(
        shutil.which("tierfs", path=os.path.dirname(sys.executable)) or "tierfs", tmp / "mnt", ram, args.capacity
    )
    try:
        vol.mountpoint.mkdir()
        emu.start()
        os.environ.update(emu.environ(), TIERFS_RUNTIME_DIR=str(tmp / "run"))  # for the daemons too
        if args.secret:
            os.environ["TIERFS_SECRET"] = new_secret()  # sealed chunks and manifests (core.bucket_seal)
        else:
            os.environ.pop("TIERFS_SECRET", None)
        client = gcs_client()
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        cmd = shlex.join([sys.executable, *sys.argv])
        print(f"# bench_gcs {now}  cores {os.cpu_count()}  command: {cmd}")
        print(
            f"# {args.size / MiB:.0f} MiB in {args.files} files, {args.rounds} rounds, fake-gcs-server "
            f"(memory backend) on {emu.url}; medians; ratio = tierfs / baseline; "
            f"{'sealed (with the job secret)' if args.secret else 'in clear (no secret)'}",
            flush=True,
        )
        raw = [run_round(rnd, args, client, emu, vol) for rnd in range(args.rounds)]
        summary = summarize(raw)
        print(render(summary))
        if args.json:
            settings = {
                "size": args.size,
                "files": args.files,
                "rounds": args.rounds,
                "change": args.change,
                "sealed": args.secret,
                "capacity": args.capacity,
                "workers": WORKERS,
                "pool": POOL,
                "chunk": CHUNK,
                "date": now,
                "command": cmd,
                "cores": os.cpu_count(),
            }
            write_json(args.json, {"settings": settings, "raw": raw, "medians": summary})
        if args.plot:
            why = plot(
                args.plot,
                summary,
                f"tierfs GCS tier vs google-cloud-storage (fake-gcs-server), "
                f"{args.size / MiB:.0f} MiB, {args.rounds} rounds, {now[:10]}",
            )
            print(f"# plot skipped: {why}" if why else f"# wrote {args.plot}")
        return 0
    except (BenchError, OSError) as e:
        return _failed(e, tmp, emu)
    except KeyboardInterrupt:
        print("bench_gcs: interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:  # no Ctrl-C while cleaning up: a half-done cleanup leaves a mount behind
        with no_interruptions():
            try:
                vol.unmount_and_wipe()
            except BenchError as e:
                subprocess.run(["umount", "-l", str(vol.mountpoint)], capture_output=True)
                print(f"bench_gcs: warning: {e}; detached {vol.mountpoint}", file=sys.stderr)
            emu.stop()
            delete_ram_data(ram)  # the rank's own tmpfs (--capacity) first, then the rest
            if is_mounted(vol.mountpoint):
                print(f"bench_gcs: warning: {vol.mountpoint} is still mounted; left {tmp}", file=sys.stderr)
            else:
                shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
