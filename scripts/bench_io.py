#!/usr/bin/env python3
"""I/O benchmark: both data paths of a tierfs volume against plain tmpfs, in one run.

Three sides are measured round after round: a plain directory under /dev/shm (``tmpfs``),
a volume mounted with ``--data-path passthrough`` (the kernel reads, writes and maps the
RAM-tier file itself) and one mounted with ``--data-path daemon`` (every byte through the
daemon), their RAM tiers also under /dev/shm. Every number is reported as a ratio to tmpfs
measured in the same run.

Rows (defaults):

- fio sequential write, then read, of one file per job: 1, 4 and 8 jobs (``numjobs``, the
  total size split over them), 1 MiB and 4 MiB blocks, two ways of moving the bytes:
  ``psync`` (read(2)/write(2) from page-aligned buffers, ``--iomem_align=4096``) and
  ``mmap`` (``--ioengine=mmap``: the file is mapped shared and copied to or from). Writes
  end with an fsync (``--end_fsync=1``), inside fio's timing, so a side cannot finish early
  by leaving dirty pages behind; on tmpfs and with passthrough it costs nothing.
- the same read again, cold: the file's cached pages dropped first
  (``posix_fadvise(POSIX_FADV_DONTNEED)``, before the timing), as a restoring job reads a
  checkpoint that is not in the page cache. On tmpfs and with passthrough there is nothing
  to drop; on the daemon path (and a FUSE ``--reference``) every byte then crosses the daemon.
  fio's own ``--invalidate=1`` would drop them inside its timing, charging the FUSE sides
  with the kernel freeing the pages the write left (about 40 ms per 512 MiB here), which a
  job reading after a restart does not pay.
- the same writes into a preallocated file (``--fallocate=native``, fio's default: before
  its timing fio extends the file with ``fallocate(fd, 0, 0, size)``, so tmpfs allocates
  the pages up front and the timed writes only copy); the rows above use
  ``--fallocate=none``, where every write allocates its pages. A preallocated file is
  written only (its read is the read above), then deleted. ``--fallocate none`` leaves
  these rows out.
- a 1,000-file checkpoint, in Python, the same code on every side: create ``<step>.tmp``,
  create 1,000 files (``O_WRONLY|O_CREAT|O_TRUNC``, as ``open(..., "wb")``), write 1 MiB
  into each from a page-aligned buffer, close each, then rename the directory to
  ``<step>``: the commit, as Orbax makes it (on the volume the rename commits a step, which
  freezes it). Timed from the first create (the mkdir) until the rename has returned.

The method follows the design brief's "Facts of this machine": this VM's memory balloon
hands freed pages back to the host and makes naive A/B runs lie by up to 4x, so

- before each timed part a 2 GiB warm-up file is written on tmpfs and deleted right
  before the part starts (a segment written through a mount's page cache touches page-cache
  pages and RAM-tier pages, twice its size; the balloon hands freed pages back ~2 s after
  they are freed, so a file is timed in segments of at most ``--segment``, each right after
  its own warm-up);
- each test file is deleted right after its measurement (after the read of it);
- the order of the three sides changes from row to row and round to round (all six
  orders in turn), so no side is always first;
- every number is the median of >= 5 rounds (``--rounds``); ratios are taken between the
  medians of this run, never across runs.

Each daemon's CPU time (utime+stime of /proc/PID/stat) is read around its measurements and
reported as CPU-seconds per GiB moved (median).

Run it when the machine is quiet::

    .venv/bin/python scripts/bench_io.py --json scripts/results/bench-io.json --plot docs/bench-io.png
    .venv/bin/python scripts/bench_io.py --quick         # smoke test: 128M, 2 rounds, 200 files
    .venv/bin/python scripts/bench_io.py --files-only --data-paths passthrough  # the checkpoint row alone
    .venv/bin/python scripts/bench_io.py --modes psync --bs 1M --jobs 1,4 --files 0 --size 1G \
        --segment 1G          # plain and preallocated 1 GiB writes, as fio writes them by default
    .venv/bin/python scripts/bench_io.py --replot scripts/results/bench-io.json --plot out.png

The default run (512 MiB per measurement, 5 rounds) takes about 21 minutes on 2 cores, most
of it in the warm-ups (about 16 with ``--fallocate none``, which leaves the preallocated
writes out).
tierfs runs as ``python -m tierfs`` with this checkout's ``src`` first on PYTHONPATH, fio as
a subprocess; matplotlib only for ``--plot``. Everything it creates lives under
/dev/shm/bench-io-* and /tmp/bench-io-* and is removed (and the mounts unmounted) on exit,
also on errors and Ctrl-C.

``--metrics`` mounts the volumes with ``--metrics`` and scrapes each endpoint every second
while measuring, as Prometheus would; ``--before CHECKOUT`` adds a volume per data path
served by another checkout's code (``<path>-before``), measured in the same rounds, and
prints each row's ratio to it. Together they measure what metrics cost::

    git worktree add /tmp/tierfs-before <an earlier commit>
    .venv/bin/python scripts/bench_io.py --metrics --before /tmp/tierfs-before --data-paths daemon \
        --modes psync --bs 1M --jobs 1 --fallocate none --rounds 7

``--reference NAME=DIR`` adds a side: a directory on any other file system, measured like
the others (e.g. libfuse's C ``passthrough_hp`` example, built by
``scripts/libfuse_reference.sh``, to see what a FUSE daemon written in C gets on this
kernel and machine).

``--engine builtin`` replaces fio by a Python loop of os.write/os.readv (writes open with
O_WRONLY, which the daemon path serves with direct I/O; fio opens with O_RDWR, which it
serves through the page cache), for the psync rows only. fio's default malloc'd buffer sits
16 bytes into a page, where a copy runs ~4x slower on this machine's AMD EPYC;
``--malloc-buffers`` measures with such buffers instead of page-aligned ones.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import mmap
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from benchlib import (
    NO_MATPLOTLIB,
    BenchError,
    TierfsMount,
    clean_up,
    cpu_idle,
    interrupt_on_signals,
    last_line,
    parse_size,
    progress,
    pyplot,
    save_figure,
    warm_up,
    write_all,
    write_json,
)  # (scripts/ is on sys.path)
from tierfs_testing import free_port

GiB = 1 << 30
MiB = 1 << 20
VOLUMES = ("passthrough", "daemon")  # the data paths, each a volume of its own
SIDES = ("tmpfs", *VOLUMES)
# The reads: "read" right after the write, of what the write left in each side's page cache
# (fio --invalidate=0); "cold" again, after the file's cached pages were dropped (before the
# timing: drop_cached), as a job reads a checkpoint that a daemon restart, another node, or
# memory pressure took out of the page cache.
OPS = ("write", "read", "cold")
FIO_RW = {"write": "write", "read": "read", "cold": "read"}
MODES = ("psync", "mmap")
# fio's --fallocate: "none" (the writes allocate) and "native" (fio's default: preallocated).
FALLOCATE = ("none", "native")
FILES_ROW = "files"
# What each row should reach with passthrough, as a fraction of tmpfs.
TARGET_IO, TARGET_FILES = 0.9, 0.5
# What the daemon path should reach: a fraction of tmpfs on the large-I/O rows, and of every
# --reference (libfuse's C passthrough_hp) on every row.
DAEMON_TARGET_IO, DAEMON_TARGET_REFERENCE = 0.5, 1.0


# ----------------------------------------------------------------------------- helpers


def parse_size_list(text: str) -> list[int]:
    return [parse_size(t) for t in text.split(",") if t.strip()]


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: use e.g. 1,4,8") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: numbers must be > 0")
    return values


def parse_choices(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = [t.strip() for t in text.split(",") if t.strip()]
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"invalid list {text!r}: choose from {','.join(allowed)}")
        return values

    return parse


def parse_reference(text: str) -> tuple[str, str]:
    name, sep, directory = text.partition("=")
    name = name.strip()
    if not sep or not name or not directory:
        raise argparse.ArgumentTypeError(f"invalid reference {text!r}: expected NAME=DIR")
    if name in SIDES or "_" in name or name == "warm":
        raise argparse.ArgumentTypeError(
            f"invalid reference name {name!r}: not one of {', '.join(SIDES)}, no underscore"
        )
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"reference {name}: {directory} is not a directory")
    return name, os.path.abspath(directory)


def fmt_size(n: int) -> str:
    for unit, mult in (("G", GiB), ("M", MiB), ("K", 1024)):
        if n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def aligned_buffer(size: int, offset: int = 0) -> memoryview:
    """A buffer of random bytes ``offset`` bytes into a fresh page-aligned mapping."""
    m = mmap.mmap(-1, size + offset + mmap.PAGESIZE)
    chunk = os.urandom(min(size, MiB))
    for pos in range(0, size, len(chunk)):
        m[offset + pos : offset + min(size, pos + len(chunk))] = chunk[: min(size, pos + len(chunk)) - pos]
    return memoryview(m)[offset : offset + size]


def drop_cached(paths: list[str], offset: int, length: int) -> None:
    """Drop the page cache's copy of ``length`` bytes at ``offset`` of each file, as memory
    pressure or a restart would (on tmpfs and with passthrough there is none to drop)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def row_key(r: dict) -> tuple:
    return (r["mode"], r["op"], r["bs"], r["jobs"], r.get("fallocate", "none"))


