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

For each size of ``--sizes`` (default 1G,4G: rank 0's step), ``--rounds`` rounds; the rounds
of the smallest size (the "GCS size") run a to c, those of the others a and b only. Each round
builds a fresh 3-node LocalCluster (tierfs_testing.cluster: 127.0.0.2-4, ``--replicas 1``,
``--peer-tls`` as given, default on: TLS 1.3, the product's default; at the GCS size ``--gcs``
on a fresh bucket of a fake-gcs-server with the memory backend; default chunk size and
prefetch) and:

a. Setup (untimed): rank 0 writes the size's random bytes in ``--files`` files into
   ``ckpt/100.orbax-checkpoint-tmp`` and renames it to ``ckpt/100``; ranks 1 and 2 do the
   same with steps of their own (a start restores a step every rank has): as big as rank 0's
   at the GCS size, ``--files`` MiB at the others, so that a 4 GiB row fits in RAM (rank 0's
   step, its replica, the staged copy and the baseline's received files: 16 GiB of the VM's
   24); waits until every rank's step is replicated (``replicas.version == version``) and, at
   the GCS size, backed up; rank 0's files are kept in a tmpfs staging directory and, at the
   GCS size, uploaded as plain objects to a second bucket.
b. Restore from a peer: node 0 is killed (-9), wiped, and started again while its peers are
   up; it restores from the peer holding rank 0's replica (127.0.0.3); at the GCS size, GCS
   serves only what no peer gives (the split is reported).
   Baseline: the staged files copied from 127.0.0.3 to 127.0.0.2 over a plain TCP socket
   (``os.sendfile`` -> ``recv_into`` a page-aligned 1 MiB buffer -> fresh tmpfs files; two
   fresh processes, timed from connect to the last file closed: benchlib.plain_copy). After
   the tierfs side, when the plain copy follows, the script waits until the peer that had
   its replica on node 0 has replicated it again (it notices within 10 s), so that transfer
   does not run over the baseline.
c. Restore from GCS (the GCS size only): all three daemons are killed, node 0 is wiped and
   started alone with ``--restore-wait 1s``, so its survey gives up on the two silent peers
   after that second and it restores from GCS. That wait is taken out of the GCS figures:
   they are reduced by the span from the survey's start (status ``cluster.at``) to the
   restore's start (``restored.at``), both on the daemon's clock, i.e. the survey (the wait
   for silent peers) plus the manifest's GET; a coordinated start's status names no survey
   start, and then by the 1 s wait alone (the survey polls until its deadline). The raw
   figures are kept in the JSON and shown below the table. Baseline: google-cloud-storage
   ``transfer_manager.download_many_to_path`` of the plain objects with 8 threads (the
   daemon's default prefetch) into fresh tmpfs files.
d. Listing: a separate job with one node (no peers, so no survey wait) holds one step of
   ``--list-files`` files (default 1000, in directories of 100) totalling the GCS size, backed
   up to its own bucket once before the rounds; per round the node is wiped, so every byte
   is only in GCS, and the time from starting ``tierfs mount`` until ``os.walk`` of the step
   returned every name and ``os.stat`` every size (checked against the originals) is
   measured, with ``--prefetch 0`` (no background fetches competing with the listing: the
   figure flagged against 1 s) and with the default prefetch 8 (for comparison). The daemon
   is killed (-9) right after each.

Method as in docs/benchmarks.md (this VM's memory balloon returns freed pages to the host
about 2 s after they are freed, and touching them again costs 3-4x): each timed part follows
a tmpfs warm-up (``--warmup``, default twice the size, at most 4 GiB) written and deleted
right before it; test files are deleted right after their part; which side (tierfs or baseline; prefetch 0 or
8) goes first alternates per round; the table shows medians of ``--rounds`` and ratios of
this run's medians, ratio = baseline seconds / tierfs seconds (higher is better, 1.0 = as
fast as the plain copy). CPU seconds (/proc/PID/stat) per GiB restored, on the sending and
the receiving side: the peer holding the replica (GCS: the emulator) and the restoring
daemon (its whole life until "done", start-up included); the plain copy's sender and
receiver (GCS: the emulator and this process). Over the same span the other peer's is kept
too (it may re-replicate the replica node 0 lost, which it notices within 10 s). The daemon's
CPU by the time the mount returned (sampled then: the registration file and /proc/PID/stat,
well under 1 ms before the TTFB read) is reported besides: with small steps start-up
dominates.

    .venv/bin/python scripts/bench_restore.py [--sizes 1G,4G] [--rounds 5] [--peer-tls on|off]
                                              [--quick] [--json out.json] [--plot out.png]

``--quick``: ``--sizes 64M,128M``, 2 rounds, 100 files for the listing. Everything it creates
(/dev/shm/bench-restore-* or under --ramdisk, /tmp/bench-restore-*, daemons, mounts, the emulator and its
buckets) is removed or stopped on exit, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
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
    GCS_WORKERS,
    NO_MATPLOTLIB,
    RAMDISK_HELP,
    BenchError,
    aligned,
    close_cluster,
    compile_bytecode,
    cpu_seconds,
    default_warmup,
    deferred_interruptions,
    drop_bucket,
    gcs_client,
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

MiB, GiB = 1 << 20, 1 << 30
NODE0 = "127.0.0.2"
JOB, STEP = "bench", 100
LIST_JOB, LIST_STEP, LIST_DIR = "bench-list", 200, 100  # files per directory of the listing step
POLL = 0.02
GCS_RESTORE_WAIT, GCS_RESTORE_WAIT_S = "1s", 1.0
TIMEOUT = 900.0  # for any one wait on the daemons


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) < 600 else text[:300] + " ... " + text[-280:]


