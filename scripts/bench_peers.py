#!/usr/bin/env python3
"""Peer tier benchmark: replication and restore against a plain socket copy, and writes
with and without a replication running.

A 3-node LocalCluster (tierfs.testing.cluster: 127.0.0.2-4, ``--replicas 1``, no GCS); each step
is ``--size`` bytes of fresh random data in ``--files`` files. Per round:

1. Replication: the step, written into node 0's mount untimed, is committed by renaming
   ``ckpt/<S>.orbax-checkpoint-tmp`` to ``ckpt/<S>`` at t0; the status is polled every 20 ms
   until it is replicated: bytes / ``replicas.seconds`` and bytes / (seen - t0). Baseline:
   this script as two processes, a sender on 127.0.0.2 that ``os.sendfile``s the same files
   from tmpfs to a receiver on 127.0.0.3 that ``recv_into``s a page-aligned 1 MiB buffer and
   writes fresh tmpfs files, timed from connect to the last file closed.
2. Restore: node 0 is killed (-9) and wiped, ``tierfs mount`` is started and the status polled
   every 20 ms until ``restored.state`` is "done"; each file's sha256 is checked: bytes /
   ``restored.seconds`` and bytes / (mount start to done), against the plain copy from the peer
   to node 0. (``tierfs mount`` now returns once the namespace is in place and the bytes follow,
   so the wall time runs to "done" instead of to the mount's return: the same span as before.)
3. Writes: 1 MiB sequential writes of a fresh ``--size`` file into node 0's mount (fio with
   page-aligned buffers if installed, else a built-in writer), (a) alone and (b) started
   right after committing a new step; recorded: whether its replication ran over the write
   and how much of the step the peer held by the write's end. Target: (b) / (a) >= 0.80.

With ``--tls``, instead: encrypted peer traffic (TLS 1.3, the default) against ``--peer-tls off``.
Two 2-node clusters run side by side, one with each setting; each round writes one step of
fresh random bytes into both node 0s untimed, then times replication (as in 1.) on each, then
kills and wipes each node 0 and times its restore from the peer (as in 2.). The ratios are
TLS / in clear, from this run's medians.

Method as in docs/benchmarks.md (the balloon returns freed pages to the host ~2 s after they
are freed): each timed part follows a tmpfs warm-up (``--warmup``, default 2x the size, the
most one part touches) written and deleted right before it; test files are deleted right
after; the side that goes first alternates per round; medians, and ratios of this run's
medians. The CPU time of the daemons (/proc/PID/stat), fio and the plain copy is taken over
each part: CPU-s per GiB, and busy = CPU-s per wall second (1.0 = one of the VM's 2 cores).

    .venv/bin/python scripts/bench_peers.py [--quick] [--json out.json] [--plot out.png]
    .venv/bin/python scripts/bench_peers.py --tls [--size 512M] [--rounds 5] [--json out.json]

All it creates (/dev/shm/bench-peers-*, /tmp/bench-peers-*, daemons, processes) is removed
or stopped on exit, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse, datetime, hashlib, json, os, shlex, shutil, signal, statistics, subprocess, sys, tempfile, time
import uuid
from pathlib import Path
from benchlib import (BenchError, aligned, cpu_seconds, interrupt_on_signals, make_files,  # noqa: E402
                      parse_size, plain_copy, warm_tmpfs, write_all, write_json, pyplot, NO_MATPLOTLIB,
                      save_figure)  # (scripts/ is on sys.path)

MiB, GiB = 1 << 20, 1 << 30
NODE0, PEER = "127.0.0.2", "127.0.0.3"


# ----------------------------------------------------------------------------- writes

def write_file(path: str, size: int, buf: memoryview) -> dict:
    """Sequential 1 MiB writes of a fresh file; start/end in time.time(), to compare with the daemon's."""
    fio, start = shutil.which("fio"), time.time()
    if fio:
        out = subprocess.run([fio, "--name=w", f"--filename={path}", "--rw=write", "--bs=1M", f"--size={size}",
                              "--ioengine=psync", "--direct=0", "--iomem_align=4096", "--fallocate=none",
                              "--thread", "--output-format=json"], capture_output=True, text=True)
        if out.returncode:
            raise BenchError(f"fio failed: {out.stderr.strip()[-300:]}")
        job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
        nbytes, seconds = job["write"]["io_bytes"], job["write"]["runtime"] / 1000
        writer_cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * seconds
    else:
        fd, cpu0, t0 = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), cpu_seconds(), time.perf_counter()
        for pos in range(0, size, MiB):
            write_all(fd, buf[:min(MiB, size - pos)])
        os.close(fd)
        nbytes, seconds, writer_cpu = size, time.perf_counter() - t0, cpu_seconds() - cpu0
    end = time.time()
    if nbytes != size or seconds <= 0:
        raise BenchError(f"the write moved {nbytes} bytes in {seconds}s, expected {size}")
    return {"bytes": nbytes, "seconds": seconds, "start": end - seconds if fio else start, "end": end,
            "cpu": {"writer": writer_cpu}}


