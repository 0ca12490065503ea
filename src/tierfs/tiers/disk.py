"""A local directory as a tier (``--disk DIR``, e.g. an NVMe drive): for nodes with little RAM.

Every committed step is written here in the background, like a fast backup, and a restore
reads from here before it asks any peer. When RAM is short (``--capacity``), committed steps
that are safely here leave the RAM tier (:mod:`tierfs.pipeline.replicator` decides) and stay
restorable from the disk. Retention keeps the ``--keep`` newest steps, and milestones
(``--keep-every``, ``--keep-for``: :mod:`tierfs.core.milestones`) besides, as GCS does.

Layout under ``DIR/<job>/rank-<N>/`` (root-only, as the peer replica store, whose code keeps
it: a chunk file appears only under its verified name, a manifest is written atomically and
only once every chunk it names is there)::

    chunks/<h[0:2]>/<h>                       the raw bytes of chunk h
    manifests/rank-<N>/step-<S:012d>.json     the rank's committed step S

The store's work (copies of up to a chunk at a time, writes through the page cache,
hashing) runs in one worker thread at a time, so a slow disk never stalls the FUSE loop;
the store changes only in that thread, under a lock. Reads of chunks (a restore's) run in
parallel threads and verify what they read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, TypeVarTuple

import trio

from tierfs.core.atomic import UnsafeFile, private_dir
from tierfs.core.errors import UserError
from tierfs.core.milestones import NO_MILESTONES, Milestones
from tierfs.store.replicas import ReplicaStats, ReplicaStore
from tierfs.tiers.base import Cost, Lane, Location
from tierfs.tiers.stored import StoredTier

if TYPE_CHECKING:
    from tierfs.config import Config

R = TypeVar("R")
Ts = TypeVarTuple("Ts")


def disk_root(disk: Path, job: str, rank: int) -> Path:
    """Where (job, rank) lives under ``--disk``."""
    return disk / job / f"rank-{rank}"


class DiskTier(StoredTier):
    kind = "disk"
    name = "disk"
    lane = Lane.DISK
    cost = Cost(read_gib_s=1.5)  # an NVMe drive: slower than RAM, faster than the network
    spill = True  # when RAM is short, steps held here leave it
    store: ReplicaStore  # always one: the disk's

    def __init__(
        self,
        disk: Path,
        job: str,
        rank: int,
        keep_from: Callable[[], int | None] = lambda: None,
        keep_newest: int = 1,
        milestones: Milestones = NO_MILESTONES,
    ):
        self.disk, self.root = disk, disk_root(disk, job, rank)
        self._floor: int | None = None
        self._keep_from = keep_from
        super().__init__(
            ReplicaStore(
                self.root,
                None,
                None,
                job=job,
                keep_from=lambda: self._floor,
                keep_newest=keep_newest,
                milestones=milestones,
            )
        )
        self._lock = threading.Lock()
        self._limiter = trio.CapacityLimiter(1)
        self._stats: ReplicaStats = {"chunks": 0, "bytes": 0, "manifests": 0}

    @property
    def where(self) -> str:
        return str(self.root)

    @classmethod
    def open_for(cls, cfg: Config, keep_from: Callable[[], int | None] = lambda: None) -> DiskTier:
        """The tier of ``--disk``, opened (UserError if its directory is not usable)."""
        if cfg.disk is None:
            raise ValueError("a disk tier needs a configuration with --disk")
        tier = cls(cfg.disk, cfg.job, cfg.rank, keep_from, cfg.keep, Milestones.from_config(cfg))
        tier.open()
        return tier

    def open(self) -> None:
        """Create or check the root-only directories, and index what an earlier daemon left."""
        try:
            private_dir(self.disk, own=False)
            private_dir(self.root.parent)
            private_dir(self.root)
            self.store.load()
        except UnsafeFile as e:
            raise UserError(f"unsafe --disk: {e}") from None
        except OSError as e:
            raise UserError(
                f"--disk {self.disk} is not usable ({e.strerror or e}): point it at a writable local directory"
            ) from None
        self._stats, self._held = self.store.stats(), tuple(self.store.manifests())

    def held(self) -> tuple[tuple[int, int], ...]:
        return self._held

    async def _do(self, fn: Callable[[*Ts], R], *args: *Ts) -> R:
        self._floor = self._keep_from()  # read on the trio thread, where the survey lives

        def locked() -> R:
            with self._lock:
                try:
                    return fn(*args)
                finally:
                    self._stats, self._held = self.store.stats(), tuple(self.store.manifests())

        return await trio.to_thread.run_sync(locked, limiter=self._limiter)

    def _own_copy(self, h: str) -> Location | None:
        """Where the store keeps ``h``: read and verified in parallel threads, outside the lock.

        (A lookup in the store's index is one dict access, safe beside the worker thread.) A
        copy that fails the check is then read through the store, which removes it.
        """
        return self.store.chunk_file(h)

    async def retain(self, keep_newest: int, milestones: Milestones) -> None:
        """Drop each rank's steps past its ``keep_newest`` newest and its milestones (as the
        lane's policy asks), then the chunks nothing needs (:meth:`ReplicaStore.retain`)."""
        self.store.keep_newest, self.store.milestones = keep_newest, milestones
        await self._do(self.store.retain)

    def report(self) -> dict[str, object]:
        return {"name": self.name, "kind": self.kind, "where": self.where, "path": str(self.root), **self._stats}