class Bench:
    def __init__(self, args, emu, client):
        from tierfs.commands.status import fetch  # the control socket from this process: no

        self.fetch = fetch  # Python start-up per poll on a 2-core VM
        from tierfs_testing.cluster import LocalCluster

        self.LocalCluster = LocalCluster
        self.args, self.emu, self.client = args, emu, client
        self.buf = aligned(MiB)
        self.clusters: list = []  # every cluster not closed yet, for the cleanup
        self.buckets: list[str] = []  # every bucket not dropped yet

    # -- helpers -------------------------------------------------------------------------

    def warm(self, size: int) -> None:
        warm_up(os.path.join(self.args.shm, "warmup"), self.args.warmup or default_warmup(size), self.buf)

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
        except Exception as e:  # noqa: BLE001 (cleanup: the emulator goes away at exit anyway)
            progress(f"bench_restore: warning: cannot delete bucket {name}: {one_line(e)}")
        self.buckets.remove(name)

    def cluster(self, name: str, nodes: int, job: str, **options):
        c = self.LocalCluster(
            Path(self.args.ramdisk) / f"bench-restore-{name}-{uuid.uuid4().hex[:8]}", nodes, job, **options
        )
        self.clusters.append(c)
        return c

    def close(self, c) -> None:
        with deferred_interruptions():
            left = close_cluster(c)
            self.clusters.remove(c)
        if left:
            progress(f"bench_restore: warning: still mounted: {', '.join(left)}")

    def wait(self, mnt: Path, what: str, pred, timeout: float = TIMEOUT) -> dict:
        """Poll the status every 20 ms until ``pred(status)``; returns that status."""
        deadline = time.monotonic() + timeout
        while not pred(st := self.fetch(mnt)):
            if time.monotonic() > deadline:
                raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(POLL)
        return st

    @staticmethod
    def safe(step: int, peers: bool = True, backup: bool = True):
        """The step is committed, replicated (if there are peers) and backed up (if there is GCS)."""

        def pred(st: dict) -> bool:
            s = next((s for s in st["steps"] if s["step"] == step), None)
            return bool(
                s and (not backup or s["backed_up"]) and (not peers or s["replicas"].get("version") == s["version"])
            )

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

    def round(self, rnd: int, size: int, gcs: bool) -> dict:
        """One round at ``size``: the restore from a peer, and with ``gcs`` the one from GCS too."""
        args, tag, label = self.args, uuid.uuid4().hex[:8], f"{size_label(size)} round {rnd + 1}"
        order = ("tierfs", "baseline") if rnd % 2 == 0 else ("baseline", "tierfs")
        others = size if gcs else args.files * MiB  # ranks 1 and 2's steps
        out: dict = {"round": rnd, "order": list(order), "bytes": size, "others_bytes": others}
        buckets = (self.bucket(f"br-{tag}"), self.bucket(f"br-{tag}-base")) if gcs else ()
        src = Path(args.shm) / f"src-{rnd}"
        c = self.cluster(
            f"r{rnd}",
            3,
            JOB,
            replicas=1,
            capacity=f"{4 * size // MiB + 256}M",
            peer_tls=args.peer_tls,
            gcs=f"gs://{buckets[0]}/ckpt" if gcs else None,
        )
        try:
            # a. setup, untimed
            c.start_all()
            sums = make_files(src, size, args.files)
            names = sorted(sums)  # manifest order: sorted by path
            self.copy_in(src, names, c.nodes[0].mountpoint / "ckpt" / f"{STEP}.orbax-checkpoint-tmp")
            for node in c.nodes[1:]:
                make_files(node.mountpoint / "ckpt" / f"{STEP}.orbax-checkpoint-tmp", others, args.files)
            for node in c.nodes:
                self.commit(node.mountpoint, STEP)
            for i, node in enumerate(c.nodes):
                st = self.wait(
                    node.mountpoint,
                    f"rank {i}'s step {STEP} to be replicated" + (" and backed up" if gcs else ""),
                    self.safe(STEP, backup=gcs),
                )
                if i == 0:
                    rep = next(s for s in st["steps"] if s["step"] == STEP)["replicas"]
            holder = next(k for k, n in enumerate(c.nodes) if n.address == rep["peers"][0])
            if gcs:
                from google.cloud.storage import transfer_manager

                transfer_manager.upload_many_from_filenames(
                    self.client.bucket(buckets[1]),
                    names,
                    source_directory=str(src),
                    max_workers=GCS_WORKERS,
                    worker_type=transfer_manager.THREAD,
                    raise_exception=True,
                )
            out["holder"] = c.nodes[holder].address
            progress(
                f"{label}: rank 0's {size_label(size)} and ranks 1-2's {size_label(others)} committed, "
                f"replicated{' and backed up' if gcs else ''}; rank 0's replica is on {out['holder']}"
            )

            # b. restore from a peer
            c.kill(0)
            c.wipe(0)
            paths = [str(src / n) for n in names]
            for k, side in enumerate(order):
                if side == "tierfs":
                    out["peer"] = self.restore(c, src, sums, "peer", size, sender=holder, others=[1, 2])
                    if k == 0:
                        out["peer"]["settle_s"] = self.settle(c, gcs)
                else:
                    out["peer_base"] = plain_copy(
                        c.nodes[holder].host, NODE0, paths, os.path.join(args.shm, "recv"), lambda: self.warm(size)
                    )
            p, b = out["peer"], out["peer_base"]
            progress(
                f"{label} peer: mount {p['mount_s']:.2f} s, TTFB {p['ttfb_s']:.2f} s, full "
                f"{p['full_s']:.2f} s ({self.split(p)}) vs plain copy {b['seconds']:.2f} s"
            )
            if not gcs:
                return out

            # c. restore from GCS: the peers are gone too
            c.kill_all()
            c.wipe(0)
            for side in order:
                if side == "tierfs":
                    out["gcs"] = self.restore(c, src, sums, "gcs", size, restore_wait=GCS_RESTORE_WAIT)
                else:
                    out["gcs_base"] = self.download(buckets[1], names, sums, size)
            g, b = out["gcs"], out["gcs_base"]
            progress(
                f"{label} gcs: mount {g['mount_s']:.2f} s, TTFB {g['ttfb_s']:.2f} s, full "
                f"{g['full_s']:.2f} s, each less the survey of {g['survey_s']:.2f} s "
                f"({self.split(g)}) vs google-cloud-storage {b['seconds']:.2f} s"
            )
        finally:
            self.close(c)
            shutil.rmtree(src, ignore_errors=True)
            for name in buckets:
                self.drop(name)
        return out

    @staticmethod
    def split(r: dict) -> str:
        total = sum(r["bytes_from"].values()) or 1
        return ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(r["bytes_from"].items()))

    def restore(
        self,
        c,
        src: Path,
        sums: dict[str, str],
        tier: str,
        size: int,
        sender: int | None = None,
        others: list[int] = (),
        **extra,
    ) -> dict:
        """Start node 0 (killed and wiped) and time mount, first 4 KiB and full restore. CPU of
        the restoring daemon (the receiver), of ``others`` nodes (``sender``: the one serving) or
        of the emulator (the sender from GCS)."""
        mnt, names = c.nodes[0].mountpoint, sorted(sums)
        first = mnt / "ckpt" / str(STEP) / names[0]
        with open(src / names[0], "rb") as f:
            head_want = f.read(4096)
        watched = {f"node {k}": c.nodes[k].pid for k in others}
        if tier == "gcs":
            watched["emulator"] = self.emu_pid
        self.warm(size)
        cpu0 = {who: cpu_seconds(pid) for who, pid in watched.items()}
        start, t0 = time.time(), time.monotonic()
        try:
            c.tierfs(*c.mount_args(0, **extra))  # what LocalCluster.start(0) runs, minus its status call
            mounted = time.monotonic() - t0
            c.refresh(0)  # two file reads, < 1 ms
            startup_cpu = cpu_seconds(c.nodes[0].pid)
            with open(first, "rb", buffering=0) as f:
                head = f.read(4096)
            ttfb = time.monotonic() - t0
        finally:
            c.refresh(0)  # for the cleanup
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
        cpu.update(receiver=cpu["daemon"], sender=cpu["emulator" if tier == "gcs" else f"node {sender}"])
        r = st["restored"]
        if r["step"] != STEP or r["bytes"] != size or r["tier"] != tier or r.get("error"):
            raise BenchError(f"node 0 did not restore step {STEP} ({size} bytes) from {tier}: {r}")
        if head != head_want:
            raise BenchError(f"the first 4 KiB of ckpt/{STEP}/{names[0]} differ from the original")
        bad = [n for n in names if sha256(mnt / "ckpt" / str(STEP) / n) != sums[n]]
        if bad:
            raise BenchError(f"restored ckpt/{STEP}/{bad[0]} (and {len(bad) - 1} more) differ from the original")
        # The survey's start and the restore's start, both on the daemon's clock (wall time). A coordinated
        # start's status names no survey start: then the wait for the silent peers alone is taken out of
        # the GCS figures (the survey polls until that deadline), not the manifest's GET (milliseconds).
        if view.get("at"):
            survey = r["at"] - view["at"] if view["at"] <= r["at"] else None
        else:
            survey = GCS_RESTORE_WAIT_S if tier == "gcs" else None
        res = {
            "bytes": size,
            "mount_s": mounted,
            "ttfb_s": ttfb,
            "full_s": full,
            "restored_s": r["seconds"],
            "first_byte_s": r["first_byte_s"],
            "start_to_restore_s": r["at"] - start,
            "survey_s": survey,
            "survey_from": "survey" if view.get("at") else "restore-wait",
            "demand_fetches": r["demand_fetches"],
            "bytes_from": {
                k.split()[0]: sum(v for n, v in r["bytes_from"].items() if n.split()[0] == k.split()[0])
                for k in r["bytes_from"]
            },  # "peer HOST:PORT" -> "peer"
            "chunks": r["chunks_total"],
            "from": r["from"],
            "unreachable_peers": view.get("unreachable_peers"),
            "cpu": cpu,
        }
        if tier == "gcs":  # the figures without the wait for the silent peers
            if survey is None:
                raise BenchError(
                    f"cannot tell the survey's length from the status (cluster.at {view.get('at')}, "
                    f"restored.at {r['at']})"
                )
            res["raw"] = {k: res[k] for k in ("mount_s", "ttfb_s", "full_s")}
            res.update({k: v - survey for k, v in res["raw"].items()})
        return res

    def settle(self, c, backup: bool) -> float | None:
        """Wait until every rank's step has its replica again (node 0 lost the one it held)."""
        t0 = time.monotonic()
        deadline = t0 + 120
        while time.monotonic() < deadline:
            sts = [self.fetch(n.mountpoint) for n in c.nodes]
            held = sum((s["replicas_held"] or {}).get("manifests", 0) for s in sts)
            busy = any((s.get("peers") or {}).get("working_on") is not None for s in sts)
            if held >= len(c.nodes) and not busy and all(self.safe(STEP, backup=backup)(s) for s in sts):
                return time.monotonic() - t0
            time.sleep(0.1)
        progress(
            "bench_restore: warning: the lost replica was not replaced within 120 s; the plain copy "
            "may overlap a replication"
        )
        return None

    def download(self, bucket: str, names: list[str], sums: dict[str, str], size: int) -> dict:
        from google.cloud.storage import transfer_manager

        dl = Path(self.args.shm) / "dl"
        dl.mkdir()
        try:
            self.warm(size)
            cpu0, t0 = (cpu_seconds(self.emu_pid), cpu_seconds()), time.monotonic()
            transfer_manager.download_many_to_path(
                self.client.bucket(bucket),
                names,
                destination_directory=str(dl),
                max_workers=GCS_WORKERS,
                worker_type=transfer_manager.THREAD,
                raise_exception=True,
            )
            seconds = time.monotonic() - t0
            cpu = {"sender": cpu_seconds(self.emu_pid) - cpu0[0], "receiver": cpu_seconds() - cpu0[1]}
            bad = [n for n in names if sha256(dl / n) != sums[n]]
            if bad:
                raise BenchError(f"the google-cloud-storage download of {bad[0]} differs from the original")
            return {"bytes": size, "seconds": seconds, "cpu": cpu}
        finally:
            shutil.rmtree(dl, ignore_errors=True)  # right after the measurement

    # -- the listing ---------------------------------------------------------------------

    def listing_setup(self) -> tuple:
        """A one-node job whose one step of --list-files files is backed up, then wiped from RAM."""
        args = self.args
        bucket = self.bucket(f"br-list-{uuid.uuid4().hex[:8]}")
        c = self.cluster("list", 1, LIST_JOB, capacity=f"{2 * args.gcs_size // MiB + 256}M", gcs=f"gs://{bucket}/ckpt")
        c.start(0)
        mnt = c.nodes[0].mountpoint
        per_file, tmp = args.gcs_size // args.list_files, mnt / "ckpt" / f"{LIST_STEP}.orbax-checkpoint-tmp"
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
        mnt = c.nodes[0].mountpoint
        root = mnt / "ckpt" / str(LIST_STEP)
        self.warm(self.args.gcs_size)
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
            c.refresh(0)
        r = self.fetch(mnt)["restored"] or {}
        try:
            if seen != expected:
                wrong = sorted(set(seen.items()) ^ set(expected.items()))
                raise BenchError(
                    f"the listing of the restored step ({len(seen)} files) differs from the original "
                    f"({len(expected)} files), e.g. {wrong[:2]}"
                )
            if r.get("step") != LIST_STEP or r.get("tier") not in ("gcs", "local"):
                raise BenchError(f"the listing node did not restore step {LIST_STEP} from GCS: {r}")
        finally:
            c.kill(0)  # mid-restore with prefetch: a node that dies, nothing more
            c.wipe(0)
        return {
            "files": len(seen),
            "prefetch": prefetch,
            "mount_s": mounted,
            "seconds": walked,
            "walk_s": walked - mounted,
            "bytes_here_after": r["bytes"] - r["bytes_missing"],
            "start_to_restore_s": r["at"] - start,
        }