# ----------------------------------------------------------------------------- the cluster side

class Bench:
    def __init__(self, args, cluster):
        from tierfs.commands.status import fetch  # the control socket from this process: no
        self.fetch = fetch                        # Python start-up per poll on a 2-core VM
        self.args, self.c, self.mnt, self.buf = args, cluster, cluster.nodes[0].mountpoint, aligned(MiB)

    def wait(self, what: str, pred, timeout: float = 300):
        deadline = time.monotonic() + timeout
        while not (value := pred(self.fetch(self.mnt))):
            if time.monotonic() > deadline:
                raise BenchError(f"timed out waiting for {what}")
            time.sleep(0.02)
        return value

    @staticmethod
    def replicated(step: int):
        return lambda st: next((s["replicas"] for s in st["steps"] if s["step"] == step
                                and s["replicas"].get("version") == s["version"]), None)

    @staticmethod
    def idle(st: dict) -> bool:
        return st["peers"]["working_on"] is None and all(s["replicas"].get("version") == s["version"]
                                                         for s in st["steps"])

    def warm(self) -> None:
        warm_tmpfs(self.args.shm, self.args.warmup, self.buf)

    def cpu(self) -> list[float]:
        return [cpu_seconds(n.pid) if n.pid else 0.0 for n in self.c.nodes]

    def node_of(self, address: str) -> int:
        return next(i for i, n in enumerate(self.c.nodes) if n.address == address)

    def commit(self, step: int) -> None:
        os.rename(self.mnt / "ckpt" / f"{step}.orbax-checkpoint-tmp", self.mnt / "ckpt" / str(step))

    def replicate(self, step: int) -> dict:
        self.warm()
        cpu0, t0 = self.cpu(), time.time()
        self.commit(step)
        renamed = time.time() - t0  # the job's rename(2): the commit happens inside it
        rep = self.wait(f"replication of step {step}", self.replicated(step))
        seen, cpu1, to = time.time(), self.cpu(), self.node_of(rep["peers"][0])
        if rep["sent_bytes"] != self.args.size:
            raise BenchError(f"step {step}: {rep['sent_bytes']} bytes sent, expected {self.args.size}")
        # The manifest is written when the step is hashed, before a byte goes out: splits hashing and transfer.
        built = os.stat(self.c.nodes[0].ramdisk / self.c.job / "rank-0" / "steps" / str(step) / "manifest.json")
        return {"bytes": self.args.size, "seconds": rep["seconds"], "seen_s": seen - t0, "window_s": seen - t0,
                "rename_s": renamed, "hashed_s": built.st_mtime - t0, "transfer_s": rep["at"] - built.st_mtime,
                "peer": rep["peers"][0], "cpu": {"sender": cpu1[0] - cpu0[0], "receiver": cpu1[to] - cpu0[to]}}

    def restore(self, sums: dict[str, str], holder: int) -> dict:
        self.warm()
        peer_cpu, t0 = cpu_seconds(self.c.nodes[holder].pid), time.monotonic()
        self.c.tierfs(*self.c.mount_args(0))  # what LocalCluster.start(0) runs, minus its status call
        mounted = time.monotonic() - t0  # the namespace is in place; the bytes follow
        st = self.fetch(self.mnt)
        self.c.nodes[0].pid = st["pid"]
        if not st["restored"]:
            raise BenchError(f"node 0 restored nothing (cluster view: {st['cluster']})")
        deadline = t0 + 600
        while st["restored"]["state"] != "done":  # then at once the daemons' CPU, before the checks read
            if time.monotonic() > deadline:
                raise BenchError(f"node 0's restore did not finish within 600 s: {st['restored']}")
            time.sleep(0.02)
            st = self.fetch(self.mnt)
        wall, peer_cpu = time.monotonic() - t0, cpu_seconds(self.c.nodes[holder].pid) - peer_cpu
        r, own_cpu = st["restored"], cpu_seconds(st["pid"])
        if r.get("tier") != "peer" or r.get("bytes") != self.args.size:
            raise BenchError(f"node 0 was not restored from a peer: {r}")
        for name, want in sums.items():
            with open(self.mnt / "ckpt" / str(r["step"]) / name, "rb") as f:
                got = hashlib.file_digest(f, "sha256").hexdigest()
            if got != want:
                raise BenchError(f"restored ckpt/{r['step']}/{name} differs from the original (sha256)")
        return {"bytes": self.args.size, "seconds": r["seconds"], "wall_s": wall, "window_s": wall,
                "mount_s": mounted, "from": r["from"], "cpu": {"sender": peer_cpu, "receiver": own_cpu}}

    def write(self, tag: str, step: int | None, holder: int) -> dict:
        """A fresh file written alone, or right after committing ``step`` (replicated meanwhile)."""
        self.wait("replication to be idle", self.idle)
        if step is not None:
            make_files(self.mnt / "ckpt" / f"{step}.orbax-checkpoint-tmp", self.args.size, self.args.files)
        path, peer = str(self.mnt / f"write-{tag}"), self.c.nodes[holder].mountpoint
        held = lambda: self.fetch(peer)["replicas_held"]["bytes"]  # what the peer holds: the real overlap
        try:
            self.warm()
            cpu0, held0 = self.cpu(), held()
            if step is not None:
                self.commit(step)
            res = write_file(path, self.args.size, self.buf)
            cpu1, held1 = self.cpu(), held()
            res["cpu"].update(fuse=cpu1[0] - cpu0[0], peer=cpu1[holder] - cpu0[holder])
            if step is not None:
                rep = self.wait(f"replication of step {step}", self.replicated(step))
                over = min(rep["at"], res["end"]) - max(rep["at"] - rep["seconds"], res["start"])
                res.update(repl_at=rep["at"], repl_seconds=rep["seconds"], overlapped=rep["at"] > res["start"],
                           overlap=max(0.0, over) / res["seconds"],
                           sent_during=max(0, held1 - held0) / rep["sent_bytes"])
        finally:
            if os.path.exists(path):
                os.unlink(path)  # right after the measurement
            if step is not None:
                shutil.rmtree(self.mnt / "ckpt" / str(step), ignore_errors=True)
        return res

    def round(self, rnd: int) -> dict:
        args, out, step = self.args, {"round": rnd}, 10 * (rnd + 1)
        order = ("tierfs", "plain") if rnd % 2 == 0 else ("plain", "tierfs")
        src, recv_dir = Path(args.shm) / f"src-{step}", os.path.join(args.shm, "recv")
        sums = make_files(src, args.size, args.files)
        paths = [str(src / n) for n in sums]
        for name in sums:  # into the mount, untimed
            dest = self.mnt / "ckpt" / f"{step}.orbax-checkpoint-tmp" / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(src / name, "rb", buffering=0) as fin, open(dest, "wb", buffering=0) as fout:
                while n := fin.readinto(self.buf):
                    write_all(fout.fileno(), self.buf[:n])
        for side in order:
            if side == "tierfs":
                out["replicate"] = self.replicate(step)
            else:
                out["plain_forward"] = plain_copy(NODE0, PEER, paths, recv_dir, self.warm)
        holder = self.node_of(out["replicate"]["peer"])
        self.c.kill(0)
        self.c.wipe(0)
        for side in order:
            if side == "tierfs":
                out["restore"] = self.restore(sums, holder)
            else:
                out["plain_reverse"] = plain_copy(self.c.nodes[holder].host, NODE0, paths, recv_dir, self.warm)
        shutil.rmtree(src)
        shutil.rmtree(self.mnt / "ckpt" / str(step))
        for alone in (True, False) if rnd % 2 == 0 else (False, True):
            key = "write_alone" if alone else "write_replicating"
            out[key] = self.write(f"r{rnd}-{key}", None if alone else step + 1, holder)
        self.wait("replication to be idle", self.idle)
        out["peer_held"] = self.fetch(self.c.nodes[holder].mountpoint)["replicas_held"]  # chunks kept after a step
        return out


