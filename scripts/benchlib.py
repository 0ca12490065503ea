"""What the benchmark scripts share: sizes on the command line, CPU time, mounts, cleanup,
random test files, the tmpfs warm-up, a tierfs volume mounted for a run, the cleanup of a
local cluster, tables, the plain socket copy and a google-cloud-storage client.

The plain copy runs as two processes of this file (``--_recv`` / ``--_send``), so it needs
nothing from the script that asks for it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import mmap
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

# This checkout's tierfs, in the script and in every process it starts (daemons run as
# ``python -m tierfs``): a benchmark run from a second checkout measures that checkout's
# code, not whichever one the virtualenv was installed from.
SRC_DIR = Path(__file__).resolve().parent.parent / "src"
if SRC_DIR.is_dir():
    sys.path.insert(0, str(SRC_DIR))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC_DIR), os.environ.get("PYTHONPATH")) if p)
# And this checkout's test scaffolding (tierfs_testing, a distribution of its own), in the
# script only: the processes it starts are tierfs's, which never import it.
TESTING_DIR = SRC_DIR.parent / "testing"
if TESTING_DIR.is_dir():
    sys.path.insert(0, str(TESTING_DIR))

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
CLK_TCK = os.sysconf("SC_CLK_TCK")
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
MiB = 1 << 20


class BenchError(Exception):
    """A failure to report as one line and a non-zero exit."""


def write_json(path: str, results: dict) -> None:
    """Write a run's settings, raw rounds and medians, for the docs and for later comparison."""
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    print(f"# wrote {path}")


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 (a missing or broken matplotlib costs the plot, not the run)
        return None
    return plt


NO_MATPLOTLIB = "matplotlib is not importable"


