"""What a tier is: a place that holds chunks by hash and manifests by (rank, step).

This node's RAM, a local disk, another node's RAM and GCS are all a :class:`Tier`, and a
tier only stores: its verbs put and give chunks by hash, put and give manifests, and say
what it holds. How the pipeline uses a lane of tiers (how many copies, placement among
peers, an upload interval, which twins share the uploads, retention) is the lane's policy
(:mod:`tierfs.pipeline.policy`), not the tier's. The rest of the node takes tiers as
values, orders them by :attr:`Tier.cost` and never asks which kind it holds; what it must
know of a tier is a capability it declares (:attr:`Tier.shared`, :attr:`Tier.address`,
:attr:`Tier.volatile`, ...), never its class or its name. Adding a tier is one module that
implements this class and one line where the daemon assembles its tiers
(:func:`tierfs.daemon.tiers.node_tiers`).

The contract every tier keeps (``tests/tiers/`` runs one suite over all of them):

- **Chunks are verified.** :meth:`Tier.get_chunk` never returns bytes whose xxh3-128 is
  not the name asked for, and :meth:`Tier.put_chunk` never stores bytes that are not.
- **Manifests are atomic.** A reader gets the whole of a manifest or nothing; a put of
  the same (rank, step) replaces the old one whole. A manifest is put after its chunks,
  so its presence commits the step on that tier.
- **Sizes are capped.** No chunk larger than :data:`MAX_CHUNK` and no manifest larger
  than :data:`MAX_MANIFEST` is read or stored, whatever the other side claims.
- **Errors are one line**, naming the tier and the object: :class:`NotHeld` (the tier
  does not have it), :class:`TierUnavailable` (cannot reach it now: try later),
  :class:`SourceChanged` (the local bytes being sent changed meanwhile: read them again),
  :class:`TierError` for anything else (a refusal, damaged bytes).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, overload

import trio

from tierfs.core.chunks import MAX_CHUNK_SIZE
from tierfs.core.linux import pwrite_all
from tierfs.core.manifest import MAX_BYTES as MAX_MANIFEST_BYTES
from tierfs.tiers.twins import share

if TYPE_CHECKING:
    from tierfs.core.keys import ManifestKeys
    from tierfs.core.manifest import Manifest

log = logging.getLogger(__name__)

MAX_CHUNK = MAX_CHUNK_SIZE  # no chunk any tier stores or gives is larger
MAX_MANIFEST = MAX_MANIFEST_BYTES

Location = tuple[str, int, int]  # (path, offset, length) of a chunk's bytes in a local file
Address = tuple[str, int]  # (host, port) of a node's peer service


class Lane(StrEnum):
    """The replicator's lanes: each step's copies are recorded, and ``tierfs status`` shows them, by lane.

    str-valued, so a step's state files and the status JSON keep the names they always had.
    """

    DISK = "disk"  # this node's --disk
    PEERS = "peers"  # other nodes' RAM: alternatives, ``copies()`` of them per step
    GCS = "gcs"  # the job's bucket


class TierError(Exception):
    """A tier could not do what was asked; the message is one line naming tier and object."""


class TierUnavailable(TierError):
    """The tier cannot be reached now (down, slow, out of service): try again later."""


class NotHeld(TierError):
    """The tier does not hold the chunk or manifest asked for."""


class SourceChanged(TierError):
    """A local range sent as a chunk no longer holds that chunk's bytes (a snapshot file was
    detached while it was read): read the step again."""


@dataclass(frozen=True)
class Cost:
    """How fast a restore reads from a tier, and what reading from it costs.

    Rough numbers are enough: they only order the tiers, fastest free tier first.
    """

    read_gib_s: float
    dollars_per_gib: float = 0.0

    def key(self) -> tuple[float, float]:
        return (self.dollars_per_gib, -self.read_gib_s)


@dataclass(frozen=True)
class Holdings:
    """What a tier holds, as the cluster survey needs it."""

    manifests: tuple[tuple[int, int], ...]  # (rank, step) of every manifest it holds
    restore_step: int | None = None  # the step its node restored and still runs from, if a node
    topology: tuple[tuple[str, str], ...] = ()  # its node's labels, if a node


class Put(NamedTuple):
    """What one :meth:`Tier.put_chunk` moved: raw bytes sent (0: it was there meanwhile), bytes stored."""

    sent: int
    stored: int


@dataclass
class Pushed:
    """What putting one step on one tier moved."""

    sent_bytes: int = 0  # raw bytes of the chunks the tier lacked and this node sent
    skipped_bytes: int = 0  # raw bytes of the distinct chunks it held already, or that twins sent
    stored_bytes: int = 0  # what the tier stored for the chunks sent (after compression)
    chunks: int = 0  # distinct chunks of the step
    sent_chunks: int = 0  # chunks this node sent
    twin_chunks: int = 0  # chunks its data-parallel twins sent (of skipped_bytes: twin_bytes)
    twin_bytes: int = 0
    taken_over: int = 0  # of sent_chunks: chunks a twin was to send and had not after the wait

    def __iadd__(self, other: Pushed) -> Pushed:
        for name in (
            "sent_bytes",
            "skipped_bytes",
            "stored_bytes",
            "sent_chunks",
            "twin_chunks",
            "twin_bytes",
            "taken_over",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.chunks = max(self.chunks, other.chunks)
        return self


@dataclass
class Progress:
    """One lane's progress through the step it is putting."""

    step: int
    chunks_total: int
    chunks_done: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"step": self.step, "chunks_done": self.chunks_done, "chunks_total": self.chunks_total}


