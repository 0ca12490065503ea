#!/usr/bin/env python3
"""Restore benchmark: how soon a restarted node can use its checkpoint again, from a peer and
from GCS, against plain copies of the same bytes; and how fast a restored step can be listed.

``tierfs mount`` returns as soon as the restored step's namespace is in place; its bytes
arrive on demand (a read waits for the chunks it covers) and by a background prefetch
(``--prefetch``, default 8 parallel fetches). Three times are measured from the moment
``tierfs mount`` is started (the CLI's own start-up included, as a job sees it):

- mount: until ``tierfs mount`` returns (the namespace is there);
- TTFB: until a read of the first 4 KiB of the first file (manifest order) returns, issued
  right after the mount returned;
- full: until ``tierfs status`` (asked over the control socket every 20 ms from this process,
  no Python start-up per poll) says ``restored.state`` is "done"; then every file's sha256 is
  checked (untimed).

Each round builds a fresh 3-node LocalCluster (tierfs.testing.cluster: 127.0.0.2-4, ``--replicas 1``,
``--gcs`` on a fresh bucket of a fake-gcs-server with the memory backend, default chunk size
and prefetch) and:

a. Setup (untimed): every rank writes ``--size`` random bytes in ``--files`` files into
   ``ckpt/100.orbax-checkpoint-tmp`` and renames it to ``ckpt/100``; waits until every rank's
   step is replicated (``replicas.version == version``) and backed up; rank 0's files are kept
   in a tmpfs staging directory and uploaded as plain objects to a second bucket.
b. Restore from a peer: node 0 is killed (-9), wiped, and started again while its peers are
   up; it restores from the peer holding rank 0's replica (127.0.0.3); GCS serves only what
   no peer gives (the split is reported).
   Baseline: the staged files copied from 127.0.0.3 to 127.0.0.2 over a plain TCP socket
   (``os.sendfile`` -> ``recv_into`` a page-aligned 1 MiB buffer -> fresh tmpfs files; two
   fresh processes, timed from connect to the last file closed: benchlib.plain_copy). After
   the tierfs side, when the plain copy follows, the script waits until the peer that had
   its replica on node 0 has replicated it again (it notices within 10 s), so that transfer
   does not run over the baseline.
c. Restore from GCS: all three daemons are killed, node 0 is wiped and started alone with
   ``--restore-wait 1s``, so its survey gives up on the two silent peers after that second
   and it restores from GCS. That wait is taken out of the GCS figures:
   they are reduced by the span from the survey's start (status ``cluster.at``) to the
   restore's start (``restored.at``), both on the daemon's clock, i.e. the survey (the wait
   for silent peers) plus the manifest's GET; the raw figures are kept in the JSON and shown
   below the table. Baseline: google-cloud-storage ``transfer_manager.download_many_to_path``
   of the plain objects with 8 threads (the daemon's default prefetch) into fresh tmpfs files.
d. Listing: a separate job with one node (no peers, so no survey wait) holds one step of
   ``--list-files`` files (default 1000, in directories of 100) totalling ``--size``, backed
   up to its own bucket once before the rounds; per round the node is wiped, so every byte
   is only in GCS, and the time from starting ``tierfs mount`` until ``os.walk`` of the step
   returned every name and ``os.stat`` every size (checked against the originals) is
   measured, with ``--prefetch 0`` (no background fetches competing with the listing: the
   figure flagged against 1 s) and with the default prefetch 8 (for comparison). The daemon
   is killed (-9) right after each.

Method as in docs/benchmarks.md (this VM's memory balloon returns freed pages to the host
about 2 s after they are freed, and touching them again costs 3-4x): each timed part follows
a tmpfs warm-up (``--warmup``, default 2x ``--size``) written and deleted right before it;
test files are deleted right after their part; which side (tierfs or baseline; prefetch 0 or
8) goes first alternates per round; the table shows medians of ``--rounds`` and ratios of
this run's medians, ratio = baseline seconds / tierfs seconds (higher is better, 1.0 = as
fast as the plain copy). CPU seconds (/proc/PID/stat) per GiB restored: of the restoring
daemon (its whole life until "done", start-up included), over the same span of both peers
(the holder serves the restore; the other may re-replicate the replica node 0 lost, which
it notices within 10 s) or of the emulator, and of the baselines' processes. The daemon's
CPU by the time the mount returned (sampled then: the registration file and /proc/PID/stat,
well under 1 ms before the TTFB read) is reported besides: with small steps start-up
dominates.

    .venv/bin/python scripts/bench_restore.py [--quick] [--json out.json] [--plot out.png]

``--quick``: 64 MiB per rank, 2 rounds, 100 files for the listing. Everything it creates
(/dev/shm/bench-restore-*, /tmp/bench-restore-*, daemons, mounts, the emulator and its
buckets) is removed or stopped on exit, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchlib import (progress, GCS_WORKERS, BenchError, aligned, cpu_seconds, deferred_interruptions, drop_bucket,  # noqa: E402
                      gcs_client, interrupt_on_signals, is_mounted, make_files, no_interruptions,
                      parse_size, plain_copy, warm_tmpfs, write_all, write_json, pyplot, NO_MATPLOTLIB,
                      save_figure)  # (scripts/ is on sys.path)

MiB, GiB = 1 << 20, 1 << 30
NODE0 = "127.0.0.2"
JOB, STEP = "bench", 100
LIST_JOB, LIST_STEP, LIST_DIR = "bench-list", 200, 100  # files per directory of the listing step
POLL = 0.02
GCS_RESTORE_WAIT = "1s"
TIMEOUT = 900.0  # for any one wait on the daemons


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def stray_processes(marker: str) -> list[int]:
    """Processes of ours still running with ``marker`` (a directory this run created under a
    random name) in their command line: daemons whose start was interrupted before their
    cluster learnt their pid, and the ``tierfs mount`` commands waiting for them."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) < 600 else text[:300] + " ... " + text[-280:]