# ----------------------------------------------------------------------------- TLS against in clear

TLS_SIDES = ("clear", "tls")
TLS_ROWS = [("replication (daemon time)", "replicate", "seconds"),
            ("replication (commit to seen)", "replicate", "seen_s"),
            ("restore (daemon time)", "restore", "seconds"),
            ("restore (mount start to done)", "restore", "wall_s")]


def put_step(bench: Bench, src: Path, sums: dict[str, str], step: int) -> None:
    """The step's files into node 0's mount, untimed, ready to be committed."""
    for name in sums:
        dest = bench.mnt / "ckpt" / f"{step}.orbax-checkpoint-tmp" / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(src / name, "rb", buffering=0) as fin, open(dest, "wb", buffering=0) as fout:
            while n := fin.readinto(bench.buf):
                write_all(fout.fileno(), bench.buf[:n])


def tls_round(args, rnd: int, benches: dict[str, Bench]) -> dict:
    """One round: the same step replicated, then restored, with TLS and in clear, alternating who goes first."""
    out, step = {"round": rnd}, 10 * (rnd + 1)
    order = TLS_SIDES if rnd % 2 == 0 else TLS_SIDES[::-1]
    src = Path(args.shm) / f"src-{step}"
    sums = make_files(src, args.size, args.files)
    for side in order:
        put_step(benches[side], src, sums, step)
    for side in order:
        out[f"{side}_replicate"] = benches[side].replicate(step)
    for side in order:
        bench = benches[side]
        holder = bench.node_of(out[f"{side}_replicate"]["peer"])
        bench.c.kill(0)
        bench.c.wipe(0)
        out[f"{side}_restore"] = bench.restore(sums, holder)
    shutil.rmtree(src)
    for side in order:
        shutil.rmtree(benches[side].mnt / "ckpt" / str(step))
    return out


