"""Restore: the chosen step's files appear at once; their bytes follow, on demand and in the background.

The step is rebuilt as a snapshot (``steps/<step>/tree``) of placeholder files that have
their final names, sizes, modes and owners but no data yet (holes cost no RAM), and those
are hard-linked into the volume. From then on:

- a read of a placeholder waits only for the chunks it covers (``wait_range``); a chunk
  two readers want is fetched once;
- background workers fetch the rest in manifest order, each starting at a different peer
  so the peers holding the step work in parallel, the disk before them, GCS only for
  what no node can give (``--prefetch`` of them, 0 for on-demand only);
- anything that would change a placeholder waits for the whole file first, so the
  snapshot the job's change detaches from is complete, never a half-filled file.

A chunk of zeros is never fetched: the placeholder's hole already reads as it, so a sparse
file is restored sparse, at the cost of what it holds. Every other chunk is verified
against its name before it is written. A chunk's name is appended
to ``restored-chunks`` once all its places are written, so a daemon killed mid-restore
resumes from that journal without refetching what it verified, and its placeholders are
still placeholders, served the same way. Only when every chunk is in does the step get its
``state.json``: until then it is neither replicated, backed up, nor reported to peers as
held.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

import trio

from tierfs.config import Config
from tierfs.core import chunks
from tierfs.core.atomic import write_atomically
from tierfs.core.errors import UserError
from tierfs.core.linux import pwrite_all
from tierfs.core.manifest import Entry, Manifest
from tierfs.core.parse import format_size
from tierfs.pipeline.manifests import fetch_manifest as fetch_manifest  # re-exported: callers import it from here
from tierfs.pipeline.namespace import create_placeholders, link_into_tree
from tierfs.pipeline.resume import finished, journal_path, open_journal, read_journal, read_progress, write_progress
from tierfs.ramtier import RankDir, SpaceAccount
from tierfs.ramtier.steps import Steps, StepState
from tierfs.tiers.base import Tier, by_cost
from tierfs.tiers.fetch import ChunkSources

log = logging.getLogger(__name__)

RETRY = 5.0  # seconds before chunks that no tier could give are tried again


@dataclass
class _File:
    entry: Entry
    path: str  # the placeholder, in the step's snapshot
    missing: set[int]  # chunk indexes not written yet
    fd: int | None = None  # opened by the first chunk that arrives

    def opened(self) -> int:
        """The descriptor :meth:`Restore._place` opened for the chunks in flight (closed once none is missing)."""
        if self.fd is None:
            raise RuntimeError(f"{self.path} is not open for writing")
        return self.fd


@dataclass
class Origin:
    """The tiers that hold the step's manifest (so, its whole step), for the step's record."""

    tiers: list[Tier] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tiers]


class Restore:
    """One step of this rank, arriving into the RAM tier while the volume is in use."""

    def __init__(
        self,
        cfg: Config,
        rank: RankDir,
        steps: Steps,
        space: SpaceAccount,
        manifest: Manifest,
        sources: ChunkSources,
        origin: Origin,
    ):
        self.cfg, self.rank, self.steps, self.space = cfg, rank, steps, space
        self.manifest, self.sources, self.origin = manifest, sources, origin
        self.step = manifest.step
        self.dir = steps.snapshots.step_dir(self.step)
        self.snap = steps.snapshots.step_tree(self.step)
        self._files: dict[int, _File] = {}  # FUSE inode -> file still missing chunks
        self._users: dict[str, list[tuple[_File, int]]] = {}  # chunk -> (file, index) it fills
        self._done: set[str] = set()
        self._places: dict[str, tuple[str, int, int]] | None = None  # chunk -> its first place, once asked
        self._inflight: dict[str, trio.Event] = {}
        self._failed: dict[str, str] = {}  # chunk -> why no tier gave it (cleared on retry)
        self.last_error: str | None = None
        self._progress = trio.Event()
        self._journal: TextIO | None = None  # opened by prepare()
        self._nursery: trio.Nursery | None = None  # hosts the fetches, while run() runs
        self.mounted = trio.Event()  # prefetch waits for it: the mount's start-up goes first
        self.total = len(manifest.chunk_set())
        self.started = time.time()
        self.first_byte_s: float | None = None
        self.finished_at: float | None = None
        self.demand_fetches = 0
        self.on_finish: Callable[[dict], None] = lambda status: None  # given the status of the finished restore

    # -- preparing the namespace ---------------------------------------------------------

    def prepare(self) -> None:
        """Create the placeholders (or find them again after a crash) and link them into the volume."""
        state = read_progress(self.dir)
        if state is None or state.get("step") != self.step:
            shutil.rmtree(self.dir, ignore_errors=True)
            os.mkdir(self.dir, 0o700)  # steps/ exists (Snapshots.load) and is root-only too
            write_atomically(self.dir / "manifest.json", self.manifest.sealed(self.cfg.manifest_keys))
            state = {"step": self.step, "prepared": False, "linked": False, "tiers": self.origin.names}
            write_progress(self.dir, state)
        if not state["prepared"]:
            shutil.rmtree(self.snap, ignore_errors=True)
            journal_path(self.dir).unlink(missing_ok=True)
            create_placeholders(self.snap, self.manifest)
            state["prepared"] = True
            write_progress(self.dir, state)
        self.steps.snapshots.pin_step(self.step)
        self.steps.restoring.add(self.step)
        if not state["linked"]:
            for root in self.manifest.roots:
                self._link_into_tree(root)
            state["linked"] = True
            write_progress(self.dir, state)
        self._load_journal()

    def _link_into_tree(self, root: str) -> None:
        """Put the step's ``root`` into the volume; whatever was in its way is set aside."""
        link_into_tree(self.rank, self.snap, root, f"it is in the way of restored step {self.step}")

    def _load_journal(self) -> None:
        done = read_journal(self.dir)
        if done is not None:
            self._done = done
        self._journal = open_journal(self.dir)
        # A placeholder is all hole, so a chunk of zeros is in place already: never fetched, nor written.
        self._done |= {h for h, length in self.manifest.chunk_sizes().items() if h == chunks.zero_hash(length)}
        cs, snap = self.manifest.chunk_size, str(self.snap)
        for entry in self.manifest.entries:
            if entry.kind != "file":
                continue
            missing = {i for i, h in enumerate(entry.chunks) if h not in self._done}
            if not missing:
                continue
            f = _File(entry, os.path.join(snap, entry.path), missing)
            st = os.lstat(f.path)
            self._files[st.st_ino] = f
            self.space.update(st)
            for i in missing:
                self._users.setdefault(entry.chunks[i], []).append((f, i))
        log.info(
            "restoring step %d: %d of %d chunks to fetch (%s), %d already here",
            self.step,
            len(self._users),
            self.total,
            format_size(sum(min(cs, f.entry.size - i * cs) for f in self._files.values() for i in f.missing)),
            len(self._done),
        )

    # -- serving the mount ---------------------------------------------------------------

    def pending(self, ino: int) -> bool:
        return ino in self._files

    async def wait_range(self, ino: int, offset: int, size: int) -> None:
        f = self._files.get(ino)
        if f is None:
            return
        cs = self.manifest.chunk_size
        last = min(len(f.entry.chunks), -(-(offset + size) // cs))
        wanted = [f.entry.chunks[i] for i in range(offset // cs, last) if i in f.missing]
        await self._wait_chunks(wanted)

    async def wait_file(self, ino: int) -> None:
        f = self._files.get(ino)
        if f is not None:
            await self._wait_chunks([f.entry.chunks[i] for i in sorted(f.missing)])

    async def _wait_chunks(self, hashes: list[str]) -> None:
        for h in hashes:
            if h in self._done:
                continue
            event = self._inflight.get(h)
            if event is None:
                self.demand_fetches += 1
                event = self._start(h, prefer=0)
            await event.wait()
            if h not in self._done:
                log.error("read of restoring step %d failed: %s", self.step, self._failed.get(h, self.last_error))
                raise OSError(errno.EIO, f"chunk {h} unavailable")

    def _start(self, h: str, prefer: int) -> trio.Event:
        return self._start_batch([h], prefer)

    def _start_batch(self, hs: list[str], prefer: int) -> trio.Event:
        """Fetch chunks ``hs`` together; the event is set once each of them is in or has failed."""
        event = trio.Event()
        for h in hs:
            self._inflight[h] = event
        if self._nursery is None:  # never so: the mount, whose reads start fetches, comes after run() started
            raise RuntimeError(f"restore of step {self.step} is not running")
        self._nursery.start_soon(self._fetch, hs, prefer, event)
        return event

    # -- fetching ------------------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Prefetch until every chunk is in, then record the step as committed here.

        Also hosts the fetches that reads start, so it must run as long as the mount does.
        """
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await self.mounted.wait()
                while self._users.keys() - self._done:
                    if self.cfg.prefetch:
                        await self._prefetch_pass()
                    if not self._users.keys() - self._done:
                        break
                    with trio.move_on_after(RETRY if self._failed else float("inf")):
                        await self._progress.wait()
                    self._progress = trio.Event()
                    self._failed.clear()
                self._finish()
        finally:
            self._close_files()

    async def _prefetch_pass(self) -> None:
        hashes = self.sources.order([h for e in self.manifest.entries for h in e.chunks])
        sizes, (most_bytes, most_chunks) = self.manifest.chunk_sizes(), self.sources.batch()
        at = 0

        def take() -> list[str]:
            """The next chunks no one has fetched or is fetching, as many as one request carries."""
            nonlocal at
            batch: list[str] = []
            total = 0
            while at < len(hashes):
                h = hashes[at]
                if h in self._done or h in self._failed or h in self._inflight or h in batch:
                    at += 1
                    continue
                if batch and (len(batch) >= most_chunks or total + sizes[h] > most_bytes):
                    break
                batch.append(h)
                total += sizes[h]
                at += 1
            return batch

        async def worker(n: int) -> None:
            while batch := take():
                await self._start_batch(batch, prefer=n).wait()

        async with trio.open_nursery() as nursery:
            for n in range(self.cfg.prefetch):
                nursery.start_soon(worker, n)

    async def _fetch(self, hs: list[str], prefer: int, event: trio.Event) -> None:
        """Fetch chunks ``hs`` into place: together from a tier that takes batches, one by one from the rest."""
        try:
            alone = hs
            if len(hs) > 1:
                places = {h: self._place(h) for h in hs}
                cs = self.manifest.chunk_size
                left = await self.sources.fetch_many_into(
                    [
                        (h, length, targets[0][0].opened(), targets[0][1] * cs)
                        for h, (targets, length) in places.items()
                    ],
                    prefer,
                )
                alone = [h for h, _, _, _ in left]
                for h in hs:
                    if h not in alone:
                        await self._settle(h, *places[h])
            for h in alone:
                try:
                    await self._settle(h, *await self._fetch_one(h, prefer))
                except UserError as e:
                    self._failed[h] = self.last_error = str(e)
                    log.warning("restore of step %d: %s", self.step, e)
        finally:
            for h in hs:
                del self._inflight[h]
            event.set()
            self._progress.set()

    def _place(self, h: str) -> tuple[list[tuple[_File, int]], int]:
        """Where chunk ``h`` goes (its first place first, each file opened for writing), and its length."""
        targets = [(f, i) for f, i in self._users[h] if i in f.missing]
        for f, _ in targets:
            if f.fd is None:
                f.fd = os.open(f.path, os.O_WRONLY | os.O_CLOEXEC)
        first, index = targets[0]
        return targets, min(self.manifest.chunk_size, first.entry.size - index * self.manifest.chunk_size)

    async def _fetch_one(self, h: str, prefer: int) -> tuple[list[tuple[_File, int]], int]:
        """Fetch a chunk straight into its first place (from the first tier that has it); its places."""
        targets, length = self._place(h)
        first, index = targets[0]
        await self.sources.fetch_into(h, length, first.opened(), index * self.manifest.chunk_size, prefer)
        return targets, length

    async def _settle(self, h: str, targets: list[tuple[_File, int]], length: int) -> None:
        """Copy a chunk fetched into its first place to the others, then record it as here.

        The chunk lands in the placeholder before it is verified (a peer's bytes are hashed as
        they arrive); until it is recorded here no read is served from that range, and a
        chunk that fails is written again from the next tier. Copies and writes run in
        worker threads: filling fresh tmpfs pages is the slowest part of a fetch, and the
        FUSE requests (a listing right after mount) must not queue behind it. Only one fetch
        per chunk is in flight, and a file's descriptor closes only once all its chunks are
        recorded, so no two writes race for one range.
        """
        cs = self.manifest.chunk_size
        first, index = targets[0]
        if len(targets) > 1:
            await trio.to_thread.run_sync(
                _copy_to, first.path, index * cs, length, [(f.opened(), i * cs) for f, i in targets[1:]]
            )
        for f, i in targets:
            fd = f.opened()
            os.utime(fd, ns=(f.entry.mtime_ns, f.entry.mtime_ns))
            st = os.fstat(fd)
            self.space.update(st)
            f.missing.discard(i)
            if not f.missing:
                os.close(fd)
                f.fd = None
                self._files.pop(st.st_ino, None)
        self._done.add(h)
        if self._journal is None:  # never so: prepare() opened it, and run() comes after
            raise RuntimeError(f"restore of step {self.step} was not prepared")
        self._journal.write(h + "\n")
        self.sources.arrived(h)
        if self.first_byte_s is None:
            self.first_byte_s = round(time.time() - self.started, 3)

    def location(self, h: str) -> tuple[str, int, int] | None:
        """Where a chunk this restore wrote is (its first place), for the peer service; None if not in yet."""
        if h not in self._done:
            return None
        if self._places is None:
            snap = str(self.snap)
            self._places = {
                c: (os.path.join(snap, path), offset, length)
                for c, (path, offset, length) in self.manifest.chunk_places().items()
            }
        return self._places.get(h)

    def done_chunks(self) -> set[str]:
        return set(self._done)

    def _close_files(self) -> None:
        for f in self._files.values():
            if f.fd is not None:
                os.close(f.fd)
                f.fd = None
        if self._journal is not None:
            self._journal.close()

    def _finish(self) -> None:
        """Every chunk is in: the step is committed here, and already where it came from."""
        self._close_files()
        now = time.time()
        held = [(t, t.lane) for t in by_cost(self.origin.tiers) if t.lane is not None]
        state = StepState(self.step, sorted(self.manifest.roots), now, source=held[0][0].kind if held else "local")
        for tier, lane in held:  # the step is already on every tier it came from: no lane sends it back
            record = state.copies.setdefault(
                lane,
                {
                    "version": state.version,
                    "at": now,
                    "tiers": [],
                    "bytes": self.manifest.total_bytes,
                    "chunks": self.total,
                    "sent_bytes": 0,
                    "skipped_bytes": 0,
                    "stored_bytes": 0,
                    "restored": True,
                },
            )
            record["tiers"].append(tier.name)
        self.steps.states[self.step] = state
        self.steps.save(state)
        finished(self.dir)
        self.steps.restoring.discard(self.step)
        self.finished_at = now
        took = now - self.started
        sources = ", ".join(f"{k} {format_size(v)}" for k, v in sorted(self.sources.bytes_from.items()))
        log.info(
            "restored step %d: %s in %.2fs from %s",
            self.step,
            format_size(self.manifest.total_bytes),
            took,
            sources or "this node",
            extra={"event": "restored", "step": self.step, "seconds": round(took, 3)},
        )
        self.on_finish(self.status())
        self.steps.on_commit(state)

    def status(self) -> dict:
        cs = self.manifest.chunk_size
        missing = sum(min(cs, f.entry.size - i * cs) for f in self._files.values() for i in f.missing)
        gave = self.sources.bytes_from
        # The tier the bytes came from: the cheapest of the step's holders that gave any, the one
        # that gave most among equals (a restore from peers and GCS is "from a peer").
        came = sorted((t for t in self.origin.tiers if gave.get(t.name)), key=lambda t: (t.cost.key(), -gave[t.name]))
        return {
            "step": self.step,
            "state": "done" if self.finished_at else ("prefetching" if self.cfg.prefetch else "on demand"),
            "tier": came[0].kind if came else "local",
            "from": came[0].where if came else None,
            "bytes": self.manifest.total_bytes,
            "bytes_missing": missing,
            "bytes_from": dict(self.sources.bytes_from),
            "chunks_total": self.total,
            "chunks_done": len(self._done & self.manifest.chunk_set()),
            "chunks_failing": len(self._failed),
            "error": self.last_error,
            "files": sum(e.kind == "file" for e in self.manifest.entries),
            "files_pending": len(self._files),
            "demand_fetches": self.demand_fetches,
            "first_byte_s": self.first_byte_s,
            "seconds": round((self.finished_at or time.time()) - self.started, 3),
            "at": self.started,
        }


def _copy_to(path: str, offset: int, length: int, places: list[tuple[int, int]]) -> None:
    """The verified chunk at ``offset`` of ``path`` into the other places of the step that hold it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.pread(fd, length, offset)
    finally:
        os.close(fd)
    for out, at in places:
        pwrite_all(out, data, at)