def save_figure(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_size(text: str) -> int:
    """An argparse type: bytes, or a number with a binary K/M/G/T suffix (``256M``)."""
    m = _SIZE_RE.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use bytes or e.g. 256M, 2G (> 0)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_sizes(text: str) -> list[int]:
    """An argparse type: a comma-separated list of sizes (``1G,4G``), each as :func:`parse_size`."""
    sizes = [parse_size(part) for part in str(text).split(",") if part.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError(f"invalid sizes {text!r}: use e.g. 1G,4G")
    return sizes


def size_label(n: int) -> str:
    """``4 GiB``, ``256 MiB``: a size as the tables name it."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor} {unit}"
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n} B"


RAMDISK_HELP = (
    "a tmpfs for every side's files: the nodes' ramdisks, the source files, the warm-up and the plain "
    "copies' receiving directory (default /dev/shm); one mounted huge=within_size measures both sides "
    "with large folios"
)
WARMUP_CAP = 4 << 30


def default_warmup(size: int) -> int:
    """Twice the bytes a part touches, at most 4 GiB: what one part needs warm, without a
    4 GiB step's warm-up pushing the RAM a run already holds (step, replica, copies) past the VM's."""
    return min(2 * size, WARMUP_CAP)


def render_table(head: tuple[str, ...], body: list[tuple[str, ...]], left: int = 1) -> str:
    """A plain-text table: the first ``left`` columns (the labels) left-aligned, the numbers
    right-aligned, a rule under the head."""
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    return "\n".join(
        "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        for cells in [head, tuple("-" * w for w in widths), *body]
    )


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (all its threads); of this one without a pid."""
    if pid is None:
        return time.process_time()
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # fields from 3 (state) on
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5)


def cpu_idle() -> str:
    """The machine's idle-CPU setting, which decides what a wake-up costs on a VM (and so
    every FUSE round trip): the cpuidle driver, haltpoll's guest polling if it is that, and
    a wake-up latency limit some process holds (PM QoS) if any, since it would speed up
    every side alike, hiding what the volume's own hold is worth."""

    def read(path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None

    setting = read("/sys/devices/system/cpu/cpuidle/current_driver") or "none"
    if setting == "haltpoll":
        setting += f", guest_halt_poll_ns={read('/sys/module/haltpoll/parameters/guest_halt_poll_ns')}"
    try:
        with open("/dev/cpu_dma_latency", "rb") as f:
            limit = int.from_bytes(f.read(4), "little", signed=True)
    except (OSError, ValueError):
        limit = None
    if limit is not None and limit < 2_000_000_000:  # 2e9 µs: the kernel's "no limit"
        setting += f", wake-up latency limit {limit} us held by another process"
    return setting


def is_mounted(path: str | os.PathLike) -> bool:
    target = os.path.abspath(path)
    with open("/proc/self/mountinfo") as f:
        return any(len(p := line.split()) > 4 and p[4] == target for line in f)


@contextlib.contextmanager
def no_interruptions() -> Iterator[None]:
    """Ignore Ctrl-C and friends meanwhile: a half-done cleanup leaves mounts behind."""
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def clean_up(name: str, mounts, created: list[str]) -> None:
    """Unmount a benchmark's volumes, then remove the directories it made (newest first),
    except one that still has a mount on it: removing through a live mount would delete
    the volume's RAM tier behind its daemon."""
    from tierfs_testing import unmount_all_beneath

    with no_interruptions():
        for mount in mounts:
            mount.unmount()
        for d in reversed(created):
            if any(is_mounted(m.mountpoint) for m in mounts if m.mountpoint.startswith(d + "/")):
                print(f"{name}: warning: leaving {d} in place, a mount is still on it", file=sys.stderr)
                continue
            unmount_all_beneath(Path(d))  # a volume's --capacity tmpfs outlives its daemon
            shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def deferred_interruptions() -> Iterator[None]:
    """Hold Ctrl-C and friends until the block is done, then stop as Ctrl-C does: a cleanup in the
    middle of a run is neither cut in half nor makes the run miss the signal."""
    got = []
    old = {sig: signal.signal(sig, lambda signum, frame: got.append(signum)) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if got:
        raise KeyboardInterrupt


def progress(msg: str) -> None:
    """A line of progress for the person waiting: on stderr, so tables on stdout stay clean."""
    print(msg, file=sys.stderr, flush=True)


def interrupt_on_signals() -> None:
    """SIGTERM and SIGHUP end a run as Ctrl-C does, so its cleanup runs."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    for sig in _STOP_SIGNALS:
        signal.signal(sig, interrupt)


def compile_bytecode() -> None:
    """Byte-compile tierfs as ``pip install`` does, before a run that times daemon start-ups.

    An editable install under ``PYTHONDONTWRITEBYTECODE`` (set in this VM's and many CI
    environments) has no ``.pyc`` files, so every ``tierfs`` command and daemon would compile
    its modules again: about 0.2 s of every start-up, which a deployed node does not pay.
    """
    import compileall

    import tierfs

    compileall.compile_dir(os.path.dirname(tierfs.__file__), quiet=1)


def keep_logs(runtime: str | os.PathLike, name: str) -> str | None:
    """Copy the daemons' logs out of a run's private runtime directory before it is removed; where to."""
    logs = sorted(Path(runtime).glob("*.log"))
    if not logs:
        return None
    kept = Path(tempfile.mkdtemp(prefix=f"{name}-logs-", dir="/tmp"))
    for log in logs:
        shutil.copy(log, kept / log.name)
    return str(kept)


# ----------------------------------------------------------------------------- buffers, files, warm-up


def aligned(n: int) -> memoryview:
    """Page-aligned random bytes (copies from a buffer 16 bytes into a page are ~4x slower here)."""
    m = mmap.mmap(-1, n)
    m[:] = os.urandom(n)
    return memoryview(m)


def write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


def random_blocks():
    """A function ``n -> n fresh random bytes``: an AES-256-CTR keystream under a key from
    os.urandom where the cryptography package is there (~1.2 GB/s here), else os.urandom
    itself (~0.3 GB/s, so a 4 GiB step took 14 s to make). Either way nothing repeats, so
    no tier can deduplicate or compress it."""
    try:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    except ImportError:
        return os.urandom
    stream = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(os.urandom(16))).encryptor()
    zeros = bytes(4 * MiB)
    return lambda n: stream.update(zeros[:n] if n <= len(zeros) else bytes(n))


def make_files(directory: Path, size: int, nfiles: int) -> dict[str, str]:
    """Files of fresh random bytes (nothing for a peer to deduplicate): name -> sha256."""
    sums, fresh = {}, random_blocks()
    for i in range(nfiles):
        name, h = f"layer-{i:02d}/shard", hashlib.sha256()
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        with open(directory / name, "wb") as f:
            for pos in range(0, size // nfiles, 4 * MiB):
                f.write(block := fresh(min(4 * MiB, size // nfiles - pos)))
                h.update(block)
        sums[name] = h.hexdigest()
    return sums


def warm_tmpfs(directory: str | os.PathLike, nbytes: int, buf: memoryview) -> None:
    """Write ``nbytes`` into a tmpfs file and delete it: freshly returned pages are touched
    now, not by the measurement that follows right after (docs/benchmarks.md)."""
    fd = os.open(path := os.path.join(directory, "warmup"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for pos in range(0, nbytes, len(buf)):
            write_all(fd, buf[: min(len(buf), nbytes - pos)])
    finally:
        os.close(fd)
        os.unlink(path)  # right before the measurement


def warm_up(path: str, size: int, buf: memoryview, writers: int | None = None) -> None:
    """Write ``size`` bytes into tmpfs files ``path.0``, ``path.1``, ... and delete them: the
    pages the measurement right after needs are touched now (docs/benchmarks.md, "Method").
    Pages the balloon took back are slow to touch again and each vCPU faults its own, so
    ``writers`` threads (default: one per core, at most 2) share the work: on 2 cores two
    take ~1.5 s per 2 GiB instead of ~3 s."""
    writers = writers or max(1, min(2, os.cpu_count() or 1))
    paths = [f"{path}.{i}" for i in range(writers)]
    errors: list[OSError] = []

    def write(p: str, nbytes: int) -> None:
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                while nbytes > 0:
                    nbytes -= os.write(fd, buf[: min(nbytes, len(buf))])
            finally:
                os.close(fd)
        except OSError as e:
            errors.append(e)

    share = -(-size // writers)
    threads = [threading.Thread(target=write, args=(p, min(share, size - i * share))) for i, p in enumerate(paths)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)  # right before the measurement
    if errors:
        raise BenchError(f"the warm-up failed: {errors[0]}")


# ----------------------------------------------------------------------------- a tierfs volume


def tierfs_env(runtime: str | os.PathLike, src: str | os.PathLike | None = None) -> dict[str, str]:
    """The environment for the tierfs CLI: this checkout's code first (see SRC_DIR), or ``src``
    (another checkout's, to measure two versions in one run), and a daemon registry of our own."""
    env = dict(os.environ, TIERFS_RUNTIME_DIR=str(runtime))
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(src), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SRC_DIR))]
        )
    return env


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