def summarize_tls(raw: list[dict]) -> dict:
    def mib_s(side, part, t):
        return statistics.median(r[f"{side}_{part}"]["bytes"] / r[f"{side}_{part}"][t] / MiB for r in raw)

    def cpu(side, part, who):
        return statistics.median(r[f"{side}_{part}"]["cpu"][who] / r[f"{side}_{part}"]["bytes"] * GiB for r in raw)

    rows = [{"metric": metric, "clear_mib_s": mib_s("clear", part, t), "tls_mib_s": mib_s("tls", part, t),
             "ratio": mib_s("tls", part, t) / mib_s("clear", part, t)} for metric, part, t in TLS_ROWS]
    cpus = {part: {side: {who: cpu(side, part, who) for who in ("sender", "receiver")} for side in TLS_SIDES}
            for part in ("replicate", "restore")}
    return {"rows": rows, "cpu_s_per_gib": cpus}


def render_tls(summary: dict) -> str:
    head = ("metric", "in clear MiB/s", "TLS MiB/s", "ratio")
    body = [(r["metric"], f"{r['clear_mib_s']:.0f}", f"{r['tls_mib_s']:.0f}", f"{r['ratio']:.2f}")
            for r in summary["rows"]]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
             for cells in [head, ["-" * w for w in widths], *body]]
    lines.append("# CPU-s per GiB (medians), in clear -> TLS:")
    for part, sides in summary["cpu_s_per_gib"].items():
        lines.append(f"#   {part}: " + ", ".join(f"{who} {sides['clear'][who]:.2f} -> {sides['tls'][who]:.2f}"
                                                 for who in ("sender", "receiver")))
    return "\n".join(lines)