def row_label(r: dict, short: bool = False) -> str:
    if r["mode"] == FILES_ROW:
        return (
            f"{r['files']} files\n{fmt_size(r['bs'])} each"
            if short
            else f"checkpoint: {r['files']} files x {fmt_size(r['bs'])}, rename"
        )
    jobs = f"{r['jobs']} job{'s' if r['jobs'] > 1 else ''}"
    prealloc = r.get("fallocate", "none") != "none"
    if short:
        return f"{r['mode']}\n{r['op']}{' pre' if prealloc else ''}\n{fmt_size(r['bs'])} {r['jobs']}j"
    op = "read" if r["op"] == "cold" else r["op"]
    return (
        f"{r['mode']} {op} {fmt_size(r['bs'])}, {jobs}{', preallocated' if prealloc else ''}"
        f"{', cold' if r['op'] == 'cold' else ''}"
    )


# ----------------------------------------------------------------------------- engines


class FioEngine:
    name = "fio"

    def __init__(self, fio: str, malloc_buffers: bool = False):
        self.fio = fio
        self.align_args = [] if malloc_buffers else ["--iomem_align=4096"]
        out = subprocess.run([fio, "--version"], capture_output=True, text=True)
        self.version = out.stdout.strip() or "fio"

    def files(self, directory: str, tag: str, jobs: int) -> list[str]:
        return [os.path.join(directory, f"{tag}.{j}") for j in range(jobs)]

    def run(
        self,
        mode: str,
        op: str,
        directory: str,
        tag: str,
        bs: int,
        per_job: int,
        jobs: int,
        offset: int = 0,
        fallocate: str = "none",
    ) -> dict:
        cmd = [
            self.fio,
            f"--name={tag}",
            f"--directory={directory}",
            f"--filename_format={tag}.$jobnum",
            f"--ioengine={mode}",
            f"--rw={FIO_RW[op]}",
            f"--bs={bs}",
            f"--size={per_job}",
            f"--offset={offset}",
            f"--numjobs={jobs}",
            "--group_reporting",
            "--output-format=json",
            "--direct=0",
            *self.align_args,
            "--invalidate=0",  # a cold read's pages were dropped before the timing (drop_cached)
            f"--fallocate={fallocate}",  # none: each write allocates its pages; native: fio's default
            *(["--end_fsync=1"] if op == "write" else []),  # the bytes are in the file when timing ends
        ]
        try:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
            )
        except OSError as e:
            raise BenchError(f"cannot run fio: {e}") from None
        try:
            stdout, stderr = proc.communicate()
        except BaseException:
            # Interrupted: let fio stop its job processes (they run in their own sessions, so
            # a SIGKILL of the main one would leave them writing into the mount).
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            raise
        if proc.returncode != 0:
            why = last_line(stderr) or last_line(stdout) or f"exit status {proc.returncode}"
            raise BenchError(f"fio {mode} {op} bs={fmt_size(bs)} jobs={jobs} in {directory} failed: {why}")
        try:
            data = json.loads(stdout[stdout.index("{") :])
            res = data["jobs"][0][FIO_RW[op]]
            nbytes, runtime_ms = int(res["io_bytes"]), float(res["runtime"])
        except (ValueError, KeyError, IndexError) as e:
            raise BenchError(f"cannot parse fio's JSON output ({e}): {last_line(stdout)}") from None
        if nbytes != per_job * jobs:
            raise BenchError(f"fio {mode} {op} moved {nbytes} bytes, expected {per_job * jobs}")
        if runtime_ms <= 0:
            raise BenchError(f"fio {op} reported a runtime of {runtime_ms} ms: use a larger --size")
        return {"bytes": nbytes, "seconds": runtime_ms / 1000.0}


