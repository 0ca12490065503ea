"""The policy loop: commit -> back up to GCS -> retain.

One trio task owns it, started in the daemon's nursery; its blocking work (hashing,
compression, HTTP) runs in worker threads, so the FUSE loop never waits for it and a slow
or absent GCS only delays backups. The loop always backs up the newest committed step;
steps superseded before their turn are skipped, never queued without bound.

A backup of one step, in the order that keeps GCS consistent for readers and for the
garbage collector (see :meth:`tierfs.gcs.GcsStore.collect_garbage`):

1. build the manifest from the step's frozen snapshot (hashes of every chunk);
2. announce the upload with a pending marker listing its chunks;
3. for every distinct chunk: touch it if GCS has it (no bytes sent), else read it from the
   snapshot, check its hash, compress it if that pays, and create it if absent;
4. write the manifest (the commit point on GCS), then drop the pending marker.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import trio

from tierfs import chunks
from tierfs.config import Config
from tierfs.gcs import GcsStore, GcsUnavailable
from tierfs.manifest import Manifest, ManifestError, build
from tierfs.steps import StepState, Steps

log = logging.getLogger(__name__)

UPLOAD_THREADS = 8
BACKOFF = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)


class SnapshotChanged(Exception):
    """A snapshot file was detached while it was being read: build the manifest again."""


class Replicator:
    def __init__(self, cfg: Config, steps: Steps, gcs: GcsStore | None):
        self.cfg = cfg
        self.steps = steps
        self.gcs = gcs
        self._wake = trio.Event()
        self._limiter = trio.CapacityLimiter(UPLOAD_THREADS)
        self._hashed: dict = {}  # (ino, size, mtime_ns) -> chunk hashes: unchanged files are not rehashed
        self.uploading: int | None = None
        self.progress = {"chunks_done": 0, "chunks_total": 0}
        self.gcs_status: dict = {"state": "idle" if gcs else "off", "error": None, "since": None}
        self.last_backup_at: float | None = None
        steps.on_commit = self._committed

    def _committed(self, state: StepState) -> None:
        self._retain_local()
        self._wake.set()

    # -- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        self._retain_local()
        if self.gcs is None:
            return
        failures = 0
        while True:
            state = self._due()
            if state is None:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            if self.cfg.backup_interval and self.last_backup_at is not None:
                await trio.sleep(self._interval_left())
                state = self._due()
                if state is None:
                    continue
            try:
                await self._backup(state)
                failures = 0
            except Exception as e:  # a backup problem must never take the mount down
                delay = BACKOFF[min(failures, len(BACKOFF) - 1)]
                failures += 1
                if isinstance(e, GcsUnavailable):
                    self._set_gcs("unavailable", str(e))
                    log.warning("backup of step %d delayed, retrying in %.0fs: %s", state.step, delay, e)
                elif not isinstance(e, SnapshotChanged):
                    self._set_gcs("failing", f"{type(e).__name__}: {e}")
                    log.exception("backup of step %d failed, retrying in %.0fs", state.step, delay)
                await trio.sleep(delay)
            finally:
                self.uploading = None
            self._retain_local()

    def _due(self) -> StepState | None:
        newest = self.steps.newest()
        return newest if newest is not None and not newest.backed_up else None

    def _interval_left(self) -> float:
        return max(0.0, self.last_backup_at + self.cfg.backup_interval - time.time())

    def _set_gcs(self, state: str, error: str | None = None) -> None:
        if self.gcs_status["state"] != state:
            self.gcs_status["since"] = time.time()
        self.gcs_status.update(state=state, error=error)

    # -- one backup ----------------------------------------------------------------------

    async def _backup(self, state: StepState) -> None:
        cfg, gcs = self.cfg, self.gcs
        version, started = state.version, time.time()
        self.uploading = state.step
        self._set_gcs("uploading")
        manifest = await self._build_manifest(state)
        data = manifest.to_json()
        await self._io(gcs.put_pending, cfg.rank, state.step, manifest.chunk_set())
        uploaded_raw, stored = await self._upload_chunks(manifest, self.steps.snapshots.step_tree(state.step))
        await self._io(gcs.put_manifest, cfg.rank, state.step, data)
        await self._io(gcs.delete_pending, cfg.rank, state.step)
        took = time.time() - started
        if state.version == version:
            state.backup = {
                "version": version,
                "at": time.time(),
                "seconds": round(took, 3),
                "lag_s": round(time.time() - state.committed_at, 3),
                "bytes": manifest.total_bytes,
                "uploaded_bytes": uploaded_raw,
                "stored_bytes": stored,
                "dedup_bytes": manifest.total_bytes - uploaded_raw,
                "chunks": len(manifest.chunk_set()),
            }
            if state.step in self.steps.states:
                self.steps.save(state)
        self.last_backup_at = time.time()
        self._set_gcs("ok")
        log.info(
            "backed up step %d: %d bytes, %d uploaded, %d deduplicated, in %.2fs",
            state.step, manifest.total_bytes, uploaded_raw, manifest.total_bytes - uploaded_raw, took,
        )
        if cfg.rank == 0:  # one collector per job is enough; it covers every rank's manifests
            result = await self._io(gcs.collect_garbage, cfg.keep, cfg.gc_grace)
            log.info("GCS retention: %s", result)

    async def _io(self, fn, *args):
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def _build_manifest(self, state: StepState) -> Manifest:
        """Hash the snapshot; if a file was detached meanwhile, some hash may be of new bytes."""
        snapshots = self.steps.snapshots
        for _ in range(5):
            detaches = snapshots.detaches
            try:
                manifest = await self._io(
                    lambda: build(
                        snapshots.step_tree(state.step), list(state.roots), job=self.cfg.job,
                        rank=self.cfg.rank, step=state.step, chunk_size=self.cfg.chunk_size,
                        known=self._hashed,
                    )
                )
            except ManifestError:
                if snapshots.detaches == detaches:
                    raise
                continue  # a file changed under the hashing: it was detached, hash the copy
            if snapshots.detaches == detaches:
                (snapshots.step_dir(state.step) / "manifest.json").write_bytes(manifest.to_json())
                return manifest
        raise SnapshotChanged(f"step {state.step} kept changing while it was hashed")

    async def _upload_chunks(self, manifest: Manifest, snap: Path) -> tuple[int, int]:
        """Send every distinct chunk GCS lacks; returns (raw bytes uploaded, bytes stored)."""
        where: dict[str, tuple[Path, int, int]] = {}
        for e in manifest.entries:
            for i, h in enumerate(e.chunks):
                length = min(manifest.chunk_size, e.size - i * manifest.chunk_size)
                where.setdefault(h, (snap / e.path, i, length))
        self.progress = {"chunks_done": 0, "chunks_total": len(where)}
        totals = [0, 0]
        send, receive = trio.open_memory_channel(math.inf)
        for item in where.items():
            send.send_nowait(item)
        send.close()

        async def worker() -> None:
            async for h, (path, index, _length) in receive:
                raw, stored = await self._io(self._put_chunk, h, path, index)
                totals[0] += raw
                totals[1] += stored
                self.progress["chunks_done"] += 1

        async with trio.open_nursery() as nursery:
            for _ in range(UPLOAD_THREADS):
                nursery.start_soon(worker)
        return totals[0], totals[1]

    def _put_chunk(self, h: str, path: Path, index: int) -> tuple[int, int]:
        """In a worker thread: make sure GCS holds chunk ``h``; returns (raw, stored) bytes sent."""
        if self.gcs.touch_chunk(h):
            return 0, 0
        for _ in range(2):  # a detach can race with the read: the path then holds the copy
            data = chunks.read_chunk(path, index, self.cfg.chunk_size)
            if chunks.chunk_hash(data) == h:
                break
        else:
            raise SnapshotChanged(f"{path} chunk {index} no longer matches its hash")
        frame = chunks.encode(data)
        if not self.gcs.put_chunk(h, frame):
            return 0, 0  # another rank uploaded the same bytes just now
        return len(data), len(frame)

    # -- local retention -------------------------------------------------------------------

    def _retain_local(self) -> None:
        """Keep the newest committed step and the one being uploaded; older snapshots go."""
        newest = self.steps.newest()
        if newest is None:
            return
        for step in list(self.steps.states):
            if step not in (newest.step, self.uploading):
                self.steps.drop(step)

    # -- status ---------------------------------------------------------------------------

    def status(self) -> dict:
        now = time.time()
        pending = [s for s in self.steps.states.values() if not s.backed_up]
        lag = now - min(s.committed_at for s in pending) if pending and self.gcs else 0.0
        return {
            "url": self.cfg.gcs,
            **self.gcs_status,
            "uploading": self.uploading,
            "progress": self.progress if self.uploading is not None else None,
            "backup_interval_s": self.cfg.backup_interval,
            "backup_lag_s": round(lag, 3),
            "last_backup_at": self.last_backup_at,
        }