def run_tls(args, settings: dict) -> dict:
    """Two 2-node clusters, one in clear and one with TLS: replication and restore, ``args.rounds`` rounds."""
    from tierfs.testing.cluster import LocalCluster
    clusters = {}
    try:
        for side in TLS_SIDES:
            clusters[side] = LocalCluster(Path("/dev/shm") / f"bench-peers-{side}-{uuid.uuid4().hex[:8]}", 2, "bench",
                                          replicas=1, capacity=f"{8 * args.size // MiB}M",
                                          peer_tls="off" if side == "clear" else None)
            clusters[side].start_all()
        settings["nodes"] = {side: [n.address for n in c.nodes] for side, c in clusters.items()}
        benches, raw = {side: Bench(args, c) for side, c in clusters.items()}, []
        for rnd in range(args.rounds):
            raw.append(r := tls_round(args, rnd, benches))
            mib = lambda k, t="seconds": f"{r[k]['bytes'] / r[k][t] / MiB:.0f}"
            print(f"round {rnd + 1}/{args.rounds}: replicate TLS {mib('tls_replicate')} vs in clear "
                  f"{mib('clear_replicate')} MiB/s; restore TLS {mib('tls_restore')} vs in clear "
                  f"{mib('clear_restore')}", file=sys.stderr, flush=True)
        return {"raw": raw, "medians": summarize_tls(raw)}
    finally:
        for c in clusters.values():
            c.close()


# ----------------------------------------------------------------------------- report

ROWS = [  # metric, baseline (measurement, time), tierfs (measurement, time)
    ("replication (daemon time)", ("plain_forward", "seconds"), ("replicate", "seconds")),
    ("replication (commit to seen)", ("plain_forward", "seconds"), ("replicate", "seen_s")),
    ("restore (daemon time)", ("plain_reverse", "seconds"), ("restore", "seconds")),
    ("restore (mount start to done)", ("plain_reverse", "seconds"), ("restore", "wall_s")),
    ("write while replicating", ("write_alone", "seconds"), ("write_replicating", "seconds")),
]
CPU_NAMES = {"plain_forward": "plain copy", "replicate": "replication", "plain_reverse": "plain copy back",
             "restore": "restore (receiver: the new daemon, start-up included)", "write_alone": "write alone",
             "write_replicating": "write replicating (fuse: node 0's daemon, peer: the receiving one)"}


def summarize(raw: list[dict]) -> dict:
    def mib_s(key, t):
        return statistics.median(r[key]["bytes"] / r[key][t] / MiB for r in raw)
    rows = [{"metric": metric, "baseline_mib_s": mib_s(*b), "tierfs_mib_s": mib_s(*t),
             "ratio": mib_s(*t) / mib_s(*b)} for metric, b, t in ROWS]
    cpu = {m: {who: {"s_per_gib": statistics.median(r[m]["cpu"][who] / r[m]["bytes"] * GiB for r in raw),
                     "busy": statistics.median(r[m]["cpu"][who] / r[m].get("window_s", r[m]["seconds"])
                                               for r in raw)}
               for who in raw[0][m]["cpu"]} for m in CPU_NAMES}
    w = [r["write_replicating"] for r in raw]
    return {"rows": rows, "cpu": cpu, "overlap": statistics.median(x["overlap"] for x in w),
            "all_overlapped": all(x["overlapped"] for x in w),
            "sent_during": statistics.median(x["sent_during"] for x in w),
            "repl_seconds": statistics.median(x["repl_seconds"] for x in w),
            "hashed_s": statistics.median(r["replicate"]["hashed_s"] for r in raw),
            "rename_s": statistics.median(r["replicate"]["rename_s"] for r in raw),
            "transfer_mib_s": mib_s("replicate", "transfer_s")}


