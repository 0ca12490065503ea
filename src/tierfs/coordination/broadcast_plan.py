"""The broadcast planner: who reads each chunk of a restore from GCS, and who passes it on to whom.

Apart from :mod:`tierfs.coordination.broadcast` (why broadcast restores exist, and the
runtime that follows a plan) because it is pure: no I/O, no clock, no trio, only the
inputs a rank's twins share.

:func:`plan` is deterministic: from who needs which chunks and who holds them now, it
gives every node, for every chunk it needs, an ordered list of sources. Every node that
computes it from the same inputs (a rank's twins: the same manifest and the same answer
of a coordinator) gets the same plan, so nothing has to be sent to agree on it.

- A chunk some peer holds now (a replica, a twin that kept it) comes from those holders,
  never from GCS; a chunk no peer holds is read from GCS by exactly one seed, the needing
  node with the fewest GCS bytes so far (so the seeds rotate and the GCS work splits evenly).
- The others form a tree under the holders or the seed: each source serves at most
  ``fan_out`` nodes per chunk, parents chosen by the fewest bytes served so far.
- After its planned source, a node's list goes up the tree (its parent's parent, ..., the
  seed), then to other holders, then to GCS: a source that fails costs one more hop, and a
  GCS read only when nothing else is left.
- A node fetches its chunks by depth (what it seeds or takes from holders first), so the
  nodes below it find them there when they ask.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tierfs.coordination.view import GCS

FAN_OUT = 4  # nodes one source serves per chunk
FALLBACKS = 3  # sources tried after the planned one before GCS


@dataclass(frozen=True)
class Source:
    """Where a chunk can come from: a node (``after_fetch``: once its own fetch is done) or GCS."""

    address: str
    after_fetch: bool = False

    @property
    def is_gcs(self) -> bool:
        return self.address == GCS


GCS_SOURCE = Source(GCS)


@dataclass
class NodePlan:
    """One node's part of a broadcast restore."""

    address: str
    order: list[str] = field(default_factory=list)  # chunks, in the order to fetch them
    sources: dict[str, tuple[Source, ...]] = field(default_factory=dict)  # chunk -> sources, best first
    depth: dict[str, int] = field(default_factory=dict)  # chunk -> hops below GCS or a holder

    def from_gcs(self) -> list[str]:
        """Chunks this node is planned to read from GCS (it seeds them)."""
        return [h for h in self.order if self.sources[h] and self.sources[h][0].is_gcs]


class _Everything:
    def __contains__(self, item: object) -> bool:
        return True


def plan(
    needs: Mapping[str, Sequence[str]],
    sizes: Mapping[str, int],
    holders: Mapping[str, Iterable[str]] | None = None,
    in_gcs: Container[str] | bool = True,
    fan_out: int = FAN_OUT,
    fallbacks: int = FALLBACKS,
    dead: Container[str] = (),
) -> dict[str, NodePlan]:
    """Per-node plans for ``needs`` (node -> chunks it needs, in the order it wants them).

    ``holders``: chunk -> nodes that hold it now; ``in_gcs``: the chunks GCS has (True:
    all); ``dead``: nodes known down, never planned as sources.
    """
    if fan_out < 1:
        raise ValueError("fan_out must be at least 1")
    holders = holders or {}
    gcs = _Everything() if in_gcs is True else (() if in_gcs is False else in_gcs)
    first: dict[str, int] = {}
    wanted: dict[str, list[str]] = {}
    for node in sorted(needs):
        for i, h in enumerate(needs[node]):
            if h not in first or i < first[h]:
                first[h] = i
            wanted.setdefault(h, []).append(node)
    plans = {node: NodePlan(node) for node in needs}
    served: Counter[str] = Counter()  # source -> bytes it sends to other nodes
    seeded: Counter[str] = Counter()  # node -> bytes it reads from GCS
    for index, h in enumerate(sorted(first, key=lambda c: (first[c], c))):
        size = sizes[h]
        held = sorted(a for a in set(holders.get(h, ())) if a != GCS and a not in dead)
        needers = sorted(set(wanted[h]) - set(held))
        if not needers:
            continue
        parent: dict[str, str] = {}
        depth: dict[str, int] = {a: 0 for a in held}
        if held:
            roots = held
        elif h in gcs:
            n = len(needers)
            seed = min(enumerate(needers), key=lambda t: (seeded[t[1]], (t[0] - index) % n))[1]
            seeded[seed] += size
            parent[seed], depth[seed] = GCS, 0
            roots = [seed]
            needers.remove(seed)
        else:
            for a in needers:  # on no tier: the fetch reports it
                plans[a].sources[h], plans[a].depth[h] = (), 0
            continue
        _tree(h, size, roots, needers, index, fan_out, served, parent, depth)
        restoring = set(wanted[h]) - set(held)
        for a in wanted[h]:
            if a in held:
                continue
            p = plans[a]
            p.sources[h] = _sources(a, parent, held, restoring, h in gcs, fallbacks)
            p.depth[h] = depth[a]
    for p in plans.values():
        p.order = sorted(p.sources, key=lambda c: (p.depth[c], first[c], c))
    return plans


def _tree(
    h: str,
    size: int,
    roots: list[str],
    needers: list[str],
    index: int,
    fan_out: int,
    served: Counter[str],
    parent: dict[str, str],
    depth: dict[str, int],
) -> None:
    """Hang ``needers`` under ``roots``, ``fan_out`` per node, least-loaded parents first."""
    if not needers:
        return
    k = index % len(needers)
    rest = needers[k:] + needers[:k]  # who sits high in the tree changes from chunk to chunk
    layer = [(served[r], r) for r in roots]
    heapq.heapify(layer)
    children: Counter[str] = Counter()
    below: list[str] = []
    for a in rest:
        if not layer:
            layer = [(served[b], b) for b in below]
            heapq.heapify(layer)
            below = []
        load, p = heapq.heappop(layer)
        parent[a], depth[a] = p, depth[p] + 1
        served[p] += size
        children[p] += 1
        below.append(a)
        if children[p] < fan_out:
            heapq.heappush(layer, (served[p], p))


def _sources(
    node: str, parent: dict[str, str], held: list[str], restoring: set[str], gcs: bool, fallbacks: int
) -> tuple[Source, ...]:
    out: list[Source] = []
    p = parent.get(node)
    if p == GCS:
        return (GCS_SOURCE,)
    seen = {node}
    while p is not None and p != GCS and len(out) < 1 + fallbacks:
        out.append(Source(p, after_fetch=p in restoring))
        seen.add(p)
        p = parent.get(p)
    for a in held:
        if len(out) >= 1 + fallbacks:
            break
        if a not in seen:
            out.append(Source(a))
            seen.add(a)
    if gcs:
        out.append(GCS_SOURCE)
    return tuple(out)


def plan_stats(plans: Mapping[str, NodePlan], sizes: Mapping[str, int]) -> dict[str, int]:
    """GCS bytes planned against the unique bytes needed, and the busiest source."""
    unique = {h for p in plans.values() for h in p.sources}
    gcs = sum(sizes[h] for p in plans.values() for h in p.from_gcs())
    served: Counter[str] = Counter()
    for p in plans.values():
        for h, src in p.sources.items():
            if src and not src[0].is_gcs:
                served[src[0].address] += sizes[h]
    return {
        "unique_bytes": sum(sizes[h] for h in unique),
        "gcs_bytes": gcs,
        "max_served_bytes": max(served.values(), default=0),
        "max_depth": max((d for p in plans.values() for d in p.depth.values()), default=0),
    }
