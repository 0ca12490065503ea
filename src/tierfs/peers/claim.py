"""One node per (job, rank): a second node that claims a served rank is refused at its start.

Two nodes serving one rank would each write "rank R's" steps, replicate them over each
other's and restore a mix. Every daemon therefore announces in its ``info`` answer who it
is (:class:`Identity`): its *node* (host name and RAM tier: the same across restarts of
its daemon), its *instance* (this process) and since when it *serves* (the moment its peer
service started listening). Right after that, a daemon asks every reachable peer; if one
of another node answers with the same rank, the later of the two yields: the newcomer exits
with one line naming the other node, the incumbent keeps serving.

- Both starting at once: both order the two the same way, by that moment, then node, then
  instance. If one asked before the other listened, it did so before the other's moment,
  so it comes first, and the other, which asks later, sees it and yields: exactly one
  yields. (Across machines this takes clocks that agree to better than a start-up, as NTP
  keeps them.)
- A restarted node retakes its rank: its old daemon is gone (it held the RAM tier's lock),
  and an answer from the same node is never a rival.
- A peer that does not answer is not a rival: a dead incumbent does not hold its rank.
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

from tierfs.core.errors import UserError


@dataclass
class Identity:
    node: str  # the same for every daemon of this node and RAM tier, restarts included
    instance: str  # this process: an answer with it is this daemon's own
    started: float  # when its peer service started listening (epoch seconds): the earlier claimant keeps the rank

    @classmethod
    def create(cls, ramdisk: object) -> Identity:
        return cls(f"{socket.gethostname()}:{ramdisk}", secrets.token_hex(8), time.time())

    def listening(self) -> None:
        """The peer service listens from now on: call before any await once it does, then ask the peers."""
        self.started = time.time()

    def info(self) -> dict[str, str | float]:
        """The fields of the peer service's ``info`` answer that say who this daemon is."""
        return {"node": self.node, "instance": self.instance, "started": self.started}

    @classmethod
    def of(cls, info: Mapping[str, object]) -> Identity | None:
        """Who answered ``info``; None for a peer that does not say (an older version)."""
        node, instance, started = info.get("node"), info.get("instance"), info.get("started")
        if not (isinstance(node, str) and isinstance(instance, str) and isinstance(started, (int, float))):
            return None
        return cls(node[:512], instance[:64], float(started))

    def precedes(self, other: Identity) -> bool:
        """Does this claimant keep the rank over ``other``? The same answer on both sides."""
        return (self.started, self.node, self.instance) < (other.started, other.node, other.instance)


def rivals(
    me: Identity, rank: int, answers: Mapping[tuple[str, int], Mapping[str, object]]
) -> list[tuple[tuple[str, int], Identity]]:
    """The peers among ``answers`` (address -> info) that claim ``rank`` from another node."""
    out = []
    for address, info in answers.items():
        if info.get("rank") != rank:
            continue
        other = Identity.of(info)
        if other is None or other.instance == me.instance or other.node == me.node:
            continue
        out.append((address, other))
    return sorted(out, key=lambda r: (r[1].started, r[1].node, r[1].instance))


def check(me: Identity, job: str, rank: int, answers: Mapping[tuple[str, int], Mapping[str, object]]) -> None:
    """Refuse this node's start if a node that precedes it serves ``rank`` (a UserError, one line)."""
    for address, other in rivals(me, rank, answers):
        if other.precedes(me):
            raise UserError(
                f"rank {rank} of job {job} is already served by node {other.node} at {_name(address)} "
                f"(up since {_when(other.started)}): not starting a second one; give this node another "
                f"--rank, or stop tierfs on {other.node} first"
            )


def _name(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _when(started: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
