"""The policy loop: commit -> replicate to peers and back up to GCS -> retain.

One trio task owns it, started in the daemon's nursery; it runs one *lane* per remote tier
(peers, GCS), each a task that always works on the newest committed step its tier lacks.
Steps superseded before their turn are skipped, never queued without bound, and a slow or
absent tier only delays its own lane. Blocking work (hashing, compression, HTTP) runs in
worker threads; peer transfers are trio sockets with zero-copy sends, so the FUSE loop
never waits for either.

Both lanes share the step's manifest, built once per committed version from the frozen
snapshot. A GCS backup then goes, in the order that keeps the bucket consistent for
readers and for the garbage collector (see :meth:`tierfs.tiers.gcs_store.GcsStore.collect_garbage`):

1. announce the upload with a pending marker listing its chunks;
2. for every distinct chunk: touch it if GCS has it (no bytes sent), else read it from the
   snapshot, check its hash, compress it if that pays, and create it if absent;
3. write the manifest (the commit point on GCS), then drop the pending marker.

A replication asks each chosen peer which chunks it holds, sends the others straight from
the snapshot files, then the manifest (the commit point on that peer).
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from tierfs import chunks
from tierfs.atomic import write_atomically
from tierfs.config import Config
from tierfs.manifest import Manifest, ManifestError, build
from tierfs.peers.network import PeerNetwork
from tierfs.peers.wire import PeerError
from tierfs.steps import StepState, Steps

if TYPE_CHECKING:
    from tierfs.tiers.gcs_store import GcsStore  # google-cloud-storage is slow to import: only with --gcs

log = logging.getLogger(__name__)

UPLOAD_THREADS = 8
# While the job writes, background transfers wait for a pause in its writes, up to this
# long per chunk: a checkpoint being written gets the CPU, replication still progresses.
WRITER_QUIET = 0.05
MAX_DEFER = 1.0
RECHECK_PEERS = 10.0  # seconds between checks that the peers still hold the newest replica
BACKOFF = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)


class SnapshotChanged(Exception):
    """A snapshot file was detached while it was being read: read it again."""


class Lane:
    """One remote tier's progress: which step it works on, and how it is doing."""

    def __init__(self, name: str, work: Callable[[StepState], Awaitable[None]],
                 done: Callable[[StepState], bool], transient: tuple[type[Exception], ...],
                 interval: float = 0.0, recheck: Callable[[StepState], Awaitable[None]] | None = None):
        self.name, self.work, self.done, self.interval = name, work, done, interval
        self.transient = transient  # the tier is away: retry quietly (anything else is logged)
        self.recheck = recheck  # when idle: is the newest step still where we put it?
        self.every_steps = 0  # work on a step only this many steps after the last one (0: any)
        self.last_step: int | None = None
        self.wake = trio.Event()
        self.busy: int | None = None
        self.last_at: float | None = None
        self.status: dict = {"state": "idle", "error": None, "since": time.time()}

    def set(self, state: str, error: str | None = None) -> None:
        if self.status["state"] != state:
            self.status["since"] = time.time()
        self.status.update(state=state, error=error)


