#!/usr/bin/env python3
"""Sequential I/O benchmark: a tierfs mount against a plain tmpfs directory.

Writes and then reads large files with 1 MiB and 4 MiB blocks, with 1 and 4 writers
(the total size stays the same), on (a) a plain directory under /dev/shm and (b) a tierfs
mount whose RAM tier is also under /dev/shm. It uses fio when installed (psync, buffered
I/O), else a built-in Python writer/reader (``--engine builtin``).

The method follows docs "Facts of this machine": this VM's memory balloon hands pages back
to the host and makes naive A/B runs lie by up to 4x, so

- each file is moved in timed segments (512 MiB by default); before EACH segment a warm-up
  file (2 GiB) is written on the tmpfs and deleted right before the segment starts. The
  balloon hands freed pages back to the host ~2 s after they are freed, so a whole 2 GiB
  measurement after one warm-up would put the slower side on cold pages. The warm-up must
  cover the larger footprint: a segment written into the mount through the page cache
  fills page-cache pages and the RAM tier's pages, twice its size (with a 1 GiB warm-up
  the same run measured 0.37x instead of 0.44x);
- each test file is deleted right after its measurement (after the read of it);
- the side that goes first alternates from round to round;
- every number reported is the median of >= 5 rounds (``--rounds``), and the ratio
  tierfs/tmpfs is computed from the medians of this run, never across runs.

The daemon's CPU time (utime+stime of /proc/PID/stat) is read before and after each
tierfs measurement and reported as CPU-seconds per GiB moved (median).

Run it when the machine is quiet::

    .venv/bin/python scripts/bench_io.py                 # full run, ~2 GiB per measurement
    .venv/bin/python scripts/bench_io.py --quick         # smoke test: 256M, 2 rounds
    .venv/bin/python scripts/bench_io.py --json out.json --plot out.png

Stdlib only; tierfs and fio run as subprocesses. Everything it creates lives under
/dev/shm/bench-io-* and /tmp/bench-io-* and is removed (and the mount unmounted) on exit,
also on errors and Ctrl-C.

The two engines open files for writing differently, and the mount treats the two opens
differently: fio opens with O_RDWR, which the mount serves through the page cache (so that
shared mmap works), as it serves tensorstore's (Orbax's) data files; the built-in writer
opens with O_WRONLY, which the mount serves with direct I/O, as it serves ``torch.save``,
PyTorch DCP, numpy and safetensors files. Run both to see both paths.

I/O buffers are page-aligned (fio ``--iomem_align=4096``; mmap buffers in the built-in
engine). fio's default malloc'd buffer sits 16 bytes into a page, and on this machine's
AMD EPYC a copy to or from such a buffer runs ~4x slower (tmpfs reads: ~1.4 GiB/s instead
of ~6 GiB/s); that would slow the tmpfs side far more than the tierfs side and inflate the
ratio. ``--malloc-buffers`` measures with such buffers instead.
"""

from __future__ import annotations

import argparse
import datetime
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
from benchlib import (cpu_seconds, interrupt_on_signals, is_mounted, no_interruptions, parse_size,  # noqa: E402
                      write_json, pyplot, NO_MATPLOTLIB, save_figure)  # (scripts/ is on sys.path)

GiB = 1 << 30
MiB = 1 << 20
SIDES = ("tmpfs", "tierfs")
OPS = ("write", "read")


class BenchError(Exception):
    """A failure to report as one line and a non-zero exit."""


# ----------------------------------------------------------------------------- helpers

def parse_size_list(text: str) -> list[int]:
    return [parse_size(t) for t in text.split(",") if t.strip()]


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: use e.g. 1,4") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"invalid list {text!r}: numbers must be > 0")
    return values


def fmt_size(n: int) -> str:
    for unit, mult in (("G", GiB), ("M", MiB), ("K", 1024)):
        if n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


def find_tierfs() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "tierfs")
    if os.access(here, os.X_OK):
        return here
    found = shutil.which("tierfs")
    if not found:
        raise BenchError(f"the tierfs command is neither next to {sys.executable} nor on PATH")
    return found


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def proc_cpu_seconds(pid: int) -> float:
    try:
        return cpu_seconds(pid)
    except OSError:
        raise BenchError(f"the tierfs daemon (pid {pid}) is gone") from None


