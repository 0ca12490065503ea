"""Other ranks' replicas, held in this node's RAM tier.

Layout under ``root`` (the daemon passes a directory on the same tmpfs as the RAM tier)::

    chunks/<h[0:2]>/<h>                       the raw bytes of chunk h (xxh3-128, 32 hex digits)
    chunks/.tmp-*                             a chunk being received or copied; removed by load()
    manifests/rank-<R>/step-<S:012d>.json     the manifest of rank R at step S

A chunk file appears under its name only after its bytes were hashed and matched the
name, so every file the store lists is one it verified. That check is remembered
(:class:`~tierfs.store.chunkfiles.VerifiedRanges`): a read of any range, even one byte,
serves without hashing again while the file is unchanged. A file that changed, a chunk of
this node's own steps never checked before, and every chunk after a restart are hashed once
on their next read. Readers verify what they receive themselves (whole chunks against their
names), which is what catches memory that rots after the check. A manifest is written only
when every chunk it names is held, so its presence is the commit point, as on every tier.

Data-parallel twins commit identical bytes. When a manifest names a chunk this node already
holds in its *own* committed steps (``local``), the replica gets a private copy made with
``copy_file_range`` instead of a network transfer: the twin's own step may be retained away
long before the replica is.

Everything runs on the trio thread, but for the writes of a received body
(:meth:`ChunkWriter.write`), which may run in the worker thread that moves it
(:mod:`tierfs.peers.bodies`). Work that touches bytes is bounded per chunk (one copy and
one hash of at most :data:`MAX_CHUNK` bytes), and loops over many chunks yield between
them, so a big manifest never stalls the other connections or the FUSE handlers.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import trio

from tierfs.core.atomic import private_dir
from tierfs.core.manifest import Manifest, ManifestError
from tierfs.core.milestones import NO_MILESTONES, Milestones
from tierfs.peers.wire import MAX_CHUNK, NoSpace, PeerError, brief, clip
from tierfs.ramtier.space import PAGE, SpaceAccount
from tierfs.store.chunkfiles import (
    ChunkSource,
    ChunkWriter,
    Corrupt,
    LocalChunks,
    Location,
    NotFound,
    VerifiedRanges,
    create_private,
    discard_file,
    is_hash,
    mkdir_private,
    mtime,
    scan,
    write_private,
)
from tierfs.store.retention import is_milestone, rolled_back, superseded

log = logging.getLogger(__name__)

# Chunks a connected sender was told about or sent are kept until it disconnects (its
# manifest is on its way); after that, an unreferenced chunk is kept this long, for a
# sender that lost its connection mid-push and comes back.
GRACE = 60.0

_RANK_RE = re.compile(r"rank-(\d+)")
_STEP_RE = re.compile(r"step-(\d{12})\.json")
_TMP = ".tmp-"


class MissingChunks(PeerError):
    """A manifest names chunks that are neither held nor available locally."""

    def __init__(self, missing: int, total: int):
        super().__init__(f"{missing} of the manifest's {total} chunks are missing: send them first")
        self.missing = missing


class ReplicaStats(TypedDict):
    """What a store holds, for ``tierfs status``."""

    chunks: int
    bytes: int
    manifests: int


@dataclass(slots=True)
class _Held:
    ino: int
    size: int
    used: float  # unix time it was last received, re-sent or reported held


class ReplicaStore:
    """The replicas this node holds for other ranks of ``job``; call :meth:`load` first.

    ``space`` is the RAM tier's account (replicas share its capacity with the job's own
    files); ``None`` means unbounded. ``grace`` is how long a chunk nobody references is
    kept after it was last received or asked about. ``keep_from()`` is the newest step the
    whole job can restore (None while unknown): replicas of that step or newer are never
    dropped, even when a newer replica of the same rank arrives. ``milestones`` are kept
    besides: the disk tier's steps keep them; peers' replicas in RAM keep none, RAM being
    the scarce tier (a milestone lives in GCS and on ``--disk``).
    """

    def __init__(
        self,
        root: Path,
        space: SpaceAccount | None,
        local: LocalChunks | None = None,
        *,
        job: str,
        grace: float = GRACE,
        keep_from: Callable[[], int | None] = lambda: None,
        keep_newest: int = 1,
        milestones: Milestones = NO_MILESTONES,
    ):
        self.root = Path(root)
        self.keep_newest = keep_newest  # replicas kept per rank besides those from keep_from() on
        self.milestones = milestones
        self.keep_from = keep_from
        self.job = job
        self.space = space
        self.local = local
        self.grace = grace
        self._chunk_dir = self.root / "chunks"
        self._manifest_dir = self.root / "manifests"
        self._chunks: dict[str, _Held] = {}
        self._manifests: dict[tuple[int, int], frozenset[str]] = {}  # (rank, step) -> its chunks
        self._reserved = 0  # bytes promised to chunks being received
        self._sessions: dict[object, set[str]] = {}  # connection -> chunks it relies on
        self._verified = VerifiedRanges()

    # -- start-up ------------------------------------------------------------------------

    def load(self) -> None:
        """Index what a previous daemon left: drop half-written files, account the rest.

        Call after ``space.scan`` (which recounts only the trees it is given) or include
        ``root`` in that scan; accounting is by inode, so counting twice is harmless.
        """
        self._chunks.clear()
        self._manifests.clear()
        private_dir(self._chunk_dir)  # root-only, like every directory of the daemon's (umask 0)
        private_dir(self._manifest_dir)
        for sub in scan(self._chunk_dir):
            if sub.name.startswith(_TMP):
                discard_file(Path(sub.path))
            elif sub.is_dir(follow_symlinks=False):
                for f in scan(Path(sub.path)):
                    self._load_chunk(sub.name, f)
        for rank_dir in scan(self._manifest_dir):
            m = _RANK_RE.fullmatch(rank_dir.name)
            if m and rank_dir.is_dir(follow_symlinks=False):
                for f in scan(Path(rank_dir.path)):
                    self._load_manifest(int(m.group(1)), f)
        removed = self.collect_garbage()
        log.info(
            "replica store %s: %d manifests, %d chunks (%d bytes) held; %d unreferenced chunks removed",
            self.root,
            len(self._manifests),
            len(self._chunks),
            self.stats()["bytes"],
            removed,
        )

    def _load_chunk(self, prefix: str, f: os.DirEntry[str]) -> None:
        path = Path(f.path)
        if f.name.startswith(_TMP):
            discard_file(path)
            return
        st = f.stat(follow_symlinks=False)
        if not (is_hash(f.name) and f.name[:2] == prefix and f.is_file(follow_symlinks=False)):
            log.warning("replica store: ignoring unexpected %s", path)
            return
        self._account(st)
        self._chunks[f.name] = _Held(st.st_ino, st.st_size, st.st_mtime)

    def _load_manifest(self, rank: int, f: os.DirEntry[str]) -> None:
        path = Path(f.path)
        if f.name.startswith(_TMP):
            discard_file(path)
            return
        m = _STEP_RE.fullmatch(f.name)
        if not m:
            log.warning("replica store: ignoring unexpected %s", path)
            return
        step = int(m.group(1))
        try:
            manifest = Manifest.from_json(path.read_bytes())
            if (manifest.job, manifest.rank, manifest.step) != (self.job, rank, step):
                raise ManifestError(f"holds job {manifest.job!r} rank {manifest.rank} step {manifest.step}")
        except ManifestError as e:
            log.warning("replica store: removing unusable manifest %s: %s", path, e)
            self._remove_file(path)
            return
        self._account(f.stat(follow_symlinks=False))
        self._manifests[(rank, step)] = frozenset(manifest.chunk_set())

    # -- queries -------------------------------------------------------------------------

    def has(self, h: str) -> bool:
        """Stored here, or available from this node's own steps.

        A stored chunk's grace period restarts, so a sender told "yes" may rely on it for
        ``grace`` seconds while it sends the rest and then the manifest.
        """
        if h in self._chunks:
            self._touch(h)
            return True
        return self.local is not None and is_hash(h) and self.local.find(h) is not None

    def manifests(self) -> list[tuple[int, int]]:
        """Every (rank, step) held, sorted."""
        return sorted(self._manifests)

    def get_manifest(self, rank: int, step: int) -> bytes:
        if (rank, step) not in self._manifests:
            raise NotFound()
        return self._manifest_path(rank, step).read_bytes()

    def chunk_file(self, h: str) -> Location | None:
        """Where chunk ``h``'s bytes are (not verified: :meth:`open_chunk` verifies)."""
        held = self._chunks.get(h)
        if held is not None:
            return str(self._chunk_path(h)), 0, held.size
        return self.local.find(h) if self.local is not None and is_hash(h) else None

    def stats(self) -> ReplicaStats:
        return {
            "chunks": len(self._chunks),
            "bytes": sum(c.size for c in self._chunks.values()),
            "manifests": len(self._manifests),
        }

    # -- chunks --------------------------------------------------------------------------

    def begin_chunk(self, h: str, length: int) -> ChunkWriter:
        """Get ready to receive chunk ``h`` of ``length`` bytes, or refuse with :class:`NoSpace`.

        The store's capacity is checked (and reserved, so concurrent receives cannot
        overcommit together) before a single byte is accepted; a RAM tier that fills up
        meanwhile is found by the write that has no room (:meth:`ChunkWriter.write`).
        """
        if not is_hash(h) or not 0 <= length <= MAX_CHUNK:
            raise PeerError(f"invalid chunk {brief(h)} of {length} bytes")
        if h in self._chunks:
            self._touch(h)  # held through the transfer: the body is only hashed
            return ChunkWriter(h, length, None, None, install=self._received, release=lambda: None)
        need = _pages(length)
        self._check_space(need)
        tmp = self._chunk_dir / f"{_TMP}{h}-{secrets.token_hex(4)}"
        fd = create_private(tmp)
        self._reserved += need
        return ChunkWriter(h, length, fd, tmp, install=self._received, release=lambda: self._unreserve(need))

    def open_chunk(self, h: str) -> ChunkSource:
        """Chunk ``h``, verified (when stored, or now); raises :class:`NotFound` or :class:`Corrupt`.

        A stored chunk that fails the check is deleted (a sender will put it again) and the
        node's own copy, if any, is tried; a bad own copy is reported, never deleted: it is
        not the store's.
        """
        source = None
        if h in self._chunks:
            source = self._verified.open(str(self._chunk_path(h)), 0, None, h)
            if isinstance(source, ChunkSource):
                return source
            log.warning("replica chunk %s in %s is unusable (%s): removed", h, self.root, source)
            self._remove_chunk(h)
        location = self.chunk_file(h)
        if location is None:
            raise Corrupt() if source is not None else NotFound()
        path, offset, length = location
        source = self._verified.open(path, offset, length, h)
        if not isinstance(source, ChunkSource):
            log.warning("own chunk %s at %s+%d is unusable (%s)", h, path, offset, source)
            raise Corrupt()
        return source

    def hold_for(self, session: object, h: str) -> None:
        """Keep chunk ``h`` while ``session`` (a connected sender) may still name it."""
        self._sessions.setdefault(session, set()).add(h)

    def end_session(self, session: object) -> None:
        self._sessions.pop(session, None)

    def collect_garbage(self, now: float | None = None) -> int:
        """Delete chunks no held manifest names, no connected sender relies on, none sent lately."""
        now = time.time() if now is None else now
        referenced = set().union(*self._manifests.values(), *self._sessions.values())
        stale = [h for h, held in self._chunks.items() if h not in referenced and now - held.used >= self.grace]
        for h in stale:
            self._remove_chunk(h)
        if stale:
            log.debug("replica store %s: collected %d chunks", self.root, len(stale))
        return len(stale)

    # -- manifests -----------------------------------------------------------------------

    async def put_manifest(self, rank: int, step: int, data: bytes) -> None:
        """Commit a replica of (rank, step): every chunk must be held or locally available.

        Chunks available locally are copied in first, yielding to other tasks between chunks.
        Then the manifest is written atomically, older steps of the rank are dropped and
        unreferenced chunks collected. Raises :class:`MissingChunks` (nothing written, nothing copied) when some
        chunk is nowhere on this node, :class:`NoSpace`, or :class:`PeerError` for a
        manifest that is unusable or is not the one it claims to be.
        """
        needed = self._check_manifest(rank, step, data)
        copies = {}
        for h in needed - self._chunks.keys():
            location = self.local.find(h) if self.local is not None else None
            if location is not None:
                copies[h] = location
        missing = len(needed - self._chunks.keys()) - len(copies)
        if missing:
            raise MissingChunks(missing, len(needed))
        for h, location in copies.items():
            if h not in self._chunks:  # another connection may have stored it meanwhile
                self._copy_local(h, location)
            await trio.lowlevel.checkpoint()
        # From here on nothing awaits: the check, the write and the index update are atomic
        # with respect to every other connection, including their garbage collections.
        self._commit_manifest(rank, step, data, needed)
        log.info(
            "replica of job %s rank %d step %d stored (%d chunks, %d copied locally)",
            self.job,
            rank,
            step,
            len(needed),
            len(copies),
        )

    def put_manifest_now(self, rank: int, step: int, data: bytes) -> None:
        """:meth:`put_manifest` for a caller that put every chunk itself (no local copies, no await)."""
        self._commit_manifest(rank, step, data, self._check_manifest(rank, step, data))

    def _check_manifest(self, rank: int, step: int, data: bytes) -> frozenset[str]:
        """The chunks of a manifest that is this job's and the (rank, step) it claims to be."""
        try:
            manifest = Manifest.from_json(data)
        except ManifestError as e:
            raise PeerError(f"unusable manifest: {clip(str(e))}") from None
        if manifest.job != self.job:
            raise PeerError(f"manifest is for job {brief(manifest.job)}, this store holds {self.job!r}")
        if (manifest.rank, manifest.step) != (rank, step):
            raise PeerError(f"manifest is for rank {manifest.rank} step {manifest.step}, not rank {rank} step {step}")
        return frozenset(manifest.chunk_set())

    def _commit_manifest(self, rank: int, step: int, data: bytes, needed: frozenset[str]) -> None:
        missing = len(needed - self._chunks.keys())
        if missing:
            raise MissingChunks(missing, len(needed))
        self._write_manifest(rank, step, data)
        self._manifests[(rank, step)] = needed
        self.retain()

    # -- internals -----------------------------------------------------------------------

    def _chunk_path(self, h: str) -> Path:
        return self._chunk_dir / h[:2] / h

    def _manifest_path(self, rank: int, step: int) -> Path:
        return self._manifest_dir / f"rank-{rank}" / f"step-{step:012d}.json"

    def _check_space(self, nbytes: int) -> None:
        if self.space is None:
            return
        try:
            self.space.check_growth(self._reserved + nbytes)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise NoSpace() from None
            raise

    def _account(self, st: os.stat_result) -> None:
        if self.space is not None:
            self.space.update(st)

    def _unreserve(self, nbytes: int) -> None:
        self._reserved -= nbytes

    def _received(self, h: str, fd: int | None, tmp: Path | None) -> None:
        """Move a verified temp file into place (or drop it if the chunk arrived meanwhile).

        ``fd`` is ``None`` for a chunk that was held already: only its grace period restarts.
        """
        if fd is None or tmp is None:  # both None together: the writer of a chunk held already
            self._touch(h)
            return
        if h in self._chunks:
            discard_file(tmp)
            self._touch(h)
            return
        path = self._chunk_path(h)
        mkdir_private(path.parent)
        os.rename(tmp, path)
        st = os.fstat(fd)  # after the rename, which changes the ctime
        self._account(st)
        self._chunks[h] = _Held(st.st_ino, st.st_size, time.time())
        self._verified.remember(st, 0, st.st_size, h)  # its bytes were hashed as they arrived

    def _touch(self, h: str) -> None:
        if (held := self._chunks.get(h)) is not None:
            held.used = time.time()

    def _copy_local(self, h: str, location: Location) -> None:
        """Copy this node's own copy of ``h`` in, verified; zero bytes cross the network."""
        problem = self.copy_in(h, location)
        if problem is not None:
            log.warning("own chunk %s at %s+%d %s: not copied", h, location[0], location[1], problem)

    def copy_in(self, h: str, location: Location) -> str | None:
        """Store chunk ``h`` from a local file range, verified; what is wrong with the range, or None.

        Raises :class:`NoSpace` (nothing kept) when there is no room for it.
        """
        path, offset, length = location
        if h in self._chunks:  # held already: nothing to copy
            self._touch(h)
            return None
        with self.begin_chunk(h, length) as writer:
            problem = writer.fill_from(path, offset)
            if problem is None:
                writer.commit()
        return problem

    def _write_manifest(self, rank: int, step: int, data: bytes) -> None:
        path = self._manifest_path(rank, step)
        self._check_space(_pages(len(data)))
        mkdir_private(path.parent)
        tmp = path.with_name(f"{_TMP}{path.name}-{secrets.token_hex(4)}")
        st = write_private(tmp, data)
        try:
            old = os.stat(path)
        except FileNotFoundError:
            old = None
        os.rename(tmp, path)
        if old is not None and self.space is not None:
            self.space.drop(old.st_ino)
        self._account(st)

    def retain(self, now: float | None = None) -> None:
        """Drop replicas superseded by ``keep_newest`` newer ones of their rank that the job no longer needs.

        A superseded replica stays while it is at or after the newest step the whole job
        can restore (or while that is unknown): it may be the only copy of that step. The
        ``keep_newest`` newest milestones of a rank stay too, while they are ones at ``now``
        (default: the time now).
        """
        floor = self.keep_from()
        now = time.time() if now is None else now

        def milestone(rank: int, step: int) -> bool:
            return is_milestone(self.milestones, self._manifest_path(rank, step), step, now)

        for (r, s), newest in superseded(self._manifests, self.keep_newest, floor, milestone).items():
            del self._manifests[(r, s)]
            self._remove_file(self._manifest_path(r, s))
            log.debug("replica of rank %d step %d dropped: superseded by step %d", r, s, newest)
        self.collect_garbage()

    def forget(self, rank: int | None, above: int, before: float) -> list[tuple[int, int]]:
        """A rollback (:meth:`tierfs.tiers.base.Tier.set_aside`): drop the manifests of ``rank``
        (None: every rank) newer than ``above`` and written before ``before``; a cache of
        what the owner's other tiers set aside."""
        gone = rolled_back(self._manifests, rank, above, before, lambda r, s: mtime(self._manifest_path(r, s)))
        for r, s in gone:
            del self._manifests[(r, s)]
            self._remove_file(self._manifest_path(r, s))
        return gone

    def _remove_chunk(self, h: str) -> None:
        held = self._chunks.pop(h)
        discard_file(self._chunk_path(h))
        if self.space is not None:
            self.space.drop(held.ino)

    def _remove_file(self, path: Path) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        discard_file(path)
        if self.space is not None:
            self.space.drop(st.st_ino)


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE
