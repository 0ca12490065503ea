#!/usr/bin/env python3
"""Peer tier benchmark: replication and restore, encrypted (the default) and in clear, against a
plain socket copy; a restore from two peers against one; writes with and without a replication
running.

For each size of ``--sizes`` (default 1G,4G), ``--rounds`` rounds (default 3). Every part of a
round runs in a fresh LocalCluster (tierfs_testing.cluster: nodes on 127.0.0.2-4, no GCS,
``--capacity`` 4x the size), closed right after it: no two clusters, and no step a cluster
retained, share the RAM. A step is the size's bytes of fresh random data in ``--files`` files.

1. Copy (``--parts copy``), once per setting of ``--peer-tls`` (default ``on,off``: TLS 1.3,
   the product's default, then in clear; which goes first alternates per round), 2 nodes,
   ``--replicas 1``. The round's step, staged once in tmpfs and written into node 0's mount
   untimed, is
   a. replicated: committed by renaming ``ckpt/<S>.orbax-checkpoint-tmp`` to ``ckpt/<S>`` at
      t0; the status is polled every 20 ms until the step is on the peer: bytes / (seen - t0)
      ("commit to on the peer") and bytes / ``replicas.seconds`` (the daemon's own time);
   b. restored: node 0 is killed (-9) and wiped, ``tierfs mount`` is started and the status
      polled every 20 ms until ``restored.state`` is "done": bytes / (mount start to done)
      and bytes / ``restored.seconds``; every file's sha256 is then checked (untimed) and
      node 0 killed and wiped again, which frees its RAM for the baseline.
   Baseline, in the same part, before or after each (alternating per round): benchlib.plain_copy
   of the staged files, two fresh processes, a sender that ``os.sendfile``s them over TCP to a
   receiver that ``recv_into``s a page-aligned 1 MiB buffer and writes fresh tmpfs files, timed
   from connect to the last file closed; 127.0.0.2 -> 127.0.0.3 for a, back for b.
   Ratios tierfs / plain copy, and TLS / in clear; targets (printed, not asserted): >= 0.7
   with TLS, >= 0.9 in clear.
2. Two holders against one (``--parts holders``): 3 nodes, ``--replicas 2``, ``--peer-tls on``.
   A step written into node 0's mount is committed and replicated to nodes 1 and 2 (untimed).
   "two": node 0 is killed and wiped and restored as in 1b while both peers hold the step.
   "one": node 0 is killed and wiped, node 2 is killed, wiped (its replica goes) and started
   again empty (``--restore-wait 1s``: node 0 is down meanwhile), then node 0 is restored as
   in 1b while only node 1 holds the step; both peers answer its survey, so neither case waits
   for a silent peer. After a "one", node 0 puts the step back on node 2 before a "two" follows.
   Which goes first alternates per round. Ratio two / one (restore MiB/s), both times.
3. Writes (``--parts writes``): 2 nodes, ``--replicas 1``, ``--peer-tls on``. 1 MiB sequential
   writes of a fresh file of the size into node 0's mount (fio with page-aligned buffers if
   installed, else a built-in writer), (a) alone and (b) started right after committing a
   step of the size; recorded: whether its replication ran over the write and how much of the
   step the peer held by the write's end. Target: (b) / (a) >= 0.95.
4. A job's log (``--parts log``): 2 nodes, ``--replicas 1``, ``--peer-tls on``, a fresh cluster
   for each side. A step's replication timed as in 1a (commit to on the peer) while a thread
   appends a log line to a file in node 0's mount every 10 ms, against the same without it;
   which goes first alternates per round. Background work gives way to the job's bulk writes,
   not to its log lines. Target: with / without >= 0.95.
5. Erasure coding (``--parts erasure``, not run by default: three 6-node clusters a round),
   implemented in scripts/bench_peers_erasure.py, whose docstring has the details: ``--erasure
   4+2`` against ``--replicas 1`` and ``--replicas 2``, TLS, in that order or its reverse per
   round. Every rank commits a step at once; per scheme: RAM held for other ranks / shard (goal
   P/D = 0.5 for 4+2, within 5%), bytes sent per rank / shard, commit to on the lane and the six
   daemons' CPU-s/GiB; then node 1 is killed, wiped and rebuilt (mount start to done, MiB/s,
   CPU-s/GiB, every file's sha256 checked), and its time set against ``--replicas 1``'s.

Memory (the VM has 24 GiB, shared): at 4 GiB the copy part peaks at 16 GiB (the staged
step, node 0's step, its replica and the baseline's received files); the holders part holds
the step three times (12 GiB), the writes part a step, its replica and the written file. The
erasure part's ``--replicas 2`` holds six steps three times each (18x the size): at most 1G.

Method as in docs/benchmarks.md (the balloon returns freed pages to the host ~2 s after they
are freed): each timed part follows a tmpfs warm-up (``--warmup``, default twice the size,
at most 4 GiB) written and deleted right before it; test files are deleted right after;
which side goes first alternates per round; medians, and ratios of this run's medians. The
CPU time (/proc/PID/stat) of the daemons, of fio and of the plain copy's processes is taken
over each timed part: CPU-s per GiB on the sending and on the receiving side (for a restore,
the receiver is the new daemon over its whole life, start-up included; the sender, every
peer that holds the step).

    .venv/bin/python scripts/bench_peers.py [--sizes 1G,4G] [--rounds 3] [--quick]
                                            [--json out.json] [--plot out.png]

``--quick``: ``--sizes 64M,256M --rounds 2``, a smoke run. All it creates
(/dev/shm/bench-peers-* or under --ramdisk, /tmp/bench-peers-*, daemons, mounts, processes) is removed or
stopped on exit, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from benchlib import (
    NO_MATPLOTLIB,
    RAMDISK_HELP,
    BenchError,
    aligned,
    close_cluster,
    compile_bytecode,
    cpu_seconds,
    default_warmup,
    interrupt_on_signals,
    keep_logs,
    make_files,
    no_interruptions,
    parse_size,
    parse_sizes,
    plain_copy,
    progress,
    pyplot,
    render_table,
    save_figure,
    size_label,
    warm_up,
    write_all,
    write_json,
)  # (scripts/ is on sys.path)

from tierfs.core.errors import UserError

MiB, GiB = 1 << 20, 1 << 30
NODE0, PEER = "127.0.0.2", "127.0.0.3"
STEP = 10
PARTS = ("copy", "holders", "writes", "log", "erasure")
DEFAULT_PARTS = PARTS[:4]  # erasure: three 6-node clusters a round, asked for by name
TLS_NAMES = {"on": "TLS", "off": "in clear"}
TARGETS = {"on": 0.7, "off": 0.9, "writes": 0.95, "log": 0.95}
LOG_EVERY = 0.01  # how often the log part's job appends a line, as a training loop's logger may
RESTART_WAIT = "1s"  # a node restarted while node 0 is down waits this long for it
TIMEOUT = 600.0


# ----------------------------------------------------------------------------- writes


@contextlib.contextmanager
def job_log(path: Path):
    """A thread appending a log line to ``path`` every LOG_EVERY seconds while the block runs; yields [lines]."""
    stop, lines = threading.Event(), [0]

    def log() -> None:
        with open(path, "ab", buffering=0) as f:
            while not stop.wait(LOG_EVERY):
                f.write(b"step 10 loss 0.2500 lr 3.0e-04\n")
                lines[0] += 1

    thread = threading.Thread(target=log, daemon=True)
    thread.start()
    try:
        yield lines
    finally:
        stop.set()
        thread.join()


def write_file(path: str, size: int, buf: memoryview) -> dict:
    """Sequential 1 MiB writes of a fresh file; start/end in time.time(), to compare with the daemon's."""
    fio, start = shutil.which("fio"), time.time()
    if fio:
        out = subprocess.run(
            [
                fio,
                "--name=w",
                f"--filename={path}",
                "--rw=write",
                "--bs=1M",
                f"--size={size}",
                "--ioengine=psync",
                "--direct=0",
                "--iomem_align=4096",
                "--fallocate=none",
                "--thread",
                "--output-format=json",
            ],
            capture_output=True,
            text=True,
        )
        if out.returncode:
            raise BenchError(f"fio failed: {out.stderr.strip()[-300:]}")
        job = json.loads(out.stdout[out.stdout.index("{") :])["jobs"][0]
        nbytes, seconds = job["write"]["io_bytes"], job["write"]["runtime"] / 1000
        writer_cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * seconds
    else:
        fd, cpu0, t0 = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), cpu_seconds(), time.perf_counter()
        for pos in range(0, size, MiB):
            write_all(fd, buf[: min(MiB, size - pos)])
        os.close(fd)
        nbytes, seconds, writer_cpu = size, time.perf_counter() - t0, cpu_seconds() - cpu0
    end = time.time()
    if nbytes != size or seconds <= 0:
        raise BenchError(f"the write moved {nbytes} bytes in {seconds}s, expected {size}")
    return {
        "bytes": nbytes,
        "seconds": seconds,
        "start": end - seconds if fio else start,
        "end": end,
        "cpu": {"writer": writer_cpu},
    }