# ----------------------------------------------------------------------------- report


def summarize(raw: dict[int, list[dict]], listing: list[dict], gcs_size: int) -> dict:
    """Medians per row (a peer row per size, the GCS row at ``gcs_size``), ratios of medians."""
    med = statistics.median
    rows = []
    for tier, base, size in [*(("peer", "peer_base", n) for n in raw), ("gcs", "gcs_base", gcs_size)]:
        rs = raw[size]
        m = {k: med(r[tier][k] for r in rs) for k in ("mount_s", "ttfb_s", "full_s", "restored_s")}
        b = med(r[base]["seconds"] for r in rs)
        rows.append(
            {
                "tier": tier,
                "size": size,
                **m,
                "baseline_s": b,
                "ratio": b / m["full_s"],
                "tierfs_mib_s": size / MiB / m["full_s"],
                "baseline_mib_s": size / MiB / b,
                "ratio_daemon": b / m["restored_s"],
                "start_to_restore_s": med(r[tier]["start_to_restore_s"] for r in rs),
                "daemon_at_mount_cpu_s": med(r[tier]["cpu"]["daemon_at_mount"] for r in rs),
                "others_bytes": rs[0]["others_bytes"],
                "bytes_from": {
                    k: med(r[tier]["bytes_from"].get(k, 0) / r[tier]["bytes"] for r in rs)
                    for k in sorted({k for r in rs for k in r[tier]["bytes_from"]})
                },
                "cpu_s_per_gib": {
                    "tierfs": {
                        who: med(r[tier]["cpu"][who] / r[tier]["bytes"] * GiB for r in rs)
                        for who in rs[0][tier]["cpu"]
                        if who != "daemon_at_mount"
                    },
                    "baseline": {
                        who: med(r[base]["cpu"][who] / r[base]["bytes"] * GiB for r in rs) for who in rs[0][base]["cpu"]
                    },
                },
            }
        )
    gcs_rounds = raw[gcs_size]
    gcs_raw = {k: med(r["gcs"]["raw"][k] for r in gcs_rounds) for k in ("mount_s", "ttfb_s", "full_s")}
    lists = {p: [x for x in listing if x["prefetch"] == p] for p in sorted({x["prefetch"] for x in listing})}
    return {
        "rows": rows,
        "gcs_raw": gcs_raw,
        "gcs_survey_s": med(r["gcs"]["survey_s"] for r in gcs_rounds),
        "gcs_survey_from": " / ".join(sorted({r["gcs"]["survey_from"] for r in gcs_rounds})),
        "peer_survey_s": {
            str(n): med(r["peer"]["survey_s"] for r in rs)
            if all(r["peer"]["survey_s"] is not None for r in rs)
            else None
            for n, rs in raw.items()
        },
        "settle_s": [r["peer"].get("settle_s") for rs in raw.values() for r in rs if "settle_s" in r["peer"]],
        "listing": {
            str(p): {
                "files": xs[0]["files"],
                "seconds": med(x["seconds"] for x in xs),
                "mount_s": med(x["mount_s"] for x in xs),
                "walk_s": med(x["walk_s"] for x in xs),
                "start_to_restore_s": med(x["start_to_restore_s"] for x in xs),
                "max_s": max(x["seconds"] for x in xs),
                "under_1s": med(x["seconds"] for x in xs) < 1,
            }
            for p, xs in lists.items()
        },
    }


