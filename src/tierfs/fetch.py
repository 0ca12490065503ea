"""Where a restore gets a chunk from: this node, a peer that holds the step, or GCS.

Every chunk is verified against its name before it is used, whatever tier sent it. A peer
that fails (down, too slow, wrong bytes) is not asked again during this restore; the chunk
goes to the next source. Connections to a peer are pooled: a chunk costs one request, not
a handshake, and concurrent fetches from one peer use separate connections.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import asynccontextmanager

import trio

from tierfs import chunks
from tierfs.config import parse_address
from tierfs.errors import UserError
from tierfs.peers.wire import PeerError

log = logging.getLogger(__name__)

GCS_ATTEMPTS = 4  # per request, on top of the GCS module's own quick retries
Address = tuple[str, int]
_GCS = "gcs"


def peer_name(address: Address) -> str:
    return f"{address[0]}:{address[1]}"


def peer_address(name: str) -> Address:
    """The inverse of :func:`peer_name`."""
    return parse_address(name, "peer")


class ChunkSources:
    """The tiers one restore draws from, fastest first: local, peers (closest first), GCS.

    ``local(h)`` finds a copy this node already holds (an older step, a replica of a
    data-parallel twin) as (path, offset, length).
    """

    def __init__(self, peers=None, holders: list[Address] = (), gcs=None,
                 local: Callable[[str], tuple[str, int, int] | None] = lambda h: None):
        self.peers, self.gcs, self._local = peers, gcs, local
        self.alive: list[Address] = list(holders)
        self._idle: dict[Address, list] = {}
        self.bytes_from: dict[str, int] = {}


    async def fetch(self, h: str, length: int, prefer: int = 0) -> bytes:
        """Chunk ``h`` (``length`` bytes), verified; ``prefer`` rotates which peer goes first.

        GCS comes after every peer: it is slower, and reads from it are paid for.

        Raises UserError (one line naming the chunk) when no tier can give it.
        """
        data = await self._from_local(h, length)
        if data is not None:
            return data
        errors: list[str] = []
        order: list = list(self.alive)
        if order:
            k = prefer % len(order)
            order = order[k:] + order[:k]
        for source in order + ([_GCS] if self.gcs is not None else []):
            if source is _GCS:
                try:
                    return await self._from_gcs(h, length)
                except UserError as e:
                    errors.append(str(e))
            elif source in self.alive:
                data = await self._from_peer(source, h, length, errors)
                if data is not None:
                    return data
        raise UserError(f"chunk {h} is on no reachable tier: "
                        f"{'; '.join(errors) or 'no peer holds it and there is no --gcs'}")

    async def aclose(self) -> None:
        for clients in self._idle.values():
            for client in clients:
                await client.aclose()
        self._idle.clear()

    # -- tiers ---------------------------------------------------------------------------

    async def _from_local(self, h: str, length: int) -> bytes | None:
        where = self._local(h)
        if where is None:
            return None
        path, offset, n = where
        try:
            data = await trio.to_thread.run_sync(_pread, path, offset, n)
        except OSError:
            return None
        if len(data) != length or chunks.chunk_hash(data) != h:
            return None  # changed since it was indexed
        self._count("local", len(data))
        return data

    @asynccontextmanager
    async def _client(self, address: Address):
        idle = self._idle.setdefault(address, [])
        client = idle.pop() if idle else await self.peers.connect(address)
        try:
            yield client
        except BaseException:
            await client.aclose()
            raise
        idle.append(client)

    async def _from_peer(self, address: Address, h: str, length: int, errors: list[str]) -> bytes | None:
        try:
            async with self._client(address) as client:
                data = await client.get_chunk(h, 0, length)
            if chunks.chunk_hash(data) != h:
                raise PeerError("sent bytes that do not match the chunk's hash")
        except (PeerError, OSError, trio.TooSlowError) as e:
            errors.append(f"peer {peer_name(address)}: {e}")
            log.warning("chunk %s from peer %s failed (%s); trying the next tier", h, peer_name(address), e)
            if address in self.alive:  # down or untrustworthy: not asked again in this restore
                self.alive.remove(address)
                for client in self._idle.pop(address, []):
                    await client.aclose()
            return None
        self._count(f"peer {peer_name(address)}", len(data))
        return data

    async def _from_gcs(self, h: str, length: int) -> bytes:
        """Chunk ``h`` from GCS: never more than ``length`` bytes read, nor decoded."""
        from tierfs.tiers.gcs_store import GcsError, MissingObject  # noqa: PLC0415 (only with --gcs)

        url = self.gcs.chunk_url(h)
        try:
            frame = await gcs_call(self.gcs.get_chunk_frame, h, length)
        except MissingObject:
            raise UserError(f"chunk {url} is missing from GCS") from None
        except GcsError as e:
            raise UserError(f"chunk {url} is corrupt or unreadable ({e})") from None
        try:
            data = await trio.to_thread.run_sync(chunks.decode, frame, h, length)
        except chunks.CorruptChunk as e:
            raise UserError(f"chunk {url} is corrupt ({e})") from None
        if len(data) != length:
            raise UserError(f"chunk {url} is corrupt ({len(data)} bytes, the manifest says {length})")
        self._count("gcs", len(data))
        return data

    def _count(self, source: str, n: int) -> None:
        self.bytes_from[source] = self.bytes_from.get(source, 0) + n


async def gcs_call(fn, *args):
    """Run a GCS request in a thread, retrying an unreachable GCS with a short backoff."""
    from tierfs.tiers.gcs_store import GcsUnavailable  # noqa: PLC0415 (only with --gcs)

    for attempt in range(GCS_ATTEMPTS):
        try:
            return await trio.to_thread.run_sync(fn, *args)
        except GcsUnavailable as e:
            if attempt == GCS_ATTEMPTS - 1:
                raise UserError(f"GCS is unreachable: {e}") from None
            await trio.sleep(2**attempt)


def _pread(path: str, offset: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)