class Bench:
    def __init__(self, args, emu, client):
        from tierfs.commands.status import fetch  # the control socket from this process: no
        self.fetch = fetch                        # Python start-up per poll on a 2-core VM
        from tierfs.testing.cluster import LocalCluster
        self.LocalCluster = LocalCluster
        self.args, self.emu, self.client = args, emu, client
        self.buf = aligned(MiB)
        self.clusters: list = []  # every cluster not closed yet, for the cleanup
        self.buckets: list[str] = []  # every bucket not dropped yet

    # -- helpers -------------------------------------------------------------------------

    def warm(self) -> None:
        warm_tmpfs(self.args.shm, self.args.warmup, self.buf)

    @property
    def emu_pid(self) -> int:
        return self.emu._process.pid

    def bucket(self, name: str) -> str:
        self.emu.make_bucket(name)
        self.buckets.append(name)
        return name

    def drop(self, name: str) -> None:
        try:
            drop_bucket(self.client, name)
        except Exception as e:  # the emulator goes away at exit anyway
            progress(f"bench_restore: warning: cannot delete bucket {name}: {one_line(e)}")
        self.buckets.remove(name)

    def cluster(self, name: str, nodes: int, job: str, **options):
        c = self.LocalCluster(Path("/dev/shm") / f"bench-restore-{name}-{uuid.uuid4().hex[:8]}", nodes, job,
                              **options)
        self.clusters.append(c)
        return c

    def close(self, c) -> None:
        with deferred_interruptions():
            c.close()
            self.clusters.remove(c)

    def wait(self, mnt: Path, what: str, pred, timeout: float = TIMEOUT) -> dict:
        """Poll the status every 20 ms until ``pred(status)``; returns that status."""
        deadline = time.monotonic() + timeout
        while not pred(st := self.fetch(mnt)):
            if time.monotonic() > deadline:
                raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(POLL)
        return st

    @staticmethod
    def safe(step: int, peers: bool = True):
        """The step is committed, replicated (if there are peers) and backed up."""
        def pred(st: dict) -> bool:
            s = next((s for s in st["steps"] if s["step"] == step), None)
            return bool(s and s["backed_up"] and (not peers or s["replicas"].get("version") == s["version"]))
        return pred

    @staticmethod
    def commit(mnt: Path, step: int) -> None:
        os.rename(mnt / "ckpt" / f"{step}.orbax-checkpoint-tmp", mnt / "ckpt" / str(step))

    def copy_in(self, src: Path, names: list[str], dest: Path) -> None:
        for name in names:  # 1 MiB writes from a page-aligned buffer, as a checkpoint writer does
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            with open(src / name, "rb", buffering=0) as fin, open(dest / name, "wb", buffering=0) as fout:
                while n := fin.readinto(self.buf):
                    write_all(fout.fileno(), self.buf[:n])

    # -- a round ---------------------------------------------------------------------------

    def round(self, rnd: int) -> dict:
        args, tag = self.args, uuid.uuid4().hex[:8]
        order = ("tierfs", "baseline") if rnd % 2 == 0 else ("baseline", "tierfs")
        out: dict = {"round": rnd, "order": list(order), "bytes": args.size}
        tier_bucket, base_bucket = self.bucket(f"br-{tag}"), self.bucket(f"br-{tag}-base")
        src = Path(args.shm) / f"src-{rnd}"
        c = self.cluster(f"r{rnd}", 3, JOB, replicas=1, capacity=f"{4 * args.size // MiB + 256}M",
                         gcs=f"gs://{tier_bucket}/ckpt")
        try:
            # a. setup, untimed
            c.start_all()
            sums = make_files(src, args.size, args.files)
            names = sorted(sums)  # manifest order: sorted by path
            self.copy_in(src, names, c.nodes[0].mountpoint / "ckpt" / f"{STEP}.orbax-checkpoint-tmp")
            for node in c.nodes[1:]:
                make_files(node.mountpoint / "ckpt" / f"{STEP}.orbax-checkpoint-tmp", args.size, args.files)
            for node in c.nodes:
                self.commit(node.mountpoint, STEP)
            for i, node in enumerate(c.nodes):
                st = self.wait(node.mountpoint, f"rank {i}'s step {STEP} to be replicated and backed up",
                               self.safe(STEP))
                if i == 0:
                    rep = next(s for s in st["steps"] if s["step"] == STEP)["replicas"]
            holder = next(k for k, n in enumerate(c.nodes) if n.address == rep["peers"][0])
            from google.cloud.storage import transfer_manager  # noqa: PLC0415 (slow import)
            transfer_manager.upload_many_from_filenames(
                self.client.bucket(base_bucket), names, source_directory=str(src), max_workers=GCS_WORKERS,
                worker_type=transfer_manager.THREAD, raise_exception=True)
            out["holder"] = c.nodes[holder].address
            progress(f"round {rnd + 1}: 3 ranks x {args.size // MiB} MiB committed, replicated and backed up; "
                     f"rank 0's replica is on {c.nodes[holder].address}")

            # b. restore from a peer
            c.kill(0)
            c.wipe(0)
            paths = [str(src / n) for n in names]
            for k, side in enumerate(order):
                if side == "tierfs":
                    out["peer"] = self.restore(c, src, sums, "peer", others=[1, 2])
                    if k == 0:
                        out["peer"]["settle_s"] = self.settle(c)
                else:
                    out["peer_base"] = plain_copy(c.nodes[holder].host, NODE0, paths,
                                                  os.path.join(args.shm, "recv"), self.warm)
            p, b = out["peer"], out["peer_base"]
            progress(f"round {rnd + 1} peer: mount {p['mount_s']:.2f} s, TTFB {p['ttfb_s']:.2f} s, full "
                     f"{p['full_s']:.2f} s ({self.split(p)}) vs plain copy {b['seconds']:.2f} s")

            # c. restore from GCS: the peers are gone too
            c.kill_all()
            c.wipe(0)
            for side in order:
                if side == "tierfs":
                    out["gcs"] = self.restore(c, src, sums, "gcs", restore_wait=GCS_RESTORE_WAIT)
                else:
                    out["gcs_base"] = self.download(base_bucket, names, sums)
            g, b = out["gcs"], out["gcs_base"]
            progress(f"round {rnd + 1} gcs: mount {g['mount_s']:.2f} s, TTFB {g['ttfb_s']:.2f} s, full "
                     f"{g['full_s']:.2f} s, each less the survey of {g['survey_s']:.2f} s "
                     f"({self.split(g)}) vs google-cloud-storage {b['seconds']:.2f} s")
        finally:
            self.close(c)
            shutil.rmtree(src, ignore_errors=True)
            for name in (tier_bucket, base_bucket):
                self.drop(name)
        return out

    @staticmethod
    def split(r: dict) -> str:
        total = sum(r["bytes_from"].values()) or 1
        return ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(r["bytes_from"].items()))

    def restore(self, c, src: Path, sums: dict[str, str], tier: str, others: list[int] = (), **extra) -> dict:
        """Start node 0 (killed and wiped) and time mount, first 4 KiB and full restore."""
        from tierfs.core import mounts  # noqa: PLC0415

        mnt, names = c.nodes[0].mountpoint, sorted(sums)
        first = mnt / "ckpt" / str(STEP) / names[0]
        with open(src / names[0], "rb") as f:
            head_want = f.read(4096)
        watched = {f"node {k}": c.nodes[k].pid for k in others}
        if tier == "gcs":
            watched["emulator"] = self.emu_pid
        self.warm()
        cpu0 = {who: cpu_seconds(pid) for who, pid in watched.items()}
        start, t0 = time.time(), time.monotonic()
        try:
            c.tierfs(*c.mount_args(0, **extra))  # what LocalCluster.start(0) runs, minus its status call
            mounted = time.monotonic() - t0
            c.nodes[0].pid = (mounts.Registration(mnt).read() or {}).get("pid")  # two file reads, < 1 ms
            startup_cpu = cpu_seconds(c.nodes[0].pid)
            with open(first, "rb", buffering=0) as f:
                head = f.read(4096)
            ttfb = time.monotonic() - t0
        finally:
            c.nodes[0].pid = (mounts.Registration(mnt).read() or {}).get("pid")  # for the cleanup
        st = self.fetch(mnt)
        if not st["restored"]:
            raise BenchError(f"node 0 restored nothing on its start ({tier}); cluster view: {st['cluster']}")
        view = st["cluster"] or {}
        st = self.wait(mnt, f"node 0's restore from {tier} to be done", lambda s: s["restored"]["state"] == "done")
        full = time.monotonic() - t0
        cpu = {who: cpu_seconds(pid) - cpu0[who] for who, pid in watched.items()}
        # The restoring daemon: all of its life until "done", and how much of it was spent by the mount's return
        # (start-up, and whatever the restore did meanwhile).
        cpu = {"daemon": cpu_seconds(st["pid"]), **cpu, "daemon_at_mount": startup_cpu}
        r = st["restored"]
        if r["step"] != STEP or r["bytes"] != self.args.size or r["tier"] != tier or r.get("error"):
            raise BenchError(f"node 0 did not restore step {STEP} ({self.args.size} bytes) from {tier}: {r}")
        if head != head_want:
            raise BenchError(f"the first 4 KiB of ckpt/{STEP}/{names[0]} differ from the original")
        bad = [n for n in names if sha256(mnt / "ckpt" / str(STEP) / n) != sums[n]]
        if bad:
            raise BenchError(f"restored ckpt/{STEP}/{bad[0]} (and {len(bad) - 1} more) differ from the original")
        # The survey's start and the restore's start, both on the daemon's clock (wall time).
        survey = r["at"] - view["at"] if view.get("at") and view["at"] <= r["at"] else None
        res = {"bytes": self.args.size, "mount_s": mounted, "ttfb_s": ttfb, "full_s": full,
               "restored_s": r["seconds"], "first_byte_s": r["first_byte_s"], "start_to_restore_s": r["at"] - start,
               "survey_s": survey, "demand_fetches": r["demand_fetches"],
               "bytes_from": {k.split()[0]: sum(v for n, v in r["bytes_from"].items() if n.split()[0] == k.split()[0])
                              for k in r["bytes_from"]},  # "peer HOST:PORT" -> "peer"
               "chunks": r["chunks_total"], "from": r["from"], "unreachable_peers": view.get("unreachable_peers"),
               "cpu": cpu}
        if tier == "gcs":  # the figures without the wait for the silent peers
            if survey is None:
                raise BenchError(f"cannot tell the survey's length from the status (cluster.at {view.get('at')}, "
                                 f"restored.at {r['at']})")
            res["raw"] = {k: res[k] for k in ("mount_s", "ttfb_s", "full_s")}
            res.update({k: v - survey for k, v in res["raw"].items()})
        return res

    def settle(self, c) -> float | None:
        """Wait until every rank's step has its replica again (node 0 lost the one it held)."""
        t0 = time.monotonic()
        deadline = t0 + 120
        while time.monotonic() < deadline:
            sts = [self.fetch(n.mountpoint) for n in c.nodes]
            held = sum((s["replicas_held"] or {}).get("manifests", 0) for s in sts)
            busy = any((s.get("peers") or {}).get("working_on") is not None for s in sts)
            if held >= len(c.nodes) and not busy and all(self.safe(STEP)(s) for s in sts):
                return time.monotonic() - t0
            time.sleep(0.1)
        progress("bench_restore: warning: the lost replica was not replaced within 120 s; the plain copy "
                 "may overlap a replication")
        return None

    def download(self, bucket: str, names: list[str], sums: dict[str, str]) -> dict:
        from google.cloud.storage import transfer_manager  # noqa: PLC0415 (slow import)

        dl = Path(self.args.shm) / "dl"
        dl.mkdir()
        try:
            self.warm()
            cpu0, t0 = (cpu_seconds(self.emu_pid), cpu_seconds()), time.monotonic()
            transfer_manager.download_many_to_path(
                self.client.bucket(bucket), names, destination_directory=str(dl), max_workers=GCS_WORKERS,
                worker_type=transfer_manager.THREAD, raise_exception=True)
            seconds = time.monotonic() - t0
            cpu = {"client": cpu_seconds() - cpu0[1], "emulator": cpu_seconds(self.emu_pid) - cpu0[0]}
            bad = [n for n in names if sha256(dl / n) != sums[n]]
            if bad:
                raise BenchError(f"the google-cloud-storage download of {bad[0]} differs from the original")
            return {"bytes": self.args.size, "seconds": seconds, "cpu": cpu}
        finally:
            shutil.rmtree(dl, ignore_errors=True)  # right after the measurement

    # -- the listing ---------------------------------------------------------------------

    def listing_setup(self) -> tuple:
        """A one-node job whose one step of --list-files files is backed up, then wiped from RAM."""
        args = self.args
        bucket = self.bucket(f"br-list-{uuid.uuid4().hex[:8]}")
        c = self.cluster("list", 1, LIST_JOB, capacity=f"{2 * args.size // MiB + 256}M", gcs=f"gs://{bucket}/ckpt")
        c.start(0)
        mnt = c.nodes[0].mountpoint
        per_file, tmp = args.size // args.list_files, mnt / "ckpt" / f"{LIST_STEP}.orbax-checkpoint-tmp"
        expected = {}
        for i in range(args.list_files):
            name = f"d{i // LIST_DIR:02d}/f{i:04d}.bin"
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            with open(tmp / name, "wb", buffering=0) as f:
                write_all(f.fileno(), memoryview(os.urandom(per_file)))
            expected[name] = per_file
        self.commit(mnt, LIST_STEP)
        self.wait(mnt, f"the listing step of {args.list_files} files to be backed up", self.safe(LIST_STEP, False))
        c.kill(0)
        c.wipe(0)
        progress(f"listing: {args.list_files} files of {per_file} bytes backed up to gs://{bucket}; node wiped")
        return c, bucket, expected

    def listing(self, c, expected: dict[str, int], prefetch: int) -> dict:
        from tierfs.core import mounts  # noqa: PLC0415

        mnt = c.nodes[0].mountpoint
        root = mnt / "ckpt" / str(LIST_STEP)
        self.warm()
        start, t0 = time.time(), time.monotonic()
        try:
            c.tierfs(*c.mount_args(0, prefetch=prefetch))
            mounted = time.monotonic() - t0
            seen = {}
            for d, _, files in os.walk(root):
                for f in files:
                    seen[os.path.relpath(os.path.join(d, f), root)] = os.stat(os.path.join(d, f)).st_size
            walked = time.monotonic() - t0
        finally:
            c.nodes[0].pid = (mounts.Registration(mnt).read() or {}).get("pid")
        r = self.fetch(mnt)["restored"] or {}
        try:
            if seen != expected:
                wrong = sorted(set(seen.items()) ^ set(expected.items()))
                raise BenchError(f"the listing of the restored step ({len(seen)} files) differs from the original "
                                 f"({len(expected)} files), e.g. {wrong[:2]}")
            if r.get("step") != LIST_STEP or r.get("tier") not in ("gcs", "local"):
                raise BenchError(f"the listing node did not restore step {LIST_STEP} from GCS: {r}")
        finally:
            c.kill(0)  # mid-restore with prefetch: a node that dies, nothing more
            c.wipe(0)
        return {"files": len(seen), "prefetch": prefetch, "mount_s": mounted, "seconds": walked,
                "walk_s": walked - mounted, "bytes_here_after": r["bytes"] - r["bytes_missing"],
                "start_to_restore_s": r["at"] - start}