async def _no_pause() -> None:
    pass


class Tier(ABC):
    """One place that holds chunks and manifests. Subclasses set the class attributes.

    ``name`` identifies the tier in surveys, logs and status (``"local"``, ``"disk"``,
    ``"peer HOST:PORT"``, ``"gcs"``); ``kind`` is what it is (``"local"``, ``"disk"``,
    ``"peer"``, ``"gcs"``); ``lane`` is the replicator lane that puts steps on it (tiers
    that share a lane are alternatives: a step goes to :meth:`copies` of them).
    """

    name: str
    kind: str
    lane: Lane | None = None  # None: the replicator puts nothing here (this node's own RAM)
    cost: Cost
    concurrency: int = 1  # chunks (or batches) put at once while a step goes to this tier
    batch_bytes: int = 0  # > 0: put_chunks and get_chunks_into carry up to this many bytes of chunks per request
    batch_chunks: int = 1  # ... and at most this many chunks
    early: bool = False  # keeps chunks put before the manifest naming them exists: sent while the step is hashed
    skip_after_failure: bool = False  # one of several holders: after a failure a restore asks the others
    volatile: bool = False  # may lose what it holds (another node's RAM): the lane checks it again
    awaited: bool = False  # another node of the job, maybe starting now: a survey waits for it
    spill: bool = False  # on this node beside the RAM: when RAM is short, a step held here may leave RAM
    shared: bool = False  # one store every rank of the job shares (a bucket): its listing answers for every rank
    address: Address | None = None  # another node's peer service: the node the job's coordination names

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    @property
    def where(self) -> str:
        """Where it is, for people: a URL, a path, a peer's address."""
        return self.name

    # -- chunks ------------------------------------------------------------------------

    @abstractmethod
    async def has_chunks(self, hashes: Sequence[str]) -> list[bool]:
        """For each hash, whether the tier holds that chunk (and keeps it while a step is put)."""

    @abstractmethod
    async def put_chunk(self, h: str, path: str | Path, offset: int, length: int) -> Put:
        """Store chunk ``h``: ``length`` bytes of the local file ``path`` at ``offset``.

        Raises :class:`SourceChanged` if those bytes are not chunk ``h``, :class:`TierError`
        if the tier refuses them.
        """

    async def put_chunks(self, chunks: Sequence[tuple[str, Location]]) -> list[Put]:
        """Store several chunks, as :meth:`put_chunk` does each; a tier with ``batch_bytes`` in one request.

        A failure may leave some of them stored: the tier holds what it holds, and a step's
        put asks it again.
        """
        return [await self.put_chunk(h, *where) for h, where in chunks]

    @abstractmethod
    async def get_chunk(self, h: str, length: int) -> bytes:
        """Chunk ``h`` of ``length`` bytes, verified; :class:`NotHeld` if the tier lacks it."""

    async def get_chunk_into(self, h: str, length: int, fd: int, offset: int) -> None:
        """Chunk ``h`` written into ``fd`` at ``offset``; raises as :meth:`get_chunk` does.

        The range may hold other bytes when this raises (a tier that writes as bytes arrive
        checks them at the end): the caller writes it again from another tier, and serves
        none of it before it succeeds. A tier that can receive straight into the file (a
        peer) overrides this and saves the copies through a buffer.
        """
        data = await self.get_chunk(h, length)
        await trio.to_thread.run_sync(pwrite_all, fd, data, offset)

    async def get_chunks_into(self, chunks: Sequence[tuple[str, int, int, int]]) -> list[bool]:
        """Chunks ``(h, length, fd, offset)``, each as :meth:`get_chunk_into` writes it; for each, whether it came.

        ``False``: the tier does not hold it (:class:`NotHeld`). Any other failure is
        raised, and then any of the ranges may hold other bytes. A tier with
        ``batch_bytes`` asks for them all in one request.
        """
        came = []
        for h, length, fd, offset in chunks:
            try:
                await self.get_chunk_into(h, length, fd, offset)
            except NotHeld:
                came.append(False)
            else:
                came.append(True)
        return came

    async def present(self, h: str, path: str | Path, offset: int, length: int) -> bool:
        """Whether the tier holds chunk ``h`` now (its local bytes are at ``path``, for tiers that compare them)."""
        return (await self.has_chunks([h]))[0]

    # -- manifests ---------------------------------------------------------------------

    @abstractmethod
    async def put_manifest(self, rank: int, step: int, data: bytes) -> None:
        """Commit (rank, step) on this tier: every chunk it names must be held already."""

    @abstractmethod
    async def get_manifest(self, rank: int, step: int) -> bytes:
        """The manifest's bytes (at most :data:`MAX_MANIFEST`); :class:`NotHeld` if absent.

        The caller parses it and checks it is the job's, rank's and step's.
        """

    @abstractmethod
    async def holdings(self) -> Holdings:
        """Every (rank, step) whose manifest the tier holds, and what its node says of itself."""

    async def list_manifests(self) -> list[tuple[int, int]]:
        return sorted((await self.holdings()).manifests)

    async def list_manifests_under(self, prefix: str) -> dict[int, list[int]]:
        """Committed steps by rank, of the manifests under ``prefix``: one shard of a ``shared``
        tier's listing, so that coordinators list a large job's bucket in parallel."""
        raise NotImplementedError(f"{self.name} is not listed in shards: only a shared tier is")

    def held(self) -> tuple[tuple[int, int], ...]:
        """The (rank, step) manifests held, known without asking: a ``spill`` tier's, which its
        node reports as its own; () for a tier that must be asked."""
        return ()

    async def set_aside(self, rank: int | None, above: int, before: float) -> list[tuple[int, int]]:
        """A rollback to step ``above``: take the manifests of ``rank`` (None: every rank's) newer
        than ``above`` and committed before ``before`` (unix time) out of what the tier holds.

        They are the abandoned timeline's: left in place they would count as complete steps
        again, and the job's next commits reuse their numbers. A tier that keeps steps for
        good moves them where no listing counts them (GCS); a cache drops them. Returns the
        (rank, step) manifests that went; another node's tier (a peer) is never asked.
        """
        return []

    async def put_step(
        self,
        manifest: Manifest,
        where: dict[str, Location],
        pace: Callable[[], Awaitable[None]] = _no_pause,
        progress: Progress | None = None,
        seal_with: ManifestKeys | None = None,
        twins: Sequence[int] = (),
    ) -> Pushed:
        """Put a whole step here (:func:`put_step`: its chunks, then its manifest). A tier that
        keeps a step as something else than chunks (an erasure group's parity) overrides it."""
        return await put_step(self, manifest, where, pace, progress, seal_with, twins)

    def stands_for(self, name: str) -> bool:
        """Whether this tier gives what the tier named ``name`` reports holding (an erasure group
        gives its members' steps, which their peer tiers report); a restore reads it in their place."""
        return False

    async def lost(self, rank: int, step: int) -> str | None:
        """Why the tier cannot give ``rank``'s ``step`` though it knows the step existed (an erasure
        group with too few members left); None when it can, or never held it."""
        return None

    # -- what it says about itself ---------------------------------------------------------

    def report(self) -> dict[str, object]:
        """What ``tierfs status`` shows of the tier."""
        return {"name": self.name, "kind": self.kind, "where": self.where}

    # -- a step's bracket, and closing ----------------------------------------------------

    async def begin_step(self, rank: int, step: int, hashes: Sequence[str]) -> None:  # noqa: B027 (an optional hook, a no-op by default)
        """Called before the chunks of a step are put (GCS announces the upload)."""

    async def end_step(self, rank: int, step: int) -> None:  # noqa: B027 (an optional hook, a no-op by default)
        """Called after the step's manifest is put."""

    async def aclose(self) -> None:  # noqa: B027 (an optional hook, a no-op by default)
        """Let go of connections and files."""


