"""Another node's RAM, reached through the peer protocol: one :class:`PeerTier` per peer.

The protocol itself (framing, authentication, TLS) is :mod:`tierfs.peers`, and the service
that answers it, with its replica store, :mod:`tierfs.store`; this module only speaks it as
a tier. All the peers of a node share one :class:`~tierfs.peers.network.PeerNetwork`, which
knows their state for ``tierfs status`` and the ranks and topology placement needs:
:meth:`PeerTier.order` puts replicas on twins first, then one close peer, then distant ones
(:mod:`tierfs.peers.placement`).

Connections are pooled (:mod:`tierfs.peers.pool`): a step's chunks and a restore's
fetches each cost one request, not a handshake.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import trio

from tierfs.peers.client import PeerClient
from tierfs.peers.network import PeerNetwork
from tierfs.peers.pool import ConnectionPool
from tierfs.peers.wire import MAX_BATCH, PeerError, PeerUnavailable
from tierfs.tiers.base import (
    Address,
    Cost,
    Holdings,
    Lane,
    Location,
    NotHeld,
    Put,
    Tier,
    TierError,
    TierUnavailable,
    check_chunk,
    check_manifest,
)

T = TypeVar("T")


def peer_name(address: Address) -> str:
    return f"{address[0]}:{address[1]}"


class PeerTier(Tier):
    kind = "peer"
    lane: Lane | None = Lane.PEERS
    cost = Cost(read_gib_s=1.0)
    skip_after_failure = True  # a down peer costs a timeout per request; the others hold the same
    volatile = True  # its RAM can be lost, or the node replaced
    awaited = True  # nodes of a job start together: a survey waits for the others
    concurrency = 4  # requests in flight per peer, each on its own connection: the round trips overlap
    batch_bytes = 16 << 20  # a step's small chunks go many to a request (put_chunks, get_chunks)
    batch_chunks = MAX_BATCH
    early = True  # its replica store holds a connection's chunks for as long as it lasts
    address: Address  # always one: the peer's

    def __init__(self, network: PeerNetwork, address: Address):
        super().__init__()
        self.network = network
        self.address = address
        self.name = f"peer {peer_name(address)}"
        if network.cfg.erasure is not None:
            self.lane = None  # an erasure group takes the steps (tierfs.tiers.erasure): no replicas here
        self._pool = ConnectionPool(lambda timeout: network.connect(address, timeout))

    # -- connections -------------------------------------------------------------------

    async def _request(self, what: str, call: Callable[[PeerClient], Awaitable[T]]) -> T:
        """``call(client)`` on a pooled connection; the peer's failures become tier errors naming ``what``."""
        try:
            return await self._pool.request(call)
        except (PeerError, OSError, trio.TooSlowError) as e:
            raise self._failed(e, what) from None

    def _failed(self, e: BaseException, what: str) -> TierError:
        """The tier error for a peer's failure; one that is not a refusal marks the peer down."""
        message, about = str(e), f" ({what})"
        if isinstance(e, PeerError) and message.endswith(": not found"):
            return NotHeld(f"{self.name} does not hold {what}")
        self.network.mark(self.address, "down", f"{type(e).__name__}: {e}")
        if isinstance(e, PeerUnavailable) or not isinstance(e, PeerError):
            return TierUnavailable(f"{message if isinstance(e, PeerError) else f'{self.name}: {e}'}{about}")
        return TierError(f"{message}{about}")

    async def aclose(self) -> None:
        await self._pool.aclose()

    # -- chunks ------------------------------------------------------------------------

    async def has_chunks(self, hashes: Sequence[str]) -> list[bool]:
        return await self._request("have", lambda client: client.have(list(hashes)))

    async def put_chunk(self, h: str, path: str | Path, offset: int, length: int) -> Put:
        """Sent straight from the page cache; the peer hashes it and refuses a mismatch."""
        check_chunk(self, h, length)
        await self._request(f"chunk {h}", lambda client: client.put_chunk(h, path, offset, length))
        return Put(length, length)

    async def put_chunks(self, chunks: Sequence[tuple[str, Location]]) -> list[Put]:
        """One request for them all (:meth:`PeerClient.put_chunks`), their bodies moved by one thread."""
        if len(chunks) == 1:
            return [await self.put_chunk(chunks[0][0], *chunks[0][1])]
        for h, (_, _, length) in chunks:
            check_chunk(self, h, length)
        await self._request(
            f"{len(chunks)} chunks from {chunks[0][0]}",
            lambda client: client.put_chunks([(h, *where) for h, where in chunks]),
        )
        return [Put(length, length) for _, (_, _, length) in chunks]

    async def get_chunk(self, h: str, length: int) -> bytes:
        """Hashed as it arrives, off the event loop; bytes that are not chunk ``h`` are refused."""
        check_chunk(self, h, length)
        return await self._request(f"chunk {h}", lambda client: client.fetch_chunk(h, length))

    async def get_chunk_into(self, h: str, length: int, fd: int, offset: int) -> None:
        """Received straight into ``fd``, hashed on the way, off the event loop."""
        check_chunk(self, h, length)
        await self._request(f"chunk {h}", lambda client: client.get_chunk_into(h, fd, offset, length))

    async def get_chunks_into(self, chunks: Sequence[tuple[str, int, int, int]]) -> list[bool]:
        """One request for them all (:meth:`PeerClient.get_chunks_into`), received, hashed and written by one thread."""
        for h, length, _, _ in chunks:
            check_chunk(self, h, length)
        return await self._request(
            f"{len(chunks)} chunks from {chunks[0][0]}", lambda client: client.get_chunks_into(chunks)
        )

    # -- manifests ---------------------------------------------------------------------

    async def put_manifest(self, rank: int, step: int, data: bytes) -> None:
        check_manifest(self, rank, step, data)
        await self._request(
            f"manifest of rank {rank} step {step}", lambda client: client.put_manifest(rank, step, data)
        )

    async def get_manifest(self, rank: int, step: int) -> bytes:
        return await self._request(
            f"the manifest of rank {rank} step {step}", lambda client: client.get_manifest(rank, step)
        )

    async def list_manifests(self) -> list[tuple[int, int]]:
        return sorted(await self._request("list", lambda client: client.list(self.network.cfg.nodes)))

    async def holdings(self) -> Holdings:
        """The peer's own committed steps, the replicas it keeps, its restore decision."""
        report = (await self.network.reports([self.address])).get(self.address)
        if report is None:
            error = self._seen().get("error") or "no answer"
            raise TierUnavailable(f"{self.name}: {error}")
        return Holdings(
            tuple((report.rank, s) for s in report.steps) + tuple(report.manifests),
            report.restore_step,
            report.topology,
        )

    # -- what it says about itself -----------------------------------------------------

    def report(self) -> dict[str, object]:
        return {**super().report(), **self._seen()}

    def _seen(self) -> dict[str, object]:
        """What the network last saw of this peer: state, rank, error."""
        name = peer_name(self.address)
        return next((s for s in self.network.status() if s.get("address") == name), {})


def peer_tiers(network: PeerNetwork) -> list[PeerTier]:
    """One tier per configured peer, sharing ``network``."""
    return [PeerTier(network, address) for address in network.cfg.peers]