# ----------------------------------------------------------------------------- the cluster side


class Bench:
    """The parts of a round, each in a cluster of its own."""

    def __init__(self, args):
        from tierfs_testing.cluster import LocalCluster

        from tierfs.commands.status import fetch  # the control socket from this process: no
        from tierfs.core import mounts  # Python start-up per poll on a 2-core VM

        self.fetch, self.mounts, self.LocalCluster = fetch, mounts, LocalCluster
        self.args, self.buf = args, aligned(MiB)
        self.clusters: list = []  # every cluster not closed yet, for the cleanup

    # -- clusters and waiting -------------------------------------------------------------

    @contextlib.contextmanager
    def cluster(self, name: str, nodes: int, size: int, **options):
        """A fresh cluster of ``nodes`` nodes, all started; closed (and its RAM freed) after."""
        c = self.LocalCluster(
            Path(self.args.ramdisk) / f"bench-peers-{name}-{uuid.uuid4().hex[:8]}",
            nodes,
            "bench",
            capacity=f"{4 * size // MiB + 256}M",
            **options,
        )
        self.clusters.append(c)
        try:
            c.start_all()
            yield c
        finally:
            self.close(c)

    def close(self, c) -> None:
        with no_interruptions():
            left = close_cluster(c)
            self.clusters.remove(c)
        if left:
            progress(f"bench_peers: warning: still mounted: {', '.join(left)}")

    def wait(self, mnt: Path, what: str, pred, timeout: float = TIMEOUT):
        deadline = time.monotonic() + timeout
        while not (value := pred(self.fetch(mnt))):
            if time.monotonic() > deadline:
                raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.02)
        return value

    @staticmethod
    def replicated(step: int, copies: int = 1):
        """The step's ``replicas`` once its current version is on ``copies`` peers."""
        return lambda st: next(
            (
                s["replicas"]
                for s in st["steps"]
                if s["step"] == step
                and s["replicas"].get("version") == s["version"]
                and len(s["replicas"].get("peers") or ()) >= copies
            ),
            None,
        )

    @staticmethod
    def idle(st: dict) -> bool:
        return st["peers"]["working_on"] is None and all(
            s["replicas"].get("version") == s["version"] for s in st["steps"]
        )

    def warm(self, size: int) -> None:
        warm_up(os.path.join(self.args.shm, "warmup"), self.args.warmup or default_warmup(size), self.buf)

    @staticmethod
    def node_of(c, address: str) -> int:
        return next(i for i, n in enumerate(c.nodes) if n.address == address)

    @staticmethod
    def commit(mnt: Path, step: int) -> None:
        os.rename(mnt / "ckpt" / f"{step}.orbax-checkpoint-tmp", mnt / "ckpt" / str(step))

    def put_step(self, mnt: Path, src: Path, sums: dict[str, str], step: int) -> None:
        """The staged files into a mount, untimed, ready to be committed (1 MiB page-aligned writes)."""
        for name in sums:
            dest = mnt / "ckpt" / f"{step}.orbax-checkpoint-tmp" / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            with open(src / name, "rb", buffering=0) as fin, open(dest, "wb", buffering=0) as fout:
                while n := fin.readinto(self.buf):
                    write_all(fout.fileno(), self.buf[:n])

    # -- timed parts ------------------------------------------------------------------------

    def replicate(self, c, step: int, size: int) -> dict:
        """Commit node 0's step and time it until the status shows it on its peer."""
        mnt = c.nodes[0].mountpoint
        self.warm(size)
        pids = [n.pid for n in c.nodes]
        cpu0, t0 = [cpu_seconds(p) for p in pids], time.time()
        self.commit(mnt, step)
        renamed = time.time() - t0  # the job's rename(2): the commit happens inside it
        rep = self.wait(mnt, f"replication of step {step}", self.replicated(step))
        seen, cpu1, to = time.time(), [cpu_seconds(p) for p in pids], self.node_of(c, rep["peers"][0])
        if rep.get("sent_bytes") not in (None, size):
            raise BenchError(f"step {step}: {rep['sent_bytes']} bytes sent, expected {size}")
        out = {
            "bytes": size,
            "seconds": rep["seconds"],
            "seen_s": seen - t0,
            "rename_s": renamed,
            "peer": rep["peers"][0],
            "cpu": {"sender": cpu1[0] - cpu0[0], "receiver": cpu1[to] - cpu0[to]},
        }
        try:  # the manifest is written when the step is hashed, before a byte goes out: splits hashing and transfer
            built = os.stat(c.nodes[0].ramdisk / c.job / "rank-0" / "steps" / str(step) / "manifest.json").st_mtime
            out.update(hashed_s=built - t0, transfer_s=rep["at"] - built)
        except (OSError, KeyError, TypeError):
            pass
        return out

    def restore(self, c, sums: dict[str, str], size: int, holders: list[int]) -> dict:
        """Start node 0 (killed and wiped) and time it until its restore is done; check every file."""
        mnt = c.nodes[0].mountpoint
        self.warm(size)
        peers = {c.nodes[i].address: c.nodes[i].pid for i in holders}
        cpu0, t0 = {a: cpu_seconds(p) for a, p in peers.items()}, time.monotonic()
        try:
            c.tierfs(*c.mount_args(0), timeout=TIMEOUT)  # what LocalCluster.start(0) runs, minus its status call
            mounted = time.monotonic() - t0  # the namespace is in place; the bytes follow
            st = self.fetch(mnt)
        finally:
            c.refresh(0)  # for the cleanup
        if not st["restored"]:
            raise BenchError(f"node 0 restored nothing (cluster view: {st['cluster']})")
        deadline = t0 + TIMEOUT
        while st["restored"]["state"] != "done":  # then at once the daemons' CPU, before the checks read
            if time.monotonic() > deadline:
                raise BenchError(f"node 0's restore did not finish within {TIMEOUT:.0f} s: {st['restored']}")
            time.sleep(0.02)
            st = self.fetch(mnt)
        wall = time.monotonic() - t0
        sent = {a: cpu_seconds(p) - cpu0[a] for a, p in peers.items()}
        r, own_cpu = st["restored"], cpu_seconds(st["pid"])
        if r.get("tier") != "peer" or r.get("bytes") != size or r.get("error"):
            raise BenchError(f"node 0 was not restored from a peer: {r}")
        for name, want in sums.items():
            with open(mnt / "ckpt" / str(r["step"]) / name, "rb") as f:
                got = hashlib.file_digest(f, "sha256").hexdigest()
            if got != want:
                raise BenchError(f"restored ckpt/{r['step']}/{name} differs from the original (sha256)")
        gave = {k.split()[-1]: v for k, v in r["bytes_from"].items() if v}  # "peer HOST:PORT" -> HOST:PORT
        return {
            "bytes": size,
            "seconds": r["seconds"],
            "wall_s": wall,
            "mount_s": mounted,
            "from": r["from"],
            "bytes_from": gave,
            "cpu": {"sender": sum(sent.values()), "receiver": own_cpu},
            "cpu_peers": sent,
        }

    def write(self, c, tag: str, step: int | None, size: int) -> dict:
        """A fresh file written alone, or right after committing ``step`` (replicated meanwhile)."""
        mnt, peer = c.nodes[0].mountpoint, c.nodes[1]
        self.wait(mnt, "replication to be idle", self.idle)
        if step is not None:
            make_files(mnt / "ckpt" / f"{step}.orbax-checkpoint-tmp", size, self.args.files)
        path = str(mnt / f"write-{tag}")

        def held():  # what the peer holds: the real overlap
            return self.fetch(peer.mountpoint)["replicas_held"]["bytes"]

        try:
            self.warm(size)
            pids = (c.nodes[0].pid, peer.pid)
            cpu0, held0 = [cpu_seconds(p) for p in pids], held()
            if step is not None:
                self.commit(mnt, step)
            res = write_file(path, size, self.buf)
            cpu1, held1 = [cpu_seconds(p) for p in pids], held()
            res["cpu"].update(fuse=cpu1[0] - cpu0[0], peer=cpu1[1] - cpu0[1])
            if step is not None:
                rep = self.wait(mnt, f"replication of step {step}", self.replicated(step))
                over = min(rep["at"], res["end"]) - max(rep["at"] - rep["seconds"], res["start"])
                res.update(
                    repl_at=rep["at"],
                    repl_seconds=rep["seconds"],
                    overlapped=rep["at"] > res["start"],
                    overlap=max(0.0, over) / res["seconds"],
                    sent_during=max(0, held1 - held0) / (rep.get("sent_bytes") or size),
                )
        finally:
            if os.path.exists(path):
                os.unlink(path)  # right after the measurement
        return res

    # -- the parts of a round ---------------------------------------------------------------

    def copy(self, rnd: int, size: int, tls: str, src: Path, sums: dict[str, str]) -> dict:
        """Replication and restore with ``--peer-tls tls``, each beside the plain copy."""
        order = ("tierfs", "plain") if rnd % 2 == 0 else ("plain", "tierfs")
        paths, recv_dir = [str(src / n) for n in sums], os.path.join(self.args.shm, "recv")
        out: dict = {"order": list(order)}
        with self.cluster(f"copy-{tls}", 2, size, replicas=1, peer_tls=tls) as c:
            self.put_step(c.nodes[0].mountpoint, src, sums, STEP)
            for side in order:
                if side == "tierfs":
                    out["replicate"] = self.replicate(c, STEP, size)
                else:
                    out["plain_forward"] = plain_copy(NODE0, PEER, paths, recv_dir, lambda: self.warm(size))
            holder = self.node_of(c, out["replicate"]["peer"])
            c.kill(0)
            c.wipe(0)
            for side in order:
                if side == "tierfs":
                    out["restore"] = self.restore(c, sums, size, [holder])
                    c.kill(0)  # its RAM back before the plain copy, which then fits beside the replica
                    c.wipe(0)
                else:
                    out["plain_reverse"] = plain_copy(
                        c.nodes[holder].host, NODE0, paths, recv_dir, lambda: self.warm(size)
                    )
        return out

    def holders(self, rnd: int, size: int) -> dict:
        """Node 0 restored while two peers hold its step, and while one does."""
        order = ("two", "one") if rnd % 2 == 0 else ("one", "two")
        out: dict = {"order": list(order)}
        with self.cluster("holders", 3, size, replicas=2, peer_tls="on") as c:
            mnt = c.nodes[0].mountpoint
            sums = make_files(mnt / "ckpt" / f"{STEP}.orbax-checkpoint-tmp", size, self.args.files)
            self.commit(mnt, STEP)
            rep = self.wait(mnt, f"step {STEP} on two peers", self.replicated(STEP, 2))
            out["replicated_to"] = list(rep["peers"])
            for k, case in enumerate(order):
                if case == "two":
                    if k:  # node 0 puts its restored step back on the emptied node 2 first
                        t0 = time.monotonic()
                        self.wait(mnt, f"step {STEP} to be on two peers again", self.replicated(STEP, 2))
                        out["rereplicated_s"] = time.monotonic() - t0
                    c.kill(0)
                    c.wipe(0)
                    out["two"] = self.restore(c, sums, size, [1, 2])
                else:
                    c.kill(0)
                    c.wipe(0)
                    c.kill(2)
                    c.wipe(2)
                    c.start(2, restore_wait=RESTART_WAIT)
                    out["one"] = self.restore(c, sums, size, [1])
                    if set(out["one"]["bytes_from"]) - {c.nodes[1].address}:
                        raise BenchError(f"node 0 restored from more than the one holder: {out['one']['bytes_from']}")
        return out

    def writes(self, rnd: int, size: int) -> dict:
        """A write alone and one while a step replicates, alternating which goes first."""
        out: dict = {}
        with self.cluster("writes", 2, size, replicas=1, peer_tls="on") as c:
            for alone in (True, False) if rnd % 2 == 0 else (False, True):
                key = "write_alone" if alone else "write_replicating"
                out[key] = self.write(c, f"r{rnd}-{key}", None if alone else STEP, size)
            self.wait(c.nodes[0].mountpoint, "replication to be idle", self.idle)
            out["peer_held"] = self.fetch(c.nodes[1].mountpoint)["replicas_held"]
        return out

    def log(self, rnd: int, size: int) -> dict:
        """A step's replication while the job logs a line every LOG_EVERY seconds, and while it does not."""
        out: dict = {}
        for logging in (True, False) if rnd % 2 == 0 else (False, True):
            key = "logging" if logging else "quiet"
            with self.cluster("log", 2, size, replicas=1, peer_tls="on") as c:
                mnt = c.nodes[0].mountpoint
                make_files(mnt / "ckpt" / f"{STEP}.orbax-checkpoint-tmp", size, self.args.files)
                with job_log(mnt / "train.log") if logging else contextlib.nullcontext([0]) as lines:
                    out[key] = self.replicate(c, STEP, size)
                out[key]["log_lines"] = lines[0]
        return out

    def round(self, rnd: int, size: int) -> dict:
        args, out = self.args, {"round": rnd}
        if "copy" in args.parts:
            src = Path(args.shm) / "src"
            sums = make_files(src, size, args.files)
            try:
                for tls in args.peer_tls if rnd % 2 == 0 else args.peer_tls[::-1]:
                    out[f"copy_{tls}"] = self.copy(rnd, size, tls, src, sums)
            finally:
                shutil.rmtree(src, ignore_errors=True)
        if "holders" in args.parts:
            out["holders"] = self.holders(rnd, size)
        if "writes" in args.parts:
            out["writes"] = self.writes(rnd, size)
        if "log" in args.parts:
            out["log"] = self.log(rnd, size)
        if "erasure" in args.parts:
            out["erasure"] = erasure_part().run(self, rnd, size)
        return out