# ----------------------------------------------------------------------------- report

def summarize(raw: list[dict], listing: list[dict]) -> dict:
    med = statistics.median
    rows = []
    for tier, base in (("peer", "peer_base"), ("gcs", "gcs_base")):
        m = {k: med(r[tier][k] for r in raw) for k in ("mount_s", "ttfb_s", "full_s", "restored_s")}
        b = med(r[base]["seconds"] for r in raw)
        rows.append({"tier": tier, **m, "baseline_s": b, "ratio": b / m["full_s"],
                     "tierfs_mib_s": raw[0]["bytes"] / MiB / m["full_s"], "baseline_mib_s": raw[0]["bytes"] / MiB / b,
                     "ratio_daemon": b / m["restored_s"],
                     "start_to_restore_s": med(r[tier]["start_to_restore_s"] for r in raw),
                     "daemon_at_mount_cpu_s": med(r[tier]["cpu"]["daemon_at_mount"] for r in raw),
                     "bytes_from": {k: med(r[tier]["bytes_from"].get(k, 0) / r[tier]["bytes"] for r in raw)
                                    for k in sorted({k for r in raw for k in r[tier]["bytes_from"]})},
                     "cpu_s_per_gib": {
                         "tierfs": {who: med(r[tier]["cpu"][who] / r[tier]["bytes"] * GiB for r in raw)
                                    for who in raw[0][tier]["cpu"] if who != "daemon_at_mount"},
                         "baseline": {who: med(r[base]["cpu"][who] / r[base]["bytes"] * GiB for r in raw)
                                      for who in raw[0][base]["cpu"]}}})
    gcs_raw = {k: med(r["gcs"]["raw"][k] for r in raw) for k in ("mount_s", "ttfb_s", "full_s")}
    lists = {p: [x for x in listing if x["prefetch"] == p] for p in sorted({x["prefetch"] for x in listing})}
    return {"rows": rows, "gcs_raw": gcs_raw, "gcs_survey_s": med(r["gcs"]["survey_s"] for r in raw),
            "peer_survey_s": med(r["peer"]["survey_s"] or 0.0 for r in raw),
            "settle_s": [r["peer"].get("settle_s") for r in raw if "settle_s" in r["peer"]],
            "listing": {str(p): {"files": xs[0]["files"], "seconds": med(x["seconds"] for x in xs),
                                 "mount_s": med(x["mount_s"] for x in xs), "walk_s": med(x["walk_s"] for x in xs),
                                 "start_to_restore_s": med(x["start_to_restore_s"] for x in xs),
                                 "max_s": max(x["seconds"] for x in xs), "under_1s": med(x["seconds"] for x in xs) < 1}
                        for p, xs in lists.items()}}


