"""The GCS tier: one job's chunks and manifests under gs://BUCKET/PREFIX.

Layout (with an empty PREFIX, names start at ``<job>/``)::

    <prefix>/<job>/chunks/<h[0:2]>/<h>                      a chunk frame, named by its hash
    <prefix>/<job>/manifests/rank-<R>/step-<S:012d>.json     a manifest; its presence commits step S
    <prefix>/<job>/manifests/rank-<R>/step-<S:012d>.pending  an upload in progress: JSON list of
                                                             the chunk hashes it will reference

Chunks are shared by every rank and step of the job and never change once written, so
they are created with ``ifGenerationMatch=0``: of two ranks uploading the same bytes one
wins and the other learns it can stop. Only :meth:`GcsStore.collect_garbage` deletes
chunks, and it proves each one unused first.

Nothing read from the bucket is trusted: anyone who can write to it can plant objects.
Every read is bounded by the size the object can have (a chunk frame, a manifest), names
that are not exactly the ones this module writes are ignored, and an existing chunk
object is decoded and checked against its name before an upload relies on it; one that
fails is replaced (``ifGenerationMatch=<its generation>``), not trusted forever. With the
job's manifest keys, a manifest counts only once its seal verifies (:meth:`GcsStore.list_manifests`):
a well-formed, correctly named manifest someone else wrote is not a step, for a restore or
for retention.

Everything is synchronous, for worker threads; one store (and its HTTP connection pool)
serves all of them. Transient failures are retried here for about a second, then raised
as :class:`GcsUnavailable`: the caller owns the long backoff. The library's own retries
are turned off because they would hide an outage for two minutes per request.
"""

from __future__ import annotations

import functools
import http.client
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, TypeVar

import requests
import urllib3
from google.api_core import exceptions as api
from google.auth import exceptions as auth
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.storage.exceptions import DataCorruption

from tierfs.core import chunks
from tierfs.core import manifest as manifest_format
from tierfs.core.errors import UserError
from tierfs.core.keys import ManifestKeys
from tierfs.core.parse import parse_gcs_url

T = TypeVar("T")
_VANISHED = "it was deleted meanwhile"
log = logging.getLogger(__name__)

RETRY_DELAYS = (0.2, 1.0)  # sleeps between the three attempts of one request
CONNECT_TIMEOUT = 10.0  # a connect that takes longer is an outage, however big the object
POOL_SIZE = 32  # pooled connections: room for 16 worker threads plus the collector's
GC_THREADS = 16
PENDING_MAX_AGE = 24 * 3600.0  # an upload marker older than this belongs to a dead upload
LIST_PAGE = 1000
USED_KEY = "tierfs-used"  # chunk metadata: unix time of the last touch
CONTENT_TYPE = "application/octet-stream"
MAX_CHUNK_FRAME = chunks.max_frame_size(chunks.MAX_CHUNK_SIZE)
REMEMBERED = 1 << 20  # chunks remembered as checked (about 100 MB at most), and names as ignored

_HASH_RE = re.compile(r"[0-9a-f]{32}")
# Candidates only (digit counts keep int() cheap); a name counts once it is exactly the one
# _manifest_name gives for its numbers.
_MANIFEST_RE = re.compile(r"rank-([0-9]{1,10})/step-([0-9]{1,19})\.(json|pending)")

_TRANSIENT: tuple[type[BaseException], ...] = (
    api.TooManyRequests,
    api.InternalServerError,
    api.BadGateway,
    api.ServiceUnavailable,
    api.GatewayTimeout,
    requests.exceptions.ConnectionError,
    requests.exceptions.Timeout,
    requests.exceptions.ChunkedEncodingError,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.TimeoutError,
    http.client.HTTPException,  # e.g. a body cut short
    ConnectionError,
    TimeoutError,
    auth.TransportError,  # the token endpoint is unreachable
    DataCorruption,  # checksum mismatch in transit: the stored object is fine
)
_DENIED = (api.Unauthorized, api.Forbidden, auth.RefreshError)


class GcsError(Exception):
    """A GCS request failed; the message names the operation and the gs:// URL."""