def erasure_part():
    """scripts/bench_peers_erasure.py (part 5), imported only when used: it imports this module."""
    import bench_peers_erasure

    return bench_peers_erasure


def round_line(r: dict) -> str:
    """One round's numbers in MiB/s, for the person waiting."""

    def mib(x, t="seconds"):
        return f"{x['bytes'] / x[t] / MiB:.0f}"

    parts = []
    for key in (k for k in r if k.startswith("copy_")):
        x, name = r[key], TLS_NAMES[key[5:]]
        parts.append(
            f"{name}: replicate {mib(x['replicate'], 'seen_s')} vs plain {mib(x['plain_forward'])}, "
            f"restore {mib(x['restore'], 'wall_s')} vs plain {mib(x['plain_reverse'])}"
        )
    if "holders" in r:
        h = r["holders"]
        parts.append(f"restore from two peers {mib(h['two'], 'wall_s')} vs one {mib(h['one'], 'wall_s')}")
    if "writes" in r:
        w = r["writes"]
        parts.append(
            f"write {mib(w['write_replicating'])} replicating vs {mib(w['write_alone'])} alone "
            f"({w['write_replicating']['sent_during']:.0%} of the step sent meanwhile)"
        )
    if "log" in r:
        lg = r["log"]
        parts.append(
            f"replicate {mib(lg['logging'], 'seen_s')} with the job logging vs {mib(lg['quiet'], 'seen_s')} without"
        )
    if "erasure" in r:
        parts.append(erasure_part().round_line(r["erasure"]))
    return " MiB/s; ".join(parts) + " MiB/s"