def aligned_buffer(size: int, offset: int = 0) -> memoryview:
    """A buffer of random bytes ``offset`` bytes into a fresh page-aligned mapping."""
    m = mmap.mmap(-1, size + offset + mmap.PAGESIZE)
    chunk = os.urandom(min(size, MiB))
    for pos in range(0, size, len(chunk)):
        m[offset + pos:offset + min(size, pos + len(chunk))] = chunk[:min(size, pos + len(chunk)) - pos]
    return memoryview(m)[offset:offset + size]


def write_warmup(path: str, size: int, buf: memoryview) -> None:
    """Write ``size`` bytes to ``path`` (on tmpfs): touches fresh pages, as the method needs."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = size
        while left > 0:
            left -= os.write(fd, buf[:min(left, len(buf))])
    finally:
        os.close(fd)


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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

    def run(self, op: str, directory: str, tag: str, bs: int, per_job: int, jobs: int,
            offset: int = 0) -> dict:
        cmd = [
            self.fio, f"--name={tag}", f"--directory={directory}",
            f"--filename_format={tag}.$jobnum",
            "--ioengine=psync", f"--rw={op}", f"--bs={bs}", f"--size={per_job}", f"--offset={offset}",
            f"--numjobs={jobs}", "--group_reporting", "--output-format=json",
            "--direct=0", *self.align_args,
            "--invalidate=0",    # drop nothing: reads see what the write left, on both sides
            "--fallocate=none",  # writes allocate their pages on both sides alike
        ]
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, text=True)
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
        out = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
        if out.returncode != 0:
            why = last_line(out.stderr) or last_line(out.stdout) or f"exit status {out.returncode}"
            raise BenchError(f"fio {op} bs={fmt_size(bs)} jobs={jobs} in {directory} failed: {why}")
        text = out.stdout
        try:
            data = json.loads(text[text.index("{"):])
            res = data["jobs"][0][op]
            nbytes, runtime_ms = int(res["io_bytes"]), float(res["runtime"])
        except (ValueError, KeyError, IndexError) as e:
            raise BenchError(f"cannot parse fio's JSON output ({e}): {last_line(text)}") from None
        if nbytes != per_job * jobs:
            raise BenchError(f"fio {op} moved {nbytes} bytes, expected {per_job * jobs}")
        if runtime_ms <= 0:
            raise BenchError(f"fio {op} reported a runtime of {runtime_ms} ms: use a larger --size")
        seconds = runtime_ms / 1000.0
        return {"bytes": nbytes, "seconds": seconds, "fio_bw_bytes": res.get("bw_bytes")}


class BuiltinEngine:
    """os.write / os.readv loops over one preallocated buffer; one thread per file."""

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

    def run(self, op: str, directory: str, tag: str, bs: int, per_job: int, jobs: int,
            offset: int = 0) -> dict:
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
                        n = os.write(fd, buf[:min(left, bs)])
                    else:
                        n = os.readv(fd, rbuf if left >= bs else [buf[:left]])
                        if n == 0:
                            raise OSError(f"unexpected end of file after {per_job - left} bytes")
                    left -= n
                    moved[i] += n
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


# ----------------------------------------------------------------------------- tierfs mount

class TierfsMount:
    def __init__(self, tierfs: str, mountpoint: str, ramdisk: str, runtime: str, capacity: str | None):
        self.tierfs, self.mountpoint, self.ramdisk = tierfs, mountpoint, ramdisk
        self.env = dict(os.environ, TIERFS_RUNTIME_DIR=runtime)
        self.capacity = capacity
        self.pid: int | None = None
        self.log_hint = runtime

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run the tierfs CLI in its own session, so Ctrl-C cannot cut a mount or unmount
        in half (a daemon mounting behind our back); an interrupt waits for it, then counts."""
        cmd = [self.tierfs, *args]
        proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        interrupted = False
        deadline = time.monotonic() + timeout
        while True:
            try:
                out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
                break
            except KeyboardInterrupt:
                interrupted = True
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise
        if interrupted:
            raise KeyboardInterrupt
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def mount(self) -> None:
        args = ["mount", self.mountpoint, "--ramdisk", self.ramdisk]
        if self.capacity:
            args += ["--capacity", self.capacity]
        try:
            out = self._run(*args)
        except subprocess.TimeoutExpired:
            raise BenchError(f"tierfs mount {self.mountpoint} did not return within 120 s "
                             f"(logs in {self.log_hint})") from None
        if out.returncode != 0:
            why = last_line(out.stderr) or last_line(out.stdout) or f"exit status {out.returncode}"
            raise BenchError(f"mount failed: {why}")
        if not is_mounted(self.mountpoint):
            raise BenchError(f"mount failed: tierfs mount returned but {self.mountpoint} is not mounted")
        out = self._run("status", self.mountpoint, "--json", timeout=60)
        try:
            self.status = json.loads(out.stdout)
            self.pid = int(self.status["pid"])
        except (ValueError, KeyError, TypeError):
            why = last_line(out.stderr) or last_line(out.stdout) or "no output"
            raise BenchError(f"tierfs status {self.mountpoint} --json gave no daemon pid: {why}") from None
        proc_cpu_seconds(self.pid)  # the pid must be ours to read

    def unmount(self) -> None:
        """Unmount; if tierfs cannot, detach lazily. Never raises."""
        if not is_mounted(self.mountpoint):
            return
        try:
            out = self._run("unmount", self.mountpoint)
            if out.returncode == 0 and not is_mounted(self.mountpoint):
                return
            why = last_line(out.stderr) or f"exit status {out.returncode}"
        except (OSError, subprocess.TimeoutExpired) as e:
            why = str(e)
        print(f"bench_io: warning: tierfs unmount {self.mountpoint} failed ({why}); detaching it",
              file=sys.stderr)
        for cmd in (["fusermount3", "-uz", self.mountpoint], ["umount", "-l", self.mountpoint]):
            try:
                subprocess.run(cmd, capture_output=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if not is_mounted(self.mountpoint):
                break
        if self.pid is not None:  # the daemon we started; do not leave it running
            deadline = time.monotonic() + 10
            while os.path.exists(f"/proc/{self.pid}") and time.monotonic() < deadline:
                time.sleep(0.1)
            if os.path.exists(f"/proc/{self.pid}"):
                try:
                    os.kill(self.pid, signal.SIGTERM)
                except OSError:
                    pass
        if is_mounted(self.mountpoint):
            print(f"bench_io: warning: {self.mountpoint} is still mounted", file=sys.stderr)


# ----------------------------------------------------------------------------- benchmark

def measure(engine, side: str, op: str, directory: str, tag: str, bs: int, per_job: int, jobs: int,
            warm_path: str, warm_size: int, warm_buf: memoryview, daemon_pid: int | None,
            segment: int) -> dict:
    if op == "read":  # make sure the read hits exactly the files just written
        for p in engine.files(directory, tag, jobs):
            try:
                size = os.stat(p).st_size
            except OSError as e:
                raise BenchError(f"the file to read is missing: {e}") from None
            if size != per_job:
                raise BenchError(f"{p} holds {size} bytes after the write, expected {per_job}")
    # The file is moved in timed segments, each right after its own warm-up: the balloon
    # hands freed pages back to the host about 2 s after they are freed, so a side that
    # takes longer than that to move one warmed-up segment would touch cold pages.
    res = {"bytes": 0, "seconds": 0.0, "segments": 0, "daemon_cpu_s": 0.0}
    seg = min(per_job, max(bs, segment // jobs // bs * bs))
    for offset in range(0, per_job, seg):
        write_warmup(warm_path, warm_size, warm_buf)
        os.unlink(warm_path)  # right before the measurement
        cpu0 = proc_cpu_seconds(daemon_pid) if side == "tierfs" else None
        part = engine.run(op, directory, tag, bs, min(seg, per_job - offset), jobs, offset)
        if side == "tierfs":
            res["daemon_cpu_s"] += proc_cpu_seconds(daemon_pid) - cpu0
        res["bytes"] += part["bytes"]
        res["seconds"] += part["seconds"]
        res["segments"] += 1
    if side == "tierfs":
        res["daemon_cpu_s_per_gib"] = res["daemon_cpu_s"] / (res["bytes"] / GiB)
    else:
        del res["daemon_cpu_s"]
    res["gib_s"] = res["bytes"] / GiB / res["seconds"]
    return res


def run_benchmark(args, engine, dirs: dict, mount: TierfsMount, progress) -> list[dict]:
    warm_buf = aligned_buffer(4 * MiB)
    warm_path = os.path.join(dirs["warm"], "warmup")
    raw: list[dict] = []
    configs = [(bs, jobs) for bs in args.bs for jobs in args.jobs]
    total = args.rounds * len(configs) * len(SIDES) * len(OPS)
    done = 0
    for rnd in range(args.rounds):
        order = SIDES if rnd % 2 == 0 else SIDES[::-1]
        for bs, jobs in configs:
            per_job = (args.size // jobs) // bs * bs
            if per_job <= 0:
                raise BenchError(f"--size {fmt_size(args.size)} is too small for bs={fmt_size(bs)} jobs={jobs}")
            for pos, side in enumerate(order):
                directory = dirs[side]
                tag = f"bench-r{rnd}-bs{fmt_size(bs)}-j{jobs}"
                try:
                    for op in OPS:
                        res = measure(engine, side, op, directory, tag, bs, per_job, jobs,
                                      warm_path, args.warmup, warm_buf,
                                      mount.pid if side == "tierfs" else None, args.segment)
                        res.update(round=rnd, side=side, op=op, bs=bs, jobs=jobs, position=pos)
                        raw.append(res)
                        done += 1
                        cpu = (f", daemon {res['daemon_cpu_s_per_gib']:.2f} CPU-s/GiB"
                               if "daemon_cpu_s_per_gib" in res else "")
                        progress(f"[{done}/{total}] round {rnd + 1} {side:6} {op:5} bs={fmt_size(bs)} "
                                 f"jobs={jobs}: {res['gib_s']:.3f} GiB/s{cpu}")
                finally:  # right after its measurement (the read), or on any failure
                    for p in engine.files(directory, tag, jobs):
                        remove(p)
                    remove(warm_path)
    return raw


def summarize(args, raw: list[dict]) -> list[dict]:
    rows = []
    for op in OPS:
        for bs in args.bs:
            for jobs in args.jobs:
                sel = [r for r in raw if r["op"] == op and r["bs"] == bs and r["jobs"] == jobs]
                med = {}
                for side in SIDES:
                    vals = [r["gib_s"] for r in sel if r["side"] == side]
                    med[side] = statistics.median(vals) if vals else None
                cpu = [r["daemon_cpu_s_per_gib"] for r in sel if "daemon_cpu_s_per_gib" in r]
                ratio = (med["tierfs"] / med["tmpfs"]) if med["tmpfs"] and med["tierfs"] is not None else None
                rows.append({
                    "op": op, "bs": bs, "jobs": jobs,
                    "tmpfs_gib_s": med["tmpfs"], "tierfs_gib_s": med["tierfs"], "ratio": ratio,
                    "daemon_cpu_s_per_gib": statistics.median(cpu) if cpu else None,
                    "rounds": len(sel) // len(SIDES),
                })
    return rows


def render_table(rows: list[dict]) -> str:
    head = ("op", "bs", "jobs", "tmpfs GiB/s", "tierfs GiB/s", "ratio", "daemon CPU s/GiB")
    def f(v, spec):
        return "-" if v is None else format(v, spec)
    body = [(r["op"], fmt_size(r["bs"]), str(r["jobs"]), f(r["tmpfs_gib_s"], ".3f"),
             f(r["tierfs_gib_s"], ".3f"), f(r["ratio"], ".2f"), f(r["daemon_cpu_s_per_gib"], ".2f"))
            for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    def line(cells):
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def plot(path: str, rows: list[dict], title: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    groups = [(bs, jobs) for bs in sorted({r["bs"] for r in rows}) for jobs in sorted({r["jobs"] for r in rows})]
    width = 0.8 / len(OPS)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
    for k, op in enumerate(OPS):
        ys = []
        for bs, jobs in groups:
            r = next((r for r in rows if r["op"] == op and r["bs"] == bs and r["jobs"] == jobs), None)
            ys.append(r["ratio"] if r and r["ratio"] is not None else 0.0)
        xs = [i + (k - (len(OPS) - 1) / 2) * width for i in range(len(groups))]
        bars = ax.bar(xs, ys, width, label=op)
        for b, y in zip(bars, ys):
            ax.annotate(f"{y:.2f}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"bs {fmt_size(bs)}\n{jobs} job{'s' if jobs > 1 else ''}" for bs, jobs in groups])
    ax.set_ylabel("tierfs / tmpfs (median throughput)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    save_figure(fig, path)
    return None


# ----------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Sequential write/read throughput of a tierfs mount against plain tmpfs "
                    "(medians of alternating rounds, balloon-safe warm-up).")
    p.add_argument("--size", type=parse_size, help="total bytes per measurement, split over the jobs (default 2G)")
    p.add_argument("--rounds", type=int, help="rounds; medians are taken over them (default 5, >= 5 for real numbers)")
    p.add_argument("--bs", type=parse_size_list, default=[MiB, 4 * MiB], help="block sizes (default 1M,4M)")
    p.add_argument("--jobs", type=parse_int_list, default=[1, 4], help="writers/readers in parallel (default 1,4)")
    p.add_argument("--warmup", type=parse_size, default=2 * GiB,
                   help="warm-up file written and deleted on tmpfs before each timed segment (default 2G: "
                        "a segment written through the page cache touches twice its size)")
    p.add_argument("--segment", type=parse_size, default=512 * MiB,
                   help="bytes moved per timed segment, each after its own warm-up (default 512M; "
                        "the balloon returns freed pages to the host ~2 s after they are freed)")
    p.add_argument("--engine", choices=("auto", "fio", "builtin"), default="auto",
                   help="fio, the built-in Python loop, or auto (fio if installed; default)")
    p.add_argument("--malloc-buffers", action="store_true",
                   help="use 16-byte-aligned I/O buffers (fio's default) instead of page-aligned ones")
    p.add_argument("--capacity", help="passed to tierfs mount --capacity")
    p.add_argument("--replot", metavar="JSON", help="re-render the table and --plot of a saved --json run")
    p.add_argument("--quick", action="store_true", help="smoke run: --size 256M --rounds 2 unless given")
    p.add_argument("--json", metavar="PATH", help="write settings, raw per-round numbers and medians")
    p.add_argument("--plot", metavar="PATH.png", help="grouped bars of the ratios (needs matplotlib)")
    return p


def replot(json_path: str, plot_path: str | None) -> int:
    """Print the table (and draw the plot) of a saved ``--json`` run without measuring."""
    with open(json_path) as f:
        saved = json.load(f)
    rows = saved["medians"]
    print(f"# bench_io {saved['header']['date']}  command: {saved['header']['command']}")
    print(render_table(rows))
    if plot_path:
        st = saved["settings"]
        title = (f"tierfs/tmpfs, {st['engine']}, {fmt_size(st['size'])}, {st['rounds']} rounds, "
                 f"{saved['header']['date'][:10]}")
        why = plot(plot_path, rows, title)
        print(f"# plot skipped: {why}" if why else f"# wrote {plot_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.replot:
        return replot(args.replot, args.plot)
    if args.size is None:
        args.size = 256 * MiB if args.quick else 2 * GiB
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.rounds < 1:
        print("bench_io: error: --rounds must be >= 1", file=sys.stderr)
        return 2

    # SIGTERM/SIGHUP take the same path as Ctrl-C, so the finally blocks run; SIGINT too
    # when started in the background (where the shell has it ignored).
    interrupt_on_signals()

    def progress(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    created: list[str] = []
    mount: TierfsMount | None = None
    try:
        if args.engine in ("auto", "fio") and shutil.which("fio"):
            engine = FioEngine(shutil.which("fio"), args.malloc_buffers)
        elif args.engine == "fio":
            raise BenchError("--engine fio: fio is not installed (use --engine builtin)")
        else:
            engine = BuiltinEngine(args.malloc_buffers)
        tierfs = find_tierfs()

        st = os.statvfs("/dev/shm")
        need = args.size + args.warmup + 256 * MiB
        if st.f_bavail * st.f_frsize < need:
            raise BenchError(f"/dev/shm has {st.f_bavail * st.f_frsize / GiB:.1f} GiB free, "
                             f"the run needs {need / GiB:.1f} GiB")

        tmp_root = tempfile.mkdtemp(prefix="bench-io-", dir="/tmp")
        created.append(tmp_root)
        shm_tmpfs = tempfile.mkdtemp(prefix="bench-io-tmpfs-", dir="/dev/shm")
        created.append(shm_tmpfs)
        shm_ram = tempfile.mkdtemp(prefix="bench-io-ram-", dir="/dev/shm")
        created.append(shm_ram)
        shm_warm = tempfile.mkdtemp(prefix="bench-io-warm-", dir="/dev/shm")
        created.append(shm_warm)
        mountpoint = os.path.join(tmp_root, "mnt")
        runtime = os.path.join(tmp_root, "run")
        os.mkdir(mountpoint)
        os.mkdir(runtime)

        cmdline = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        header = {"date": now, "kernel": platform.release(), "cores": os.cpu_count(), "command": cmdline}
        print(f"# bench_io {now}  kernel {header['kernel']}  cores {header['cores']}  command: {cmdline}")
        settings = {
            "engine": engine.name, "engine_version": engine.version, "size": args.size,
            "rounds": args.rounds, "bs": args.bs, "jobs": args.jobs, "warmup": args.warmup,
            "segment": args.segment,
            "buffers": "malloc (16-byte aligned)" if args.malloc_buffers else "page-aligned",
            "tmpfs_dir": shm_tmpfs, "tierfs_mountpoint": mountpoint, "tierfs_ramdisk": shm_ram,
            "tierfs": tierfs, "capacity": args.capacity,
        }
        print(f"# engine {engine.version}, {settings['buffers']} buffers, {fmt_size(args.size)} per measurement, {args.rounds} rounds, "
              f"timed in {fmt_size(args.segment)} segments, each after a {fmt_size(args.warmup)} warm-up; "
              "medians; ratio = tierfs/tmpfs",
              flush=True)

        mount = TierfsMount(tierfs, mountpoint, shm_ram, runtime, args.capacity)
        mount.mount()
        settings["tierfs_daemon_pid"] = mount.pid
        progress(f"mounted tierfs at {mountpoint} (daemon pid {mount.pid}, ramdisk {shm_ram})")

        dirs = {"tmpfs": shm_tmpfs, "tierfs": mountpoint, "warm": shm_warm}
        started = time.monotonic()
        raw = run_benchmark(args, engine, dirs, mount, progress)
        settings["elapsed_s"] = round(time.monotonic() - started, 1)
        rows = summarize(args, raw)

        print(render_table(rows))
        if args.rounds < 5:
            print(f"# note: only {args.rounds} rounds; use >= 5 for numbers to keep")
        if args.json:
            write_json(args.json, {"header": header, "settings": settings, "raw": raw, "medians": rows})
        if args.plot:
            title = f"tierfs/tmpfs, {engine.name}, {fmt_size(args.size)}, {args.rounds} rounds, {now}"
            why = plot(args.plot, rows, title)
            print(f"# plot skipped: {why}" if why else f"# wrote {args.plot}")
        return 0
    except BenchError as e:
        print(f"bench_io: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_io: interrupted; cleaning up", file=sys.stderr)
        return 130
    finally:
        with no_interruptions():
            if mount is not None:
                mount.unmount()
            for d in reversed(created):
                if is_mounted(os.path.join(d, "mnt")):
                    print(f"bench_io: warning: leaving {d} in place, a mount is still on it", file=sys.stderr)
                    continue
                shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