async def put_step(
    tier: Tier,
    manifest: Manifest,
    where: dict[str, Location],
    pace: Callable[[], Awaitable[None]] = _no_pause,
    progress: Progress | None = None,
    seal_with: ManifestKeys | None = None,
    twins: Sequence[int] = (),
) -> Pushed:
    """Put a step on ``tier``: the chunks it lacks, then the manifest (its commit point there).

    ``where`` locates every distinct chunk of the step in local files; ``pace`` is awaited
    before each chunk, or batch of them (:func:`batches`), is sent (the job's writes go
    first). The manifest goes sealed with ``seal_with``, the node's manifest keys (``None``:
    a node without a secret). With ``twins`` (other ranks putting the same chunks on the
    tier, as the lane's policy says), the chunks it lacks are shared out among them
    (:func:`tierfs.tiers.twins.share`): this node sends those it leads, and waits, within a
    bound, for the others to be there before its manifest goes.
    """
    hashes = list(where)
    data = manifest.sealed(seal_with)
    pushed = Pushed(chunks=len(hashes))
    await tier.begin_step(manifest.rank, manifest.step, hashes)
    have = await tier.has_chunks(hashes) if hashes else []
    missing = {}
    for h, held in zip(hashes, have, strict=True):
        if held:
            pushed.skipped_bytes += where[h][2]
        else:
            missing[h] = where[h][2]
    if progress is not None:
        progress.chunks_done = len(hashes) - len(missing)

    async def upload(batch: list[str]) -> list[bool]:
        await pace()
        puts = await tier.put_chunks([(h, where[h]) for h in batch])
        pushed.stored_bytes += sum(put.stored for put in puts)
        return [put.sent > 0 for put in puts]

    def settled(h: str) -> None:
        if progress is not None:
            progress.chunks_done += 1

    shared = await share(
        missing,
        manifest.rank,
        list(twins),
        exists=lambda h: tier.present(h, *where[h]),
        upload=upload,
        batched=lambda hs: batches(tier, [(h, where[h]) for h in hs]),
        workers=tier.concurrency,
        settled=settled,
    )
    pushed.sent_bytes += shared.sent_bytes
    pushed.skipped_bytes += shared.found_bytes + shared.twin_bytes
    pushed.sent_chunks, pushed.twin_chunks = shared.sent_chunks, shared.twin_chunks
    pushed.twin_bytes, pushed.taken_over = shared.twin_bytes, shared.taken_over
    await tier.put_manifest(manifest.rank, manifest.step, data)  # only now: every chunk it names is there
    await tier.end_step(manifest.rank, manifest.step)
    return pushed