# ----------------------------------------------------------------------------- report


def summarize(raw: list[dict]) -> dict:
    """Medians of one size's rounds, and ratios of those medians."""
    med = statistics.median

    def mib_s(xs, t="seconds"):
        return med(x["bytes"] / x[t] / MiB for x in xs)

    def cpu(xs):
        return {who: med(x["cpu"][who] / x["bytes"] * GiB for x in xs) for who in xs[0]["cpu"]}

    out: dict = {"rows": []}
    for tls in ("on", "off"):
        if f"copy_{tls}" not in raw[0]:
            continue
        parts = [r[f"copy_{tls}"] for r in raw]
        for part, key, plain, t in (
            ("replication", "replicate", "plain_forward", "seen_s"),
            ("restore", "restore", "plain_reverse", "wall_s"),
        ):
            ours, base = [p[key] for p in parts], [p[plain] for p in parts]
            row = {
                "part": part,
                "tls": tls,
                "baseline_mib_s": mib_s(base),
                "tierfs_mib_s": mib_s(ours, t),
                "daemon_mib_s": mib_s(ours),
                "target": TARGETS[tls],
                "cpu": cpu(ours),
                "baseline_cpu": cpu(base),
            }
            row.update(
                ratio=row["tierfs_mib_s"] / row["baseline_mib_s"],
                daemon_ratio=row["daemon_mib_s"] / row["baseline_mib_s"],
            )
            out["rows"].append(row)
        reps = [p["replicate"] for p in parts]
        if all("hashed_s" in x for x in reps):
            out.setdefault("replication", {})[tls] = {
                "rename_s": med(x["rename_s"] for x in reps),
                "hashed_s": med(x["hashed_s"] for x in reps),
                "transfer_mib_s": mib_s(reps, "transfer_s"),
            }
    if len({r["tls"] for r in out["rows"]}) == 2:
        by = {(r["part"], r["tls"]): r for r in out["rows"]}
        out["tls_over_clear"] = {
            part: by[part, "on"]["tierfs_mib_s"] / by[part, "off"]["tierfs_mib_s"]
            for part in ("replication", "restore")
        }
    if "holders" in raw[0]:
        hs = [r["holders"] for r in raw]
        two, one = [h["two"] for h in hs], [h["one"] for h in hs]
        h = {
            "two_mib_s": mib_s(two, "wall_s"),
            "one_mib_s": mib_s(one, "wall_s"),
            "two_daemon_mib_s": mib_s(two),
            "one_daemon_mib_s": mib_s(one),
            "two_cpu": cpu(two),
            "one_cpu": cpu(one),
            "two_split": med(
                min(x["bytes_from"].values(), default=0) / x["bytes"] for x in two if len(x["bytes_from"]) == 2
            )
            if all(len(x["bytes_from"]) == 2 for x in two)
            else None,
            "two_peers_gave": [len(x["bytes_from"]) for x in two],
        }
        h.update(ratio=h["two_mib_s"] / h["one_mib_s"], daemon_ratio=h["two_daemon_mib_s"] / h["one_daemon_mib_s"])
        out["holders"] = h
    if "writes" in raw[0]:
        ws = [r["writes"] for r in raw]
        w = [x["write_replicating"] for x in ws]
        out["writes"] = {
            "alone_mib_s": mib_s([x["write_alone"] for x in ws]),
            "replicating_mib_s": mib_s(w),
            "target": TARGETS["writes"],
            "overlap": med(x["overlap"] for x in w),
            "all_overlapped": all(x["overlapped"] for x in w),
            "sent_during": med(x["sent_during"] for x in w),
            "repl_seconds": med(x["repl_seconds"] for x in w),
            "cpu_alone": cpu([x["write_alone"] for x in ws]),
            "cpu_replicating": cpu(w),
        }
        out["writes"]["ratio"] = out["writes"]["replicating_mib_s"] / out["writes"]["alone_mib_s"]
    if "log" in raw[0]:
        ls = [r["log"] for r in raw]
        lg = {
            "quiet_mib_s": mib_s([x["quiet"] for x in ls], "seen_s"),
            "logging_mib_s": mib_s([x["logging"] for x in ls], "seen_s"),
            "target": TARGETS["log"],
            "lines": med(x["logging"]["log_lines"] for x in ls),
            "cpu_quiet": cpu([x["quiet"] for x in ls]),
            "cpu_logging": cpu([x["logging"] for x in ls]),
        }
        lg["ratio"] = lg["logging_mib_s"] / lg["quiet_mib_s"]
        out["log"] = lg
    if "erasure" in raw[0]:
        out["erasure"] = erasure_part().summarize([r["erasure"] for r in raw])
    return out


