"""Which peers keep a rank's replicas.

Two things make a replica cheap or valuable:

- a data-parallel *twin* (a rank that holds the same data: with D data-parallel replicas of
  nodes/D ranks each, ranks nodes/D apart) already has every chunk, so replicating to it
  is a hash comparison and no bytes move;
- a *distant* peer (sharing few topology labels: another slice, rack or zone) survives the
  failures that take out this node's neighbours; one *close* peer restores fastest.

So twins come first (or, without one, one close peer), then the most distant ones. Ties
go in ring order from this rank, which spreads the replicas of different ranks over
different peers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierfs.config import Config


@dataclass(frozen=True)
class PeerInfo:
    address: tuple[str, int]
    rank: int
    topology: tuple[tuple[str, str], ...] = ()
    twins: tuple[int, ...] | None = None  # the ranks its replicator.yaml names as holding its data

    @property
    def name(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"


def twins(rank: int, nodes: int, data_parallel: int) -> set[int]:
    """Ranks that hold the same data as ``rank``."""
    group = nodes // data_parallel
    return {rank % group + k * group for k in range(data_parallel)} - {rank}


def job_twins(cfg: Config) -> list[int]:
    """This rank's twins as the job says now: replicator.yaml's peer-ranks if it names them,
    else from --data-parallel."""
    same = set(cfg.peer_ranks) if cfg.peer_ranks is not None else twins(cfg.rank, cfg.nodes, cfg.data_parallel)
    return sorted(same - {cfg.rank})


def closeness(a: tuple[tuple[str, str], ...], b: tuple[tuple[str, str], ...]) -> int:
    """How many topology labels two nodes share."""
    return len(set(a) & set(b))


def choose(
    rank: int,
    topology: tuple[tuple[str, str], ...],
    candidates: list[PeerInfo],
    k: int,
    nodes: int,
    data_parallel: int = 1,
    same_data: set[int] | None = None,
) -> list[PeerInfo]:
    """Pick up to ``k`` of the reachable ``candidates`` for ``rank``'s replicas, best first.

    ``same_data``: the twins when the job names them (replicator.yaml's peer-ranks);
    otherwise they follow from ``data_parallel``.
    """
    ring = sorted((p for p in candidates if p.rank != rank), key=lambda p: ((p.rank - rank) % max(nodes, 1), p.name))
    if same_data is None:
        same_data = twins(rank, nodes, data_parallel)
    chosen = [p for p in ring if p.rank in same_data][:k]
    rest = [p for p in ring if p not in chosen]
    if len(chosen) < k and rest and not chosen and topology:
        close = max(rest, key=lambda p: closeness(topology, p.topology))  # max keeps ring order on ties
        chosen.append(close)
        rest.remove(close)
    rest.sort(key=lambda p: closeness(topology, p.topology))  # stable: ring order among equals
    return chosen + rest[: k - len(chosen)]
