"""Coordination messages over the peer protocol: :class:`tierfs.coordination.transport.Transport` for the daemon.

A message is one JSON header and its answer one JSON header on an authenticated peer
connection (docs/peer-protocol.md), carrying the sender's listen address as ``from``:
coordinators know members by the address they listen on, not by the ephemeral port a
request comes from. Connections are pooled per address, so a round of reports costs a
request each, not a handshake; a long poll holds its connection, and concurrent requests
to one node use separate ones.

Failures map onto what coordination expects: a refused connection, or an answer saying
the node is still starting, is :class:`~tierfs.coordination.transport.Refused` (ask again
soon); no answer in time, a reset or a broken message is
:class:`~tierfs.coordination.transport.Unreachable`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import trio

from tierfs.coordination.transport import Message, Refused, Unreachable, encoded
from tierfs.config import parse_address
from tierfs.errors import UserError
from tierfs.peers.client import PeerClient
from tierfs.peers.wire import PeerError, PeerRefused

STARTING = "starting"  # the answer's ``error`` while the node has not joined its job yet
CONNECT_TIMEOUT = 5.0
REUSE_IDLE = 30.0  # an idle connection is reused this long (the service drops it at 300 s)
MAX_IDLE = 4  # idle connections kept per node

Connect = Callable[[tuple[str, int], float], Awaitable[PeerClient]]  # (address, timeout) -> an authenticated client


class PeerTransport:
    """Requests to other nodes' peer services, as ``source`` (this node's listen address)."""

    def __init__(self, source: str, connect: Connect):
        self.source = source
        self._connect = connect
        self._idle: dict[str, list[tuple[float, PeerClient]]] = {}

    async def request(self, address: str, message: Message, timeout: float) -> Message:
        header = {**message, "from": self.source}
        encoded(header)  # refuses an oversized message before it leaves
        for attempt in range(2):
            client, reused = await self._take(address, timeout)
            try:
                reply = await client.call(header, timeout)
            except PeerError as e:  # timed out, reset, or out of step: the connection is gone
                await client.aclose()
                if reused and attempt == 0:  # dropped while idle: once more on a new one
                    continue
                raise Unreachable(str(e)) from None
            idle = self._idle.setdefault(address, [])
            if len(idle) < MAX_IDLE:
                idle.append((time.monotonic(), client))
            else:
                await client.aclose()
            if reply.get("error") == STARTING:
                raise Refused(f"{address} is starting")
            return reply
        raise AssertionError("unreachable")

    async def _take(self, address: str, timeout: float) -> tuple[PeerClient, bool]:
        idle = self._idle.get(address, [])
        now = time.monotonic()
        while idle:
            at, client = idle.pop()
            if now - at < REUSE_IDLE:
                return client, True
            await client.aclose()
        try:
            host, port = parse_address(address, "a peer address")
            client = await self._connect((host, port), min(timeout, CONNECT_TIMEOUT))
        except PeerRefused as e:
            raise Refused(str(e)) from None
        except (PeerError, OSError, UserError, trio.TooSlowError) as e:
            raise Unreachable(str(e)) from None
        return client, False

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for clients in idle.values():
            for _, client in clients:
                await client.aclose()