def render(summary: dict) -> str:
    head = ("metric", "baseline MiB/s", "tierfs MiB/s", "ratio")
    body = [(r["metric"], f"{r['baseline_mib_s']:.0f}", f"{r['tierfs_mib_s']:.0f}", f"{r['ratio']:.2f}")
            for r in summary["rows"]]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
             for cells in [head, ["-" * w for w in widths], *body]]
    lines += ["# baselines: plain sendfile -> recv_into+write copy (node 0 -> peer; peer -> node 0 for the "
              "restore); the same writes with nothing replicating",
              f"# the replication ran over a median {summary['overlap']:.0%} of the write "
              f"({'in every round' if summary['all_overlapped'] else 'NOT in every round'}) and sent "
              f"{summary['sent_during']:.0%} of the step by the write's end; it took {summary['repl_seconds']:.1f} s",
              f"# replication (medians): the commit's rename took {summary['rename_s']:.2f} s, the step was hashed "
              f"{summary['hashed_s']:.2f} s after the commit, then sent at {summary['transfer_mib_s']:.0f} MiB/s",
              "# CPU-s per GiB (busy: CPU-s per wall second, 1.0 = one core), medians:"]
    lines += [f"#   {name}: " + ", ".join(f"{who} {v['s_per_gib']:.2f} ({v['busy']:.2f})"
                                          for who, v in summary["cpu"][m].items()) for m, name in CPU_NAMES.items()]
    return "\n".join(lines)


def plot(path: str, rows: list[dict], title: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(9, 4.2))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["baseline_mib_s"] for r in rows], 0.4, label="baseline (plain copy / write alone)")
    ax.bar([x + 0.2 for x in xs], [r["tierfs_mib_s"] for r in rows], 0.4, label="tierfs")
    for x, r in zip(xs, rows):
        ax.annotate(f"{r['ratio']:.2f}x", (x, max(r["baseline_mib_s"], r["tierfs_mib_s"])), ha="center", va="bottom")
    ax.set_xticks(list(xs), [r["metric"].replace(" (", "\n(").replace(" while", "\nwhile") for r in rows], fontsize=8)
    ax.set(ylabel="MiB/s (median)", ylim=(0, 1.12 * max(max(r["baseline_mib_s"], r["tierfs_mib_s"]) for r in rows)))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return None


