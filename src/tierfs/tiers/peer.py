"""Another node's RAM, reached through the peer protocol: one :class:`PeerTier` per peer.

The protocol itself (framing, authentication, TLS, the server and its replica store) is
:mod:`tierfs.peers`; this module only speaks it as a tier. All the peers of a node share one
:class:`~tierfs.peers.network.PeerNetwork`, which knows their state for ``tierfs status``
and places replicas (twins first, one close peer, then distant ones).

Connections are pooled: a step's chunks and a restore's fetches each cost one request, not
a handshake, and concurrent fetches from one peer use separate connections. An idle
connection is reused only briefly: the peer's service closes connections that idle.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from tierfs import chunks
from tierfs.config import parse_address
from tierfs.peers.network import PeerNetwork
from tierfs.peers.placement import choose
from tierfs.peers.wire import PeerError, PeerUnavailable
from tierfs.tiers.base import (Cost, Holdings, NotHeld, Put, Tier, TierError, TierUnavailable, check_chunk,
                               check_manifest)

Address = tuple[str, int]
REUSE_IDLE = 30.0  # seconds an idle connection is kept for the next request (the service drops it at 300)
_FAILURES = (PeerError, OSError, trio.TooSlowError)


def peer_name(address: Address) -> str:
    return f"{address[0]}:{address[1]}"


def peer_address(name: str) -> Address:
    """The inverse of :func:`peer_name` (``"peer "`` in front is allowed)."""
    return parse_address(name.removeprefix("peer "), "peer")


class PeerTier(Tier):
    kind = "peer"
    lane = "peers"
    cost = Cost(read_gib_s=1.0)
    skip_after_failure = True  # a down peer costs a timeout per request; the others hold the same
    volatile = True  # its RAM can be lost, or the node replaced
    awaited = True  # nodes of a job start together: a survey waits for the others

    def __init__(self, network: PeerNetwork, address: Address):
        super().__init__()
        self.network = network
        self.address = address
        self.name = f"peer {peer_name(address)}"
        self._idle: list[tuple[float, object]] = []

    # -- connections -------------------------------------------------------------------

    @asynccontextmanager
    async def _client(self):
        now = time.monotonic()
        client = None
        while self._idle:
            at, candidate = self._idle.pop()
            if now - at < REUSE_IDLE:
                client = candidate
                break
            await candidate.aclose()
        if client is None:
            client = await self._call(self.network.connect(self.address), "connect")
        try:
            yield client
        except BaseException:
            await client.aclose()
            raise
        self._idle.append((time.monotonic(), client))

    async def _call(self, awaitable, what: str = ""):
        """Await a client call; the peer's failures become tier errors that say ``what`` failed."""
        about = f" ({what})" if what else ""
        try:
            return await awaitable
        except PeerError as e:
            message = str(e)
            if message.endswith(": not found"):
                raise NotHeld(f"{self.name} does not hold {what or 'it'}") from None
            self._down(e)
            raise (TierUnavailable if isinstance(e, PeerUnavailable) else TierError)(f"{message}{about}") from None
        except (OSError, trio.TooSlowError) as e:
            self._down(e)
            raise TierUnavailable(f"{self.name}: {e}{about}") from None

    def _down(self, e: BaseException) -> None:
        """What ``tierfs status`` shows of the peer (the network keeps it)."""
        self.network._mark(self.address, "down", f"{type(e).__name__}: {e}")

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for _, client in idle:
            await client.aclose()

    # -- chunks ------------------------------------------------------------------------

    async def has_chunks(self, hashes: Sequence[str]) -> list[bool]:
        async with self._client() as client:
            return await self._call(client.have(list(hashes)), "have")

    async def put_chunk(self, h: str, path: str | Path, offset: int, length: int) -> Put:
        """Sent straight from the page cache; the peer hashes it and refuses a mismatch."""
        check_chunk(self, h, length)
        async with self._client() as client:
            await self._call(client.put_chunk(h, path, offset, length), f"chunk {h}")
        return Put(length, length)

    async def get_chunk(self, h: str, length: int) -> bytes:
        check_chunk(self, h, length)
        async with self._client() as client:
            data = await self._call(client.get_chunk(h, 0, length), f"chunk {h}")
        if chunks.chunk_hash(data) != h:
            raise TierError(f"{self.name} sent bytes that do not match chunk {h}")
        return data

    # -- manifests ---------------------------------------------------------------------

    async def put_manifest(self, rank: int, step: int, data: bytes) -> None:
        check_manifest(self, rank, step, data)
        async with self._client() as client:
            await self._call(client.put_manifest(rank, step, data), f"manifest of rank {rank} step {step}")

    async def get_manifest(self, rank: int, step: int) -> bytes:
        async with self._client() as client:
            return await self._call(client.get_manifest(rank, step), f"manifest of rank {rank} step {step}")

    async def list_manifests(self) -> list[tuple[int, int]]:
        async with self._client() as client:
            return sorted(await self._call(client.list(), "list"))

    async def holdings(self) -> Holdings:
        """The peer's own committed steps, the replicas it keeps, its restore decision."""
        report = (await self.network.reports([self.address])).get(self.address)
        if report is None:
            error = self._seen().get("error") or "no answer"
            raise TierUnavailable(f"{self.name}: {error}")
        return Holdings(tuple((report.rank, s) for s in report.steps) + tuple(report.manifests),
                        report.restore_step, report.topology)

    # -- what it says about itself, and placement --------------------------------------

    def report(self) -> dict:
        return {**super().report(), **self._seen()}

    def _seen(self) -> dict:
        """What the network last saw of this peer: state, rank, error."""
        name = peer_name(self.address)
        return next((s for s in self.network.status() if s.get("address") == name), {})

    def lane_report(self) -> dict:
        replicas = self.network.cfg.replicas
        return {"label": f"{replicas} replica(s)", "replicas": replicas, "known": self.network.status()}

    def copies(self) -> int:
        return self.network.cfg.replicas

    async def order(self, tiers: list[Tier]) -> list[Tier]:
        """Placement: data-parallel twins first, then one close peer, then distant ones."""
        cfg = self.network.cfg
        by_address = {t.address: t for t in tiers if isinstance(t, PeerTier)}
        candidates = choose(cfg.rank, cfg.topology, await self.network.discover(), len(cfg.peers),
                            cfg.nodes, cfg.data_parallel,
                            set(cfg.peer_ranks) if cfg.peer_ranks is not None else None)
        return [by_address[p.address] for p in candidates if p.address in by_address]


def peer_tiers(network: PeerNetwork) -> list[PeerTier]:
    """One tier per configured peer, sharing ``network``."""
    return [PeerTier(network, address) for address in network.cfg.peers]

