"""Retention and garbage collection of one job's objects in GCS: which manifests go, which chunks nothing needs.

Apart from the store because it is the one part that deletes what others may be using,
and its argument (why a concurrent upload never loses a chunk) reads best on its own.
:class:`GarbageCollection` is a part of :class:`~tierfs.tiers.gcs_store.GcsStore` and runs
on the store's own operations: its listings, reads and conditional deletes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tierfs.core import manifest as manifest_format
from tierfs.core.milestones import NO_MILESTONES, Milestones
from tierfs.tiers.gcs_http import CorruptObject, GcsBucket, MissingObject
from tierfs.tiers.gcs_layout import ChunkInfo, ManifestListing, chunk_name, last_used, parse_manifest_chunks

if TYPE_CHECKING:
    from tierfs.core.bucket_seal import ChunkSeal
    from tierfs.core.keys import ManifestKeys

GC_THREADS = 16
PENDING_MAX_AGE = 24 * 3600.0  # an upload marker older than this belongs to a dead upload


class GarbageCollection(GcsBucket):
    """The collector of :class:`~tierfs.tiers.gcs_store.GcsStore`, which it is a part of."""

    if TYPE_CHECKING:  # the store's own (and its Rollback's), which the collector runs on
        _base: str
        keys: ManifestKeys | None

        def _manifest_name(self, rank: int, step: int, kind: str) -> str: ...
        def _read_manifest(self, name: str, rank: int, step: int, generation: int | None = None) -> bytes: ...
        def list_manifests(self, prefix: str = "") -> ManifestListing: ...
        def delete_manifest(self, rank: int, step: int) -> None: ...
        def list_pending(self, max_age: float) -> dict[tuple[int, int], set[str]]: ...
        def list_chunks(self) -> Iterator[ChunkInfo]: ...
        def delete_chunk(self, key: str, if_metageneration_match: int) -> bool: ...
        def seal_by_id(self, seal_id: str) -> ChunkSeal | None: ...
        def list_aside(self) -> dict[int, ManifestListing]: ...
        def _aside_name(self, to: int, rank: int, step: int) -> str: ...

    def collect_garbage(
        self,
        keep_newest: int,
        grace: float,
        nodes: int = 1,
        pending_max_age: float = PENDING_MAX_AGE,
        *,
        milestones: Milestones = NO_MILESTONES,
        now: float | None = None,
    ) -> dict[str, int]:
        """Apply retention to every rank of the job, then delete the chunks nothing needs.

        Each rank keeps its newest ``keep_newest`` manifests, its ``milestones`` besides them,
        and every manifest at or after the newest step that GCS holds for every one of the
        job's ``nodes`` ranks: retention never removes the newest step the whole job can
        restore from GCS. A milestone's age is that of its manifest object: GCS's creation
        time of it (``timeCreated``, from the listing) is taken for the step's commit time,
        and ``now`` (default: when the collection starts) is when ages are measured; one the
        listing gives no time for is kept. The chunks a kept milestone names stay, as any
        kept manifest's; an expired one goes like any old step. Manifests a rollback set
        aside (:mod:`~tierfs.tiers.gcs_aside`) are not the collector's to delete: they stay,
        with every chunk they name, until the operator discards them. A chunk is deleted only
        if no remaining manifest, no set-aside manifest and no live pending marker names it,
        and it has not been written or touched since ``t0 - grace``, ``t0`` being taken
        before any listing.

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

        Why a rollback never loses one either. Setting a manifest aside copies it under
        ``aside/`` before its original goes, and set-aside manifests are listed after the
        kept ones are read: a kept manifest found gone when read was copied before that, so
        the listing finds the copy. (The one case left: a manifest this collection drops
        while a rollback copies it; that is an old step retention removes anyway, and its
        copy may then lack chunks.)

        ``grace`` must exceed the clock skew between this host and GCS, since
        ``updated`` is GCS's time and ``t0`` ours. An upload must finish, or put its
        marker again, within ``pending_max_age``.

        Each candidate is read again right before its conditional delete. On GCS the
        precondition alone is enough; the read costs one request per deleted chunk and
        keeps the guarantee on servers that ignore delete preconditions (fake-gcs-server).

        Chunks are objects here, by key (:mod:`~tierfs.tiers.gcs_layout`): a manifest whose
        chunks are sealed needs the objects its seal names them by.

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
        now = t0 if now is None else now
        for rank, steps in listing.items():
            for step in steps[:-keep_newest]:
                keep = (
                    protect is not None
                    and step >= protect
                    or milestones.is_milestone(step, listing.created.get((rank, step)), now)
                )
                (kept if keep else dropped).append((rank, step))
            kept += [(rank, step) for step in steps[-keep_newest:]]

        with ThreadPoolExecutor(GC_THREADS, thread_name_prefix="tierfs-gc") as pool:
            list(pool.map(lambda rs: self.delete_manifest(*rs), dropped))
            kept_names = [(self._manifest_name(rank, step, "json"), rank, step) for rank, step in kept]
            needed: set[str] = set().union(*pool.map(self._manifest_chunks, kept_names))
            needed.update(*pool.map(self._manifest_chunks, self._aside_names()))  # only now: see above
            referenced = needed.union(*pending.values())
            present: set[str] = set()
            candidates: list[ChunkInfo] = []
            for info in self.list_chunks():
                present.add(info.key)
                if info.key not in referenced and info.updated < cutoff:
                    candidates.append(info)
            collected = pool.map(functools.partial(self._collect, cutoff=cutoff), candidates)
            deleted = [info for info, gone in zip(candidates, collected, strict=True) if gone]

        return {
            "manifests_deleted": len(dropped),
            "chunks_deleted": len(deleted),
            "bytes_deleted": sum(info.size for info in deleted),
            "chunks_kept": len(present) - len(deleted),
            "chunks_missing": len(needed - present),
        }

    def _aside_names(self) -> list[tuple[str, int, int]]:
        """(object name, rank, step) of every manifest set aside
        (:meth:`~tierfs.tiers.gcs_aside.Rollback.list_aside`)."""
        return [
            (self._aside_name(to, rank, step), rank, step)
            for to, listing in self.list_aside().items()
            for rank, steps in listing.items()
            for step in steps
        ]

    def _manifest_chunks(self, named: tuple[str, int, int]) -> set[str]:
        """The chunk objects the manifest object ``name`` of (rank, step) needs: an active one
        or a set-aside copy, read by its name and checked as the job's (rank, step)."""
        name, rank, step = named
        url = self.url_of(name)
        try:
            data = self._read_manifest(name, rank, step)
        except MissingObject:
            return set()  # deleted since it was listed (another collector, a discard): nothing to keep
        try:
            data = manifest_format.authenticate(data, self.keys, rank, step)
        except manifest_format.Unauthenticated as e:
            # Replaced since the listing verified it: which chunks the step needs is unknown.
            raise CorruptObject(f"{url} was replaced by a manifest that is not this job's ({e})") from None
        seal_id, hashes = parse_manifest_chunks(data, url)
        if not seal_id:
            return hashes  # in clear: the objects are named by the chunks' hashes
        seal = self.seal_by_id(seal_id)
        if seal is None:  # which objects it needs is unknown here: nothing may go
            raise CorruptObject(
                f"{url} has its chunks sealed under a secret this node lacks "
                f"(seal {seal_id}): add that secret to the older lines of the secret file"
            )
        return {seal.object_key(h) for h in hashes}

    def _collect(self, info: ChunkInfo, cutoff: float) -> bool:
        """Delete one unreferenced chunk unless it has been used since it was listed."""
        name = chunk_name(self._base, info.key)
        blob = self._call("read", name, lambda: self._bucket().get_blob(name, retry=None, timeout=self._timeout))
        if blob is None or blob.metageneration != info.metageneration or last_used(blob) >= cutoff:
            return False
        return self.delete_chunk(info.key, info.metageneration)