def main() -> int:
    p = argparse.ArgumentParser(description="Peer replication, restore and writes during replication against "
                                            "a plain socket copy (medians of alternating rounds).")
    p.add_argument("--size", type=parse_size, help="checkpoint bytes per step (default 1G)")
    p.add_argument("--files", type=int, default=16, help="files per checkpoint (default 16)")
    p.add_argument("--rounds", type=int, help="rounds; medians are taken over them (default 3)")
    p.add_argument("--warmup", type=parse_size, help="tmpfs warm-up before each measurement (default 2x --size)")
    p.add_argument("--quick", action="store_true", help="smoke run: --size 256M --rounds 2 unless given")
    p.add_argument("--tls", action="store_true",
                   help="TLS (the default) against --peer-tls off instead (default --size 512M --rounds 5)")
    p.add_argument("--json", metavar="PATH", help="write settings, raw per-round numbers and medians")
    p.add_argument("--plot", metavar="PATH.png", help="grouped bars in MiB/s (needs matplotlib)")
    args = p.parse_args()
    args.size = args.size or (256 * MiB if args.quick else 512 * MiB if args.tls else GiB)
    args.rounds = args.rounds or (2 if args.quick else 5 if args.tls else 3)
    args.warmup = args.warmup or 2 * args.size
    args.size -= args.size % (args.files * MiB) if args.files > 0 else 0  # whole MiB per file
    if args.tls and args.plot:
        p.error("--plot draws the comparison with a plain copy; with --tls, use --json")
    if args.size <= 0 or args.files < 1 or args.rounds < 1:
        p.error("--size must be at least --files MiB, --files and --rounds at least 1")

    interrupt_on_signals()
    tmp = tempfile.mkdtemp(prefix="bench-peers-", dir="/tmp")
    os.environ["TIERFS_RUNTIME_DIR"] = os.path.join(tmp, "run")  # a private daemon registry
    args.shm, cluster = tempfile.mkdtemp(prefix="bench-peers-data-", dir="/dev/shm"), None
    try:
        if args.tls:
            now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
            settings = {"size": args.size, "files": args.files, "rounds": args.rounds, "warmup": args.warmup,
                        "cores": os.cpu_count(), "kernel": os.uname().release, "date": now,
                        "command": shlex.join([sys.executable, *sys.argv])}
            print(f"# bench_peers --tls {now}  {settings['cores']} cores  command: {settings['command']}\n"
                  f"# {args.size // MiB} MiB in {args.files} files per step, {args.rounds} rounds, two 2-node "
                  "clusters (TLS 1.3 keyed from the secret; --peer-tls off); medians; ratio = TLS / in clear",
                  flush=True)
            result = run_tls(args, settings)
            print(render_tls(result["medians"]))
            if args.json:
                write_json(args.json, {"settings": settings, **result})
            return 0
        from tierfs.testing.cluster import LocalCluster
        cluster = LocalCluster(Path("/dev/shm") / f"bench-peers-cluster-{uuid.uuid4().hex[:8]}", 3, "bench",
                               replicas=1, capacity=f"{8 * args.size // MiB}M")
        cluster.start_all()
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        writer = "fio --iomem_align=4096" if shutil.which("fio") else "builtin, page-aligned"
        settings = {"size": args.size, "files": args.files, "rounds": args.rounds, "warmup": args.warmup,
                    "writer": writer, "cores": os.cpu_count(), "kernel": os.uname().release, "date": now,
                    "command": shlex.join([sys.executable, *sys.argv]), "nodes": [n.address for n in cluster.nodes]}
        print(f"# bench_peers {now}  {settings['cores']} cores  command: {settings['command']}\n"
              f"# {args.size // MiB} MiB in {args.files} files per step, {args.rounds} rounds, 3 nodes, replicas=1,"
              f" writer {writer}; medians; ratio = tierfs / baseline", flush=True)
        bench, raw = Bench(args, cluster), []
        for rnd in range(args.rounds):
            raw.append(r := bench.round(rnd))
            mib = lambda k, t="seconds": f"{r[k]['bytes'] / r[k][t] / MiB:.0f}"
            print(f"round {rnd + 1}/{args.rounds}: replicate {mib('replicate')} (seen {mib('replicate', 'seen_s')})"
                  f" vs plain {mib('plain_forward')} MiB/s; restore {mib('restore')} (wall {mib('restore', 'wall_s')})"
                  f" vs plain {mib('plain_reverse')}; write {mib('write_replicating')} replicating vs "
                  f"{mib('write_alone')} alone ({r['write_replicating']['sent_during']:.0%} of the step sent "
                  "meanwhile)",
                  file=sys.stderr, flush=True)
        summary = summarize(raw)
        print(render(summary))
        if args.json:
            write_json(args.json, {"settings": settings, "raw": raw, "medians": summary})
        if args.plot:
            why = plot(args.plot, summary["rows"], f"tierfs peer tier / plain copy, {args.size // MiB} MiB, "
                                                   f"{args.rounds} rounds, {now[:10]}")
            print(f"# plot skipped: {why}" if why else f"# wrote {args.plot}")
        return 0
    except (BenchError, AssertionError, subprocess.TimeoutExpired) as e:
        print(f"bench_peers: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_peers: interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:  # no more Ctrl-C: a half-done cleanup would leave daemons and mounts behind
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        if cluster is not None:
            cluster.close()
        shutil.rmtree(args.shm, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
