"""Authenticated connections to one peer, kept for the next request while they are fresh.

A handshake (TCP, TLS, HMAC) costs more than most requests, so the peer tier and the
coordination messages reuse connections; concurrent requests take separate ones. An idle
connection is reused only briefly: the peer's service closes connections that idle.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tierfs.peers.client import PeerClient
from tierfs.peers.wire import PeerUnavailable

T = TypeVar("T")
REUSE_IDLE = 30.0  # seconds an idle connection is kept for the next request (the service drops it at 300)


class ConnectionPool:
    def __init__(self, connect: Callable[[float | None], Awaitable[PeerClient]], max_idle: int | None = None):
        """``connect(timeout)``: a new authenticated client (None: the default timeout)."""
        self._connect, self._max_idle = connect, max_idle
        self._idle: list[tuple[float, PeerClient]] = []  # (when it was last used, connection)

    def __len__(self) -> int:
        """Idle connections held."""
        return len(self._idle)

    async def request(self, call: Callable[[PeerClient], Awaitable[T]], connect_timeout: float | None = None) -> T:
        """``call(client)`` on a pooled connection; its errors (and the connect's) are raised as they are.

        A pooled connection the peer dropped meanwhile (its service restarted, or idled it
        out) fails at once; the request is then made again once on a new connection, which
        every caller here allows (a chunk or manifest sent twice is stored once), and the
        other idle connections are let go too.
        """
        for attempt in range(2):
            client, reused = await self._take(connect_timeout)
            try:
                result = await call(client)
            except BaseException as e:
                await self._give(client)  # kept if still in step (a refusal), else closed
                if isinstance(e, PeerUnavailable) and reused and attempt == 0:
                    await self.aclose()  # the other idle ones predate the same restart: not worth a try each
                    continue
                raise
            await self._give(client)
            return result
        raise AssertionError("unreachable")

    async def _take(self, connect_timeout: float | None) -> tuple[PeerClient, bool]:
        now = time.monotonic()
        while self._idle:
            at, client = self._idle.pop()
            if now - at < REUSE_IDLE:
                return client, True
            await client.aclose()
        return await self._connect(connect_timeout), False

    async def _give(self, client: PeerClient) -> None:
        if client.usable and (self._max_idle is None or len(self._idle) < self._max_idle):
            self._idle.append((time.monotonic(), client))
        else:
            await client.aclose()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for _, client in idle:
            await client.aclose()