WRITE_CPU = ("writer", "fuse", "peer")


def target_cell(ratio: float, target: float | None) -> str:
    return "" if target is None else f">= {target:.2f} {'met' if ratio >= target else 'NOT met'}"


def cpu_cell(c: dict, keys=("sender", "receiver")) -> str:
    return " / ".join(f"{c[k]:.2f}" for k in keys)


def render(summaries: dict[int, dict]) -> str:
    head = (
        "size",
        "row",
        "baseline MiB/s",
        "tierfs MiB/s",
        "ratio",
        "target",
        "CPU-s/GiB snd / rcv",
        "baseline snd / rcv",
    )
    body, notes = [], []
    for size, s in summaries.items():
        label = size_label(size)
        for r in s["rows"]:
            what = (
                "replication (commit to on the peer)" if r["part"] == "replication" else "restore (mount start to done)"
            )
            body.append(
                (
                    label,
                    f"{what}, {TLS_NAMES[r['tls']]}",
                    f"{r['baseline_mib_s']:.0f}",
                    f"{r['tierfs_mib_s']:.0f}",
                    f"{r['ratio']:.2f}",
                    target_cell(r["ratio"], r["target"]),
                    cpu_cell(r["cpu"]),
                    cpu_cell(r["baseline_cpu"]),
                )
            )
        if "holders" in s:
            h = s["holders"]
            body.append(
                (
                    label,
                    "restore from two peers (baseline: from one), TLS",
                    f"{h['one_mib_s']:.0f}",
                    f"{h['two_mib_s']:.0f}",
                    f"{h['ratio']:.2f}",
                    "",
                    cpu_cell(h["two_cpu"]),
                    cpu_cell(h["one_cpu"]),
                )
            )
        if "writes" in s:
            w = s["writes"]
            body.append(
                (
                    label,
                    "writes while replicating (baseline: alone), TLS",
                    f"{w['alone_mib_s']:.0f}",
                    f"{w['replicating_mib_s']:.0f}",
                    f"{w['ratio']:.2f}",
                    target_cell(w["ratio"], w["target"]),
                    "",
                    "",
                )
            )
        if "log" in s:
            lg = s["log"]
            body.append(
                (
                    label,
                    "replication while the job logs every 10 ms (baseline: not logging), TLS",
                    f"{lg['quiet_mib_s']:.0f}",
                    f"{lg['logging_mib_s']:.0f}",
                    f"{lg['ratio']:.2f}",
                    target_cell(lg["ratio"], lg["target"]),
                    cpu_cell(lg["cpu_logging"]),
                    cpu_cell(lg["cpu_quiet"]),
                )
            )
        notes.append(f"# {label}:")
        if s["rows"]:
            notes.append(
                "#   daemon's own time (replicas.seconds / restored.seconds) / plain copy: "
                + ", ".join(
                    f"{r['part']} {TLS_NAMES[r['tls']]} {r['daemon_ratio']:.2f} ({r['daemon_mib_s']:.0f} MiB/s)"
                    for r in s["rows"]
                )
            )
        if "tls_over_clear" in s:
            notes.append("#   TLS / in clear: " + ", ".join(f"{k} {v:.2f}" for k, v in s["tls_over_clear"].items()))
        for tls, x in s.get("replication", {}).items():
            notes.append(
                f"#   replication {TLS_NAMES[tls]}: the commit's rename took {x['rename_s']:.2f} s, the step "
                f"was hashed {x['hashed_s']:.2f} s after the commit, then sent at "
                f"{x['transfer_mib_s']:.0f} MiB/s"
            )
        if "holders" in s:
            h = s["holders"]
            split = (
                f"the smaller share {h['two_split']:.0%}"
                if h["two_split"] is not None
                else f"peers that gave bytes per round: {h['two_peers_gave']}"
            )
            notes.append(
                f"#   two peers / one, daemon's time: {h['daemon_ratio']:.2f} ({h['two_daemon_mib_s']:.0f} vs "
                f"{h['one_daemon_mib_s']:.0f} MiB/s); from two peers, {split}; sender CPU is both "
                "peers' together"
            )
        if "writes" in s:
            w = s["writes"]
            notes.append(
                f"#   writes: the replication ran over a median {w['overlap']:.0%} of the write "
                f"({'in every round' if w['all_overlapped'] else 'NOT in every round'}) and sent "
                f"{w['sent_during']:.0%} of the step by the write's end; it took {w['repl_seconds']:.1f} s; "
                "CPU-s/GiB writer / node 0 / peer: alone "
                + cpu_cell(w["cpu_alone"], WRITE_CPU)
                + ", replicating "
                + cpu_cell(w["cpu_replicating"], WRITE_CPU)
            )
        if "log" in s:
            notes.append(
                f"#   log: the job appended a median {s['log']['lines']:.0f} lines over the warm-up, the "
                "commit and the replication"
            )
    lines = [
        render_table(head, body, left=2),
        "# ratio = tierfs / baseline MiB/s (medians); targets are printed, not asserted. Baselines: the plain "
        "sendfile -> recv_into+write copy 127.0.0.2 -> 127.0.0.3 (restore: back) in the same part; the restore "
        "from one holder; the same write with nothing replicating; the same replication with the job not logging",
        "# CPU-s per GiB: sender / receiver (restore: serving peers / the new daemon, start-up included; "
        "baseline: the plain copy's processes)",
        *notes,
    ]
    if not body:  # only the erasure part ran
        lines = []
    if any("erasure" in s for s in summaries.values()):
        lines.append(erasure_part().render(summaries))
    return "\n".join(lines)