class BuiltinEngine:
    """os.write / os.readv loops over one preallocated buffer; one thread per file (psync rows only)."""

    name = "builtin"
    version = f"python {platform.python_version()}"

    def __init__(self, malloc_buffers: bool = False):
        self.offset = 16 if malloc_buffers else 0  # 16: where glibc's malloc puts large blocks
        self._buffers: dict[int, memoryview] = {}

    def _buf(self, bs: int) -> memoryview:
        if bs not in self._buffers:
            self._buffers[bs] = aligned_buffer(bs, self.offset)
        return self._buffers[bs]

    def files(self, directory: str, tag: str, jobs: int) -> list[str]:
        return [os.path.join(directory, f"{tag}.{j}") for j in range(jobs)]

    def run(
        self,
        mode: str,
        op: str,
        directory: str,
        tag: str,
        bs: int,
        per_job: int,
        jobs: int,
        offset: int = 0,
        fallocate: str = "none",
    ) -> dict:
        if mode != "psync":
            raise BenchError(f"--engine builtin measures only psync rows, not {mode}")
        buf = self._buf(bs)
        paths = self.files(directory, tag, jobs)
        stop = threading.Event()
        start = threading.Barrier(jobs + 1)
        errors: list[str] = []
        moved = [0] * jobs

        def worker(i: int) -> None:
            try:
                if op == "write":
                    fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | (0 if offset else os.O_TRUNC), 0o644)
                    if fallocate == "native":  # as fio lays the file out, before the timing
                        os.posix_fallocate(fd, 0, offset + per_job)
                else:
                    fd = os.open(paths[i], os.O_RDONLY)
                os.lseek(fd, offset, os.SEEK_SET)
            except OSError as e:
                errors.append(f"open {paths[i]}: {e}")
                start.abort()
                return
            try:
                start.wait()
                left = per_job
                rbuf = [buf]
                while left > 0 and not stop.is_set():
                    if op == "write":
                        n = os.write(fd, buf[: min(left, bs)])
                    else:
                        n = os.readv(fd, rbuf if left >= bs else [buf[:left]])
                        if n == 0:
                            raise OSError(f"unexpected end of file after {per_job - left} bytes")
                    left -= n
                    moved[i] += n
                if op == "write":
                    os.fsync(fd)  # as fio's --end_fsync
            except threading.BrokenBarrierError:
                pass
            except OSError as e:
                errors.append(f"{op} {paths[i]}: {e}")
            finally:
                os.close(fd)

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(jobs)]
        for t in threads:
            t.start()
        try:
            try:
                start.wait()
            except threading.BrokenBarrierError:
                pass
            t0 = time.perf_counter()
            for t in threads:
                t.join()
            seconds = time.perf_counter() - t0
        except BaseException:
            stop.set()
            for t in threads:
                t.join(timeout=10)
            raise
        if errors:
            raise BenchError(f"builtin {op} bs={fmt_size(bs)} jobs={jobs} failed: {errors[0]}")
        nbytes = sum(moved)
        if nbytes != per_job * jobs:
            raise BenchError(f"builtin {op} moved {nbytes} bytes, expected {per_job * jobs}")
        return {"bytes": nbytes, "seconds": seconds}


