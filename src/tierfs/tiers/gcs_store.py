"""The GCS tier: one job's chunks and manifests under gs://BUCKET/PREFIX.

The names of the objects and what each holds are :mod:`tierfs.tiers.gcs_layout`; what a
rollback does to them (manifests set aside, its record) is :mod:`tierfs.tiers.gcs_aside`.

Chunks are shared by every rank and step of the job and never change once written, so
they are created with ``ifGenerationMatch=0``: of two ranks uploading the same bytes one
wins and the other learns it can stop. Only :meth:`GcsStore.collect_garbage`
(:mod:`tierfs.tiers.gcs_gc`) deletes chunks, and it proves each one unused first.

With the job's secret, every chunk is sealed (:mod:`tierfs.core.bucket_seal`): encrypted,
authenticated and named under keys of the secret, so that neither reading nor writing the
bucket reveals or forges a byte. A manifest names the seal its chunks are under; chunks a
release before sealing wrote (in clear, named by their hash) stay readable for the
manifests that name them so.

Nothing read from the bucket is trusted: anyone who can write to it can plant objects.
Every read is bounded by the size the object can have (a chunk frame, a manifest), names
that are not exactly the ones tierfs writes are ignored, and an existing chunk object
counts only once it is proven to hold the chunk before an upload relies on it: by its MD5,
which GCS computes from what it stores, being that of the frame this node would upload
(no byte moves), or else by downloading and decoding it. One that fails is replaced
(``ifGenerationMatch=<its generation>``), not trusted forever. CRC32C, which GCS keeps too,
is not used as proof: anyone can make bytes with a given CRC32C. With the
job's manifest keys, a manifest counts only once its seal verifies (:meth:`GcsStore.list_manifests`):
a well-formed, correctly named manifest someone else wrote is not a step, for a restore or
for retention.

Everything is synchronous, for worker threads; one store (and its HTTP connection pool)
serves all of them; requests and their quick retries are :mod:`tierfs.tiers.gcs_http`.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final

from google.api_core import exceptions as api
from google.cloud import storage

from tierfs.core import chunks
from tierfs.core import manifest as manifest_format
from tierfs.core.bucket_seal import OVERHEAD, ChunkSeal
from tierfs.core.bucket_seal import TAG as SEALED
from tierfs.core.keys import ManifestKeys
from tierfs.tiers.gcs_aside import Rollback
from tierfs.tiers.gcs_gc import GC_THREADS, GarbageCollection
from tierfs.tiers.gcs_http import CorruptObject, GcsBucket, GcsError, MissingObject
from tierfs.tiers.gcs_layout import (
    USED_KEY,
    ChunkInfo,
    ManifestListing,
    chunk_name,
    chunk_of,
    job_base,
    last_used,
    manifest_name,
    manifest_object,
    parse_pending,
    pending_marker,
)

_VANISHED = "it was deleted meanwhile"
log = logging.getLogger(__name__)

MAX_CHUNK_FRAME = chunks.max_frame_size(chunks.MAX_CHUNK_SIZE)


class _Current(enum.Enum):
    SEAL = "current"  # the seal arguments' default: the job's current seal (a type of its own, not a seal nor None)


CURRENT: Final = _Current.SEAL
REMEMBERED = 1 << 20  # chunks remembered as checked (about 100 MB at most), and names as ignored


class Found(enum.Enum):
    """What the bucket holds under a chunk's name, as far as a metadata request tells."""

    MISSING = "missing"  # no object
    UNPROVEN = "unproven"  # an object not (yet) proven to hold the chunk
    CHUNK = "chunk"  # an object proven to hold the chunk


def object_md5(body: bytes) -> str:
    """The MD5 GCS reports for an object holding ``body`` (``md5Hash``: base64 of the digest)."""
    return base64.b64encode(hashlib.md5(body).digest()).decode()