def plot(path: str, summaries: dict[int, dict], title: str) -> str | None:
    """Horizontal bars of every ratio, each with its target marked."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    bars = []  # (label, ratio, target)
    for size, s in summaries.items():
        label = size_label(size)
        bars += [(f"{label} {r['part']}, {TLS_NAMES[r['tls']]}", r["ratio"], r["target"]) for r in s["rows"]]
        if "holders" in s:
            bars.append((f"{label} restore, two peers / one", s["holders"]["ratio"], None))
        if "writes" in s:
            bars.append((f"{label} writes replicating / alone", s["writes"]["ratio"], s["writes"]["target"]))
        if "log" in s:
            bars.append((f"{label} replication, job logging / not", s["log"]["ratio"], s["log"]["target"]))
    if any("erasure" in s for s in summaries.values()):  # other units, a figure of its own
        erasure = erasure_part()
        where = erasure.plot_path(path) if bars else path
        if erasure.plot(where, summaries, title) is None and bars:
            progress(f"bench_peers: wrote the erasure part's figure to {where}")
        if not bars:
            return None
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(bars) + 1.4))
    ys = range(len(bars))[::-1]
    colors = [
        "tab:green" if t is not None and r >= t else "tab:red" if t is not None else "tab:blue" for _, r, t in bars
    ]
    ax.barh(list(ys), [r for _, r, _ in bars], 0.6, color=colors)
    for y, (_, r, t) in zip(ys, bars, strict=True):
        ax.annotate(f"{r:.2f}", (r, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        if t is not None:
            ax.plot([t, t], [y - 0.4, y + 0.4], color="black", lw=1.5)
    ax.set_yticks(list(ys), [b[0] for b in bars], fontsize=8)
    ax.axvline(1.0, color="gray", lw=0.8, ls=":")
    ax.set(xlabel="ratio of medians (black tick: target)", xlim=(0, max(1.2, 1.15 * max(r for _, r, _ in bars))))
    ax.set_title(title, fontsize=9)
    save_figure(fig, path)
    return None


def main() -> int:
    p = argparse.ArgumentParser(
        description="Peer replication and restore, with TLS and in clear, against a plain "
        "socket copy; restore from two peers against one; writes during "
        "replication; replication beside a job's log (medians of alternating "
        "rounds)."
    )
    p.add_argument(
        "--sizes",
        "--size",
        type=parse_sizes,
        help="checkpoint bytes per step, comma-separated: one row of every part per size (default 1G,4G)",
    )
    p.add_argument("--files", type=int, default=16, help="files per checkpoint (default 16)")
    p.add_argument("--rounds", type=int, help="rounds per size; medians are taken over them (default 3)")
    p.add_argument("--ramdisk", default="/dev/shm", help=RAMDISK_HELP)
    p.add_argument(
        "--warmup", type=parse_size, help="tmpfs warm-up before each measurement (default twice the size, at most 4G)"
    )
    p.add_argument(
        "--peer-tls",
        type=lambda v: v.split(","),
        default=["on", "off"],
        metavar="on,off",
        help="peer traffic settings of the copy part, in this order in even rounds (default on,off)",
    )
    p.add_argument(
        "--parts",
        type=lambda v: v.split(","),
        default=list(DEFAULT_PARTS),
        metavar=",".join(PARTS),
        help=f"which parts of a round to run (default {','.join(DEFAULT_PARTS)})",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: --sizes 64M,256M --rounds 2 unless given")
    p.add_argument("--json", metavar="PATH", help="write settings, raw per-round numbers and medians")
    p.add_argument("--plot", metavar="PATH.png", help="bars of every ratio against its target (needs matplotlib)")
    args = p.parse_args()
    args.sizes = args.sizes or ([64 * MiB, 256 * MiB] if args.quick else [GiB, 4 * GiB])
    args.rounds = args.rounds or (2 if args.quick else 3)
    if args.files < 1 or args.rounds < 1:
        p.error("--files and --rounds must be at least 1")
    args.sizes = [s - s % (args.files * MiB) for s in args.sizes]  # whole MiB per file
    if min(args.sizes) <= 0:
        p.error("every size must be at least --files MiB")
    if not args.peer_tls or set(args.peer_tls) - set(TLS_NAMES) or len(set(args.peer_tls)) < len(args.peer_tls):
        p.error("--peer-tls takes on, off or both (on,off / off,on)")
    if not args.parts or set(args.parts) - set(PARTS):
        p.error(f"--parts takes some of {','.join(PARTS)}")

    interrupt_on_signals()
    compile_bytecode()
    tmp = tempfile.mkdtemp(prefix="bench-peers-", dir="/tmp")
    os.environ["TIERFS_RUNTIME_DIR"] = os.path.join(tmp, "run")  # a private daemon registry
    args.shm, bench = tempfile.mkdtemp(prefix="bench-peers-data-", dir=args.ramdisk), None
    try:
        bench = Bench(args)
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        writer = "fio --iomem_align=4096" if shutil.which("fio") else "builtin, page-aligned"
        settings = {
            "sizes": args.sizes,
            "files": args.files,
            "rounds": args.rounds,
            "parts": args.parts,
            "peer_tls": args.peer_tls,
            "warmup": args.warmup or "min(2x size, 4 GiB)",
            "writer": writer,
            "cores": os.cpu_count(),
            "kernel": os.uname().release,
            "date": now,
            "command": shlex.join([sys.executable, *sys.argv]),
        }
        print(
            f"# bench_peers {now}  {settings['cores']} cores  command: {settings['command']}\n"
            f"# sizes {', '.join(map(size_label, args.sizes))} in {args.files} files per step, {args.rounds} rounds "
            f"each; parts {', '.join(args.parts)}; copy: 2 nodes, --replicas 1, --peer-tls "
            f"{' and '.join(args.peer_tls)}; holders: 3 nodes, --replicas 2, TLS; writes: 2 nodes, TLS, writer "
            f"{writer}; log: 2 nodes, TLS, a line every {LOG_EVERY * 1000:.0f} ms; "
            + (f"{erasure_part().DESCRIPTION}; " if "erasure" in args.parts else "")
            + "a fresh cluster per part; medians",
            flush=True,
        )
        raw: dict[int, list[dict]] = {}
        for size in args.sizes:
            for rnd in range(args.rounds):
                raw.setdefault(size, []).append(r := bench.round(rnd, size))
                progress(f"{size_label(size)} round {rnd + 1}/{args.rounds}: {round_line(r)}")
        summaries = {size: summarize(rounds) for size, rounds in raw.items()}
        print(render(summaries))
        if args.json:
            write_json(
                args.json,
                {
                    "settings": settings,
                    "raw": {str(k): v for k, v in raw.items()},
                    "medians": {str(k): v for k, v in summaries.items()},
                },
            )
        if args.plot:
            why = plot(args.plot, summaries, f"tierfs peer tier: ratios of medians, {args.rounds} rounds, {now[:10]}")
            print(f"# plot skipped: {why}" if why else f"# wrote {args.plot}")
        return 0
    except (BenchError, AssertionError, OSError, subprocess.TimeoutExpired, UserError) as e:
        kept = keep_logs(os.environ["TIERFS_RUNTIME_DIR"], "bench-peers")
        print(
            f"bench_peers: error: {' '.join(str(e).split())[:600] or type(e).__name__}"
            + (f" (daemon logs kept in {kept})" if kept else ""),
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("bench_peers: interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:  # no more Ctrl-C: a half-done cleanup would leave daemons and mounts behind
        with no_interruptions():
            for c in list(bench.clusters if bench else []):
                bench.close(c)
            shutil.rmtree(args.shm, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