def render(s: dict, args) -> str:
    head = ("restore from", "mount s", "TTFB s", "full s", "baseline s", "ratio", "tierfs MiB/s", "baseline MiB/s")
    names = {"peer": "peer (127.0.0.3)", "gcs": "GCS (less survey)"}
    body = [(names[r["tier"]], f"{r['mount_s']:.2f}", f"{r['ttfb_s']:.2f}", f"{r['full_s']:.2f}",
             f"{r['baseline_s']:.2f}", f"{r['ratio']:.2f}", f"{r['tierfs_mib_s']:.0f}", f"{r['baseline_mib_s']:.0f}")
            for r in s["rows"]]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
             for cells in [head, ["-" * w for w in widths], *body]]
    peer, gcs = s["rows"]
    raw = s["gcs_raw"]
    lines += [
        "# times from starting `tierfs mount`: mount = it returned (namespace ready), TTFB = first 4 KiB of the "
        "first file read, full = restored.state \"done\"; ratio = baseline s / full s (1.0 = as fast as the baseline)",
        "# baselines: peer = plain sendfile -> recv_into+write socket copy 127.0.0.3 -> 127.0.0.2; GCS = "
        f"google-cloud-storage download_many_to_path, {GCS_WORKERS} threads, from the same emulator",
        f"# GCS figures less the start's survey ({GCS_RESTORE_WAIT} --restore-wait for the 2 silent peers + the "
        f"manifest GET, daemon clock): median {s['gcs_survey_s']:.2f} s; raw: mount {raw['mount_s']:.2f}, "
        f"TTFB {raw['ttfb_s']:.2f}, full {raw['full_s']:.2f} s (the peer case's survey: {s['peer_survey_s']:.2f} s)",
        f"# daemon's own restored.seconds (restore start to done): peer {peer['restored_s']:.2f} s (ratio "
        f"{peer['ratio_daemon']:.2f}), GCS {gcs['restored_s']:.2f} s (ratio {gcs['ratio_daemon']:.2f}); the restore "
        f"started {peer['start_to_restore_s']:.2f} s (peer) and {gcs['start_to_restore_s']:.2f} s (GCS, survey "
        "included) after `tierfs mount` was started (CLI and daemon start-up, survey, manifest)",
        "# bytes came from (medians): " + "; ".join(
            f"{r['tier']} restore: " + ", ".join(f"{k} {v:.0%}" for k, v in r["bytes_from"].items())
            for r in s["rows"]),
        "# CPU-s per GiB (medians): " + "; ".join(
            f"{r['tier']} restore: tierfs " + ", ".join(f"{w} {v:.2f}" for w, v in
                                                                  r["cpu_s_per_gib"]["tierfs"].items())
            + " | baseline " + ", ".join(f"{w} {v:.2f}" for w, v in r["cpu_s_per_gib"]["baseline"].items())
            for r in s["rows"]) + " (daemon: the restoring daemon's whole life until done, start-up included; "
        f"by the mount's return it had used {peer['daemon_at_mount_cpu_s']:.2f} (peer) / "
        f"{gcs['daemon_at_mount_cpu_s']:.2f} (GCS) CPU-s)",
    ]
    for p, x in s["listing"].items():
        lines.append(f"listing {x['files']} files: {x['seconds']:.2f} s (< 1 s: {'yes' if x['under_1s'] else 'NO'})"
                     f"  [--prefetch {p}{' (no background fetches)' if p == '0' else ''}: restore began after "
                     f"{x['start_to_restore_s']:.2f} s, mount returned after {x['mount_s']:.2f} s, walk+stat "
                     f"{x['walk_s']:.2f} s; slowest round {x['max_s']:.2f} s]")
    return "\n".join(lines)


