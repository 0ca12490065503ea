"""The policy loop: commit -> put the step on every tier -> retain.

One trio task owns it, started in the daemon's nursery. The tiers it is given are values
(:mod:`tierfs.tiers`); tiers that share a *lane* (``Tier.lane``: every peer is in the
"peers" lane) are alternatives, of which each step must reach ``copies()``. One task per
lane, cheapest lane first, always works on the newest committed step its tiers lack (and on
milestones first, where they are kept: :meth:`Replicator._milestones_owed`). Steps superseded
before their turn are skipped, never queued without bound, and a slow or absent tier only
delays its own lane. Blocking work (hashing, compression, HTTP, disk writes) runs
in worker threads, and so do the bodies of peer transfers (:mod:`tierfs.peers.transfer`),
so the FUSE loop never waits for either.

Every lane shares the step's manifest, built once per committed version from the frozen
snapshot. Putting a step on one tier (:func:`tierfs.tiers.base.put_step`) asks the tier
which chunks it holds, sends the others straight from the snapshot's files, then the
manifest (the commit point there); each tier brackets it with what it needs (GCS: a
pending marker the garbage collector respects) and applies its retention after.

Which tiers of a lane get the step is the tier's own choice (``Tier.order``: placement
among peers), and so is how often (``Tier.schedule``: GCS's backup interval).

A step no manifest can describe (a file of a size no manifest can name, ``truncate -s 1P``
costs the job nothing) is *refused*: found out from sizes alone, before any byte is hashed,
logged once, recorded in the step's state (so ``tierfs status`` shows it) and never tried
again in that version. It stays on this node only; the lanes go on with the newest step
that is not refused, so it never holds back the next one.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import trio

from tierfs.config import Config
from tierfs.core.atomic import write_atomically
from tierfs.core.describe import build
from tierfs.core.errors import UserError
from tierfs.core.manifest import Manifest, ManifestError
from tierfs.core.meters import Meters
from tierfs.core.milestones import Milestones
from tierfs.pipeline.early import Feeds
from tierfs.pipeline.lanes import Lane, lanes_of
from tierfs.pipeline.pacing import Pacing
from tierfs.pipeline.policy import policy_for
from tierfs.ramtier.steps import Steps, StepState
from tierfs.tiers.base import Progress, Pushed, SourceChanged, Tier, TierError, TierUnavailable, first_leaf

log = logging.getLogger(__name__)

BUILD_THREADS = 8
RECHECK = 10.0  # seconds between checks that volatile tiers (peers) still hold the newest step
BACKOFF = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)


class SnapshotChanged(Exception):
    """A snapshot file was detached while it was being read: read it again."""


class StepRefused(Exception):
    """No manifest can describe the step's current version, so no tier can take it."""


