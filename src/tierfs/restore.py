"""Restore onto an empty RAM tier: the newest step of this rank that GCS holds a manifest for.

The step is rebuilt in a staging tree beside the real one and swapped in only when every
chunk has been fetched and verified, so a failed or interrupted restore never shows a
partial checkpoint: the next start finds an empty tree and tries again.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierfs import chunks
from tierfs.config import Config, format_size
from tierfs.errors import UserError
from tierfs.gcs import GcsStore, GcsUnavailable, MissingObject
from tierfs.manifest import Manifest, ManifestError
from tierfs.ramtier import RankDir
from tierfs.steps import StepState, Steps

log = logging.getLogger(__name__)

FETCH_THREADS = 8
ATTEMPTS = 4  # per chunk, on top of the GCS module's own quick retries


def tree_is_empty(tree: Path) -> bool:
    with os.scandir(tree) as it:
        return next(it, None) is None


def restore_from_gcs(cfg: Config, gcs: GcsStore, rank: RankDir, steps: Steps) -> dict | None:
    """Restore the newest step in GCS into the empty tree; returns what was restored, or None."""
    available = _retrying(gcs.list_steps, cfg.rank)
    if not available:
        log.info("GCS holds no step of %s rank %d: starting empty", cfg.job, cfg.rank)
        return None
    step = available[-1]
    started = time.time()
    try:
        manifest = Manifest.from_json(_retrying(gcs.get_manifest, cfg.rank, step))
    except ManifestError as e:
        raise UserError(f"manifest of step {step} in {cfg.gcs} is unusable: {e}") from None
    if cfg.capacity is not None and manifest.total_bytes > cfg.capacity:
        raise UserError(
            f"step {step} in {cfg.gcs} holds {format_size(manifest.total_bytes)}, more than "
            f"--capacity {format_size(cfg.capacity)}: raise the capacity"
        )
    staging = rank.path / ".restoring"
    shutil.rmtree(staging, ignore_errors=True)
    os.mkdir(staging)
    os.chmod(staging, 0o1777)
    try:
        _materialize(manifest, staging, gcs)
        os.rmdir(rank.tree)  # empty, checked by the caller
        os.rename(staging, rank.tree)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for root in manifest.roots:
        steps.snapshots.freeze(step, root, set())
    state = StepState(step, sorted(manifest.roots), time.time(), source="gcs")
    state.backup = {"version": state.version, "at": time.time(), "bytes": manifest.total_bytes,
                    "uploaded_bytes": 0, "dedup_bytes": manifest.total_bytes, "restored": True}
    steps.states[step] = state
    steps.save(state)
    (steps.snapshots.step_dir(step) / "manifest.json").write_bytes(manifest.to_json())
    took = time.time() - started
    log.info("restored step %d from %s: %s in %.2fs", step, cfg.gcs, format_size(manifest.total_bytes), took)
    return {"step": step, "from": cfg.gcs, "tier": "gcs", "bytes": manifest.total_bytes,
            "files": sum(e.kind == "file" for e in manifest.entries), "seconds": round(took, 3),
            "at": time.time()}


def _materialize(manifest: Manifest, root: Path, gcs: GcsStore) -> None:
    """Create every entry under ``root`` and fill files with verified chunks."""
    fds: dict[str, int] = {}
    wanted: dict[str, list[tuple[int, int]]] = {}  # chunk -> (fd, offset) it fills
    try:
        for e in manifest.entries:
            path = root / e.path
            if e.kind == "dir":
                path.mkdir(exist_ok=True)
            elif e.kind == "symlink":
                os.symlink(e.target, path)
            else:
                fd = fds[e.path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                os.ftruncate(fd, e.size)
                for i, h in enumerate(e.chunks):
                    wanted.setdefault(h, []).append((fd, i * manifest.chunk_size))

        def fetch(h: str) -> None:
            data = _fetch_chunk(gcs, h)
            for fd, offset in wanted[h]:
                os.pwrite(fd, data, offset)

        with ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="restore") as pool:
            for _ in pool.map(fetch, wanted):
                pass
    finally:
        for fd in fds.values():
            os.close(fd)
    for e in reversed(manifest.entries):  # children before parents: directory mtimes stick
        path = root / e.path
        os.chown(path, e.uid, e.gid, follow_symlinks=False)
        if e.kind != "symlink":
            os.chmod(path, stat.S_IMODE(e.mode))
        os.utime(path, ns=(e.mtime_ns, e.mtime_ns), follow_symlinks=False)


def _fetch_chunk(gcs: GcsStore, h: str) -> bytes:
    url = gcs.chunk_url(h)
    try:
        frame = _retrying(gcs.get_chunk_frame, h)
    except MissingObject:
        raise UserError(f"chunk {url} is missing from GCS: the step cannot be restored from it") from None
    try:
        return chunks.decode(frame, h)
    except chunks.CorruptChunk as e:
        raise UserError(f"chunk {url} is corrupt ({e}): the step cannot be restored from GCS") from None


def _retrying(fn, *args):
    for attempt in range(ATTEMPTS):
        try:
            return fn(*args)
        except GcsUnavailable as e:
            if attempt == ATTEMPTS - 1:
                raise UserError(f"GCS is unreachable while restoring: {e}") from None
            time.sleep(2**attempt)
