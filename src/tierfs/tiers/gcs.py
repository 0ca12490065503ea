"""Google Cloud Storage as a tier: one job's chunks and manifests under gs://BUCKET/PREFIX.

The bucket's layout, its conditional creates, what is checked when it is read, and the
garbage collector are :mod:`tierfs.tiers.gcs_store`; this module speaks it as a tier.
Every request runs in a worker thread (the store is synchronous) and an unreachable GCS
is retried with a short backoff before :class:`~tierfs.tiers.base.TierUnavailable`.

A step goes up in the order that keeps the bucket consistent for readers and for the
collector (:meth:`~tierfs.tiers.gcs_store.GcsStore.collect_garbage`): a pending marker
listing its chunks (:meth:`GcsTier.begin_step`), every chunk GCS lacks (a chunk it has is
only touched), the manifest, then the marker goes. After a step, rank 0 applies retention
to the whole job.

The bucket is shared by the whole job, so a rank's data-parallel twins (:meth:`GcsTier.twins`)
split a step's uploads between them (:mod:`tierfs.tiers.twins`); an object already in the
bucket is proven to be the chunk by its MD5 against the object this node would upload,
without a download (:meth:`GcsTier.present`). With the job's secret, chunks are sealed
(:mod:`tierfs.core.bucket_seal`), deterministically, so twins make the same objects.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar, TypeVarTuple

import trio
from google.cloud import storage

from tierfs.core import chunks
from tierfs.core.bucket_seal import ChunkSeal
from tierfs.core.errors import UserError
from tierfs.core.keys import ManifestKeys
from tierfs.core.manifest import split_seal
from tierfs.core.milestones import Milestones
from tierfs.tiers.base import (
    Cost,
    Holdings,
    Lane,
    NotHeld,
    Put,
    SourceChanged,
    Tier,
    TierError,
    TierUnavailable,
    check_chunk,
    check_manifest,
)
from tierfs.tiers.gcs_http import CorruptObject, GcsError, GcsUnavailable, MissingObject
from tierfs.tiers.gcs_layout import chunk_seal_of, parse_manifest_chunks
from tierfs.tiers.gcs_store import REMEMBERED, Found, GcsStore, object_md5

log = logging.getLogger(__name__)

R = TypeVar("R")
Ts = TypeVarTuple("Ts")

ATTEMPTS = 4  # per request, on top of the store's own quick retries
THREADS = 8  # requests at once: uploads, touches


class GcsTier(Tier):
    kind = "gcs"
    lane = Lane.GCS
    name = "gcs"
    shared = True  # every rank's manifests in one bucket
    cost = Cost(read_gib_s=0.2, dollars_per_gib=0.12)  # slower than any node, and reads are paid for
    concurrency = THREADS

    def __init__(
        self,
        url: str,
        job: str,
        store: GcsStore | None = None,
        keys: ManifestKeys | None = None,
        seals: Sequence[ChunkSeal] = (),
        client: storage.Client | None = None,
    ):
        super().__init__()
        self.url = url
        self.store = store or GcsStore(url, job, client=client, keys=keys, seals=seals)
        self._limiter = trio.CapacityLimiter(THREADS)
        self._md5: dict[str, str] = {}  # chunk -> MD5 of the object this node makes of it
        self._absent: set[str] = set()  # chunks the bucket lacked when last asked: the upload need not ask again
        self._read_seals: list[ChunkSeal] = []  # the seals of the manifests read, the latest first
        self._clear: set[str] = set()  # chunks that manifests read name in clear (written before sealing)

    @property
    def where(self) -> str:
        return self.url

    async def _run(self, fn: Callable[[*Ts], R], *args: *Ts) -> R:
        """``fn(*args)`` in a worker thread; an unreachable GCS is retried with a short backoff."""
        for attempt in range(ATTEMPTS - 1):
            try:
                return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)
            except GcsUnavailable:
                await trio.sleep(2**attempt)
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        except GcsUnavailable as e:
            raise TierUnavailable(f"GCS is unreachable: {e}") from None

    def check(self) -> None:
        """Reach the bucket now (start-up): GcsUnavailable or a UserError (missing bucket) if not."""
        self.store.check()

    # -- chunks ------------------------------------------------------------------------

    async def has_chunks(self, hashes: Sequence[str]) -> list[bool]:
        """Touches each chunk, which keeps it from the collector; held means known to be the chunk.

        An object not yet proven to be the chunk counts as not held: :meth:`put_chunk` then
        proves it by its MD5 (no upload), or replaces it.
        """
        out = [False] * len(hashes)

        async def touch(i: int, h: str) -> None:
            found = await self._run(self.store.touch, h)
            out[i] = found is Found.CHUNK
            if found is Found.MISSING:
                self._absent.add(h)

        async with trio.open_nursery() as nursery:
            for i, h in enumerate(hashes):
                nursery.start_soon(touch, i, h)
        return out

    async def present(self, h: str, path: str | Path, offset: int, length: int) -> bool:
        """Whether GCS holds chunk ``h`` now, proven by the MD5 of the frame this node would upload."""
        check_chunk(self, h, length)
        return await self._run(self._present, h, str(path), offset, length)

    def _present(self, h: str, path: str, offset: int, length: int) -> bool:
        md5 = self._md5.get(h)
        if md5 is None:
            md5 = object_md5(self._body(h, path, offset, length))
            if len(self._md5) >= REMEMBERED:
                self._md5.clear()  # computing it again is only slower
            self._md5[h] = md5
        found = self.store.find_chunk(h, md5)
        if found is Found.MISSING:
            self._absent.add(h)
        return found is Found.CHUNK

    async def put_chunk(self, h: str, path: str | Path, offset: int, length: int) -> Put:
        check_chunk(self, h, length)
        return await self._run(self._put_chunk, h, str(path), offset, length)

    def _put_chunk(self, h: str, path: str, offset: int, length: int) -> Put:
        """In a worker thread: read, check, compress if that pays, seal, create if absent."""
        body = self._body(h, path, offset, length)
        look = h not in self._absent
        self._absent.discard(h)
        if not self.store.put_chunk(h, body, look=look, md5=self._md5.get(h)):
            return Put(0, 0)  # another rank uploaded the same bytes
        return Put(length, len(body))

    def _body(self, h: str, path: str, offset: int, length: int) -> bytes:
        """What the object of chunk ``h`` holds as this node stores it, from its local bytes."""
        for _ in range(2):  # a detach can race with the read: the path then holds the copy
            data = _pread(path, offset, length)
            if chunks.chunk_hash(data) == h:
                break
        else:
            raise SourceChanged(f"{path} at {offset} no longer holds chunk {h}")
        return self.store.body(h, chunks.encode(data))

    async def get_chunk(self, h: str, length: int) -> bytes:
        """Never more than ``length`` bytes read, nor decoded.

        Under the seal of the manifests read (the current one first), and in clear only if
        a manifest read names the chunk so: no one who can write the bucket can make a
        sealed step read a chunk in clear."""
        check_chunk(self, h, length)
        url = self.store.chunk_url(h)
        tried: list[ChunkSeal | None] = [*self._read_seals, *(s for s in self.store.seals if s not in self._read_seals)]
        if h in self._clear or not self.store.seals:
            tried.append(None)
        for seal in tried:
            try:
                frame = await self._run(self.store.get_chunk_frame, h, length, seal)
                break
            except MissingObject:
                continue
            except GcsError as e:
                raise TierError(f"chunk {url} is corrupt or unreadable ({e})") from None
            except chunks.CorruptChunk as e:
                raise TierError(f"chunk {url} is corrupt or not this job's ({e})") from None
        else:
            raise NotHeld(f"chunk {url} is missing from GCS")
        try:
            data = await trio.to_thread.run_sync(chunks.decode, frame, h, length)
        except chunks.CorruptChunk as e:
            raise TierError(f"chunk {url} is corrupt ({e})") from None
        if len(data) != length:
            raise TierError(f"chunk {url} is corrupt ({len(data)} bytes, the manifest says {length})")
        return data

    # -- manifests ---------------------------------------------------------------------

    async def put_manifest(self, rank: int, step: int, data: bytes) -> None:
        check_manifest(self, rank, step, data)
        await self._run(self.store.put_manifest, rank, step, data)

    async def get_manifest(self, rank: int, step: int) -> bytes:
        url = self.store.manifest_url(rank, step)
        try:
            data = await self._run(self.store.get_manifest, rank, step)
        except MissingObject:
            raise NotHeld(f"{url} does not exist") from None
        except (GcsError, UserError) as e:
            raise TierError(f"cannot read {url}: {e}") from None
        await trio.to_thread.run_sync(self._note_seal, data, url)
        return data

    def _note_seal(self, data: bytes, url: str) -> None:
        """Remember under which seal the chunks of a manifest read are (:meth:`get_chunk`):
        a seal of the job's, or in clear for a manifest written before sealing. Whether the
        manifest is the job's is the reader's to check; one that is not restores nothing."""
        data = split_seal(data)[0]
        seal_id = chunk_seal_of(data)
        if not seal_id:
            try:
                _, hashes = parse_manifest_chunks(data, url)
            except CorruptObject:
                return
            if len(self._clear) + len(hashes) > REMEMBERED:
                self._clear.clear()
            self._clear |= hashes
            return
        seal = self.store.seal_by_id(seal_id)
        if seal is not None:
            self._read_seals = [seal, *(s for s in self._read_seals if s is not seal)]

    async def holdings(self) -> Holdings:
        listing = await self.list_manifests_under("")
        return Holdings(tuple((rank, step) for rank, steps in listing.items() for step in steps))

    async def list_manifests_under(self, prefix: str) -> dict[int, list[int]]:
        """Committed steps by rank, of the manifests under ``manifests/<prefix>`` (a shard of a listing)."""
        try:
            return await self._run(self.store.list_manifests, prefix)
        except (GcsError, UserError) as e:
            raise TierError(str(e)) from None

    # -- a rollback ----------------------------------------------------------------------

    async def set_aside(self, rank: int | None, above: int, before: float) -> list[tuple[int, int]]:
        """Move the manifests of ``rank`` (None: every rank's) after step ``above`` and created
        no later than ``before`` under ``aside/`` (:meth:`GcsStore.set_aside`): kept with their
        chunks, counted by no listing. A manifest whose creation time the listing does not
        give counts as before. Returns the (rank, step) manifests that now lie aside."""
        what = f"cannot set aside the steps after {above} in {self.url}"
        listing = await self._request(what, self.store.list_manifests, "" if rank is None else f"rank-{rank}/")
        chosen = [
            (r, s)
            for r, steps in listing.items()
            for s in steps
            if s > above and _no_later(listing.created.get((r, s)), before)
        ]
        moved: list[tuple[int, int]] = []
        failed: list[TierError] = []

        async def move(r: int, s: int) -> None:
            try:
                if await self._request(what, lambda: self.store.set_aside(r, s, above, before=before)):
                    moved.append((r, s))
            except TierError as e:
                failed.append(e)

        async with trio.open_nursery() as nursery:
            for r, s in chosen:
                nursery.start_soon(move, r, s)
        if failed:
            raise failed[0]
        log.info(
            "GCS: rollback to step %d set aside %d manifests of %s committed by %.3f (steps %s)",
            above,
            len(moved),
            "every rank" if rank is None else f"rank {rank}",
            before,
            sorted({s for _, s in moved}),
        )
        return sorted(moved)

    async def rollback_at(self, step: int, *, record: bool = False) -> float | None:
        """When the job was rolled back to ``step``, as the bucket records it for every node
        (GCS's clock); ``record`` creates the record unless one stands."""
        fn = self.store.record_rollback if record else self.store.rollback_time
        return await self._request(
            f"cannot {'record' if record else 'read'} the rollback to step {step} in {self.url}", fn, step
        )

    async def committed_since(self, rank: int, above: int, at: float) -> list[int]:
        """The steps of ``rank`` after ``above`` whose manifests were created after ``at`` (GCS's
        clock): the new timeline's, once a rollback to ``above`` was made at ``at``."""
        listing = await self._request(
            f"cannot list rank {rank}'s steps in {self.url}", self.store.list_manifests, f"rank-{rank}/"
        )
        return [s for s in listing.get(rank, []) if s > above and not _no_later(listing.created.get((rank, s)), at)]

    async def _request(self, what: str, fn: Callable[[*Ts], R], *args: *Ts) -> R:
        """``fn(*args)`` as :meth:`_run` makes it, any other GCS failure a :class:`TierError`
        saying ``what`` could not be done, in one line."""
        try:
            return await self._run(fn, *args)
        except (GcsError, UserError) as e:
            raise TierError(f"{what}: {e}") from None

    # -- a step's bracket and retention --------------------------------------------------

    async def begin_step(self, rank: int, step: int, hashes: Sequence[str]) -> None:
        self._absent.clear()  # what a step before learned may be stale
        await self._run(self.store.put_pending, rank, step, hashes)

    async def end_step(self, rank: int, step: int) -> None:
        await self._run(self.store.delete_pending, rank, step)

    async def collect(self, keep_newest: int, grace: float, nodes: int, milestones: Milestones) -> dict[str, int]:
        """Retention and garbage collection of the job's objects
        (:meth:`~tierfs.tiers.gcs_gc.GarbageCollection.collect_garbage`): counts of what went."""
        return await self._run(lambda: self.store.collect_garbage(keep_newest, grace, nodes, milestones=milestones))

    def report(self) -> dict[str, object]:
        return {**super().report(), "url": self.url, "sealed": bool(self.store.seals)}


def _no_later(created: float | None, before: float) -> bool:
    """Whether a manifest created at ``created`` (None: the listing does not say) counts as before ``before``."""
    return created is None or created <= before


def _pread(path: str, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        parts: list[bytes] = []
        done = 0
        while done < length and (part := os.pread(fd, length - done, offset + done)):
            parts.append(part)
            done += len(part)
        return b"".join(parts)
    finally:
        os.close(fd)
