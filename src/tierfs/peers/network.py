"""This node's view of its peers: who they are, who answers, and what each reports.

Every operation talks to peers concurrently and with timeouts, so one slow or dead peer
costs at most a timeout, never a hang. Putting steps on peers is the peer tier's
(:mod:`tierfs.tiers.peer`); it records here how each peer did, for ``tierfs status``.

The peers are whatever :class:`tierfs.discovery.directory.PeerDirectory` knows now (DNS names are
looked up again every ``--survey-interval``), less this node itself: a pattern or a DNS
name usually covers it, and an ``info`` answer carrying this daemon's own instance gives
it away. ``cfg.peers`` always holds the current list.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import trio

from tierfs.config import Config
from tierfs.discovery.directory import RETRY_EMPTY, PeerDirectory
from tierfs.discovery.spec import PeerSpec
from tierfs.peers import claim, tls
from tierfs.peers.answers import MalformedAnswer
from tierfs.peers.client import PeerClient
from tierfs.peers.placement import PeerInfo
from tierfs.peers.wire import PeerError

log = logging.getLogger(__name__)
T = TypeVar("T")

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


class _Itself(PeerError):
    """The address reached this very daemon."""


class PeerNetwork:
    def __init__(self, cfg: Config, timeout: float = 30.0, identity: claim.Identity | None = None):
        self.timeout = timeout
        self.identity = identity
        self.directory = PeerDirectory(PeerSpec(cfg.peers, cfg.peer_dns))
        self._itself: set[tuple[str, int]] = set()  # addresses that reached this daemon
        self._rivals: set[str] = set()  # instances already reported as claiming this rank
        self.cfg = cfg
        self._fan_out = trio.CapacityLimiter(FAN_OUT)
        self._seen: dict[tuple[str, int], dict[str, object]] = {}  # address -> last known state, for status
        self._known: dict[tuple[str, int], PeerInfo] = {}  # who answered at an address, until it fails

    def reconfigure(self, cfg: Config) -> None:
        """The job changed its shape (nodes, data parallelism, the ranks holding its data)."""
        self.cfg = cfg

    @property
    def cfg(self) -> Config:
        """The configuration, its ``peers`` the addresses known now."""
        return self._cfg

    @cfg.setter
    def cfg(self, cfg: Config) -> None:  # the job's shape changed (replicator.yaml): same peers
        self._base = cfg
        self._use(self.directory.addresses())

    def _use(self, addresses: list[tuple[str, int]]) -> None:
        self._cfg = replace(self._base, peers=tuple(a for a in addresses if a not in self._itself))

    # -- who the peers are ---------------------------------------------------------------

    async def join(self, nursery: trio.Nursery) -> None:
        """Find the peers and this node among them; refuse a rank another node serves (UserError).

        Call it right after this node's peer service starts listening (no await between:
        the order of two claimants of a rank depends on it; see :mod:`tierfs.peers.claim`).
        Then keeps looking DNS names up in ``nursery``, every ``--survey-interval``.
        """
        if self.identity is not None and self.cfg.listen:
            self.identity.listening()
        self._use(await self.directory.resolve())
        answers = await self._each(self._info)
        if self.identity is not None:
            claim.check(self.identity, self.cfg.job, self.cfg.rank, answers)
        if self._itself:
            log.info("%s reached this node itself: not a peer", ", ".join(f"{h}:{p}" for h, p in sorted(self._itself)))
        log.info("%d peer(s) known, %d answered", len(self.cfg.peers), len(answers))
        if self.directory.dynamic:
            nursery.start_soon(self.keep_resolving)

    async def keep_resolving(self) -> None:
        """Look the DNS names up again and again: nodes that come up late join the job."""
        while True:
            known = self.cfg.peers
            await trio.sleep(min(RETRY_EMPTY, self.cfg.survey_interval) if not known else self.cfg.survey_interval)
            self._use(await self.directory.resolve())
            new = [a for a in self.cfg.peers if a not in known]
            if new:  # who they are, now: this node itself, or a rival for its rank
                await self._each(self._info, new)

    async def _info(self, address: tuple[str, int]) -> dict[str, Any]:
        async with await self.connect(address, INFO_TIMEOUT) as client:
            answer = await client.info(self.cfg.nodes)
        self._inspect(address, answer)
        self.mark(address, "up", rank=answer["rank"])
        twins = answer.get("twins")
        self._known[address] = PeerInfo(
            address,
            answer["rank"],
            tuple(tuple(x) for x in answer.get("topology", ())),
            tuple(twins) if twins is not None else None,
        )
        return answer

    def _inspect(self, address: tuple[str, int], info: dict[str, Any]) -> None:
        """Recognise this daemon's own answer; report once a rival that claims this node's rank."""
        if self.identity is None:
            return
        other = claim.Identity.of(info)
        if other is not None and other.instance == self.identity.instance:
            self._itself.add(address)
            self._seen.pop(address, None)
            self._use(self.directory.addresses())
            raise _Itself(f"{address[0]}:{address[1]} is this node")
        for _, rival in claim.rivals(self.identity, self.cfg.rank, {address: info}):
            if rival.instance not in self._rivals:
                self._rivals.add(rival.instance)
                first = "it" if self.identity.precedes(rival) else "this node"
                log.error(
                    "node %s at %s:%d also serves rank %d of job %s; %s started later and should stop",
                    rival.node,
                    address[0],
                    address[1],
                    self.cfg.rank,
                    self.cfg.job,
                    first,
                )

    def connect(self, address: tuple[str, int], timeout: float | None = None) -> Awaitable[PeerClient]:
        """An authenticated connection (an async context manager) to one peer, in TLS unless it is off."""
        return PeerClient.connect(
            address,
            job=self.cfg.job,
            secret=self.cfg.secret,
            tls=tls.for_config(self.cfg),
            timeout=timeout or self.timeout,
            local_host=self.cfg.listen[0] if self.cfg.listen else None,
        )

    def mark(self, address: tuple[str, int], state: str, error: str | None = None, rank: int | None = None) -> None:
        seen = self._seen.setdefault(address, _unknown(address))
        seen.update(state=state, error=error, at=time.time())
        if state != "up":
            self._known.pop(address, None)  # asked again before it is placed on
        if rank is not None:
            seen["rank"] = rank

    async def _each(
        self, fn: Callable[[tuple[str, int]], Awaitable[T]], addresses: Iterable[tuple[str, int]] | None = None
    ) -> dict[tuple[str, int], T]:
        """Run ``fn(address)`` for every peer (at most FAN_OUT at once); failures are recorded and left out."""
        results: dict[tuple[str, int], T] = {}

        async def one(address: tuple[str, int]) -> None:
            try:
                async with self._fan_out:
                    results[address] = await fn(address)
            except _Itself:
                pass
            except (PeerError, OSError, trio.TooSlowError) as e:
                error = f"{type(e).__name__}: {e}"
                if isinstance(e, MalformedAnswer) and self._seen.get(address, {}).get("error") != error:
                    log.warning("%s; it counts as not answering", e)  # once, not at every survey
                self.mark(address, "down", error)

        async with trio.open_nursery() as nursery:
            for address in self.cfg.peers if addresses is None else addresses:
                nursery.start_soon(one, address)
        return results

    async def discover(self) -> list[PeerInfo]:
        """The peers that answer, with their rank and topology, for placing a step's replicas.

        A peer's answer is kept until a request to it fails: a step costs a request to the
        peers not known yet (or found down since), not to every node of the job.
        """
        await self._each(self._info, [a for a in self.cfg.peers if a not in self._known])
        return [self._known[a] for a in self.cfg.peers if a in self._known]

    async def reports(self, addresses: Iterable[tuple[str, int]] | None = None) -> dict[tuple[str, int], PeerReport]:
        """What each reachable peer (of ``addresses``, default all) holds: one connection each."""

        async def report(address: tuple[str, int]) -> PeerReport:
            async with await self.connect(address, INFO_TIMEOUT) as client:
                info = await client.info(self.cfg.nodes)
                self._inspect(address, info)
                held = await client.list(self.cfg.nodes)
            self.mark(address, "up", rank=info["rank"])
            return PeerReport(
                info["rank"],
                tuple(info.get("steps", ())),
                tuple(held),
                info.get("restore_step"),
                tuple(tuple(t) for t in info.get("topology", ())),
            )

        return await self._each(report, addresses)

    def status(self) -> list[dict[str, object]]:
        return [self._seen.get(a) or _unknown(a) for a in self.cfg.peers]


def _unknown(address: tuple[str, int]) -> dict[str, object]:
    return {"address": f"{address[0]}:{address[1]}", "state": "unknown", "rank": None, "error": None, "at": None}