def batches(tier: Tier, chunks: Sequence[tuple[str, Location]]) -> list[list[str]]:
    """``chunks`` in order, cut into the batches ``tier`` takes per request (one each if it takes none)."""
    out: list[list[str]] = []
    total = 0
    for h, (_, _, length) in chunks:
        if out and len(out[-1]) < tier.batch_chunks and total + length <= tier.batch_bytes:
            out[-1].append(h)
            total += length
        else:
            out.append([h])
            total = length
    return out


def check_chunk(tier: Tier, h: str, length: int) -> None:
    """Refuse, before any I/O, a chunk that cannot exist: a bad name or more than :data:`MAX_CHUNK` bytes."""
    if not (isinstance(h, str) and len(h) == 32 and all(c in "0123456789abcdef" for c in h)):
        raise TierError(f"{tier.name}: {h!r} is not a chunk name")
    if not 0 <= length <= MAX_CHUNK:
        raise TierError(f"{tier.name}: chunk {h} of {length} bytes: no chunk is larger than {MAX_CHUNK}")


def check_manifest(tier: Tier, rank: int, step: int, data: bytes) -> None:
    """Refuse, before any I/O, a manifest larger than any manifest can be."""
    if len(data) > MAX_MANIFEST:
        raise TierError(
            f"{tier.name}: manifest of rank {rank} step {step} has {len(data)} bytes: "
            f"no manifest is larger than {MAX_MANIFEST}"
        )