def row_name(r: dict, args) -> str:
    what = f"peer ({'TLS' if args.peer_tls == 'on' else 'in clear'})" if r["tier"] == "peer" else "GCS (less survey)"
    return f"{what}, {size_label(r['size'])}"


def render(s: dict, args) -> str:
    head = (
        "restore from",
        "mount s",
        "TTFB s",
        "full s",
        "baseline s",
        "ratio",
        "tierfs MiB/s",
        "baseline MiB/s",
        "CPU-s/GiB snd / rcv",
        "baseline snd / rcv",
    )

    def cpu(c):
        return f"{c['sender']:.2f} / {c['receiver']:.2f}"

    body = [
        (
            row_name(r, args),
            f"{r['mount_s']:.2f}",
            f"{r['ttfb_s']:.2f}",
            f"{r['full_s']:.2f}",
            f"{r['baseline_s']:.2f}",
            f"{r['ratio']:.2f}",
            f"{r['tierfs_mib_s']:.0f}",
            f"{r['baseline_mib_s']:.0f}",
            cpu(r["cpu_s_per_gib"]["tierfs"]),
            cpu(r["cpu_s_per_gib"]["baseline"]),
        )
        for r in s["rows"]
    ]
    gcs = s["rows"][-1]
    raw = s["gcs_raw"]
    lines = [render_table(head, body)]
    lines += [
        "# times from starting `tierfs mount`: mount = it returned (namespace ready), TTFB = first 4 KiB of the "
        "first file read, full = restored.state \"done\"; ratio = baseline s / full s (1.0 = as fast as the baseline)",
        "# baselines: peer = plain sendfile -> recv_into+write socket copy 127.0.0.3 -> 127.0.0.2; GCS = "
        f"google-cloud-storage download_many_to_path, {GCS_WORKERS} threads, from the same emulator",
        "# CPU-s per GiB (medians), sender / receiver: peer = the peer serving the restore / the restoring daemon "
        "(its whole life until done, start-up included); GCS = the emulator / the restoring daemon; baselines: the "
        "plain copy's sender / receiver, the emulator / google-cloud-storage (this process)",
        "# ranks 1-2 committed steps of their own (the start restores a step every rank has): "
        + ", ".join(
            size_label(r["others_bytes"]) + " each beside the " + size_label(r["size"]) + " peer row"
            for r in s["rows"]
            if r["tier"] == "peer"
        ),
        f"# GCS figures less the start's survey ({GCS_RESTORE_WAIT} --restore-wait for the 2 silent peers + the "
        "manifest GET; "
        + (
            "daemon clock, survey start to restore start"
            if s["gcs_survey_from"] == "survey"
            else "the status names no survey start (a coordinated start): the wait alone"
        )
        + f"): median {s['gcs_survey_s']:.2f} s; raw: mount {raw['mount_s']:.2f}, "
        f"TTFB {raw['ttfb_s']:.2f}, full {raw['full_s']:.2f} s (the peer rows' survey: "
        + ", ".join(
            f"{size_label(int(n))} " + (f"{v:.2f} s" if v is not None else "n/a") for n, v in s["peer_survey_s"].items()
        )
        + ")",
        "# daemon's own restored.seconds (restore start to done), and when the restore started after `tierfs mount` "
        "was started (CLI and daemon start-up, survey, manifest): "
        + "; ".join(
            f"{row_name(r, args)} {r['restored_s']:.2f} s (ratio {r['ratio_daemon']:.2f}), started after "
            f"{r['start_to_restore_s']:.2f} s"
            for r in s["rows"]
        ),
        "# bytes came from (medians): "
        + "; ".join(
            f"{row_name(r, args)}: " + ", ".join(f"{k} {v:.0%}" for k, v in r["bytes_from"].items()) for r in s["rows"]
        ),
        "# CPU-s per GiB, every process watched (medians): "
        + "; ".join(
            f"{row_name(r, args)}: "
            + ", ".join(
                f"{w} {v:.2f}" for w, v in r["cpu_s_per_gib"]["tierfs"].items() if w not in ("sender", "receiver")
            )
            + f" (by the mount's return the daemon had used {r['daemon_at_mount_cpu_s']:.2f} CPU-s)"
            for r in s["rows"]
        ),
    ]
    for p, x in s["listing"].items():
        lines.append(
            f"listing {x['files']} files ({size_label(gcs['size'])}): {x['seconds']:.2f} s "
            f"(< 1 s: {'yes' if x['under_1s'] else 'NO'})"
            f"  [--prefetch {p}{' (no background fetches)' if p == '0' else ''}: restore began after "
            f"{x['start_to_restore_s']:.2f} s, mount returned after {x['mount_s']:.2f} s, walk+stat "
            f"{x['walk_s']:.2f} s; slowest round {x['max_s']:.2f} s]"
        )
    return "\n".join(lines)