class GcsUnavailable(GcsError):
    """GCS could not be reached or answered 429/5xx, even after quick retries: try later."""


class MissingObject(GcsError):
    """The object does not exist (HTTP 404)."""


class CorruptObject(GcsError):
    """An object this module must understand is unreadable.

    The collector stops on one rather than guess which chunks it protects.
    """


class MissingBucket(GcsError, UserError):
    """The bucket does not exist: only the user can fix that."""


class GcsAccessDenied(GcsError, UserError):
    """The credentials may not do this (HTTP 401/403): no retry helps, access must be granted."""


class ChunkInfo(NamedTuple):
    """One chunk as a listing saw it: enough to decide, and to delete only that version."""

    hash: str
    size: int
    updated: float  # unix time the chunk was last written or touched
    metageneration: int


class GcsStore:
    """One job's objects in one bucket; safe to share between threads."""

    def __init__(
        self, url: str, job: str, client: storage.Client | None = None, timeout: float = 30,
        keys: ManifestKeys | None = None,
    ):
        self.bucket, self.prefix = parse_gcs_url(url)
        if not job or "/" in job:
            raise ValueError(f"invalid job id {job!r}")
        self.job = job
        self._base = f"{self.prefix}/{job}/" if self.prefix else f"{job}/"
        self._client = client
        self._client_lock = threading.Lock()
        self._timeout = (min(timeout, CONNECT_TIMEOUT), timeout)
        self._lock = threading.Lock()  # guards the three below; worker threads share the store
        self._sound: dict[str, str] = {}  # chunk -> md5 (or generation) of the object found to hold it
        self._replace: dict[str, int] = {}  # chunk -> generation of an object that does not hold it
        self._ignored: set[str] = set()  # names under manifests/ already logged as not ours
        self.keys = keys  # None: no secret, so manifests cannot be authenticated
        self._sealed: dict[str, tuple[int, bool]] = {}  # manifest name -> (generation, its seal verifies)

    @property
    def client(self) -> storage.Client:
        """Created on first use, so that merely configuring GCS needs no credentials yet."""
        if self._client is None:
            with self._client_lock:
                if self._client is None:
                    self._client = _make_client()
        return self._client

    def url_of(self, name: str) -> str:
        return f"gs://{self.bucket}/{name}"

    def chunk_url(self, h: str) -> str:
        return self.url_of(self._chunk_name(h))

    def manifest_url(self, rank: int, step: int) -> str:
        return self.url_of(self._manifest_name(rank, step, "json"))

    def check(self) -> None:
        """Fail now, with a clear message, if the bucket is missing or out of reach.

        This lists objects rather than reading the bucket: object roles, which are all
        tierfs needs, do not include reading the bucket's own metadata.
        """
        next(self._list(self._base, "items(name)", page_size=1), None)

    # -- chunks ---------------------------------------------------------------------------

    def put_chunk(self, h: str, frame: bytes) -> bool:
        """Make the chunk's object hold ``frame``; False if it already held the chunk.

        The create is conditional on nothing being there. If something is, it is checked:
        the chunk (another rank uploaded the same bytes, or a retry after a lost response
        finds the first attempt's) means there is nothing to do; anything else is replaced,
        conditionally on its generation, so a concurrent fix by another rank is not undone.
        """
        name = self._chunk_name(h)
        for _ in range(3):
            with self._lock:
                generation = self._replace.pop(h, 0)
            try:
                blob = self._upload(name, frame, if_generation_match=generation)
            except api.PreconditionFailed:
                blob = self._call("read", name,
                                  lambda: self._bucket().get_blob(name, retry=None, timeout=self._timeout))
                if blob is not None and self._holds_chunk(h, blob):
                    return False
                continue  # gone meanwhile (create it), or bad (replace that generation)
            self._remember_sound(h, blob)
            return True
        raise GcsError(f"cannot put {self.url_of(name)}: the object under that name keeps changing")

    def touch_chunk(self, h: str) -> bool:
        """Mark an existing chunk as in use now; False if it does not exist or is not the chunk.

        The metadata patch moves the chunk's ``updated`` time and bumps its
        metageneration, which is what keeps :meth:`collect_garbage` away from it.

        An object this store has not yet seen hold the chunk is downloaded and decoded
        once: something planted or damaged under the chunk's name must not stand in for
        the chunk in every later step. False then makes the uploader put the chunk, and
        :meth:`put_chunk` replaces the object.
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
            return False
        return self._holds_chunk(h, blob)

    def get_chunk_frame(self, h: str, max_size: int = chunks.MAX_CHUNK_SIZE) -> bytes:
        """The stored frame of a chunk of at most ``max_size`` bytes.

        Read with a bound: an object larger than such a chunk's frame can be raises
        :class:`CorruptObject` after at most one byte more than the bound.
        """
        return self._download(self._chunk_name(h), chunks.max_frame_size(max_size))

    def _holds_chunk(self, h: str, blob: storage.Blob) -> bool:
        """Whether ``blob`` (as just listed, patched or read) is a frame of chunk ``h``.

        Checked by decoding it once per content (its MD5, which GCS computes, or else its
        generation); the answer for sound content is remembered. An object that is not the
        chunk is logged and noted for :meth:`put_chunk` to replace.
        """
        key = blob.md5_hash or f"generation {blob.generation}"
        with self._lock:
            if self._sound.get(h) == key:
                return True
        problem = self._chunk_problem(h, blob)
        if problem is None:
            self._remember_sound(h, blob)
            return True
        with self._lock:
            self._replace[h] = blob.generation or 0
        # Gone meanwhile: most often a twin uploading the same chunk replaced that generation.
        log.log(logging.INFO if problem == _VANISHED else logging.WARNING,
                "%s does not hold chunk %s (%s): replacing it", self.url_of(blob.name), h, problem)
        return False

    def _chunk_problem(self, h: str, blob: storage.Blob) -> str | None:
        if blob.size is not None and blob.size > MAX_CHUNK_FRAME:
            return f"{blob.size} bytes, larger than any chunk frame"
        try:
            frame = self._download(blob.name, MAX_CHUNK_FRAME, blob.generation)
            chunks.decode(frame, h)
        except MissingObject:
            return _VANISHED
        except (CorruptObject, chunks.CorruptChunk) as e:
            return str(e)
        return None

    def _remember_sound(self, h: str, blob: storage.Blob) -> None:
        with self._lock:
            if len(self._sound) >= REMEMBERED:
                self._sound.clear()  # checking again is only slower
            self._sound[h] = blob.md5_hash or f"generation {blob.generation}"
            self._replace.pop(h, None)

    def list_chunks(self) -> Iterator[ChunkInfo]:
        """Every chunk of the job; other objects are skipped, so the collector leaves them be."""
        prefix = f"{self._base}chunks/"
        fields = "items(name,size,updated,metageneration,metadata)"
        for blob in self._list(prefix, fields):
            shard, _, h = blob.name[len(prefix):].partition("/")
            if _HASH_RE.fullmatch(h) and shard == h[:2]:
                yield ChunkInfo(h, blob.size, _last_used(blob), blob.metageneration)

    def delete_chunk(self, h: str, if_metageneration_match: int) -> bool:
        """Delete the chunk if it is unchanged since it was listed; False if changed or gone."""
        name = self._chunk_name(h)
        try:
            self._call(
                "delete",
                name,
                lambda: self._blob(name).delete(
                    if_metageneration_match=if_metageneration_match,
                    retry=None,
                    timeout=self._timeout,
                ),
            )
        except (api.NotFound, api.PreconditionFailed):
            return False
        return True

    # -- manifests and upload markers -----------------------------------------------------

    def put_manifest(self, rank: int, step: int, data: bytes) -> None:
        self._upload(self._manifest_name(rank, step, "json"), data)

    def get_manifest(self, rank: int, step: int, generation: int | None = None) -> bytes:
        """The manifest's bytes as stored, read with the bound of the largest manifest
        (:class:`CorruptObject` past it); the reader authenticates them."""
        return self._download(self._manifest_name(rank, step, "json"), manifest_format.MAX_BYTES, generation)

    def delete_manifest(self, rank: int, step: int) -> None:
        self._delete(self._manifest_name(rank, step, "json"))

    def list_steps(self, rank: int) -> list[int]:
        """Committed steps of one rank, oldest first (with keys: only those whose seal verifies)."""
        return self._list_manifests(f"{self._base}manifests/rank-{rank}/").get(rank, [])

    def list_manifests(self, prefix: str = "") -> dict[int, list[int]]:
        """Committed steps of every rank that has any (under ``manifests/<prefix>``), oldest first.

        With keys, a manifest counts only if its seal verifies: each object is read once
        (per generation) to check it, and one that fails is logged once and left alone. So a
        planted manifest is never the newest step, and never pushes a real one out of
        retention.
        """
        return self._list_manifests(f"{self._base}manifests/{prefix}")

    def put_pending(self, rank: int, step: int, hashes: Iterable[str]) -> None:
        """Announce an upload and every chunk it will reference, before touching any of them.

        Putting the marker again refreshes it: an upload that may outlive
        ``PENDING_MAX_AGE`` must do so.
        """
        data = json.dumps(sorted(set(hashes))).encode()
        self._upload(self._manifest_name(rank, step, "pending"), data)

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
            found[(rank, step)] = _parse_pending(data, self.url_of(blob.name))
        return found

    # -- garbage collection ---------------------------------------------------------------

    def collect_garbage(
        self, keep_newest: int, grace: float, nodes: int = 1, pending_max_age: float = PENDING_MAX_AGE
    ) -> dict[str, int]:
        """Apply retention to every rank of the job, then delete the chunks nothing needs.

        Each rank keeps its newest ``keep_newest`` manifests, and every manifest at or after
        the newest step that GCS holds for every one of the job's ``nodes`` ranks: retention
        never removes the newest step the whole job can restore from GCS. A chunk is deleted only if
        no remaining manifest and no live pending marker names it, and it has not been
        written or touched since ``t0 - grace``, ``t0`` being taken before any listing.

        Why a concurrent upload never loses a chunk. An upload (1) puts its pending
        marker, (2) touches or puts every chunk, (3) puts its manifest, (4) deletes the
        marker. Markers are listed before manifests, so for any upload either

        - its marker was listed, and the marker names its chunks; or
        - its marker was already gone, so its manifest was in place before manifests
          were listed and names its chunks; or
        - its marker was not listed because it came later, hence every touch and put
          of (2) came after ``t0``. A touch before the chunk listing makes the chunk recent; a
          touch after it bumps the metageneration, which the conditional delete requires
          unchanged; a touch after the delete finds no chunk, and the upload puts it.

        ``grace`` must exceed the clock skew between this host and GCS, since
        ``updated`` is GCS's time and ``t0`` ours. An upload must finish, or put its
        marker again, within ``pending_max_age``.

        Each candidate is read again right before its conditional delete. On GCS the
        precondition alone is enough; the read costs one request per deleted chunk and
        keeps the guarantee on servers that ignore delete preconditions (fake-gcs-server).

        Returns counts: manifests and chunks deleted, bytes freed, chunks kept, and
        chunks named by a kept manifest that GCS does not have (which means damage).
        """
        if keep_newest < 1:
            raise ValueError(f"keep_newest must be at least 1, not {keep_newest}")
        t0 = time.time()
        cutoff = t0 - grace
        pending = self.list_pending(pending_max_age)
        kept: list[tuple[int, int]] = []
        dropped: list[tuple[int, int]] = []
        listing = self.list_manifests()
        complete = set.intersection(*(set(listing.get(r, ())) for r in range(nodes)))
        protect = max(complete, default=None)
        for rank, steps in listing.items():
            for step in steps[:-keep_newest]:
                (kept if protect is not None and step >= protect else dropped).append((rank, step))
            kept += [(rank, step) for step in steps[-keep_newest:]]

        with ThreadPoolExecutor(GC_THREADS, thread_name_prefix="tierfs-gc") as pool:
            list(pool.map(lambda rs: self.delete_manifest(*rs), dropped))
            needed: set[str] = set().union(*pool.map(self._manifest_chunks, kept))
            referenced = needed.union(*pending.values())
            present: set[str] = set()
            candidates: list[ChunkInfo] = []
            for info in self.list_chunks():
                present.add(info.hash)
                if info.hash not in referenced and info.updated < cutoff:
                    candidates.append(info)
            collected = pool.map(functools.partial(self._collect, cutoff=cutoff), candidates)
            deleted = [info for info, gone in zip(candidates, collected) if gone]

        return {
            "manifests_deleted": len(dropped),
            "chunks_deleted": len(deleted),
            "bytes_deleted": sum(info.size for info in deleted),
            "chunks_kept": len(present) - len(deleted),
            "chunks_missing": len(needed - present),
        }

    def _manifest_chunks(self, rank_step: tuple[int, int]) -> set[str]:
        rank, step = rank_step
        url = self.manifest_url(rank, step)
        try:
            data = self.get_manifest(rank, step)
        except MissingObject:
            return set()  # deleted by another collector since it was listed: nothing to keep
        try:
            data = manifest_format.authenticate(data, self.keys, rank, step)
        except manifest_format.Unauthenticated as e:
            # Replaced since the listing verified it: which chunks the step needs is unknown.
            raise CorruptObject(f"{url} was replaced by a manifest that is not this job's ({e})") from None
        return _parse_manifest_chunks(data, url)

    def _collect(self, info: ChunkInfo, cutoff: float) -> bool:
        """Delete one unreferenced chunk unless it has been used since it was listed."""
        name = self._chunk_name(info.hash)
        blob = self._call(
            "read", name, lambda: self._bucket().get_blob(name, retry=None, timeout=self._timeout)
        )
        if blob is None or blob.metageneration != info.metageneration or _last_used(blob) >= cutoff:
            return False
        return self.delete_chunk(info.hash, info.metageneration)

    # -- names ----------------------------------------------------------------------------

    def _chunk_name(self, h: str) -> str:
        if not _HASH_RE.fullmatch(h):
            raise ValueError(f"not a chunk hash: {h!r}")
        return f"{self._base}chunks/{h[:2]}/{h}"

    def _manifest_name(self, rank: int, step: int, kind: str) -> str:
        if rank < 0 or step < 0:
            raise ValueError(f"invalid rank {rank} or step {step}")
        return f"{self._base}manifests/rank-{rank}/step-{step:012d}.{kind}"

    def _manifest_objects(self, prefix: str) -> Iterator[tuple[int, int, str, storage.Blob]]:
        """Manifests and markers under ``prefix``, by (rank, step, kind).

        Only names exactly as :meth:`_manifest_name` writes them count. Another spelling
        of a number (``step-99999.json``) names an object nothing would read or delete,
        and a planted one would win retention over the real steps and be chosen as the
        step to restore, which then cannot be found: such names are ignored, and logged
        once each.
        """
        start = len(f"{self._base}manifests/")
        for blob in self._list(prefix, "items(name,updated,generation)"):
            m = _MANIFEST_RE.fullmatch(blob.name, start)
            if m and blob.name == self._manifest_name(int(m[1]), int(m[2]), m[3]):
                yield int(m[1]), int(m[2]), m[3], blob
            else:
                self._ignore(blob.name)

    def _ignore(self, name: str) -> None:
        with self._lock:
            if name in self._ignored or len(self._ignored) >= REMEMBERED:
                return
            self._ignored.add(name)
        log.warning("ignoring %r: not a manifest or upload marker name tierfs writes "
                    "(manifests/rank-<R>/step-<S, 12 digits>.json or .pending)", self.url_of(name))

    def _list_manifests(self, prefix: str) -> dict[int, list[int]]:
        found = [(rank, step, blob) for rank, step, kind, blob in self._manifest_objects(prefix) if kind == "json"]
        if self.keys is not None:
            sealed = self._known_seals(found)
            unknown = [f for f in found if f[2].name not in sealed]
            if len(unknown) > 1:
                with ThreadPoolExecutor(min(GC_THREADS, len(unknown)), thread_name_prefix="tierfs-seal") as pool:
                    checked = list(pool.map(lambda f: self._check_seal(*f), unknown))
            else:
                checked = [self._check_seal(*f) for f in unknown]
            sealed.update((blob.name, ok) for (_, _, blob), ok in zip(unknown, checked))
            found = [f for f in found if sealed[f[2].name]]
        steps: dict[int, list[int]] = {}
        for rank, step, _ in found:
            steps.setdefault(rank, []).append(step)
        return {rank: sorted(s) for rank, s in sorted(steps.items())}

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
            data = self.get_manifest(rank, step, generation or None)
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

    # -- requests -------------------------------------------------------------------------

    def _bucket(self) -> storage.Bucket:
        return self.client.bucket(self.bucket)

    def _blob(self, name: str) -> storage.Blob:
        # A Blob caches the object's properties: one per request, never shared by threads.
        return self._bucket().blob(name)

    def _upload(self, name: str, data: bytes, **preconditions: int) -> storage.Blob:
        """One request up to 8 MiB; larger objects take a one-chunk resumable session.

        Returns the blob with the properties GCS answered (generation, MD5).
        """

        def send() -> storage.Blob:
            blob = self._blob(name)
            blob.upload_from_string(
                data, content_type=CONTENT_TYPE, retry=None, timeout=self._timeout, **preconditions
            )
            return blob

        try:
            return self._call("upload", name, send)
        except api.NotFound:
            raise self._missing_bucket() from None

    def _download(self, name: str, limit: int, generation: int | None = None) -> bytes:
        """The object's bytes if it has at most ``limit``; else :class:`CorruptObject`.

        The request asks for ``limit + 1`` stored bytes (an HTTP range), so an oversized
        object costs no more than that to find out about.
        """

        def get() -> bytes:
            blob = self._bucket().blob(name, generation=generation)
            try:
                # One read of the whole body, not 8 KiB steps: objects are a chunk at most,
                # and the stepwise loop holds the GIL long enough to stall the FUSE thread.
                # Raw: the stored bytes, never inflated on the way in (tierfs sets no
                # Content-Encoding; a planted gzip one would otherwise be a bomb).
                return blob.download_as_bytes(start=0, end=limit, raw_download=True, retry=None,
                                              timeout=self._timeout, single_shot_download=True)
            except api.RequestRangeNotSatisfiable:
                return b""  # an empty object has no byte 0 to start from

        try:
            data = self._call("download", name, get)
        except api.NotFound:
            raise MissingObject(f"{self.url_of(name)} does not exist") from None
        if len(data) > limit:
            raise CorruptObject(f"{self.url_of(name)} is larger than {limit} bytes, "
                                "more than any object tierfs writes there")
        return data

    def _delete(self, name: str) -> None:
        """Delete if present: a retry after a lost response finds nothing, and that is fine."""
        try:
            self._call(
                "delete", name, lambda: self._blob(name).delete(retry=None, timeout=self._timeout)
            )
        except api.NotFound:
            pass

    def _list(
        self, prefix: str, fields: str, page_size: int | None = None
    ) -> Iterator[storage.Blob]:
        """Objects under ``prefix``, a page at a time: a failed page is retried, not the listing."""
        token: str | None = None
        while True:
            page = functools.partial(self._page, prefix, token, fields, page_size)
            try:
                blobs, token = self._call("list", prefix, page)
            except api.NotFound:
                raise self._missing_bucket() from None
            yield from blobs
            if not token:
                return

    def _page(
        self, prefix: str, token: str | None, fields: str, size: int | None = None
    ) -> tuple[list[storage.Blob], str | None]:
        iterator = self.client.list_blobs(
            self.bucket,
            prefix=prefix,
            page_token=token,
            page_size=size or LIST_PAGE,
            fields=f"{fields},nextPageToken",
            retry=None,
            timeout=self._timeout,
        )
        page = next(iterator.pages, None)
        return (list(page) if page is not None else []), iterator.next_page_token

    def _call(self, what: str, name: str, request: Callable[[], T]) -> T:
        """Make one request, retrying transient failures a few times, quickly."""
        for delay in RETRY_DELAYS:
            try:
                return self._once(what, name, request)
            except GcsUnavailable:
                time.sleep(delay)
        return self._once(what, name, request)

    def _once(self, what: str, name: str, request: Callable[[], T]) -> T:
        """Map failures to this module's errors; 404 and 412 pass: their meaning is the caller's."""
        try:
            return request()
        except (api.NotFound, api.PreconditionFailed):
            raise
        except _TRANSIENT as e:
            raise GcsUnavailable(f"cannot {what} {self.url_of(name)}: {_reason(e)}") from e
        except _DENIED as e:
            raise GcsAccessDenied(
                f"cannot {what} {self.url_of(name)}: access denied ({_reason(e)}); "
                f"let tierfs's credentials read and write objects in gs://{self.bucket}"
            ) from None
        except api.GoogleAPICallError as e:
            raise GcsError(f"cannot {what} {self.url_of(name)}: {_reason(e)}") from e

    def _missing_bucket(self) -> MissingBucket:
        return MissingBucket(
            f"GCS bucket gs://{self.bucket} does not exist: create it or fix --gcs"
        )


def _make_client() -> storage.Client:
    """Anonymous against an emulator (STORAGE_EMULATOR_HOST), default credentials otherwise."""
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        client = storage.Client(credentials=AnonymousCredentials(), project="tierfs")
    else:
        try:
            client = storage.Client()
        except auth.DefaultCredentialsError:
            raise UserError(
                "no Google Cloud credentials for --gcs: attach a service account, set "
                "GOOGLE_APPLICATION_CREDENTIALS, or run 'gcloud auth application-default login'"
            ) from None
    # The library shares one requests session between threads, which it documents as safe.
    # Past the default 10 pooled connections per host, requests opens throwaway ones: a new
    # TLS handshake per request, and a warning each time, with 16 threads at work.
    session = client._http
    adapter = requests.adapters.HTTPAdapter(pool_maxsize=POOL_SIZE)
    for scheme in ("https://", "http://"):
        if type(session.get_adapter(scheme)) is requests.adapters.HTTPAdapter:  # not mTLS
            session.mount(scheme, adapter)
    return client


def _last_used(blob: storage.Blob) -> float:
    """When the chunk was last written or touched.

    GCS moves ``updated`` on every metadata patch, so the touch stamp adds nothing there;
    fake-gcs-server does not, and the stamp stands in. A stamp from a fast clock keeps a
    chunk longer, never shorter.
    """
    updated = blob.updated.timestamp()
    try:
        return max(updated, float((blob.metadata or {}).get(USED_KEY, 0)))
    except ValueError:
        return updated


def _parse_pending(data: bytes, url: str) -> set[str]:
    try:
        hashes = json.loads(data)
    except (ValueError, RecursionError):
        hashes = None
    if not isinstance(hashes, list) or not all(_is_hash(h) for h in hashes):
        raise CorruptObject(f"{url} is not a JSON list of chunk hashes")
    return set(hashes)


def _parse_manifest_chunks(data: bytes, url: str) -> set[str]:
    """The chunks a manifest's JSON names; only ``entries[].chunks`` matters to the collector."""
    try:
        entries = json.loads(data)["entries"]
        hashes = {h for entry in entries for h in entry.get("chunks", ())}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise CorruptObject(f"{url} is not a manifest: its chunks cannot be told") from None
    if not all(_is_hash(h) for h in hashes):
        raise CorruptObject(f"{url} names something that is not a chunk hash")
    return hashes


def _is_hash(h: object) -> bool:
    return isinstance(h, str) and _HASH_RE.fullmatch(h) is not None


def _reason(e: BaseException) -> str:
    """The gist of a failure for a one-line message: ``HTTP 503: ...``, ``Connection refused``."""
    if isinstance(e, api.GoogleAPICallError) and e.code:
        message = re.sub(r"^[A-Z]+ \S+: ", "", e.message)  # the request line: URL and all
        return f"HTTP {e.code} {message}"[:300]
    text = str(e)
    errno = re.search(r"\[Errno -?\d+\] ([^'\"()\]]+)", text)
    if errno:
        return errno[1].strip()
    return f"{type(e).__name__}: {text}"[:300] if text else type(e).__name__