def plot(path: str, s: dict, title: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, (ax, lx) = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [3, 1]})
    parts = (("mount_s", "mount returned"), ("ttfb_s", "first 4 KiB"), ("full_s", "full restore"),
             ("baseline_s", "baseline copy"))
    for k, (key, label) in enumerate(parts):
        bars = ax.bar([i + (k - 1.5) * 0.2 for i in range(len(s["rows"]))], [r[key] for r in s["rows"]], 0.2,
                      label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    top = max(r[key] for r in s["rows"] for key, _ in parts)
    for i, r in enumerate(s["rows"]):
        ax.annotate(f"ratio {r['ratio']:.2f}", (i, top * 1.1), ha="center", fontsize=8)
    ax.set_xticks(range(len(s["rows"])), ["from a peer\n(plain socket copy)", "from GCS, less survey\n"
                                           "(google-cloud-storage)"])
    ax.set(ylabel="seconds from `tierfs mount` (median)", ylim=(0, top * 1.4))
    ax.legend(fontsize=7, loc="upper center", ncol=4)
    items = sorted(s["listing"].items())
    bars = lx.bar(range(len(items)), [x["seconds"] for _, x in items], 0.6, color="tab:gray")
    lx.bar_label(bars, fmt="%.2f", fontsize=7)
    lx.axhline(1.0, color="tab:red", lw=0.8, ls="--")
    lx.set_xticks(range(len(items)), [f"prefetch {p}" for p, _ in items], fontsize=8)
    lx.set(ylabel="seconds", title=f"mount + list {items[0][1]['files']} files" if items else "listing",
           ylim=(0, max([1.1] + [x["seconds"] * 1.2 for _, x in items])))
    lx.title.set_fontsize(8)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)
    return None