def plot(path: str, s: dict, title: str, args) -> str | None:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, (ax, lx) = plt.subplots(
        1, 2, figsize=(4 + 2.2 * len(s["rows"]), 4.2), gridspec_kw={"width_ratios": [len(s["rows"]), 1]}
    )
    parts = (
        ("mount_s", "mount returned"),
        ("ttfb_s", "first 4 KiB"),
        ("full_s", "full restore"),
        ("baseline_s", "baseline copy"),
    )
    for k, (key, label) in enumerate(parts):
        bars = ax.bar(
            [i + (k - 1.5) * 0.2 for i in range(len(s["rows"]))], [r[key] for r in s["rows"]], 0.2, label=label
        )
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    top = max(r[key] for r in s["rows"] for key, _ in parts)
    for i, r in enumerate(s["rows"]):
        ax.annotate(f"ratio {r['ratio']:.2f}", (i, top * 1.1), ha="center", fontsize=8)
    ax.set_xticks(
        range(len(s["rows"])),
        [
            row_name(r, args).replace(", ", "\n")
            + "\n("
            + ("plain socket copy)" if r["tier"] == "peer" else "google-cloud-storage)")
            for r in s["rows"]
        ],
        fontsize=8,
    )
    ax.set(ylabel="seconds from `tierfs mount` (median)", ylim=(0, top * 1.4))
    ax.legend(fontsize=7, loc="upper center", ncol=4)
    items = sorted(s["listing"].items())
    bars = lx.bar(range(len(items)), [x["seconds"] for _, x in items], 0.6, color="tab:gray")
    lx.bar_label(bars, fmt="%.2f", fontsize=7)
    lx.axhline(1.0, color="tab:red", lw=0.8, ls="--")
    lx.set_xticks(range(len(items)), [f"prefetch {p}" for p, _ in items], fontsize=8)
    lx.set(
        ylabel="seconds",
        title=f"mount + list {items[0][1]['files']} files" if items else "listing",
        ylim=(0, max([1.1] + [x["seconds"] * 1.2 for _, x in items])),
    )
    lx.title.set_fontsize(8)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)
    return None