class Replicator:
    def __init__(
        self,
        cfg: Config,
        steps: Steps,
        tiers: Sequence[Tier],
        last_write: Callable[[], float] = lambda: 0.0,
        retention_floor: Callable[[], int | None] | None = None,
        ram_short: Callable[[], bool] = lambda: False,
        meters: Meters | None = None,
        encoded: Callable[[], int | None] | None = None,
    ):
        self.cfg = cfg
        self.meters = meters or Meters(cfg.job, cfg.rank)
        # The newest step complete on every rank; alone, that is simply our newest.
        self.retention_floor = retention_floor or (lambda: max(steps.states, default=None))
        self.ram_short = ram_short  # RAM is short: steps a spill tier holds may leave it
        self.encoded = encoded or (lambda: None)  # the newest step an erasure group rebuilds from this RAM
        self.pacing = Pacing(last_write)  # the job's writes go first
        self.steps, self.tiers = steps, list(tiers)
        self._limiter = trio.CapacityLimiter(BUILD_THREADS)
        self._hashed: dict = {}  # (ino, size, mtime_ns) -> chunk hashes: unchanged files are not rehashed
        self._manifests: dict[int, tuple[int, Manifest]] = {}  # step -> (version, manifest)
        self._local: dict[str, tuple[str, int, int]] = {}  # chunk -> where this node holds it
        self._build_lock = trio.Lock()
        self._feeds = Feeds()  # the chunks of the step being hashed, file by file
        self._trash: list[Path] = []  # dropped snapshots, deleted off the trio thread
        self._trash_wake = trio.Event()
        self.lanes = lanes_of(self.tiers, cfg)
        self.meters.lanes(self.lanes)
        self._nursery: trio.Nursery | None = None  # runs the lanes, once started
        self.dropped: Callable[[list[str]], None] = lambda roots: None  # a step left the RAM tier
        self.reconfigure(cfg)
        steps.on_commit = self._committed

    def reconfigure(self, cfg: Config) -> None:
        """Follow a changed job shape (the multi-tier checkpointing protocol's replicator.yaml)."""
        self.cfg = cfg
        for lane in self.lanes.values():
            lane.configure(cfg)

    def add_tiers(self, tiers: list[Tier]) -> None:
        """Tiers found after the start (peers a DNS name gave later) join their lanes."""
        for tier in tiers:
            self.tiers.append(tier)
            if tier.lane is None:
                continue  # no lane puts steps there (this node's RAM)
            lane = self.lanes.get(tier.lane)
            if lane is not None:
                lane.tiers.append(tier)
            else:
                lane = self.lanes[tier.lane] = Lane(tier.lane, [tier], policy_for(tier.lane, self.cfg))
                self.meters.lanes([lane.name])
                if self._nursery is not None:
                    self._nursery.start_soon(self._run_lane, lane)
            lane.wake.set()

    def _committed(self, state: StepState) -> None:
        self.retain_local()
        for lane in self.lanes.values():
            lane.wake.set()

    # -- the lanes -----------------------------------------------------------------------

    async def run(self) -> None:
        self.retain_local()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._empty_trash)
            for lane in self.lanes.values():
                nursery.start_soon(self._run_lane, lane)

    async def _empty_trash(self) -> None:
        while True:
            await self._trash_wake.wait()
            self._trash_wake = trio.Event()
            while self._trash:
                await trio.to_thread.run_sync(shutil.rmtree, self._trash.pop(), True)

    def _milestones_owed(self, lane: Lane) -> list[StepState]:
        """The milestones in RAM newer than the lane's last put step that it lacks, oldest first.

        A lane puts the newest step at its schedule's pace: a milestone committed meanwhile would be
        overtaken and leave RAM, never reaching GCS or ``--disk``, which keep it for good. So their
        lanes put these first, unpaced, and RAM keeps them till then.
        """
        return lane.milestones_owed(self.steps.states, Milestones.from_config(self.cfg), time.time())

    async def _run_lane(self, lane: Lane) -> None:
        failures = 0
        while True:
            state, paced = lane.next_step(self.steps.newest(), self._milestones_owed(lane))
            if state is None or lane.done(state) or lane.early(state, paced):
                with trio.move_on_after(RECHECK if lane.volatile else math.inf):
                    await lane.wake.wait()
                    lane.wake = trio.Event()
                    continue
                if state is not None:
                    try:
                        await self._recheck(lane, state)
                    except Exception as e:  # noqa: BLE001 (a tier's trouble must never take the mount down)
                        log.warning("%s: could not recheck step %d: %s", lane.name, state.step, e)
                continue
            wait = lane.wait(paced)
            if wait > 0:
                with trio.move_on_after(wait):  # a commit meanwhile may be a milestone, which does not wait
                    await lane.wake.wait()
                    lane.wake = trio.Event()
                continue  # the newest step may have changed meanwhile
            lane.busy = state.step
            before = dict(lane.status)
            lane.set("working")
            try:
                await self._put(lane, state)
                lane.last_at, lane.last_step = time.time(), state.step
                lane.set("ok")
                failures = 0
            except Exception as group:  # a tier's trouble must never take the mount down
                error = first_leaf(group)
                if isinstance(error, StepRefused):
                    lane.status = before  # the step is refused (logged, in its state), not the lane
                    continue
                delay = BACKOFF[min(failures, len(BACKOFF) - 1)]
                failures += 1
                if isinstance(error, (SnapshotChanged, SourceChanged)):
                    log.info("step %d changed while read for %s; again", state.step, lane.name)
                else:
                    if not isinstance(error, TierError):  # a tier's own refusal was counted where it came
                        self.meters.put_failed(lane.name)
                    why = f"{type(error).__name__}: {error}"
                    lane.set("unavailable" if isinstance(error, TierUnavailable) else "failing", why)
                    log.warning(
                        "%s: step %d delayed, retrying in %.0fs: %s",
                        lane.name,
                        state.step,
                        delay,
                        error,
                        exc_info=not isinstance(error, (TierError, UserError)),  # their one line says it all
                    )
                    await trio.sleep(delay)
            finally:
                lane.busy = lane.progress = None
                self.retain_local()

    async def _put(self, lane: Lane, state: StepState) -> None:
        """Put the step on ``copies()`` of the lane's tiers, in the order the lane prefers."""
        version, started, wanted = state.version, time.time(), lane.copies()
        candidates = await lane.policy.order(lane.tiers)
        early = [t for t in candidates[:wanted] if t.early]
        manifest, sent_early = await self.manifest_for(state, early)
        where = self.steps.snapshots.chunk_locations(manifest)
        lane.progress = Progress(state.step, len(where))
        placed: list[Tier] = []
        errors: list[TierError] = []
        pushed = Pushed(chunks=len(where))
        queue = list(candidates)

        async def place(tier: Tier, progress: Progress | None) -> None:
            """Put the step on ``tier``; if it fails, the next candidate takes its place."""
            nonlocal pushed
            try:
                put = await tier.put_step(
                    manifest,
                    where,
                    self.pacing.yield_to_writers,
                    progress,
                    seal_with=self.cfg.manifest_keys,
                    twins=lane.policy.twins(),
                )
                early_bytes = sent_early.get(tier.name, 0)  # found there by the put, but sent by this node
                put.sent_bytes, put.stored_bytes = put.sent_bytes + early_bytes, put.stored_bytes + early_bytes
                put.skipped_bytes = max(0, put.skipped_bytes - early_bytes)
                pushed += put
            except TierError as e:
                if isinstance(e, SourceChanged):
                    raise
                errors.append(e)
                self.meters.put_failed(lane.name)
                log.warning("%s: step %d did not reach %s: %s", lane.name, state.step, tier.name, e)
                if queue:
                    nursery.start_soon(place, queue.pop(0), progress)
                return
            placed.append(tier)

        async with trio.open_nursery() as nursery:  # the copies go out in parallel, each to its own peer
            for i in range(min(wanted, len(queue))):
                nursery.start_soon(place, queue.pop(0), lane.progress if i == 0 else None)
        placed.sort(key=candidates.index)  # in the lane's order of preference, whichever finished first
        if len(placed) < wanted:
            if len(errors) == 1 and not placed:
                raise errors[0]  # its kind (unavailable or refused) is the lane's state
            refused = any(not isinstance(e, TierUnavailable) for e in errors)
            reason = f": {errors[-1]}" if errors else ""
            raise (TierError if refused else TierUnavailable)(
                f"step {state.step} reached {len(placed)} of {wanted} of {lane.name} "
                f"({len(candidates)} answering){reason}"
            )
        for tier in placed:
            await lane.policy.retain(tier)
        if state.version == version:
            now = time.time()
            state.copies[lane.name] = {
                "version": version,
                "at": now,
                "seconds": round(now - started, 3),
                "lag_s": round(now - state.committed_at, 3),
                "tiers": [t.name for t in placed],
                "bytes": manifest.total_bytes,
                "chunks": pushed.chunks,
                "sent_bytes": pushed.sent_bytes,
                "skipped_bytes": pushed.skipped_bytes,
                "stored_bytes": pushed.stored_bytes,
                "sent_chunks": pushed.sent_chunks,
                "twin_chunks": pushed.twin_chunks,
                "twin_bytes": pushed.twin_bytes,
                "taken_over": pushed.taken_over,
            }
            self._save(state)
        self.meters.step_put(lane.name, time.time() - started, pushed.sent_bytes, pushed.skipped_bytes)
        log.info(
            "%s: step %d on %s in %.2fs: %d bytes sent, %d already there%s",
            lane.name,
            state.step,
            ", ".join(t.name for t in placed),
            time.time() - started,
            pushed.sent_bytes,
            pushed.skipped_bytes,
            f" ({pushed.sent_chunks} chunks sent here, {pushed.twin_chunks} by twins, {pushed.taken_over} taken over)"
            if pushed.twin_chunks or pushed.taken_over
            else "",
            extra={
                "event": "placed",
                "step": state.step,
                "lane": lane.name,
                "tiers": [t.name for t in placed],
                "seconds": round(time.time() - started, 3),
                "sent_bytes": pushed.sent_bytes,
            },
        )

    async def _recheck(self, lane: Lane, state: StepState) -> None:
        """A tier that lost what it held (a peer's RAM, a replaced node) no longer has our step: put it again."""
        record = state.copies.get(lane.name, {})
        held = list(record.get("tiers", ()))
        kept, silent = await lane.still_holding(held, self.cfg.rank, state.step)
        if kept != held:
            lost = sorted(set(held) - set(kept) - silent.keys())
            log.warning(
                "step %d is %s: putting it on %s again",
                state.step,
                "; ".join(
                    [
                        *(f"no longer on {n}" for n in lost),
                        *(f"not confirmed by {n} ({why})" for n, why in silent.items()),
                    ]
                ),
                lane.name,
            )
            state.copies[lane.name] = {**record, "tiers": kept}
            self._save(state)

    # -- manifests -----------------------------------------------------------------------

    async def manifest_for(self, state: StepState, early: Sequence[Tier] = ()) -> tuple[Manifest, dict[str, int]]:
        """The manifest of the step's current version, and the bytes sent to ``early`` tiers meanwhile.

        Built once and shared by the lanes. While it is being hashed, the chunks of the files
        already hashed go to ``early`` tiers (:mod:`tierfs.pipeline.early`). Raises
        :class:`StepRefused` if no manifest can describe that version; the first lane to
        find out records and logs it, the others only skip the step.
        """
        if not early:
            return await self._manifest_for(state), {}
        return await self._feeds.alongside(
            lambda: self._manifest_for(state),
            state.step,
            state.version,
            early,
            self.pacing.yield_to_writers,
            built=lambda: self._manifests.get(state.step, (None,))[0] == state.version,
        )

    async def _manifest_for(self, state: StepState) -> Manifest:
        async with self._build_lock:
            cached = self._manifests.get(state.step)
            if cached is not None and cached[0] == state.version:
                return cached[1]
            version = state.version
            if (refusal := state.refusal()) is not None:
                raise StepRefused(refusal)
            try:
                manifest = await self._build_manifest(state)
            except ManifestError as e:
                if state.version == version:  # not a newer commit into the step meanwhile: it stays refused
                    state.refused = {"version": version, "error": str(e), "at": time.time()}
                    self._save(state)
                    log.error(
                        "step %d cannot be replicated or backed up, it stays on this node only: %s", state.step, e
                    )
                raise StepRefused(str(e)) from None
            self._manifests[state.step] = (version, manifest)
            self._index_local()
            return manifest

    async def _build_manifest(self, state: StepState) -> Manifest:
        """Hash the snapshot; if a file was detached meanwhile, some hash may be of new bytes."""
        snapshots = self.steps.snapshots
        feed = self._feeds.begin(state.step, state.version)
        token, tree, cs = trio.lowlevel.current_trio_token(), snapshots.step_tree(state.step), self.cfg.chunk_size

        def hashed(rel: str, size: int, hashes: list[str]) -> None:  # in a hashing thread
            places = [(h, (str(tree / rel), i * cs, min(cs, size - i * cs))) for i, h in enumerate(hashes)]
            # Handed over, not waited for: the hashing goes on while the loop is busy (with
            # many small files, waiting for it at every file took longer than the hashing).
            # The loop runs these in order, and all of them before it hears the build ended.
            token.run_sync_soon(feed.add, places)

        try:
            for _ in range(5):
                detaches = snapshots.detaches
                try:
                    manifest = await self.pacing.in_thread(
                        lambda pace: build(
                            tree,
                            list(state.roots),
                            job=self.cfg.job,
                            rank=self.cfg.rank,
                            step=state.step,
                            chunk_size=cs,
                            known=self._hashed,
                            hashed=hashed,
                            pace=pace,
                        ),
                        self._limiter,
                    )
                except ManifestError:
                    if snapshots.detaches == detaches:
                        raise
                    continue  # a file changed under the hashing: it was detached, hash the copy
                if snapshots.detaches == detaches:
                    seals = self.cfg.bucket_seals  # buckets get its chunks sealed: the manifest says under which
                    manifest.chunk_seal = seals[0].id if seals else ""
                    write_atomically(
                        snapshots.step_dir(state.step) / "manifest.json", manifest.sealed(self.cfg.manifest_keys)
                    )
                    return manifest
            raise SnapshotChanged(f"step {state.step} kept changing while it was hashed")
        finally:
            feed.close()

    def find_local(self, h: str) -> tuple[str, int, int] | None:
        """This node's own committed copy of chunk ``h`` (lets twins replicate with no transfer)."""
        return self._local.get(h)

    def _index_local(self) -> None:
        self._local = {
            h: where
            for _, manifest in self._manifests.values()
            for h, where in self.steps.snapshots.chunk_locations(manifest).items()
        }

    # -- local retention -------------------------------------------------------------------

    def _save(self, state: StepState) -> None:
        if self.steps.states.get(state.step) is state:
            self.steps.save(state)

    def retain_local(self) -> None:
        """Drop local snapshots that no tier needs any more.

        Kept: the ``--keep-local`` newest committed steps, the steps a lane is sending or owes
        as milestones (:meth:`_milestones_owed`), the newest step an erasure group encoded
        (``encoded``: the others rebuild a lost member's step from it), and every step from the newest one complete
        on every rank on (``retention_floor``; everything while that is unknown): that step
        may exist nowhere else. When RAM is short, a step a *spill* tier (``--disk``) holds in
        its current version may go too: it is restored from there first.
        """
        floor = self.retention_floor()
        keep = set(sorted(self.steps.states)[-self.cfg.keep_local :])
        keep |= {lane.busy for lane in self.lanes.values() if lane.busy is not None}
        keep |= {s.step for lane in self.lanes.values() for s in self._milestones_owed(lane)}
        if (
            encoded := self.encoded()
        ) is not None:  # its parts rebuild a lost member's step till a newer one is encoded
            keep.add(encoded)
        spill = [lane for lane in self.lanes.values() if lane.lead.spill]
        short = None  # asked only when a step could spill
        for step in list(self.steps.states):
            if step in keep:
                continue
            state = self.steps.states[step]
            if not (floor is not None and step < floor):
                if not any(lane.done(state) for lane in spill):
                    continue
                if short is None:
                    short = self.ram_short()
                if not short:
                    continue
                log.info(
                    "RAM is short: step %d leaves it, %s holds it",
                    step,
                    ", ".join(lane.name for lane in spill if lane.done(state)),
                )
            self._drop(step)

    def _drop(self, step: int) -> None:
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
        """Each lane's state, lag and progress, with what its tiers say of themselves."""
        now = time.time()
        return {name: lane.report(self.steps.states, now) for name, lane in self.lanes.items()}