class GcsStore(Rollback, GarbageCollection, GcsBucket):
    """One job's objects in one bucket; safe to share between threads."""

    def __init__(
        self,
        url: str,
        job: str,
        client: storage.Client | None = None,
        timeout: float = 30,
        keys: ManifestKeys | None = None,
        seals: Sequence[ChunkSeal] = (),
    ):
        super().__init__(url, client, timeout)
        self.seals = tuple(seals)  # the job's bucket seals: the first seals, all open; none: chunks in clear
        self.seal = self.seals[0] if self.seals else None
        self._base = job_base(self.prefix, job)
        self.job = job
        self._lock = threading.Lock()  # guards the three below; worker threads share the store
        self._sound: dict[str, str] = {}  # chunk -> md5 (or generation) of the object found to hold it
        self._replace: dict[str, int] = {}  # chunk -> generation of an object that does not hold it
        self._unsound: dict[str, str] = {}  # chunk -> md5 (or generation) of an object found not to hold it
        self._ignored: set[str] = set()  # names under manifests/ already logged as not ours
        self.keys = keys  # None: no secret, so manifests cannot be authenticated
        self._sealed: dict[str, tuple[int, bool]] = {}  # manifest name -> (generation, its seal verifies)

    def chunk_url(self, h: str) -> str:
        return self.url_of(self._chunk_name(h))

    def seal_by_id(self, seal_id: str) -> ChunkSeal | None:
        return next((seal for seal in self.seals if seal.id == seal_id), None)

    def body(self, h: str, frame: bytes) -> bytes:
        """What the object of chunk ``h`` holds: ``frame``, sealed with the job's seal if it has one."""
        return self.seal.seal(h, frame) if self.seal is not None else frame

    def manifest_url(self, rank: int, step: int) -> str:
        return self.url_of(self._manifest_name(rank, step, "json"))

    def check(self) -> None:
        """Fail now, with a clear message, if the bucket is missing or out of reach.

        This lists objects rather than reading the bucket: object roles, which are all
        tierfs needs, do not include reading the bucket's own metadata.
        """
        next(self._list(self._base, "items(name)", page_size=1), None)

    # -- chunks ---------------------------------------------------------------------------

    def put_chunk(self, h: str, body: bytes, look: bool = True, md5: str | None = None) -> bool:
        """Make the chunk's object hold ``body`` (:meth:`body`); False if it already held the chunk.

        First a metadata request (``look``; skip it only right after one found nothing):
        an object already there whose MD5 is ``body``'s is the chunk, and nothing is sent.
        The create itself is conditional on nothing being there. If something is, it is
        checked: the chunk (another rank uploaded the same bytes, or a retry after a lost
        response finds the first attempt's) means there is nothing to do; anything else is
        replaced, conditionally on its generation, so a concurrent fix by another rank is
        not undone. ``md5`` is ``body``'s if the caller has it: computed here only when needed,
        it costs a pass over the body that a lone uploader never needs.
        """
        name = self._chunk_name(h)
        if look:
            md5 = md5 or object_md5(body)
            if self.find_chunk(h, md5) is Found.CHUNK:
                return False
        for _ in range(3):
            with self._lock:
                generation = self._replace.pop(h, 0)
            try:
                blob = self._upload(name, body, if_generation_match=generation)
            except api.PreconditionFailed:
                md5 = md5 or object_md5(body)
                if self.find_chunk(h, md5) is Found.CHUNK:
                    return False
                continue  # gone meanwhile (create it), or bad (replace that generation)
            self._remember_sound(h, blob)
            return True
        raise GcsError(f"cannot put {self.url_of(name)}: the object under that name keeps changing")

    def find_chunk(self, h: str, md5: str | None = None) -> Found:
        """Whether the bucket holds chunk ``h``, by one metadata request.

        ``md5``: that of the object this node would upload (:func:`object_md5`). An object
        with that MD5, or with the one this store last proved, is the chunk; any other is
        downloaded and decoded once (a frame another encoder made is still the chunk), and
        one that is not the chunk is noted for :meth:`put_chunk` to replace.
        """
        name = self._chunk_name(h)
        blob = self._call("read", name, lambda: self._bucket().get_blob(name, retry=None, timeout=self._timeout))
        if blob is None:
            return Found.MISSING
        if md5 is not None and blob.md5_hash == md5:
            self._remember_sound(h, blob)
            return Found.CHUNK
        return Found.CHUNK if self._holds_chunk(h, blob) else Found.UNPROVEN

    def touch_chunk(self, h: str) -> bool:
        """Mark an existing chunk as in use now; True if it is known to hold the chunk (:meth:`touch`)."""
        return self.touch(h) is Found.CHUNK

    def touch(self, h: str) -> Found:
        """Mark an existing chunk object as in use now, and say what it is.

        The metadata patch moves the chunk's ``updated`` time and bumps its
        metageneration, which is what keeps :meth:`collect_garbage` away from it.

        Nothing is downloaded: an object counts as the chunk only if this store proved
        that content before (the same MD5). Any other is :attr:`Found.UNPROVEN`, which
        makes the uploader put the chunk, and :meth:`put_chunk` then settles it by its
        MD5 (no byte moves when it is the chunk) or replaces it.
        """
        name = self._chunk_name(h)

        def patch() -> storage.Blob:
            blob = self._blob(name)
            blob.metadata = {USED_KEY: f"{time.time():.6f}"}
            blob.patch(retry=None, timeout=self._timeout)
            return blob

        try:
            blob = self._call("touch", name, patch)
        except api.NotFound:
            return Found.MISSING
        with self._lock:
            known = self._sound.get(h) == _content_key(blob)
        return Found.CHUNK if known else Found.UNPROVEN

    def get_chunk_frame(
        self, h: str, max_size: int = chunks.MAX_CHUNK_SIZE, seal: ChunkSeal | None | _Current = CURRENT
    ) -> bytes:
        """The frame of a chunk of at most ``max_size`` bytes, from its object under ``seal``
        (the job's current one unless named; None: the chunk in clear).

        Read with a bound: an object larger than such a chunk's body can be raises
        :class:`CorruptObject` after at most one byte more than the bound. A sealed one that
        does not open raises :class:`~tierfs.core.chunks.CorruptChunk`.
        """
        seal = self.seal if seal is CURRENT else seal
        body = self._download(self._chunk_name(h, seal), chunks.max_frame_size(max_size) + OVERHEAD)
        return seal.open(h, body) if seal is not None else body

    def _holds_chunk(self, h: str, blob: storage.Blob) -> bool:
        """Whether ``blob`` (as just listed, patched or read) is a frame of chunk ``h``.

        Checked by decoding it once per content (its MD5, which GCS computes, or else its
        generation); the answer is remembered, so the same object is never downloaded
        twice. An object that is not the chunk is logged and noted for :meth:`put_chunk`
        to replace.
        """
        key = _content_key(blob)
        with self._lock:
            if self._sound.get(h) == key:
                return True
            if self._unsound.get(h) == key:
                self._replace[h] = blob.generation or 0
                return False
        problem = self._chunk_problem(h, blob)
        if problem is None:
            self._remember_sound(h, blob)
            return True
        with self._lock:
            self._replace[h] = blob.generation or 0
            if problem != _VANISHED:
                if len(self._unsound) >= REMEMBERED:
                    self._unsound.clear()
                self._unsound[h] = key
        # Gone meanwhile: most often a twin uploading the same chunk replaced that generation.
        log.log(
            logging.INFO if problem == _VANISHED else logging.WARNING,
            "%s does not hold chunk %s (%s): replacing it",
            self.url_of(blob.name),
            h,
            problem,
        )
        return False

    def _chunk_problem(self, h: str, blob: storage.Blob) -> str | None:
        if blob.size is not None and blob.size > MAX_CHUNK_FRAME + OVERHEAD:
            return f"{blob.size} bytes, larger than any chunk's object"
        try:
            body = self._download(blob.name, MAX_CHUNK_FRAME + OVERHEAD, blob.generation)
            chunks.decode(self.seal.open(h, body) if self.seal is not None else body, h)
        except MissingObject:
            return _VANISHED
        except (CorruptObject, chunks.CorruptChunk) as e:
            return str(e)
        return None

    def _remember_sound(self, h: str, blob: storage.Blob) -> None:
        with self._lock:
            if len(self._sound) >= REMEMBERED:
                self._sound.clear()  # checking again is only slower
            self._sound[h] = _content_key(blob)
            self._replace.pop(h, None)
            self._unsound.pop(h, None)

    def list_chunks(self) -> Iterator[ChunkInfo]:
        """Every chunk object of the job, by key (sealed or in clear); other objects are
        skipped, so the collector leaves them be."""
        prefix = f"{self._base}chunks/"
        fields = "items(name,size,updated,metageneration,metadata)"
        for blob in self._list(prefix, fields):
            key = chunk_of(prefix, blob.name)
            if key is not None:
                yield ChunkInfo(key, blob.size, last_used(blob), blob.metageneration)

    def delete_chunk(self, key: str, if_metageneration_match: int) -> bool:
        """Delete the chunk object ``key`` if it is unchanged since it was listed; False if changed or gone."""
        name = chunk_name(self._base, key)
        try:
            self._call(
                "delete",
                name,
                lambda: self._blob(name).delete(
                    if_metageneration_match=if_metageneration_match, retry=None, timeout=self._timeout
                ),
            )
        except (api.NotFound, api.PreconditionFailed):
            return False
        return True

    # -- manifests and upload markers -----------------------------------------------------

    def put_manifest(self, rank: int, step: int, data: bytes) -> None:
        """Store a manifest: sealed with the job's seal if it has one (:mod:`tierfs.core.bucket_seal`)."""
        body = self.seal.seal_manifest(rank, step, data) if self.seal is not None else data
        self._upload(self._manifest_name(rank, step, "json"), body)

    def get_manifest(self, rank: int, step: int, generation: int | None = None) -> bytes:
        """The manifest's bytes, read with the bound of the largest manifest (:class:`CorruptObject`
        past it) and opened with whichever of the job's seals sealed it; one in clear (written
        before sealing, or without a secret) as stored. The reader authenticates them."""
        return self._read_manifest(self._manifest_name(rank, step, "json"), rank, step, generation)

    def _read_manifest(self, name: str, rank: int, step: int, generation: int | None = None) -> bytes:
        """:meth:`get_manifest` of the object ``name`` (a set-aside copy too): its seal binds
        (rank, step), not the name, so a copy opens as the original did."""
        body = self._download(name, manifest_format.MAX_BYTES + OVERHEAD, generation)
        if body[:1] != SEALED:
            return body
        for seal in self.seals:
            data = seal.open_manifest(rank, step, body)
            if data is not None:
                return data
        raise CorruptObject(f"{self.url_of(name)} is sealed, but by no secret this node has")

    def delete_manifest(self, rank: int, step: int) -> None:
        self._delete(self._manifest_name(rank, step, "json"))

    def list_steps(self, rank: int) -> list[int]:
        """Committed steps of one rank, oldest first (with keys: only those whose seal verifies)."""
        return self._list_manifests(f"{self._base}manifests/rank-{rank}/").get(rank, [])

    def list_manifests(self, prefix: str = "") -> ManifestListing:
        """Committed steps of every rank that has any (under ``manifests/<prefix>``), oldest first,
        and when each was committed (:class:`~tierfs.tiers.gcs_layout.ManifestListing`).

        With keys, a manifest counts only if its seal verifies: each object is read once
        (per generation) to check it, and one that fails is logged once and left alone. So a
        planted manifest is never the newest step, and never pushes a real one out of
        retention.
        """
        return self._list_manifests(f"{self._base}manifests/{prefix}")

    def put_pending(self, rank: int, step: int, hashes: Iterable[str]) -> None:
        """Announce an upload and every chunk it will reference (by its object's key), before
        touching any of them.

        Putting the marker again refreshes it: an upload that may outlive
        :data:`~tierfs.tiers.gcs_gc.PENDING_MAX_AGE` must do so.
        """
        keys = (self.seal.object_key(h) for h in hashes) if self.seal is not None else hashes
        self._upload(self._manifest_name(rank, step, "pending"), pending_marker(keys))

    def delete_pending(self, rank: int, step: int) -> None:
        self._delete(self._manifest_name(rank, step, "pending"))

    def list_pending(self, max_age: float) -> dict[tuple[int, int], set[str]]:
        """Chunks of uploads in progress, by (rank, step).

        A marker not refreshed for ``max_age`` seconds is taken for a crashed upload and
        deleted; its chunks are then protected only by their own recency.
        """
        now = time.time()
        found: dict[tuple[int, int], set[str]] = {}
        for rank, step, kind, blob in self._manifest_objects(f"{self._base}manifests/"):
            if kind != "pending":
                continue
            if now - blob.updated.timestamp() >= max_age:
                self._delete(blob.name)
                continue
            try:
                # A marker lists each chunk once, 36 bytes a name: at most about the manifest's size.
                data = self._download(blob.name, 2 * manifest_format.MAX_BYTES)
            except MissingObject:
                continue  # the upload finished meanwhile and its manifest is in place
            found[(rank, step)] = parse_pending(data, self.url_of(blob.name))
        return found

    # -- names ----------------------------------------------------------------------------

    def _chunk_name(self, h: str, seal: ChunkSeal | None | _Current = CURRENT) -> str:
        """The name of chunk ``h``'s object under ``seal`` (the current one unless named)."""
        seal = self.seal if seal is CURRENT else seal
        return chunk_name(self._base, seal.object_key(h) if seal is not None else h)

    def _manifest_name(self, rank: int, step: int, kind: str) -> str:
        return manifest_name(self._base, rank, step, kind)

    def _manifest_objects(self, prefix: str) -> Iterator[tuple[int, int, str, storage.Blob]]:
        """Manifests and markers under ``prefix``, by (rank, step, kind).

        Only names exactly as :func:`~tierfs.tiers.gcs_layout.manifest_name` writes them
        count (:func:`~tierfs.tiers.gcs_layout.manifest_object`); the others are ignored,
        and logged once each.
        """
        for blob in self._list(prefix, "items(name,updated,timeCreated,generation)"):
            found = manifest_object(self._base, blob.name)
            if found is not None:
                yield *found, blob
            else:
                self._ignore(blob.name)

    def _ignore(self, name: str, expected: str = "manifests/rank-<R>/step-<S, 12 digits>.json or .pending") -> None:
        with self._lock:
            if name in self._ignored or len(self._ignored) >= REMEMBERED:
                return
            self._ignored.add(name)
        log.warning("ignoring %r: not a name tierfs writes there (%s)", self.url_of(name), expected)

    def _list_manifests(self, prefix: str) -> ManifestListing:
        return self._listing(
            [(rank, step, blob) for rank, step, kind, blob in self._manifest_objects(prefix) if kind == "json"]
        )

    def _listing(self, found: list[tuple[int, int, storage.Blob]]) -> ManifestListing:
        """The (rank, step, listed object) manifests ``found``, as a listing: with keys, only
        those whose seal verifies (:meth:`_check_seal`)."""
        if self.keys is not None:
            sealed = self._known_seals(found)
            unknown = [f for f in found if f[2].name not in sealed]
            if len(unknown) > 1:
                with ThreadPoolExecutor(min(GC_THREADS, len(unknown)), thread_name_prefix="tierfs-seal") as pool:
                    checked = list(pool.map(lambda f: self._check_seal(*f), unknown))
            else:
                checked = [self._check_seal(*f) for f in unknown]
            sealed.update((blob.name, ok) for (_, _, blob), ok in zip(unknown, checked, strict=True))
            found = [f for f in found if sealed[f[2].name]]
        steps: dict[int, list[int]] = {}
        for rank, step, _ in found:
            steps.setdefault(rank, []).append(step)
        created = {(rank, step): _created(blob) for rank, step, blob in found}
        return ManifestListing({rank: sorted(s) for rank, s in sorted(steps.items())}, created)

    def _known_seals(self, found: list[tuple[int, int, storage.Blob]]) -> dict[str, bool]:
        """What earlier listings learned of these objects' seals (of the same generation only)."""
        known = {}
        with self._lock:
            for _, _, blob in found:
                seen = self._sealed.get(blob.name)
                if seen is not None and seen[0] == (blob.generation or 0):
                    known[blob.name] = seen[1]
        return known

    def _check_seal(self, rank: int, step: int, blob: storage.Blob) -> bool:
        """Whether the listed manifest object carries this job's seal for (rank, step).

        Remembered per object generation, so a listing reads only manifests it has not
        checked yet; a failure is logged once.
        """
        name, generation = blob.name, blob.generation or 0
        try:
            data = self._read_listed(rank, step, blob)
            manifest_format.authenticate(data, self.keys, rank, step)
            problem = None
        except MissingObject:
            return False  # deleted (or replaced) since the listing: not a step any more
        except (CorruptObject, manifest_format.Unauthenticated) as e:
            problem = str(e)
        with self._lock:
            if len(self._sealed) >= REMEMBERED:
                self._sealed.clear()  # checking again is only slower
            self._sealed[name] = (generation, problem is None)
        if problem is not None:
            log.warning("ignoring %s: %s", self.url_of(name), problem)
        return problem is None

    def _read_listed(self, rank: int, step: int, blob: storage.Blob) -> bytes:
        """The listed manifest object's bytes, of the generation listed: an active one through
        :meth:`get_manifest`, the one reader of active manifests; a set-aside copy by its name."""
        if blob.name == self._manifest_name(rank, step, "json"):
            return self.get_manifest(rank, step, blob.generation or None)
        return self._read_manifest(blob.name, rank, step, blob.generation or None)


def _created(blob: storage.Blob) -> float | None:
    """When the object (this generation of it) was created, if the listing says."""
    return blob.time_created.timestamp() if blob.time_created is not None else None


def _content_key(blob: storage.Blob) -> str:
    """What names an object's content: its MD5, or else its generation."""
    return blob.md5_hash or f"generation {blob.generation}"