def by_cost(tiers: Sequence[Tier]) -> list[Tier]:
    """Cheapest and fastest first; the order given is kept among equals (closest peer first)."""
    return sorted(tiers, key=lambda t: t.cost.key())


def rotate_equals(tiers: Sequence[Tier], prefer: int) -> list[Tier]:
    """``tiers`` (in cost order) with each run of equal cost rotated by ``prefer``.

    Restore workers pass different ``prefer`` values, so the peers holding a step are read
    in parallel, each worker starting at another one.
    """
    out: list[Tier] = []
    i = 0
    while i < len(tiers):
        j = i
        while j < len(tiers) and tiers[j].cost == tiers[i].cost:
            j += 1
        run = list(tiers[i:j])
        k = prefer % len(run)
        out += run[k:] + run[:k]
        i = j
    return out


def first_leaf(e: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups from a nursery of workers."""
    while isinstance(e, BaseExceptionGroup):
        e = e.exceptions[0]
    return e


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


class NodeTiers(Sequence[Tier]):
    """Every tier of one node, cheapest first: one owner changes it, every other part reads it.

    The parts of a node are built before its tiers are all known (its RAM first, the others
    at start, peers a DNS name gives later), so they hold this object and read it each time
    they act. Only its owner (the daemon, and the cluster task it runs) changes it, through
    :meth:`replace` and :meth:`add`; a part never does.
    """

    def __init__(self, tiers: Sequence[Tier] = ()):
        self._tiers: list[Tier] = by_cost(tiers)

    @overload
    def __getitem__(self, i: int) -> Tier: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Tier]: ...
    def __getitem__(self, i: int | slice) -> Tier | Sequence[Tier]:
        return self._tiers[i]

    def __len__(self) -> int:
        return len(self._tiers)

    def replace(self, tiers: Sequence[Tier]) -> None:
        self._tiers = by_cost(tiers)

    def add(self, tiers: Sequence[Tier]) -> None:
        self._tiers = by_cost([*self._tiers, *tiers])