def main() -> int:
    p = argparse.ArgumentParser(
        description="Restore of a wiped node from a peer and from GCS against plain "
        "copies, and the listing of a restored step (medians of alternating "
        "rounds)."
    )
    p.add_argument(
        "--sizes",
        "--size",
        type=parse_sizes,
        help="rank 0's checkpoint bytes, comma-separated: a peer row per size; the smallest also gives "
        "the GCS row and the listing step's bytes (default 1G,4G)",
    )
    p.add_argument("--files", type=int, default=16, help="files per rank's checkpoint (default 16)")
    p.add_argument("--list-files", type=int, help="files of the listing step (default 1000)")
    p.add_argument("--rounds", type=int, help="rounds per size; medians are taken over them (default 5)")
    p.add_argument("--ramdisk", default="/dev/shm", help=RAMDISK_HELP)
    p.add_argument(
        "--warmup", type=parse_size, help="tmpfs warm-up before each measurement (default twice the size, at most 4G)"
    )
    p.add_argument(
        "--peer-tls",
        choices=("on", "off"),
        default="on",
        help="peer traffic: on (TLS 1.3, the product's default) or off (in clear)",
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke run: --sizes 64M,128M --rounds 2 --list-files 100 unless given"
    )
    p.add_argument("--json", metavar="PATH", help="write settings, raw per-round numbers and medians")
    p.add_argument("--plot", metavar="PATH.png", help="bars of the medians (needs matplotlib)")
    args = p.parse_args()
    args.sizes = args.sizes or ([64 * MiB, 128 * MiB] if args.quick else [GiB, 4 * GiB])
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.list_files = args.list_files or (100 if args.quick else 1000)
    if args.files < 1 or args.rounds < 1:
        p.error("--files and --rounds must be at least 1")
    args.sizes = sorted({n - n % (args.files * MiB) for n in args.sizes})  # whole MiB per file
    args.gcs_size = args.sizes[0]
    if args.gcs_size <= 0 or not 1 <= args.list_files <= args.gcs_size:
        p.error("every size must be at least --files MiB, --list-files between 1 and the smallest size in bytes")

    interrupt_on_signals()
    compile_bytecode()
    from tierfs_testing.gcs_emulator import GcsEmulator

    tmp = Path(tempfile.mkdtemp(prefix="bench-restore-", dir="/tmp"))
    args.shm = tempfile.mkdtemp(prefix="bench-restore-data-", dir=args.ramdisk)
    emu, bench = GcsEmulator(tmp / "emulator", backend="memory"), None
    try:
        emu.start()
        os.environ.update(emu.environ(), TIERFS_RUNTIME_DIR=str(tmp / "run"))  # for the daemons too
        bench = Bench(args, emu, gcs_client())
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        cmd = shlex.join([sys.executable, *sys.argv])
        settings = {
            "sizes": args.sizes,
            "gcs_size": args.gcs_size,
            "files": args.files,
            "list_files": args.list_files,
            "rounds": args.rounds,
            "warmup": args.warmup or "min(2x size, 4 GiB)",
            "peer_tls": args.peer_tls,
            "gcs_workers": GCS_WORKERS,
            "gcs_restore_wait": GCS_RESTORE_WAIT,
            "cores": os.cpu_count(),
            "kernel": os.uname().release,
            "date": now,
            "command": cmd,
        }
        gcs = size_label(args.gcs_size)
        print(
            f"# bench_restore {now}  {settings['cores']} cores  command: {cmd}\n"
            f"# rank 0: {', '.join(map(size_label, args.sizes))} in {args.files} files, 3 ranks, replicas=1, "
            f"--peer-tls {args.peer_tls}; at {gcs} --gcs on fake-gcs-server (memory backend), every rank {gcs}, "
            f"default chunk size and prefetch; listing: {args.list_files} files, {gcs}; {args.rounds} rounds "
            "per size, medians",
            flush=True,
        )
        lc, list_bucket, expected = bench.listing_setup()
        raw: dict[int, list[dict]] = {}
        listing = []
        for size in args.sizes:
            for rnd in range(args.rounds):
                raw.setdefault(size, []).append(bench.round(rnd, size, gcs=size == args.gcs_size))
                if size != args.gcs_size:
                    continue
                for prefetch in (0, 8) if rnd % 2 == 0 else (8, 0):
                    listing.append(x := bench.listing(lc, expected, prefetch) | {"round": rnd})
                    progress(
                        f"round {rnd + 1} listing, --prefetch {prefetch}: {x['files']} files in "
                        f"{x['seconds']:.2f} s (mount {x['mount_s']:.2f} s + walk {x['walk_s']:.2f} s)"
                    )
            if size == args.gcs_size:
                bench.close(lc)
                bench.drop(list_bucket)
        summary = summarize(raw, listing, args.gcs_size)
        print(render(summary, args))
        if args.json:
            write_json(
                args.json,
                {
                    "settings": settings,
                    "raw": {str(k): v for k, v in raw.items()},
                    "listing": listing,
                    "medians": summary,
                },
            )
        if args.plot:
            why = plot(
                args.plot,
                summary,
                f"tierfs restore, rank 0 {' / '.join(map(size_label, args.sizes))}, {args.rounds} rounds, {now[:10]}",
                args,
            )
            print(f"# plot skipped: {why}" if why else f"# wrote {args.plot}")
        return 0
    except KeyboardInterrupt:
        print("bench_restore: interrupted; cleaning up", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 (the script's top: a daemon's UserError, the emulator, GCS: one line)
        known = isinstance(e, (BenchError, AssertionError, OSError, subprocess.TimeoutExpired))
        kept = keep_logs(tmp / "run", "bench-restore")
        print(
            f"bench_restore: error: {'' if known else type(e).__name__ + ': '}{one_line(e)}"
            + (f" (daemon logs kept in {kept})" if kept else ""),
            file=sys.stderr,
        )
        return 1
    finally:  # no more Ctrl-C: a half-done cleanup would leave daemons and mounts behind
        with no_interruptions():
            for c in list(bench.clusters if bench else []):
                bench.close(c)
            for name in list(bench.buckets if bench else []):
                bench.drop(name)
            emu.stop()
            shutil.rmtree(args.shm, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