def checkpoint(directory: str, step: int, nfiles: int, file_size: int, buf: memoryview) -> dict:
    """Write a step of ``nfiles`` files as a checkpointing framework does, and commit it by
    renaming ``<step>.tmp`` to ``<step>``; timed from the mkdir until the rename returned."""
    tmp, final = os.path.join(directory, f"{step}.tmp"), os.path.join(directory, str(step))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    t0 = time.perf_counter()
    os.mkdir(tmp)
    for i in range(nfiles):
        fd = os.open(os.path.join(tmp, f"shard-{i:04d}"), flags, 0o644)
        try:
            for pos in range(0, file_size, len(buf)):
                write_all(fd, buf[: min(len(buf), file_size - pos)])
        finally:
            os.close(fd)
    os.rename(tmp, final)
    seconds = time.perf_counter() - t0
    got = sum(e.stat().st_size for e in os.scandir(final))
    if got != nfiles * file_size:
        raise BenchError(f"the checkpoint in {final} holds {got} bytes, expected {nfiles * file_size}")
    return {"bytes": nfiles * file_size, "seconds": seconds}


# ----------------------------------------------------------------------------- benchmark


class Run:
    """One run's sides, buffers and progress."""

    def __init__(self, args, engine, dirs: dict, mounts: dict, progress):
        self.args, self.engine, self.dirs, self.mounts, self.progress = args, engine, dirs, mounts, progress
        self.warm_buf = aligned_buffer(4 * MiB)
        self.warm_path = os.path.join(dirs["warm"], "warmup")
        self.file_buf = aligned_buffer(min(args.file_size, 4 * MiB))
        self.raw: list[dict] = []

    def sides(self) -> tuple[str, ...]:
        return ("tmpfs", *self.mounts, *(name for name, _ in self.args.reference))

    def configs(self) -> list[dict]:
        """What each round measures: every fio configuration (written, then read; preallocated
        and written), then the checkpoint."""
        configs = [
            {"mode": mode, "bs": bs, "jobs": jobs, "fallocate": fa}
            for mode in self.args.modes
            for bs in self.args.bs
            for jobs in self.args.jobs
            for fa in self.args.fallocate
        ]
        if self.args.files:
            configs.append(
                {"mode": FILES_ROW, "op": "write", "bs": self.args.file_size, "jobs": 1, "files": self.args.files}
            )
        return configs

    def rows(self) -> list[dict]:
        """The rows of the report: by mode, then operation, block size and jobs, a preallocated
        write right after its plain one; the checkpoint last."""
        rows = [
            {"mode": mode, "op": op, "bs": bs, "jobs": jobs, "fallocate": fa}
            for mode in self.args.modes
            for op in OPS
            for bs in self.args.bs
            for jobs in self.args.jobs
            for fa in self.args.fallocate
            if op == "write" or fa == "none"
        ]
        return rows + [c for c in self.configs() if c["mode"] == FILES_ROW]

    def _timed(self, side: str, fn) -> dict:
        """``fn()`` right after its own warm-up, with the side's daemon CPU counted."""
        warm_up(self.warm_path, self.args.warmup, self.warm_buf)
        mount = self.mounts.get(side)
        cpu0 = mount.daemon_cpu() if mount else None
        res = fn()
        if mount:
            res["daemon_cpu_s"] = mount.daemon_cpu() - cpu0
        return res

    def io(
        self, side: str, mode: str, op: str, tag: str, bs: int, per_job: int, jobs: int, fallocate: str = "none"
    ) -> dict:
        directory = self.dirs[side]
        if op != "write":  # the read must hit exactly the files just written
            for p in self.engine.files(directory, tag, jobs):
                try:
                    size = os.stat(p).st_size
                except OSError as e:
                    raise BenchError(f"the file to read is missing: {e}") from None
                if size != per_job:
                    raise BenchError(f"{p} holds {size} bytes after the write, expected {per_job}")
        res = {"bytes": 0, "seconds": 0.0, "segments": 0}
        seg = min(per_job, max(bs, self.args.segment // jobs // bs * bs))
        for offset in range(0, per_job, seg):
            if op == "cold":
                drop_cached(self.engine.files(directory, tag, jobs), offset, min(seg, per_job - offset))
            run = functools.partial(
                self.engine.run, mode, op, directory, tag, bs, min(seg, per_job - offset), jobs, offset, fallocate
            )
            part = self._timed(side, run)
            res["bytes"] += part["bytes"]
            res["seconds"] += part["seconds"]
            res["segments"] += 1
            if "daemon_cpu_s" in part:
                res["daemon_cpu_s"] = res.get("daemon_cpu_s", 0.0) + part["daemon_cpu_s"]
        return res

    def record(self, res: dict, **fields) -> None:
        res["gib_s"] = res["bytes"] / GiB / res["seconds"]
        if "daemon_cpu_s" in res:
            res["daemon_cpu_s_per_gib"] = res["daemon_cpu_s"] / (res["bytes"] / GiB)
        res.update(fields)
        self.raw.append(res)
        cpu = f", daemon {res['daemon_cpu_s_per_gib']:.2f} CPU-s/GiB" if "daemon_cpu_s_per_gib" in res else ""
        self.progress(
            f"[{len(self.raw)}/{self.total}] round {fields['round'] + 1} {fields['side']:11} "
            f"{row_label(fields)}: {res['gib_s']:.3f} GiB/s{cpu}"
        )

    def run(self) -> list[dict]:
        args = self.args
        configs, sides = self.configs(), self.sides()
        orders = list(itertools.permutations(sides))
        self.total = args.rounds * len(sides) * len(self.rows())
        for rnd in range(args.rounds):
            for k, row in enumerate(configs):
                order = orders[(rnd + k) % len(orders)]  # every order in turn, across rows and rounds
                for pos, side in enumerate(order):
                    if row["mode"] == FILES_ROW:
                        self._files_row(rnd, pos, side, row)
                    else:
                        self._io_rows(rnd, pos, side, row)
        return self.raw

    def _io_rows(self, rnd: int, pos: int, side: str, row: dict) -> None:
        mode, bs, jobs, fa = row["mode"], row["bs"], row["jobs"], row["fallocate"]
        per_job = (self.args.size // jobs) // bs * bs
        if per_job <= 0:
            raise BenchError(f"--size {fmt_size(self.args.size)} is too small for bs={fmt_size(bs)} jobs={jobs}")
        tag = f"bench-r{rnd}-{mode}-bs{fmt_size(bs)}-j{jobs}-{fa}"
        try:
            # the file is read right after it is written, then deleted; a preallocated one is
            # only written (its read would be the same read)
            for op in OPS if fa == "none" else ("write",):
                res = self.io(side, mode, op, tag, bs, per_job, jobs, fa)
                self.record(res, round=rnd, side=side, position=pos, mode=mode, op=op, bs=bs, jobs=jobs, fallocate=fa)
        finally:  # right after its measurement, or on any failure
            for p in self.engine.files(self.dirs[side], tag, jobs):
                remove(p)

    def _files_row(self, rnd: int, pos: int, side: str, row: dict) -> None:
        step = 100 + rnd  # a new step every round, as a training job commits them
        directory = self.dirs[side]
        try:
            res = self._timed(side, lambda: checkpoint(directory, step, row["files"], row["bs"], self.file_buf))
            self.record(res, round=rnd, side=side, position=pos, **row)
        finally:
            for name in (f"{step}.tmp", str(step)):
                remove(os.path.join(directory, name))


def summarize(rows_wanted: list[dict], raw: list[dict], sides: tuple[str, ...]) -> list[dict]:
    rows = []
    for want in rows_wanted:
        sel = [r for r in raw if row_key(r) == row_key(want)]
        row = dict(want)
        med = {}
        for side in sides:
            vals = [r["gib_s"] for r in sel if r["side"] == side]
            med[side] = statistics.median(vals) if vals else None
            row[f"{side}_gib_s"] = med[side]
            row[f"{side}_rounds"] = len(vals)
        for side in sides[1:]:
            row[f"{side}_ratio"] = med[side] / med["tmpfs"] if med["tmpfs"] and med[side] is not None else None
            cpu = [r["daemon_cpu_s_per_gib"] for r in sel if r["side"] == side and "daemon_cpu_s_per_gib" in r]
            row[f"{side}_cpu_s_per_gib"] = statistics.median(cpu) if cpu else None
        row["target"] = TARGET_FILES if want["mode"] == FILES_ROW else TARGET_IO
        pt = row.get("passthrough_ratio")
        row["meets_target"] = None if pt is None else pt >= row["target"]
        references = [s for s in sides[1:] if s not in VOLUMES]
        for ref in references:
            row[f"daemon_vs_{ref}"] = med["daemon"] / med[ref] if med.get("daemon") is not None and med[ref] else None
        if med.get("daemon") is not None:
            checks = [
                row[f"daemon_vs_{ref}"] >= DAEMON_TARGET_REFERENCE
                for ref in references
                if row[f"daemon_vs_{ref}"] is not None
            ]
            if want["mode"] != FILES_ROW:
                checks.append(row["daemon_ratio"] >= DAEMON_TARGET_IO)
            row["daemon_meets_target"] = all(checks)
        rows.append(row)
    return rows


def compared(rows: list[dict]) -> list[str]:
    """The sides measured against tmpfs, in the run's order."""
    return [k[: -len("_ratio")] for k in rows[0] if k.endswith("_ratio")] if rows else []


def render_table(rows: list[dict]) -> str:
    """A Markdown table of the medians: GiB/s per side, ratios to tmpfs, daemon CPU per GiB."""
    vols = compared(rows)
    daemons = [v for v in vols if v in VOLUMES]
    head = ["row", "tmpfs GiB/s"]
    for v in vols:
        head += [f"{v} GiB/s", f"{v} ratio"]
    refs = [k[len("daemon_vs_") :] for k in (rows[0] if rows else {}) if k.startswith("daemon_vs_")]
    head += [f"{v} CPU s/GiB" for v in daemons] + ["target", "met"]
    if "daemon" in vols:
        head += [f"daemon/{ref}" for ref in refs] + ["daemon met"]

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    body = []
    for r in rows:
        cells = [row_label(r), f(r.get("tmpfs_gib_s"), ".3f")]
        for v in vols:
            cells += [f(r.get(f"{v}_gib_s"), ".3f"), f(r.get(f"{v}_ratio"), ".2f")]
        cells += [f(r.get(f"{v}_cpu_s_per_gib"), ".2f") for v in daemons]
        cells += [f">= {r['target']:.1f}", {True: "yes", False: "**no**", None: "-"}[r.get("meets_target")]]
        if "daemon" in vols:
            cells += [f(r.get(f"daemon_vs_{ref}"), ".2f") for ref in refs]
            cells.append({True: "yes", False: "**no**", None: "-"}[r.get("daemon_meets_target")])
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


def render_before(rows: list[dict], paths: list[str]) -> str:
    """Each volume against the same path served by ``--before``'s code, measured in the same rounds."""
    out = []
    for r in rows:
        for path in paths:
            now, then = r.get(f"{path}_gib_s"), r.get(f"{path}-before_gib_s")
            cpu_now, cpu_then = r.get(f"{path}_cpu_s_per_gib"), r.get(f"{path}-before_cpu_s_per_gib")
            if now and then:
                cpu = f", daemon CPU {cpu_now / cpu_then:.3f}x" if cpu_now and cpu_then else ""
                out.append(f"# {row_label(r)} {path}: {now / then:.3f}x the throughput of --before{cpu}")
    return "\n".join(out)


class Scraper:
    """Scrapes every endpoint each second from a thread of its own, as Prometheus would, for as
    long as the ``with`` block lasts; what the metrics cost shows in the sides' numbers."""

    def __init__(self, urls: list[str]):
        self.urls, self.done, self.failed = urls, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scraper", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for url in self.urls:
                try:
                    with urllib.request.urlopen(url, timeout=5) as r:
                        r.read()
                    self.done += 1
                except OSError:
                    self.failed += 1

    def __enter__(self) -> Scraper:
        if self.urls:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.failed:
            raise BenchError(f"{self.failed} scrapes of {', '.join(self.urls)} failed")


def before_src(checkout: str) -> str:
    src = os.path.join(os.path.abspath(checkout), "src")
    if not os.path.isfile(os.path.join(src, "tierfs", "__init__.py")):
        raise BenchError(f"--before {checkout}: no tierfs checkout there (no src/tierfs)")
    return src


def plot(path: str, rows: list[dict], title: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    vols = [v for v in compared(rows) if any(r.get(f"{v}_ratio") is not None for r in rows)]
    width = 0.8 / max(1, len(vols))
    fig, ax = plt.subplots(figsize=(max(8, 0.62 * len(rows) + 2), 4.8))
    colors = {"passthrough": "tab:blue", "daemon": "tab:orange"}
    others = iter(("tab:grey", "tab:brown", "tab:olive", "tab:cyan"))
    for k, v in enumerate(vols):
        ys = [r.get(f"{v}_ratio") or 0.0 for r in rows]
        xs = [i + (k - (len(vols) - 1) / 2) * width for i in range(len(rows))]
        label = f"--data-path {v}" if v in VOLUMES else v
        bars = ax.bar(xs, ys, width, label=label, color=colors.get(v) or next(others, None))
        for b, y in zip(bars, ys, strict=True):
            ax.annotate(
                f"{y:.2f}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=6, rotation=90
            )
    ax.axhline(TARGET_IO, color="green", linewidth=0.9, linestyle="--", label=f"{TARGET_IO}x target (large I/O)")
    files = [i for i, r in enumerate(rows) if r["mode"] == FILES_ROW]
    for i in files:
        ax.hlines(
            TARGET_FILES,
            i - 0.45,
            i + 0.45,
            color="purple",
            linewidth=1.2,
            linestyle=":",
            label=f"{TARGET_FILES}x target (files)",
        )
    ax.axhline(1.0, color="grey", linewidth=0.6)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([row_label(r, short=True) for r in rows], fontsize=7)
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_ylim(0, max(1.25, max((r.get(f"{v}_ratio") or 0) for r in rows for v in vols) + 0.2))
    ax.set_ylabel("volume / tmpfs (median throughput)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper right", ncol=2)
    save_figure(fig, path)
    return None


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Throughput of tierfs' passthrough and daemon data paths against plain tmpfs "
        "(medians of rotating rounds, balloon-safe warm-up)."
    )
    p.add_argument("--size", type=parse_size, help="bytes per I/O measurement, split over the jobs (default 512M)")
    p.add_argument("--rounds", type=int, help="rounds; medians are taken over them (default 5, >= 5 for real numbers)")
    p.add_argument("--bs", type=parse_size_list, default=[MiB, 4 * MiB], help="block sizes (default 1M,4M)")
    p.add_argument(
        "--jobs",
        type=parse_int_list,
        default=[1, 4, 8],
        help="fio jobs in parallel, each with its own file (default 1,4,8)",
    )
    p.add_argument(
        "--modes",
        type=parse_choices(MODES),
        default=list(MODES),
        help="psync (read/write from page-aligned buffers) and/or mmap (default psync,mmap)",
    )
    p.add_argument(
        "--fallocate",
        type=parse_choices(FALLOCATE),
        default=list(FALLOCATE),
        help="fio --fallocate of the writes: none (each write allocates) and/or native "
        "(fio's default: the file preallocated before the timing; write rows only) "
        "(default none,native)",
    )
    p.add_argument(
        "--data-paths",
        type=parse_choices(VOLUMES),
        default=list(VOLUMES),
        help="volumes to measure against tmpfs (default passthrough,daemon)",
    )
    p.add_argument("--files", type=int, help="files of the checkpoint row; 0 leaves it out (default 1000)")
    p.add_argument(
        "--file-size", type=parse_size, default=MiB, help="bytes per file of the checkpoint row (default 1M)"
    )
    p.add_argument("--files-only", action="store_true", help="measure the checkpoint row alone (no fio rows)")
    p.add_argument(
        "--warmup",
        type=parse_size,
        default=2 * GiB,
        help="warm-up file written and deleted on tmpfs before each timed part (default 2G: "
        "a segment written through a page cache touches twice its size)",
    )
    p.add_argument(
        "--warm-dir",
        default="/dev/shm",
        help="where the warm-up writes (default /dev/shm); a tmpfs mounted huge=within_size warms the "
        "memory large folios are taken from as well, which sides with large folios need",
    )
    p.add_argument(
        "--segment",
        type=parse_size,
        default=512 * MiB,
        help="bytes moved per timed segment, each after its own warm-up (default 512M; "
        "the balloon returns freed pages to the host ~2 s after they are freed)",
    )
    p.add_argument(
        "--engine",
        choices=("auto", "fio", "builtin"),
        default="auto",
        help="fio, the built-in Python loop (psync rows only), or auto (fio if installed; default)",
    )
    p.add_argument(
        "--malloc-buffers",
        action="store_true",
        help="use 16-byte-aligned I/O buffers (fio's default) instead of page-aligned ones",
    )
    p.add_argument(
        "--reference",
        type=parse_reference,
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="also measure DIR, a directory on another file system, as side NAME "
        "(e.g. a libfuse passthrough_hp mount; repeatable)",
    )
    p.add_argument("--capacity", help="passed to both volumes' tierfs mount --capacity")
    p.add_argument(
        "--metrics",
        action="store_true",
        help="mount the volumes with --metrics and scrape each endpoint every second while measuring",
    )
    p.add_argument(
        "--before",
        metavar="CHECKOUT",
        help="another checkout of tierfs (e.g. a git worktree of an earlier commit): its code serves "
        "one more volume per data path, '<path>-before', measured in the same rounds",
    )
    p.add_argument("--replot", metavar="JSON", help="re-render the table and --plot of a saved --json run")
    p.add_argument("--quick", action="store_true", help="smoke run: --size 128M --rounds 2 --files 200 unless given")
    p.add_argument("--json", metavar="PATH", help="write settings, raw per-round numbers and medians")
    p.add_argument("--plot", metavar="PATH.png", help="grouped bars of the ratios (needs matplotlib)")
    return p


def plot_title(settings: dict, date: str) -> str:
    return (
        f"volume/tmpfs, {settings['engine']}, {fmt_size(settings['size'])} per I/O row, "
        f"medians of {settings['rounds']} rounds, {date[:10]}"
    )


def replot(json_path: str, plot_path: str | None) -> int:
    """Print the table (and draw the plot) of a saved ``--json`` run without measuring."""
    with open(json_path) as f:
        saved = json.load(f)
    print(f"# bench_io {saved['header']['date']}  command: {saved['header']['command']}")
    print(render_table(saved["medians"]))
    if plot_path:
        why = plot(plot_path, saved["medians"], plot_title(saved["settings"], saved["header"]["date"]))
        print(f"# plot skipped: {why}" if why else f"# wrote {plot_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.replot:
        return replot(args.replot, args.plot)
    if args.size is None:
        args.size = 128 * MiB if args.quick else 512 * MiB
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.files is None:
        args.files = 200 if args.quick else 1000
    if args.rounds < 1 or args.files < 0:
        print("bench_io: error: --rounds must be >= 1 and --files >= 0", file=sys.stderr)
        return 2
    if args.files_only:
        if not args.files:
            print("bench_io: error: --files-only needs --files > 0", file=sys.stderr)
            return 2
        args.modes = []
    names = [name for name, _ in args.reference]
    if len(set(names)) != len(names):
        print(f"bench_io: error: --reference names must differ: {', '.join(names)}", file=sys.stderr)
        return 2

    # SIGTERM/SIGHUP take the same path as Ctrl-C, so the finally blocks run; SIGINT too
    # when started in the background (where the shell has it ignored).
    interrupt_on_signals()

    created: list[str] = []
    mounts: dict[str, TierfsMount] = {}
    try:
        if args.engine in ("auto", "fio") and shutil.which("fio"):
            engine = FioEngine(shutil.which("fio"), args.malloc_buffers)
        elif args.engine == "fio":
            raise BenchError("--engine fio: fio is not installed (use --engine builtin)")
        else:
            engine = BuiltinEngine(args.malloc_buffers)
            if "mmap" in args.modes:
                raise BenchError("--engine builtin measures psync rows only: add --modes psync")

        st = os.statvfs("/dev/shm")
        files_bytes = args.files * args.file_size
        # the I/O files, the warm-up, and each volume's newest committed step (kept in RAM)
        need = max(args.size, files_bytes) + args.warmup + len(args.data_paths) * files_bytes + 256 * MiB
        if st.f_bavail * st.f_frsize < need:
            raise BenchError(
                f"/dev/shm has {st.f_bavail * st.f_frsize / GiB:.1f} GiB free, the run needs {need / GiB:.1f} GiB"
            )

        def mkdtemp(prefix: str, where: str) -> str:
            path = tempfile.mkdtemp(prefix=prefix, dir=where)
            created.append(path)
            return path

        tmp_root = mkdtemp("bench-io-", "/tmp")
        runtime = mkdtemp("bench-io-run-", "/dev/shm")  # a daemon registry of our own
        dirs = {"tmpfs": mkdtemp("bench-io-tmpfs-", "/dev/shm"), "warm": mkdtemp("bench-io-warm-", args.warm_dir)}
        for path in args.data_paths:
            mountpoint = os.path.join(tmp_root, path)
            os.mkdir(mountpoint)
            ramdisk = mkdtemp(f"bench-io-ram-{path}-", "/dev/shm")
            metered = ("--metrics", f"127.0.0.1:{free_port()}") if args.metrics else ()
            mounts[path] = TierfsMount(
                mountpoint, ramdisk, runtime, data_path=path, job=f"bench-{path}", capacity=args.capacity, extra=metered
            )
            dirs[path] = mountpoint
        for path in args.data_paths if args.before else ():
            side = f"{path}-before"
            mountpoint = os.path.join(tmp_root, side)
            os.mkdir(mountpoint)
            mounts[side] = TierfsMount(
                mountpoint,
                mkdtemp(f"bench-io-ram-{side}-", "/dev/shm"),
                runtime,
                data_path=path,
                job=f"bench-{side}",
                capacity=args.capacity,
                src=before_src(args.before),
            )
            dirs[side] = mountpoint
        dirs.update(args.reference)

        cmdline = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        header = {
            "date": now,
            "kernel": platform.release(),
            "cores": os.cpu_count(),
            "cpuidle": cpu_idle(),
            "command": cmdline,
        }
        print(
            f"# bench_io {now}  kernel {header['kernel']}  cores {header['cores']}  cpuidle {header['cpuidle']}  "
            f"command: {cmdline}"
        )
        settings = {
            "engine": engine.name,
            "engine_version": engine.version,
            "size": args.size,
            "rounds": args.rounds,
            "bs": args.bs,
            "jobs": args.jobs,
            "modes": args.modes,
            "fallocate": args.fallocate,
            "data_paths": args.data_paths,
            "references": dict(args.reference),
            "files": args.files,
            "file_size": args.file_size,
            "warmup": args.warmup,
            "segment": args.segment,
            "buffers": "malloc (16-byte aligned)" if args.malloc_buffers else "page-aligned",
            "dirs": dirs,
            "capacity": args.capacity,
        }
        print(
            f"# engine {engine.version}, {settings['buffers']} buffers, {fmt_size(args.size)} per I/O measurement, "
            f"{args.files} x {fmt_size(args.file_size)} checkpoint, {args.rounds} rounds, each timed part after a "
            f"{fmt_size(args.warmup)} warm-up; medians; ratio = volume/tmpfs",
            flush=True,
        )

        for path, mount in mounts.items():
            mount.mount()
            settings[f"{path}_daemon_pid"] = mount.pid
            progress(
                f"mounted {mount.mountpoint} with --data-path {mount.data_path} (daemon pid {mount.pid}, "
                f"engine {mount.status['fuse']['engine']})"
            )

        started = time.monotonic()
        run = Run(args, engine, dirs, mounts, progress)
        with Scraper([m.status["metrics"] for m in mounts.values() if m.status.get("metrics")]) as scraper:
            raw = run.run()
        settings["elapsed_s"] = round(time.monotonic() - started, 1)
        settings["scrapes"] = scraper.done
        if args.files:  # the renames committed steps on the volumes, as Orbax's do
            for path, mount in mounts.items():
                steps = [s["step"] for s in mount.read_status().get("steps", [])]
                settings[f"{path}_committed_steps"] = steps
                if 100 + args.rounds - 1 not in steps:
                    raise BenchError(
                        f"the checkpoint's rename did not commit a step on the {path} volume (steps held: {steps})"
                    )
        rows = summarize(run.rows(), raw, run.sides())

        print(render_table(rows))
        if args.before:
            print(render_before(rows, args.data_paths))
        if args.rounds < 5:
            print(f"# note: only {args.rounds} rounds; use >= 5 for numbers to keep")
        if args.json:
            write_json(args.json, {"header": header, "settings": settings, "raw": raw, "medians": rows})
        if args.plot:
            why = plot(args.plot, rows, plot_title(settings, now))
            print(f"# plot skipped: {why}" if why else f"# wrote {args.plot}")
        return 0
    except BenchError as e:
        print(f"bench_io: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_io: interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        clean_up("bench_io", list(mounts.values()), created)


if __name__ == "__main__":
    sys.exit(main())
