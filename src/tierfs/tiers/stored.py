"""Tiers on this node's own file systems, kept by the replica store's code.

The RAM tier's replicas and the disk tier hold chunks and manifests the same way: one
:class:`~tierfs.store.replicas.ReplicaStore` each (root-only directories, a chunk file only
under its verified name, manifests written atomically and only once every chunk they name
is there). :class:`StoredTier` is what both share; subclasses say on which thread the
store's work runs (:meth:`StoredTier._do`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar, TypeVarTuple

import trio

from tierfs.core import chunks
from tierfs.peers.wire import NoSpace, PeerError
from tierfs.store.chunkfiles import Corrupt, NotFound
from tierfs.store.replicas import ReplicaStore
from tierfs.tiers.base import (
    MAX_MANIFEST,
    Holdings,
    Location,
    NotHeld,
    Put,
    SourceChanged,
    Tier,
    TierError,
    check_chunk,
    check_manifest,
)

R = TypeVar("R")
Ts = TypeVarTuple("Ts")


class StoredTier(Tier):
    """A tier whose chunks and manifests live in a :class:`ReplicaStore` on this node."""

    def __init__(self, store: ReplicaStore | None):
        super().__init__()
        self.store = store  # None: this node's RAM without --listen, which keeps no replicas

    async def _do(self, fn: Callable[[*Ts], R], *args: *Ts) -> R:
        """Run one store operation (subclasses choose the thread)."""
        return fn(*args)

    def _need_store(self, what: str) -> ReplicaStore:
        """The store, or a refusal of the ``what`` (chunks, manifests) a tier without one is asked for."""
        if self.store is None:
            raise TierError(f"this node keeps no {what} for others: it has no --listen")
        return self.store

    def _own_copy(self, h: str) -> Location | None:
        """A copy of chunk ``h`` outside the store (this node's own steps), tried first."""
        return None

    # -- chunks ------------------------------------------------------------------------

    async def has_chunks(self, hashes: Sequence[str]) -> list[bool]:
        store = self._need_store("chunks")
        return await self._do(lambda: [store.has(h) for h in hashes])

    async def put_chunk(self, h: str, path: str | Path, offset: int, length: int) -> Put:
        check_chunk(self, h, length)
        try:
            problem = await self._do(self._need_store("chunks").copy_in, h, (str(path), offset, length))
        except NoSpace:
            raise TierError(f"{self.name} ({self.where}) has no room for chunk {h}") from None
        except PeerError as e:
            raise TierError(f"{self.name}: chunk {h}: {e}") from None
        if problem is not None:
            raise SourceChanged(f"{path} at {offset}: {problem}, not chunk {h}")
        return Put(length, length)

    async def get_chunk(self, h: str, length: int) -> bytes:
        check_chunk(self, h, length)
        own = self._own_copy(h)
        if own is not None and own[2] == length:
            try:
                data = await trio.to_thread.run_sync(_read_verified, *own, h)
            except OSError:
                data = None  # retained away since it was indexed
            if data is not None:
                return data
        try:
            data = await self._do(self._read_stored, h, length)
        except NotFound:
            raise NotHeld(f"{self.name} does not hold chunk {h}") from None
        except Corrupt:
            raise TierError(f"{self.name}: its copy of chunk {h} is damaged (removed)") from None
        if data is None:
            raise NotHeld(f"{self.name} holds no {length}-byte chunk {h}")
        return data

    def _read_stored(self, h: str, length: int) -> bytes | None:
        """The store's copy of ``h``, verified when stored or now, and again as read."""
        with self._need_store("chunks").open_chunk(h) as source:
            if source.length != length:
                return None
            return _read_verified_fd(source.fd, source.offset, length, h)

    # -- manifests ---------------------------------------------------------------------

    async def put_manifest(self, rank: int, step: int, data: bytes) -> None:
        check_manifest(self, rank, step, data)
        try:
            await self._do(self._need_store("manifests").put_manifest_now, rank, step, data)
        except NoSpace:
            raise TierError(
                f"{self.name} ({self.where}) has no room for the manifest of rank {rank} step {step}"
            ) from None
        except PeerError as e:
            raise TierError(f"{self.name}: manifest of rank {rank} step {step}: {e}") from None

    async def get_manifest(self, rank: int, step: int) -> bytes:
        try:
            data = await self._do(self._need_store("manifests").get_manifest, rank, step)
        except (NotFound, FileNotFoundError):
            raise NotHeld(f"{self.name} does not hold the manifest of rank {rank} step {step}") from None
        except (Corrupt, OSError) as e:
            raise TierError(f"{self.name}: manifest of rank {rank} step {step}: {e}") from None
        if len(data) > MAX_MANIFEST:
            raise TierError(f"{self.name}: manifest of rank {rank} step {step} is larger than {MAX_MANIFEST} bytes")
        return data

    async def holdings(self) -> Holdings:
        return Holdings(tuple(await self._do(self._need_store("manifests").manifests)))

    async def set_aside(self, rank: int | None, above: int, before: float) -> list[tuple[int, int]]:
        store = self._need_store("manifests")
        return await self._do(store.forget, rank, above, before)  # a copy: the owner's GCS keeps them

    def report(self) -> dict[str, object]:
        return {**super().report(), **(self.store.stats() if self.store is not None else {})}


def _read_verified(path: str, offset: int, length: int, h: str) -> bytes | None:
    """``length`` bytes of ``path`` at ``offset`` if they are chunk ``h``, else None."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _read_verified_fd(fd, offset, length, h)
    finally:
        os.close(fd)


def _read_verified_fd(fd: int, offset: int, length: int, h: str) -> bytes | None:
    parts: list[bytes] = []
    done = 0
    while done < length and (part := os.pread(fd, length - done, offset + done)):
        parts.append(part)
        done += len(part)
    data = b"".join(parts)
    return data if len(data) == length and chunks.chunk_hash(data) == h else None
