"""Long random sequences of file operations, checked after each one against a model.

The sequences (``random_ops.py``, beside this file) open, close, read, write, truncate,
map, punch holes in, copy into and append to one file through several descriptors, and
after every operation compare its size and bytes, through a second descriptor too, with a
bytearray that had the same operations applied. They run on plain tmpfs (which must agree
with the model: it checks the model), on a volume of each data path, on tierfs' own FUSE
session serving every byte, on a file of a step still being restored lazily, and as a
non-root user. Write-behind answers writes before their bytes are in the RAM tier (pyfuse3), so any
reply that reports a size from before them shows up here as a file that shrank.

A failure prints the seed and the index of the operation. To replay one:

    TIERFS_RANDOM_OPS_SEED=<seed> [TIERFS_RANDOM_OPS=<operations>] pytest tests/fs/test_random_ops.py -k <case>

or on any directory, mounted by hand: ``python3 tests/fs/random_ops.py DIR/f --seed <seed> --ops N``.
Without the variable every run draws new seeds (``SEEDS`` of them per case, each of ``OPS``
operations); ``-m slow`` runs much longer sequences.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from tests.conftest import tierfs
from tests.helpers import kill_daemon, wait_for, write_orbax_step
from tierfs.fs import Operations
from tierfs.fs.session import KernelSession
from tierfs.ramtier import SpaceAccount
from tierfs.ramtier.tmpfs import unmount_beneath

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")

DRIVER = Path(__file__).with_name("random_ops.py")
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")  # any user can run it, unlike a venv under /root
USER = 1000
OPS = int(os.environ.get("TIERFS_RANDOM_OPS", 3000))
SEEDS = 2
SLOW_OPS = 40_000
SLOW_SEEDS = 3
KILL_EVERY = 300  # operations between two kill -9s of the daemon
PYFUSE3_UNSUPPORTED = ["--unsupported", "fallocate"]  # pyfuse3 serves no FUSE_FALLOCATE: EOPNOTSUPP
RESTORED_SIZE = 1 << 20
CHUNK = 64 << 10


# kind -> (TIERFS_DATA_PATH, TIERFS_ENGINE)
VOLUMES = {"passthrough": ("passthrough", "auto"), "daemon": ("daemon", "auto"), "pyfuse3": ("daemon", "pyfuse3")}


def unsupported(kind: str) -> list[str]:
    """What a volume of ``kind`` may refuse: fallocate on pyfuse3 only; the own engine serves it."""
    return PYFUSE3_UNSUPPORTED if kind == "pyfuse3" else []


def seeds(count: int = 1) -> list[int]:
    """The seeds to run: the one asked for in TIERFS_RANDOM_OPS_SEED, or new ones."""
    if "TIERFS_RANDOM_OPS_SEED" in os.environ:
        return [int(os.environ["TIERFS_RANDOM_OPS_SEED"])]
    return [random.SystemRandom().randrange(1 << 32) for _ in range(count)]


def driver_command(path: Path, seed: int, ops: int, *extra: str, user: int | None = None) -> list[str]:
    python = sys.executable if user is None else SYSTEM_PYTHON
    return [python, str(DRIVER), str(path), "--seed", str(seed), "--ops", str(ops), *extra]


def outcome(proc: subprocess.CompletedProcess, seed: int, where: str) -> None:
    """Fail with what the sequence printed (its seed, the failing operation, the ones before)."""
    if proc.returncode == 0:
        return
    report = proc.stdout.decode(errors="replace")
    if not report:  # killed (SIGBUS: a mapping read past what the file really holds): what it was doing
        started = proc.stderr.decode(errors="replace").splitlines()
        report = f"exit status {proc.returncode} (seed {seed}); last operations started:\n  " + "\n  ".join(
            started[-5:]
        )
    pytest.fail(
        f"random operations on {where} disagree with the model (replay: TIERFS_RANDOM_OPS_SEED={seed})\n{report}",
        pytrace=False,
    )


def run_sequences(directory: Path, where: str, ops: int, count: int, *extra: str, user: int | None = None) -> None:
    if user is not None:
        directory = directory / f"user-{user}"
        directory.mkdir()
        os.chown(directory, user, user)
    for seed in seeds(count):
        path = directory / f"file-{seed}"
        proc = subprocess.run(
            driver_command(path, seed, ops, *extra, user=user), capture_output=True, timeout=600, user=user, group=user
        )
        outcome(proc, seed, where)


@pytest.fixture
def place(shm_dir, volumes, monkeypatch):
    """Factory: a directory of the kind asked for, and the options its sequences need."""

    def make(kind: str) -> tuple[Path, list[str]]:
        if kind == "tmpfs":
            d = shm_dir("tierfs-plain")
            os.chmod(d, 0o1777)
            return d, []
        path, engine = VOLUMES[kind]
        monkeypatch.setenv("TIERFS_DATA_PATH", path)
        monkeypatch.setenv("TIERFS_ENGINE", engine)
        vol = volumes(capacity="1G")
        fuse = vol.status()["fuse"]
        assert fuse["data_path"] == path and (fuse["engine"] == "pyfuse3") == (engine == "pyfuse3"), fuse
        return vol.mountpoint, unsupported(kind)

    return make


@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="needs a system python3 that any user can run")
@pytest.mark.parametrize("user", ["root", "user"])
@pytest.mark.parametrize("kind", ["tmpfs", *VOLUMES])
def test_random_operations_agree_with_the_model(place, kind, user):
    directory, extra = place(kind)
    run_sequences(directory, kind, OPS, SEEDS, *extra, user=USER if user == "user" else None)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tmpfs", *VOLUMES])
def test_long_random_operations_agree_with_the_model(place, kind):
    directory, extra = place(kind)
    run_sequences(directory, kind, SLOW_OPS, SLOW_SEEDS, *extra)


@pytest.mark.expect_log(r"tierfs.keeper: the daemon of .* was killed by SIGKILL")
@pytest.mark.parametrize("kind", ["passthrough", "daemon"])
def test_random_operations_agree_with_the_model_while_the_daemon_is_killed(place, kind):
    """The daemon killed every few hundred operations, at whatever moment of one: its
    successor takes the descriptors and mappings over, and the model still agrees."""
    directory, extra = place(kind)
    seed = seeds()[0]
    proc = subprocess.Popen(
        driver_command(directory / f"file-{seed}", seed, OPS, "--progress", str(KILL_EVERY), *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    kills, stderr = 0, []
    try:
        for line in proc.stderr:
            if line.startswith(b"progress"):
                kill_daemon(directory)
                kills += 1
            else:
                stderr.append(line)
        out = proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()
    outcome(
        subprocess.CompletedProcess(proc.args, proc.returncode, out, b"".join(stderr)),
        seed,
        f"{kind} with its daemon killed {kills} times",
    )
    assert kills == OPS // KILL_EVERY


# -- tierfs' own FUSE session, every byte through the daemon -----------------------------------


@asynccontextmanager
async def own_session_without_passthrough(shm_dir):
    """A mount served in this process by :class:`KernelSession` with passthrough refused
    (as on a kernel that does not offer it), write-behind running as in the daemon."""
    tree, mountpoint = shm_dir("tierfs-tree"), shm_dir("tierfs-mnt")
    os.chmod(tree, 0o1777)
    ops = Operations(tree, SpaceAccount(None, tree))
    session = KernelSession(ops, want_passthrough=False, wake_cpus=False, writers=2)
    session.mount(str(mountpoint), "test")
    try:
        async with trio.open_nursery() as nursery:

            async def serve():
                with ops.writes:
                    await session.run()

            nursery.start_soon(serve)
            try:
                await trio.to_thread.run_sync(os.stat, mountpoint)  # INIT is done once this answers
                assert session.data_path == "daemon" and ops.writes.running and ops.writes.threads == 2
                yield mountpoint
            finally:
                session.terminate()
    finally:
        session.close(unmount=True)
        ops.close()


async def session_sequences(shm_dir, ops: int, count: int) -> None:
    done = []
    async with own_session_without_passthrough(shm_dir) as mountpoint:
        for seed in seeds(count):
            with trio.fail_after(600):
                proc = await trio.run_process(
                    driver_command(mountpoint / f"file-{seed}", seed, ops),
                    capture_stdout=True,
                    capture_stderr=True,
                    check=False,
                )
            done.append((proc, seed))
            if proc.returncode:
                break
    for proc, seed in done:  # reported once unmounted, outside the session's nursery
        outcome(proc, seed, "the kernel session without passthrough")


async def test_random_operations_on_the_own_session_without_passthrough(shm_dir):
    await session_sequences(shm_dir, OPS, SEEDS)


@pytest.mark.slow
async def test_long_random_operations_on_the_own_session_without_passthrough(shm_dir):
    await session_sequences(shm_dir, SLOW_OPS, SLOW_SEEDS)


# -- a file of a step still being restored, read before its chunks are in --------------------


def on_disk(status: dict, step: int) -> bool:
    return any(
        s["step"] == step and s["copies"].get("disk", {}).get("version") == s["version"] for s in status["steps"]
    )


@pytest.mark.parametrize("kind", ["passthrough", "daemon", "pyfuse3"])
def test_random_operations_on_a_file_being_restored(volumes, shm_dir, tmp_path, monkeypatch, kind):
    """Step 7 is restored from the disk tier with no prefetch: its file is a placeholder
    whose chunks arrive only when read. The sequence reads it first (every open for
    writing waits for the whole file), then changes it like any other."""
    path, engine = VOLUMES[kind]
    monkeypatch.setenv("TIERFS_DATA_PATH", path)
    monkeypatch.setenv("TIERFS_ENGINE", engine)
    options = dict(job="lazy", capacity="256M", disk=tmp_path / "nvme", chunk_size=f"{CHUNK // 1024}K")
    vol = volumes(**options)
    data = random.randbytes(RESTORED_SIZE)
    write_orbax_step(vol.mountpoint, 7, {"w": data})
    wait_for(lambda: on_disk(vol.status(), 7), what="step 7 on the disk")
    tierfs("unmount", vol.mountpoint)
    unmount_beneath(vol.ramdisk / "lazy" / "rank-0")
    shutil.rmtree(vol.ramdisk / "lazy" / "rank-0")

    again = volumes(mountpoint=vol.mountpoint, prefetch=0, **options)
    restored = again.status()["restored"]
    assert (restored["step"], restored["state"], restored["bytes_missing"]) == (7, "on demand", RESTORED_SIZE)
    initial = shm_dir("tierfs-initial") / "w"
    initial.write_bytes(data)
    seed = seeds()[0]
    proc = subprocess.run(
        driver_command(
            again.mountpoint / "ckpt" / "7" / "w",
            seed,
            OPS,
            "--initial",
            str(initial),
            "--lazy",
            "300",
            "--source",
            str(again.mountpoint / "source"),
            *unsupported(kind),
        ),
        capture_output=True,
        timeout=600,
    )
    outcome(proc, seed, f"a file being restored ({kind})")
    restored = again.status()["restored"]
    assert restored["demand_fetches"] > 0 and restored["state"] == "done", restored
