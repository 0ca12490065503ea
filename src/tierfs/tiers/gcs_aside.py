"""A rollback in GCS: the abandoned timeline's manifests set aside, and the record of when.

A rollback to step N (``tierfs mount --restore-step N``) abandons every step after N. Their
manifests must leave ``manifests/``: left there they would count as complete steps again
(for a restore, for retention's newest complete step), and the job's next commits reuse
their numbers. They are not deleted: each is copied, byte for byte, under
``aside/to-<N>/`` (:func:`~tierfs.tiers.gcs_layout.aside_base`) and only then removed, so at
every moment one of the two names holds it, and the collector keeps the chunks of both
(:meth:`~tierfs.tiers.gcs_gc.GarbageCollection.collect_garbage`) until the operator
discards them (:meth:`Rollback.discard_aside`). A copy keeps its rank and step, which is
what its seals bind, so it still opens and verifies as the job's.

The record of the rollback (``rollbacks/to-<N>.json``) is created once, whoever comes
first: its creation time, GCS's clock, is the moment every node of the job agrees the
old timeline ended.

Apart from the store for its size; :class:`Rollback` is a part of
:class:`~tierfs.tiers.gcs_store.GcsStore` and runs on the store's own requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from google.api_core import exceptions as api
from google.cloud import storage

from tierfs.core import manifest as manifest_format
from tierfs.core.bucket_seal import OVERHEAD
from tierfs.tiers.gcs_http import GcsBucket, GcsError, MissingObject
from tierfs.tiers.gcs_layout import (
    ManifestListing,
    aside_base,
    aside_object,
    manifest_name,
    parse_rollback,
    rollback_name,
    rollback_of,
    rollback_record,
)

MAX_MANIFEST_OBJECT = manifest_format.MAX_BYTES + OVERHEAD  # the bound of every manifest object read
MAX_RECORD = 64  # a rollback record's bytes: {"step": N} and no more
ASIDE_NAMES = "aside/to-<N, 12 digits>/manifests/rank-<R>/step-<S, 12 digits>.json"
THREADS = 16


class Rollback(GcsBucket):
    """Setting manifests aside and recording rollbacks, for :class:`~tierfs.tiers.gcs_store.GcsStore`."""

    if TYPE_CHECKING:  # the store's own, which this part runs on
        _base: str

        def _manifest_name(self, rank: int, step: int, kind: str) -> str: ...
        def _read_manifest(self, name: str, rank: int, step: int, generation: int | None = None) -> bytes: ...
        def _listing(self, found: list[tuple[int, int, storage.Blob]]) -> ManifestListing: ...
        def _ignore(self, name: str, expected: str = ...) -> None: ...

    # -- the abandoned timeline's manifests -----------------------------------------------

    def set_aside(self, rank: int, step: int, to: int, *, before: float | None = None) -> bool:
        """Move manifest (rank, step) aside for the rollback to step ``to``; True once it lies there.

        Copied verbatim (sealed or not), then the original is deleted only if it is still
        the generation copied: a manifest put again meanwhile is the new timeline's and
        stays. Idempotent: with the original gone and the copy there, there is nothing to
        do. False if there is nothing to move: no such manifest, or (``before``, unix time)
        one created after it, which is a commit of the new timeline. An aside copy of other
        bytes under the same name (an earlier rollback to the same step) is never replaced:
        :class:`GcsError` until the operator discards it.
        """
        name = self._manifest_name(rank, step, "json")
        copy = self._aside_name(to, rank, step)
        for _ in range(3):
            blob = self._metadata(name)
            if blob is None:
                return self._metadata(copy) is not None
            created: float | None = blob.time_created.timestamp() if blob.time_created is not None else None
            if before is not None and created is not None and created > before:
                return False
            try:
                body = self._download(name, MAX_MANIFEST_OBJECT, blob.generation)
            except MissingObject:
                continue  # replaced or deleted since the read: look again
            self._copy_aside(copy, body, to)
            self._delete_generation(name, blob.generation)
            return True
        raise GcsError(f"cannot set aside {self.url_of(name)}: the object keeps changing")

    def get_aside(self, to: int, rank: int, step: int) -> bytes:
        """A set-aside manifest's bytes, read and opened as
        :meth:`~tierfs.tiers.gcs_store.GcsStore.get_manifest` reads the original's."""
        return self._read_manifest(self._aside_name(to, rank, step), rank, step)

    def list_aside(self) -> dict[int, ManifestListing]:
        """Every set-aside manifest, by the step its rollback went back to: each a listing like
        :meth:`~tierfs.tiers.gcs_store.GcsStore.list_manifests`'s (with keys, only those whose
        seal verifies), whose created times are when each was set aside. Other names under
        ``aside/`` are ignored."""
        found: dict[int, list[tuple[int, int, storage.Blob]]] = {}
        for to, rank, step, blob in self._aside_objects(None):
            found.setdefault(to, []).append((rank, step, blob))
        listings = {to: self._listing(objects) for to, objects in sorted(found.items())}
        return {to: listing for to, listing in listings.items() if listing}

    def discard_aside(self, to: int | None = None) -> int:
        """Delete the manifests set aside by the rollback to ``to`` (None: by every rollback);
        how many went. Their chunks are then garbage like any dropped step's. Names that
        are not a set-aside manifest's are left alone.

        The rollback's record goes last: the rollback is forgotten, so that the job can be
        rolled back to the same step again (a start still given it does so).
        """
        names = [blob.name for *_, blob in self._aside_objects(to)]
        if names:
            with ThreadPoolExecutor(min(THREADS, len(names)), thread_name_prefix="tierfs-discard") as pool:
                list(pool.map(self._delete, names))
        if to is not None:
            self._delete(rollback_name(self._base, to))
        else:
            for blob in self._list(f"{self._base}rollbacks/", "items(name)"):
                if rollback_of(self._base, blob.name) is not None:
                    self._delete(blob.name)
        return len(names)

    def _aside_name(self, to: int, rank: int, step: int) -> str:
        return manifest_name(aside_base(self._base, to), rank, step, "json")

    def _aside_objects(self, to: int | None) -> Iterator[tuple[int, int, int, storage.Blob]]:
        """(to, rank, step, listed object) of the set-aside manifests of one rollback, or all."""
        prefix = aside_base(self._base, to) if to is not None else f"{self._base}aside/"
        for blob in self._list(prefix, "items(name,updated,timeCreated,generation)"):
            found = aside_object(self._base, blob.name)
            if found is not None:
                yield *found, blob
            else:
                self._ignore(blob.name, ASIDE_NAMES)

    def _copy_aside(self, copy: str, body: bytes, to: int) -> None:
        """Create the copy if absent; one already there must be the same bytes (a move repeated)."""
        try:
            self._upload(copy, body, if_generation_match=0)
        except api.PreconditionFailed:
            try:
                there = self._download(copy, MAX_MANIFEST_OBJECT)
            except MissingObject:
                there = None  # discarded meanwhile: put it again
            if there is None:
                self._upload(copy, body)
            elif there != body:
                raise GcsError(
                    f"cannot set aside a manifest as {self.url_of(copy)}: a different one lies there "
                    f"from an earlier rollback to step {to}; discard it first"
                ) from None

    def _delete_generation(self, name: str, generation: int | None) -> None:
        """Delete ``name`` if it is still ``generation``; gone or replaced meanwhile is fine."""
        try:
            self._call(
                "delete",
                name,
                lambda: self._blob(name).delete(if_generation_match=generation, retry=None, timeout=self._timeout),
            )
        except (api.NotFound, api.PreconditionFailed):
            pass

    def _metadata(self, name: str) -> storage.Blob | None:
        """The object's metadata (generation, creation time), None if there is none: no byte read."""
        return self._call("read", name, lambda: self._bucket().get_blob(name, retry=None, timeout=self._timeout))

    # -- the record of a rollback ----------------------------------------------------------

    def record_rollback(self, step: int) -> float:
        """Record the rollback to ``step`` unless it is recorded; when the standing record was
        created (GCS's clock), so every node that records it gets the same time."""
        name = rollback_name(self._base, step)
        for _ in range(3):
            try:
                blob = self._upload(name, rollback_record(step), if_generation_match=0)
            except api.PreconditionFailed:
                pass  # recorded already: that record stands
            else:
                if blob.time_created is not None:
                    created: float = blob.time_created.timestamp()
                    return created
            when = self.rollback_time(step)
            if when is not None:
                return when
        raise GcsError(f"cannot record {self.url_of(name)}: the object keeps changing")

    def rollback_time(self, step: int) -> float | None:
        """When the rollback to ``step`` was recorded (GCS's clock); None if it never was.

        A record holding anything but what :meth:`record_rollback` writes is
        :class:`~tierfs.tiers.gcs_http.CorruptObject`.
        """
        name = rollback_name(self._base, step)
        blob = self._metadata(name)
        if blob is None:
            return None
        try:
            data = self._download(name, MAX_RECORD, blob.generation)
        except MissingObject:
            return None  # deleted since the read
        parse_rollback(data, self.url_of(name), step)
        if blob.time_created is None:
            raise GcsError(f"{self.url_of(name)} has no creation time")
        created: float = blob.time_created.timestamp()
        return created