class Replicator:
    def __init__(self, cfg: Config, steps: Steps, gcs: GcsStore | None, peers: PeerNetwork | None,
                 last_write: Callable[[], float] = lambda: 0.0,
                 retention_floor: Callable[[], int | None] | None = None):
        self.cfg = cfg
        # The newest step complete on every rank; alone, that is simply our newest.
        self.retention_floor = retention_floor or (lambda: max(steps.states, default=None))
        self._last_write = last_write
        self.steps = steps
        self.gcs = gcs
        self.peers = peers
        self._limiter = trio.CapacityLimiter(UPLOAD_THREADS)
        self._hashed: dict = {}  # (ino, size, mtime_ns) -> chunk hashes: unchanged files are not rehashed
        self._manifests: dict[int, tuple[int, Manifest]] = {}  # step -> (version, manifest)
        self._local: dict[str, tuple[str, int, int]] = {}  # chunk -> where this node holds it
        self._build_lock = trio.Lock()
        self.progress: dict = {}
        self._trash: list[Path] = []  # dropped snapshots, deleted off the trio thread
        self._trash_wake = trio.Event()
        self.lanes: dict[str, Lane] = {}
        self.dropped: Callable[[list[str]], None] = lambda roots: None  # a step left the RAM tier
        if peers is not None:
            self.lanes["peers"] = Lane("peers", self._replicate, self._replicated, (PeerError,),
                                       recheck=self._recheck_replicas)
        if gcs is not None:
            from tierfs.tiers.gcs_store import GcsUnavailable

            self.lanes["gcs"] = Lane("gcs", self._backup, lambda s: s.backed_up, (GcsUnavailable,),
                                     cfg.backup_interval)
        self.reconfigure(cfg)
        steps.on_commit = self._committed

    def reconfigure(self, cfg: Config) -> None:
        """Follow a changed job shape (the multi-tier checkpointing protocol's replicator.yaml)."""
        self.cfg = cfg
        gcs = self.lanes.get("gcs")
        if gcs is not None:
            gcs.interval, gcs.every_steps = cfg.backup_interval, cfg.backup_interval_steps
            gcs.wake.set()

    def _committed(self, state: StepState) -> None:
        self.retain_local()
        for lane in self.lanes.values():
            lane.wake.set()

    # -- the lanes -----------------------------------------------------------------------

    async def run(self) -> None:
        self.retain_local()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._empty_trash)
            for lane in self.lanes.values():
                nursery.start_soon(self._run_lane, lane)

    async def _empty_trash(self) -> None:
        while True:
            await self._trash_wake.wait()
            self._trash_wake = trio.Event()
            while self._trash:
                await trio.to_thread.run_sync(shutil.rmtree, self._trash.pop(), True)

    async def _run_lane(self, lane: Lane) -> None:
        failures = 0
        while True:
            newest = self.steps.newest()
            early = (newest is not None and lane.every_steps and lane.last_step is not None
                     and newest.step < lane.last_step + lane.every_steps)
            if newest is None or lane.done(newest) or early:
                with trio.move_on_after(RECHECK_PEERS if lane.recheck else math.inf):
                    await lane.wake.wait()
                    lane.wake = trio.Event()
                    continue
                if newest is not None:
                    try:
                        await lane.recheck(newest)
                    except Exception as e:
                        log.warning("%s: could not recheck step %d: %s", lane.name, newest.step, e)
                continue
            wait = lane.last_at + lane.interval - time.time() if lane.interval and lane.last_at else 0.0
            if wait > 0:
                await trio.sleep(wait)
                continue  # the newest step may have changed meanwhile
            lane.busy = newest.step
            lane.set("working")
            try:
                await lane.work(newest)
                lane.last_at, lane.last_step = time.time(), newest.step
                lane.set("ok")
                failures = 0
            except Exception as group:  # a tier's trouble must never take the mount down
                e = _first_leaf(group)
                delay = BACKOFF[min(failures, len(BACKOFF) - 1)]
                failures += 1
                if isinstance(e, SnapshotChanged):
                    log.info("step %d changed while read for %s; again", newest.step, lane.name)
                else:
                    transient = isinstance(e, lane.transient)
                    lane.set("unavailable" if transient else "failing", f"{type(e).__name__}: {e}")
                    log.warning("%s: step %d delayed, retrying in %.0fs: %s", lane.name, newest.step, delay, e,
                                exc_info=not transient)
                    await trio.sleep(delay)
            finally:
                lane.busy = None
                self.retain_local()

    # -- manifests -----------------------------------------------------------------------

    async def manifest_for(self, state: StepState) -> Manifest:
        """The manifest of the step's current version, built once and shared by the lanes."""
        async with self._build_lock:
            cached = self._manifests.get(state.step)
            if cached is not None and cached[0] == state.version:
                return cached[1]
            version = state.version
            manifest = await self._build_manifest(state)
            self._manifests[state.step] = (version, manifest)
            self._index_local()
            return manifest

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
                write_atomically(snapshots.step_dir(state.step) / "manifest.json", manifest.to_json())
                return manifest
        raise SnapshotChanged(f"step {state.step} kept changing while it was hashed")

    def chunk_locations(self, manifest: Manifest) -> dict[str, tuple[Path, int, int]]:
        """Where each distinct chunk of a step lives in its snapshot: (path, offset, length)."""
        snap = self.steps.snapshots.step_tree(manifest.step)
        where: dict[str, tuple[Path, int, int]] = {}
        for e in manifest.entries:
            for i, h in enumerate(e.chunks):
                offset = i * manifest.chunk_size
                where.setdefault(h, (snap / e.path, offset, min(manifest.chunk_size, e.size - offset)))
        return where

    def find_local(self, h: str) -> tuple[str, int, int] | None:
        """This node's own committed copy of chunk ``h`` (lets twins replicate with no transfer)."""
        return self._local.get(h)

    def _index_local(self) -> None:
        self._local = {
            h: (str(path), offset, length)
            for _, manifest in self._manifests.values()
            for h, (path, offset, length) in self.chunk_locations(manifest).items()
        }

    async def yield_to_writers(self) -> None:
        """Wait (at most MAX_DEFER) until the job has not written for WRITER_QUIET seconds."""
        deadline = trio.current_time() + MAX_DEFER
        while trio.current_time() < deadline:
            quiet_for = time.monotonic() - self._last_write()
            if quiet_for >= WRITER_QUIET:
                return
            await trio.sleep(WRITER_QUIET - quiet_for)

    async def _io(self, fn, *args):
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    # -- peers ---------------------------------------------------------------------------

    def _replicated(self, state: StepState) -> bool:
        r = state.replicas
        return r.get("version") == state.version and len(r.get("peers", ())) >= self.cfg.replicas

    async def _replicate(self, state: StepState) -> None:
        version, started = state.version, time.time()
        manifest = await self.manifest_for(state)
        result = await self.peers.replicate(manifest, self.chunk_locations(manifest), self.yield_to_writers)
        if state.version == version:
            state.replicas = {**result, "version": version, "at": time.time(),
                              "seconds": round(time.time() - started, 3),
                              "lag_s": round(time.time() - state.committed_at, 3)}
            self._save(state)
        log.info("replicated step %d to %s: %d bytes sent, %d already there",
                 state.step, ", ".join(result["peers"]), result["sent_bytes"], result["skipped_bytes"])

    async def _recheck_replicas(self, state: StepState) -> None:
        """A peer that lost its RAM (or was replaced) no longer holds our replica: replace it."""
        holdings = await self.peers.holdings()
        names = {f"{a[0]}:{a[1]}": set(held) for a, held in holdings.items()}
        kept = [p for p in state.replicas.get("peers", []) if (self.cfg.rank, state.step) in names.get(p, ())]
        if kept != state.replicas.get("peers"):
            lost = sorted(set(state.replicas["peers"]) - set(kept))
            log.warning("step %d is no longer on %s: replicating it again", state.step, ", ".join(lost))
            state.replicas = {**state.replicas, "peers": kept}
            self._save(state)

    # -- GCS -----------------------------------------------------------------------------

    async def _backup(self, state: StepState) -> None:
        cfg, gcs = self.cfg, self.gcs
        version, started = state.version, time.time()
        manifest = await self.manifest_for(state)
        await self._io(gcs.put_pending, cfg.rank, state.step, manifest.chunk_set())
        uploaded_raw, stored = await self._upload_chunks(manifest)
        await self._io(gcs.put_manifest, cfg.rank, state.step, manifest.to_json())
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
            self._save(state)
        log.info(
            "backed up step %d: %d bytes, %d uploaded, %d deduplicated, in %.2fs",
            state.step, manifest.total_bytes, uploaded_raw, manifest.total_bytes - uploaded_raw, took,
        )
        if cfg.rank == 0:  # one collector per job is enough; it covers every rank's manifests
            result = await self._io(gcs.collect_garbage, cfg.keep, cfg.gc_grace, cfg.nodes)
            log.info("GCS retention: %s", result)

    async def _upload_chunks(self, manifest: Manifest) -> tuple[int, int]:
        """Send every distinct chunk GCS lacks; returns (raw bytes uploaded, bytes stored)."""
        where = self.chunk_locations(manifest)
        progress = self.progress["gcs"] = {"step": manifest.step, "chunks_done": 0, "chunks_total": len(where)}
        totals = [0, 0]
        send, receive = trio.open_memory_channel(math.inf)
        for h, (path, offset, _length) in where.items():
            send.send_nowait((h, path, offset // manifest.chunk_size))
        send.close()

        async def worker() -> None:
            async for h, path, index in receive:
                await self.yield_to_writers()
                raw, stored = await self._io(self._put_chunk, h, path, index)
                totals[0] += raw
                totals[1] += stored
                progress["chunks_done"] += 1

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

    def _save(self, state: StepState) -> None:
        if self.steps.states.get(state.step) is state:
            self.steps.save(state)

    def retain_local(self) -> None:
        """Drop local snapshots that no tier needs any more.

        Kept: the ``--keep-local`` newest committed steps, the steps a lane is sending, and
        every step from the newest one complete on every rank on (``retention_floor``;
        everything while that is unknown): that step may exist nowhere else.
        """
        floor = self.retention_floor()
        keep = set(sorted(self.steps.states)[-self.cfg.keep_local:])
        keep |= {lane.busy for lane in self.lanes.values()}
        for step in list(self.steps.states):
            if step not in keep and floor is not None and step < floor:
                roots = list(self.steps.states[step].roots)
                trash = self.steps.drop(step)
                self.dropped(roots)
                if trash is not None:
                    self._trash.append(trash)
                    self._trash_wake.set()
                if self._manifests.pop(step, None) is not None:
                    self._index_local()

    # -- status ---------------------------------------------------------------------------

    def status(self) -> dict:
        now = time.time()
        out = {}
        for name, lane in self.lanes.items():
            pending = [s for s in self.steps.states.values() if not lane.done(s)]
            lag = now - min(s.committed_at for s in pending) if pending else 0.0
            out[name] = {**lane.status, "working_on": lane.busy, "lag_s": round(lag, 3),
                         "last_at": lane.last_at, "progress": self.progress.get(name) if lane.busy else None}
        if "gcs" in out:
            out["gcs"].update(url=self.cfg.gcs, backup_interval_s=self.cfg.backup_interval)
        if "peers" in out and self.peers is not None:
            out["peers"].update(replicas=self.cfg.replicas, known=self.peers.status())
        return out


def _first_leaf(e: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups from a nursery of workers."""
    while isinstance(e, BaseExceptionGroup):
        e = e.exceptions[0]
    return e
