"""Helpers every test folder uses: waiting, free ports, Orbax-style steps, committed trees and
their manifests, tree digests."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path

from tierfs_testing import free_port  # noqa: F401 (the package's runners need it too)

from tierfs.core import mounts
from tierfs.core.describe import build
from tierfs.core.keys import bucket_seals, split_secrets
from tierfs.core.manifest import Manifest


def kill_daemon(mountpoint) -> None:
    """kill -9 the daemon of the tierfs mount at ``mountpoint``; return once its keeper's
    successor serves the mount."""
    registration = mounts.Registration(mountpoint)
    before = registration.read()
    os.kill(before["pid"], signal.SIGKILL)
    wait_for(
        lambda: (registration.read() or {}).get("pid") not in (None, before["pid"]),
        timeout=30,
        what="a successor to take the mount over",
    )
    assert registration.read()["keeper"] == before["keeper"]


def wait_for(predicate: Callable, timeout: float = 60, what: str = "condition", interval: float = 0.1):
    """Call ``predicate`` every ``interval`` seconds until it returns something true; return that.

    Fails the test with "timed out waiting for ``what``" after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)
    return value


def write_orbax_step(
    mnt: Path, step: int, files: dict[str, bytes], base: str = "ckpt", prepare: Callable[[Path], None] | None = None
) -> Path:
    """Commit ``files`` as Orbax does: write them into ``<base>/<step>.orbax-checkpoint-tmp``,
    rename it to ``<base>/<step>``.

    ``base=""`` writes at the root of the mount (Orbax under multi-tier checkpointing).
    Files are written in the order given, so a marker goes last. ``prepare(tmp)`` runs just
    before the rename. Returns the step's directory.
    """
    tmp = mnt / base / f"{step}.orbax-checkpoint-tmp"
    for name, data in files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    if prepare is not None:
        prepare(tmp)
    final = mnt / base / str(step)
    os.rename(tmp, final)
    return final


def tree_digest(root: Path, exact: bool = False) -> dict[str, tuple]:
    """Each path beneath ``root``: its type and mode, owner, and a file's size and sha256 or a link's target.

    That is what a restore from another tier must reproduce. ``exact`` adds every path's link
    count and size (a directory's too), which a restart of the same RAM tier also keeps.
    """
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            entry: tuple = (stat.filemode(st.st_mode), st.st_uid, st.st_gid)
            if stat.S_ISLNK(st.st_mode):
                entry += (os.readlink(p),)
            elif stat.S_ISREG(st.st_mode):
                entry += (st.st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            if exact:
                entry += (st.st_size, st.st_nlink)
            out[str(p.relative_to(root))] = entry
    return out


def make_step(
    base: Path, files: dict[str, bytes], *, job: str, rank: int, step: int, chunk_size: int
) -> tuple[Manifest, dict[str, tuple[str, int, int]]]:
    """A committed tree ``ckpt/`` holding ``files``, its manifest, and where each chunk lies."""
    tree = base / f"snap-{rank}-{step}-{random.random()}"
    (tree / "ckpt").mkdir(parents=True)
    for name, data in files.items():
        (tree / "ckpt" / name).write_bytes(data)
    manifest = build(tree, ["ckpt"], job=job, rank=rank, step=step, chunk_size=chunk_size)
    where = {}
    for e in manifest.entries:
        for i, h in enumerate(e.chunks):
            where.setdefault(h, (str(tree / e.path), i * chunk_size, min(chunk_size, e.size - i * chunk_size)))
    return manifest, where


def cpu_latency_limit() -> int:
    """The node's CPU wake-up latency limit in µs (PM QoS), as the kernel applies it now."""
    fd = os.open("/dev/cpu_dma_latency", os.O_RDONLY)
    try:
        return int.from_bytes(os.pread(fd, 4, 0), "little", signed=True)
    finally:
        os.close(fd)


def sealed_key(job: str, h: str, secret: str | None = None) -> str:
    """The bucket object key of chunk ``h`` of ``job``, sealed under ``secret`` (default:
    ``TIERFS_SECRET``, as the daemons the test starts have it)."""
    secret = secret if secret is not None else os.environ["TIERFS_SECRET"]
    return bucket_seals(job, split_secrets(secret.encode())[0])[0].object_key(h)


def opened_manifest(body: bytes, job: str, rank: int, step: int, secret: str | None = None) -> bytes:
    """A manifest object's bytes as a bucket holds them, opened with the job's seal under
    ``secret`` (default: ``TIERFS_SECRET``) when sealed."""
    secret = secret if secret is not None else os.environ["TIERFS_SECRET"]
    data = bucket_seals(job, split_secrets(secret.encode())[0])[0].open_manifest(rank, step, body)
    assert data is not None, f"the manifest of rank {rank} step {step} is not sealed under the job's secret"
    return data
