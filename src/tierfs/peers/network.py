"""This node's view of its peers: who answers, where a step's replicas go, who holds what.

Every operation talks to peers concurrently and with timeouts, so one slow or dead peer
costs at most a timeout, never a hang; a peer that fails is replaced by the next best
reachable one in the same call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio

from tierfs.config import Config
from tierfs.manifest import Manifest
from tierfs.peers import tls
from tierfs.peers.client import PeerClient
from tierfs.peers.placement import PeerInfo, choose
from tierfs.peers.wire import PeerError

log = logging.getLogger(__name__)

INFO_TIMEOUT = 5.0
FAN_OUT = 64  # peers asked at once: a survey of thousands of nodes stays within its sockets


@dataclass(frozen=True)
class PeerReport:
    """What one peer holds, as the cluster view needs it."""

    rank: int
    steps: tuple[int, ...]  # its own committed steps
    manifests: tuple[tuple[int, int], ...]  # (rank, step) replicas it keeps for others
    restore_step: int | None  # the step it restored at start and has not moved past
    topology: tuple[tuple[str, str], ...] = ()


async def _no_pause() -> None:
    pass


class PeerNetwork:
    def __init__(self, cfg: Config, timeout: float = 30.0):
        self.cfg = cfg
        self.timeout = timeout
        self._fan_out = trio.CapacityLimiter(FAN_OUT)
        self._seen: dict[tuple[str, int], dict] = {  # address -> last known state, for status
            a: {"address": f"{a[0]}:{a[1]}", "state": "unknown", "rank": None, "error": None, "at": None}
            for a in cfg.peers
        }

    def connect(self, address: tuple[str, int], timeout: float | None = None):
        """An authenticated connection (an async context manager) to one peer, in TLS unless it is off."""
        return PeerClient.connect(
            address, job=self.cfg.job, secret=self.cfg.secret, tls=tls.for_config(self.cfg),
            timeout=timeout or self.timeout, local_host=self.cfg.listen[0] if self.cfg.listen else None,
        )

    def _mark(self, address: tuple[str, int], state: str, error: str | None = None, rank: int | None = None) -> None:
        seen = self._seen[address]
        seen.update(state=state, error=error, at=time.time())
        if rank is not None:
            seen["rank"] = rank

    async def _each(self, fn, addresses=None) -> dict[tuple[str, int], object]:
        """Run ``fn(address)`` for every peer (at most FAN_OUT at once); failures are recorded and left out."""
        results: dict[tuple[str, int], object] = {}

        async def one(address: tuple[str, int]) -> None:
            try:
                async with self._fan_out:
                    results[address] = await fn(address)
            except (PeerError, OSError, trio.TooSlowError) as e:
                self._mark(address, "down", f"{type(e).__name__}: {e}")

        async with trio.open_nursery() as nursery:
            for address in self.cfg.peers if addresses is None else addresses:
                nursery.start_soon(one, address)
        return results

    async def discover(self) -> list[PeerInfo]:
        """The peers that answer now, with their rank and topology."""
        async def info(address):
            async with await self.connect(address, INFO_TIMEOUT) as client:
                answer = await client.info()
            self._mark(address, "up", rank=answer["rank"])
            return PeerInfo(address, answer["rank"], tuple(tuple(x) for x in answer.get("topology", ())))

        found = await self._each(info)
        return [found[a] for a in self.cfg.peers if a in found]

    async def holdings(self) -> dict[tuple[str, int], list[tuple[int, int]]]:
        """Which (rank, step) manifests each reachable peer holds."""
        async def listing(address):
            async with await self.connect(address, INFO_TIMEOUT) as client:
                held = await client.list()
            self._mark(address, "up")
            return held

        return await self._each(listing)

    async def reports(self, addresses=None) -> dict[tuple[str, int], PeerReport]:
        """What each reachable peer (of ``addresses``, default all) holds: one connection each."""
        async def report(address):
            async with await self.connect(address, INFO_TIMEOUT) as client:
                info = await client.info()
                held = await client.list()
            self._mark(address, "up", rank=info["rank"])
            try:
                restore_step = info.get("restore_step")
                return PeerReport(int(info["rank"]), tuple(int(s) for s in info.get("steps", ())), tuple(held),
                                  None if restore_step is None else int(restore_step),
                                  tuple(tuple(t) for t in info.get("topology", ())))
            except (KeyError, TypeError, ValueError):
                raise PeerError(f"peer {address[0]}:{address[1]} sent a malformed info answer") from None

        return await self._each(report, addresses)

    async def replicate(self, manifest: Manifest, where: dict[str, tuple[Path, int, int]],
                        pace: Callable[[], Awaitable[None]] = _no_pause) -> dict:
        """Put the step on ``replicas`` peers; replaces a peer that fails by the next candidate.

        ``pace`` is awaited before each chunk is sent (the daemon lets the job's writes go first).
        """
        cfg = self.cfg
        candidates = choose(cfg.rank, cfg.topology, await self.discover(), len(cfg.peers),
                            cfg.nodes, cfg.data_parallel,
                            set(cfg.peer_ranks) if cfg.peer_ranks is not None else None)
        data = manifest.to_json()
        done: list[str] = []
        totals = {"sent_bytes": 0, "skipped_bytes": 0}
        for peer in candidates:
            if len(done) == cfg.replicas:
                break
            try:
                sent, skipped = await self._push(peer, manifest, data, where, pace)
            except (PeerError, OSError, trio.TooSlowError) as e:
                self._mark(peer.address, "down", f"{type(e).__name__}: {e}")
                log.warning("replication of step %d to %s failed: %s", manifest.step, peer.name, e)
                continue
            done.append(peer.name)
            totals["sent_bytes"] += sent
            totals["skipped_bytes"] += skipped
        if len(done) < cfg.replicas:
            raise PeerError(f"step {manifest.step} reached {len(done)} of {cfg.replicas} peer(s)")
        return {"peers": done, **totals}

    async def _push(self, peer: PeerInfo, manifest: Manifest, data: bytes,
                    where: dict[str, tuple[Path, int, int]], pace) -> tuple[int, int]:
        hashes = list(where)
        async with await self.connect(peer.address) as client:
            have = await client.have(hashes) if hashes else []
            sent = skipped = 0
            for h, held in zip(hashes, have):
                path, offset, length = where[h]
                if held:
                    skipped += length
                    continue
                await pace()
                await client.put_chunk(h, path, offset, length)
                sent += length
            await client.put_manifest(manifest.rank, manifest.step, data)
        self._mark(peer.address, "up", rank=peer.rank)
        return sent, skipped

    def status(self) -> list[dict]:
        return list(self._seen.values())