def main() -> int:
    p = argparse.ArgumentParser(description="Restore of a wiped node from a peer and from GCS against plain "
                                            "copies, and the listing of a restored step (medians of alternating "
                                            "rounds).")
    p.add_argument("--size", type=parse_size, help="checkpoint bytes per rank, and of the listing step (default 1G)")
    p.add_argument("--files", type=int, default=16, help="files per rank's checkpoint (default 16)")
    p.add_argument("--list-files", type=int, help="files of the listing step (default 1000)")
    p.add_argument("--rounds", type=int, help="rounds; medians are taken over them (default 5)")
    p.add_argument("--warmup", type=parse_size, help="tmpfs warm-up before each measurement (default 2x --size)")
    p.add_argument("--quick", action="store_true", help="smoke run: --size 64M --rounds 2 --list-files 100 "
                                                        "unless given")
    p.add_argument("--json", metavar="PATH", help="write settings, raw per-round numbers and medians")
    p.add_argument("--plot", metavar="PATH.png", help="bars of the medians (needs matplotlib)")
    args = p.parse_args()
    args.size = args.size or (64 * MiB if args.quick else GiB)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.list_files = args.list_files or (100 if args.quick else 1000)
    args.warmup = args.warmup or 2 * args.size
    args.size -= args.size % (args.files * MiB) if args.files > 0 else 0  # whole MiB per file
    if args.size <= 0 or args.files < 1 or args.rounds < 1 or not 1 <= args.list_files <= args.size:
        p.error("--size must be at least --files MiB, --files and --rounds at least 1, "
                "--list-files between 1 and --size bytes")

    interrupt_on_signals()
    from tierfs.testing import wait_gone
    from tierfs.testing.gcs_emulator import GcsEmulator

    tmp = Path(tempfile.mkdtemp(prefix="bench-restore-", dir="/tmp"))
    args.shm = tempfile.mkdtemp(prefix="bench-restore-data-", dir="/dev/shm")
    emu, bench = GcsEmulator(tmp / "emulator", backend="memory"), None
    try:
        emu.start()
        os.environ.update(emu.environ(), TIERFS_RUNTIME_DIR=str(tmp / "run"))  # for the daemons too
        bench = Bench(args, emu, gcs_client())
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        cmd = shlex.join([sys.executable, *sys.argv])
        settings = {"size": args.size, "files": args.files, "list_files": args.list_files, "rounds": args.rounds,
                    "warmup": args.warmup, "gcs_workers": GCS_WORKERS, "gcs_restore_wait": GCS_RESTORE_WAIT,
                    "cores": os.cpu_count(), "kernel": os.uname().release, "date": now, "command": cmd}
        print(f"# bench_restore {now}  {settings['cores']} cores  command: {cmd}\n"
              f"# {args.size // MiB} MiB in {args.files} files per rank, 3 ranks, replicas=1, --gcs on fake-gcs-server "
              f"(memory backend), default chunk size and prefetch; listing: {args.list_files} files, "
              f"{args.size // MiB} MiB; {args.rounds} rounds, medians", flush=True)
        lc, list_bucket, expected = bench.listing_setup()
        raw, listing = [], []
        for rnd in range(args.rounds):
            raw.append(bench.round(rnd))
            for prefetch in (0, 8) if rnd % 2 == 0 else (8, 0):
                listing.append(x := bench.listing(lc, expected, prefetch) | {"round": rnd})
                progress(f"round {rnd + 1} listing, --prefetch {prefetch}: {x['files']} files in {x['seconds']:.2f} s "
                         f"(mount {x['mount_s']:.2f} s + walk {x['walk_s']:.2f} s)")
        bench.close(lc)
        bench.drop(list_bucket)
        summary = summarize(raw, listing)
        print(render(summary, args))
        if args.json:
            write_json(args.json, {"settings": settings, "raw": raw, "listing": listing, "medians": summary})
        if args.plot:
            why = plot(args.plot, summary, f"tierfs restore of {args.size // MiB} MiB per rank, {args.rounds} rounds, "
                                           f"{now[:10]}")
            print(f"# plot skipped: {why}" if why else f"# wrote {args.plot}")
        return 0
    except KeyboardInterrupt:
        print("bench_restore: interrupted; cleaning up", file=sys.stderr)
        return 130
    except (BenchError, AssertionError, OSError, subprocess.TimeoutExpired) as e:
        print(f"bench_restore: error: {one_line(e)}", file=sys.stderr)
        return 1
    except Exception as e:  # a daemon's UserError, the emulator, google-cloud-storage: one line all the same
        print(f"bench_restore: error: {type(e).__name__}: {one_line(e)}", file=sys.stderr)
        return 1
    finally:  # no more Ctrl-C: a half-done cleanup would leave daemons and mounts behind
        with no_interruptions():
            left = []
            for c in list(bench.clusters if bench else []):
                c.close()
                for pid in stray_processes(str(c.base) + "/"):  # a start cut short by Ctrl-C
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    wait_gone(pid)
                for n in c.nodes:
                    if is_mounted(n.mountpoint):
                        subprocess.run(["umount", "-l", str(n.mountpoint)], capture_output=True)
                    if is_mounted(n.mountpoint):
                        left.append(n.mountpoint)
                if not left:
                    shutil.rmtree(c.base, ignore_errors=True)
            for name in list(bench.buckets if bench else []):
                bench.drop(name)
            emu.stop()
            shutil.rmtree(args.shm, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)
            if left:
                print(f"bench_restore: warning: still mounted: {', '.join(map(str, left))}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
