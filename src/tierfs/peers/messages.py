"""Coordination messages over the peer protocol: :class:`tierfs.coordination.transport.Transport` for the daemon.

A message is one JSON header and its answer one JSON header on an authenticated peer
connection (docs/peer-protocol.md), carrying the sender's listen address as ``from``:
coordinators know members by the address they listen on, not by the ephemeral port a
request comes from. Connections are pooled per address (:mod:`tierfs.peers.pool`), so a
round of reports costs a request each, not a handshake; a long poll holds its connection.

Failures map onto what coordination expects: a refused connection, or an answer saying
the node is still starting, is :class:`~tierfs.coordination.transport.Refused` (ask again
soon); no answer in time, a reset or a broken message is
:class:`~tierfs.coordination.transport.Unreachable`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from tierfs.coordination.transport import Message, Refused, Unreachable, encoded
from tierfs.core.errors import UserError
from tierfs.core.parse import parse_address
from tierfs.peers.client import PeerClient
from tierfs.peers.pool import ConnectionPool
from tierfs.peers.wire import PeerError, PeerRefused

STARTING = "starting"  # the answer's ``error`` while the node has not joined its job yet
CONNECT_TIMEOUT = 5.0
MAX_IDLE = 4  # idle connections kept per node

Connect = Callable[
    [tuple[str, int], float | None], Awaitable[PeerClient]
]  # (address, timeout) -> an authenticated client


class PeerTransport:
    """Requests to other nodes' peer services, as ``source`` (this node's listen address)."""

    def __init__(self, source: str, connect: Connect):
        self.source = source
        self._connect = connect
        self._pools: dict[str, ConnectionPool] = {}

    async def request(self, address: str, message: Message, timeout: float) -> Message:
        header = {**message, "from": self.source}
        encoded(header)  # refuses an oversized message before it leaves
        try:
            reply = await self._pool(address).request(
                lambda client: client.call(header, timeout), min(timeout, CONNECT_TIMEOUT)
            )
        except PeerRefused as e:
            raise Refused(str(e)) from None
        except (PeerError, OSError, UserError, trio.TooSlowError) as e:
            raise Unreachable(str(e)) from None
        if reply.get("error") == STARTING:
            raise Refused(f"{address} is starting")
        return reply

    def _pool(self, address: str) -> ConnectionPool:
        pool = self._pools.get(address)
        if pool is None:
            host, port = parse_address(address, "a peer address")
            pool = self._pools[address] = ConnectionPool(
                lambda timeout: self._connect((host, port), timeout), max_idle=MAX_IDLE
            )
        return pool

    async def aclose(self) -> None:
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            await pool.aclose()