class TierfsMount:
    """One ``tierfs mount`` for a benchmark run: mounted, asked for its daemon's pid, unmounted.

    The CLI runs as ``python -m tierfs`` with this checkout's ``src`` first on PYTHONPATH, in
    its own session so that Ctrl-C cannot cut a mount or unmount in half; ``data_path`` is
    checked against what the daemon reports, so a volume never silently measures the other path.
    """

    def __init__(
        self,
        mountpoint: str,
        ramdisk: str,
        runtime: str,
        data_path: str = "auto",
        job: str = "bench",
        capacity: str | None = None,
        extra: tuple[str, ...] = (),
        src: str | None = None,
    ):
        self.mountpoint, self.ramdisk, self.job = mountpoint, ramdisk, job
        self.data_path, self.capacity, self.extra = data_path, capacity, tuple(extra)
        self.env = tierfs_env(runtime, src)
        self.pid: int | None = None
        self.status: dict = {}
        self.log_hint = runtime

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "tierfs", *args]
        proc = subprocess.Popen(
            cmd,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
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
        args = ["mount", self.mountpoint, "--ramdisk", self.ramdisk, "--job", self.job]
        if self.data_path != "auto":
            args += ["--data-path", self.data_path]
        if self.capacity:
            args += ["--capacity", self.capacity]
        try:
            out = self.run(*args, *self.extra)
        except subprocess.TimeoutExpired:
            raise BenchError(
                f"tierfs mount {self.mountpoint} did not return within 120 s (logs in {self.log_hint})"
            ) from None
        if out.returncode != 0:
            why = last_line(out.stderr) or last_line(out.stdout) or f"exit status {out.returncode}"
            raise BenchError(f"mount failed: {why}")
        if not is_mounted(self.mountpoint):
            raise BenchError(f"mount failed: tierfs mount returned but {self.mountpoint} is not mounted")
        self.status = self.read_status()
        try:
            self.pid = int(self.status["pid"])
            got = self.status["fuse"]["data_path"]
        except (KeyError, TypeError, ValueError):
            raise BenchError(f"tierfs status {self.mountpoint} --json gave no daemon pid or data path") from None
        cpu_seconds(self.pid)  # the pid must be ours to read
        if self.data_path != "auto" and got != self.data_path:
            raise BenchError(
                f"{self.mountpoint} was mounted with --data-path {self.data_path} but serves the {got} path"
            )

    def read_status(self) -> dict:
        out = self.run("status", self.mountpoint, "--json", timeout=60)
        try:
            return json.loads(out.stdout)
        except ValueError:
            why = last_line(out.stderr) or last_line(out.stdout) or "no output"
            raise BenchError(f"tierfs status {self.mountpoint} --json failed: {why}") from None

    def daemon_cpu(self) -> float:
        try:
            return cpu_seconds(self.pid)
        except OSError:
            raise BenchError(f"the tierfs daemon of {self.mountpoint} (pid {self.pid}) is gone") from None

    def unmount(self) -> None:
        """Unmount; if tierfs cannot, detach lazily and stop the daemon we started. Never raises."""
        if not is_mounted(self.mountpoint):
            return
        try:
            out = self.run("unmount", self.mountpoint)
            if out.returncode == 0 and not is_mounted(self.mountpoint):
                return
            why = last_line(out.stderr) or f"exit status {out.returncode}"
        except (OSError, subprocess.TimeoutExpired) as e:
            why = str(e)
        print(f"warning: tierfs unmount {self.mountpoint} failed ({why}); detaching it", file=sys.stderr)
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
            print(f"warning: {self.mountpoint} is still mounted", file=sys.stderr)


# ----------------------------------------------------------------------------- a local cluster


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


def close_cluster(cluster) -> list[str]:
    """Close a ``tierfs_testing.cluster.LocalCluster`` for good: its own close, then any
    daemon or ``tierfs mount`` of its directory still running (a start cut short by Ctrl-C),
    then lazy unmounts. Removes its directory unless a mount stays; returns those left mounted."""
    from tierfs_testing import wait_gone

    with no_interruptions():
        cluster.close()
        for pid in stray_processes(str(cluster.base) + "/"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            wait_gone(pid)
        left = []
        for node in cluster.nodes:
            if is_mounted(node.mountpoint):
                subprocess.run(["umount", "-l", str(node.mountpoint)], capture_output=True)
            if is_mounted(node.mountpoint):
                left.append(str(node.mountpoint))
        if not left:
            shutil.rmtree(cluster.base, ignore_errors=True)
    return left


# ----------------------------------------------------------------------------- plain socket copy


def plain_receiver(host: str, out_dir: str) -> None:
    buf = aligned(MiB)
    with socket.create_server((host, 0)) as srv:
        print(srv.getsockname()[1], flush=True)
        conn, _ = srv.accept()
        cpu0 = cpu_seconds()
        with conn:
            (n,) = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))
            for i, left in enumerate(struct.unpack(f">{n}Q", conn.recv(8 * n, socket.MSG_WAITALL))):
                fd = os.open(os.path.join(out_dir, f"f{i:03d}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                while left:
                    got = conn.recv_into(buf, min(left, MiB))
                    if not got:
                        raise EOFError("the sender closed early")
                    write_all(fd, buf[:got])
                    left -= got
                os.close(fd)
            done = time.monotonic()
            conn.sendall(b"k")
    print(done, cpu_seconds() - cpu0, flush=True)


def plain_sender(host: str, dest: str, port: int, paths: list[str]) -> None:
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    sizes = [os.fstat(fd).st_size for fd in fds]
    print("ready", flush=True)
    sys.stdin.readline()
    cpu0, t0 = cpu_seconds(), time.monotonic()  # CLOCK_MONOTONIC: comparable across processes
    with socket.create_connection((dest, port), source_address=(host, 0)) as s:
        s.sendall(struct.pack(f">I{len(sizes)}Q", len(sizes), *sizes))
        for fd, size in zip(fds, sizes, strict=True):
            off = 0
            while off < size:
                off += os.sendfile(s.fileno(), fd, off, size - off)
        s.recv(1)  # the receiver has closed its last file
    print(t0, cpu_seconds() - cpu0, flush=True)


def plain_copy(src: str, dest: str, paths: list[str], out_dir: str, warm) -> dict:
    """One plain copy of ``paths`` by two fresh processes: a sender on ``src`` that
    ``os.sendfile``s them over TCP to a receiver on ``dest`` that ``recv_into``s a page-aligned
    1 MiB buffer and writes fresh files into ``out_dir`` (removed after); timed from connect
    to the last file closed. ``warm()`` runs right before the go."""
    os.mkdir(out_dir)
    me, procs = [sys.executable, os.path.abspath(__file__)], []
    try:
        procs.append(subprocess.Popen([*me, "--_recv", dest, out_dir], stdout=subprocess.PIPE, text=True))
        port = procs[0].stdout.readline().strip()
        procs.append(
            subprocess.Popen(
                [*me, "--_send", src, dest, port, *paths], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
        )
        recv, send = procs
        if send.stdout.readline().strip() != "ready":
            raise ValueError
        warm()
        send.stdin.write("go\n")
        send.stdin.flush()
        t0, send_cpu = map(float, send.stdout.readline().split())
        t1, recv_cpu = map(float, recv.stdout.readline().split())
        if send.wait(60) or recv.wait(60):
            raise ValueError
        got, want = sum(e.stat().st_size for e in os.scandir(out_dir)), sum(map(os.path.getsize, paths))
        if got != want:
            raise BenchError(f"the plain copy received {got} bytes, expected {want}")
        return {"bytes": want, "seconds": t1 - t0, "cpu": {"sender": send_cpu, "receiver": recv_cpu}}
    except ValueError:
        raise BenchError("the plain copy failed (see its traceback above)") from None
    finally:
        for p in reversed(procs):  # the sender first: a receiver killed under it makes it print a traceback
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        shutil.rmtree(out_dir, ignore_errors=True)  # right after the measurement


# ----------------------------------------------------------------------------- google-cloud-storage

GCS_WORKERS, GCS_POOL = 8, 32  # threads of a transfer, and its connection pool (as in tierfs.tiers.gcs_http)


def gcs_client():
    """An anonymous client (the emulator's STORAGE_EMULATOR_HOST must be in os.environ)."""
    import requests
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(credentials=AnonymousCredentials(), project="test")
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=GCS_POOL)  # 8 threads, no throwaway connections
    for scheme in ("http://", "https://"):
        client._http.mount(scheme, adapter)
    return client


def drop_bucket(client, name: str) -> None:
    """Delete every object of a bucket, then the bucket."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(GCS_WORKERS) as pool:
        list(pool.map(lambda blob: blob.delete(), client.list_blobs(name)))
    client.bucket(name).delete()


if __name__ == "__main__":  # the plain copy's two processes
    if sys.argv[1:2] == ["--_recv"]:
        plain_receiver(sys.argv[2], sys.argv[3])
    elif sys.argv[1:2] == ["--_send"]:
        plain_sender(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])
    else:
        sys.exit("benchlib.py is a library; it runs only as the plain copy's --_recv/--_send process")
