"""What an erasure group holds now, as one member sees it: which members hold which steps' parts.

Kept apart from the service (:mod:`tierfs.store.stripe_service`), which asks the members,
because these are the group's arithmetic alone: a step of a rank can be rebuilt while every
stripe it gives data to keeps at least D parts held by members other than that rank, and the
group survives as many more losses as the weakest stripe has parts beyond D. Every member
has one part in every stripe (:mod:`tierfs.core.stripes`), so a member that holds a step's
parts at all counts once in each.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tierfs.peers.groups import RankGroup


@dataclass(frozen=True)
class MemberHoldings:
    """What one member said it holds (its ``ec_status`` answer)."""

    rank: int
    data: frozenset[int] = frozenset()  # its own committed steps, whole in its RAM
    parity: frozenset[tuple[int, int, int]] = frozenset()  # (step, stripe, j) parity parts complete
    received: Mapping[tuple[int, int, int], tuple[int, ...]] = field(default_factory=dict)  # incomplete: per slot
    manifests: frozenset[tuple[int, int]] = frozenset()  # (rank, step) manifest copies of the group's members

    def holds(self, group: RankGroup, step: int, stripe: int) -> bool:
        """Whether it holds its part of ``stripe`` in ``step``: its data, or its parity complete."""
        holders = group.parity_holders(stripe)
        if self.rank in holders:
            return (step, stripe, holders.index(self.rank)) in self.parity
        return step in self.data


class GroupView:
    """The latest holdings each member of ``group`` gave; a member that did not answer holds nothing."""

    def __init__(self, group: RankGroup):
        self.group = group
        self.members: dict[int, MemberHoldings] = {}  # rank -> what it said last; absent: no answer

    def update(self, answers: Mapping[int, MemberHoldings | None]) -> None:
        for rank, held in answers.items():
            if held is None:
                self.members.pop(rank, None)
            else:
                self.members[rank] = held

    def alive_slots(self, step: int, stripe: int, without: Iterable[int] = ()) -> list[int]:
        """The slots of ``stripe`` whose parts of ``step`` are held now, by members other than ``without``."""
        left_out = set(without)
        layout = self.group.layout
        return sorted(
            layout.slot(stripe, self.group.member(rank))
            for rank, held in self.members.items()
            if rank not in left_out and held.holds(self.group, step, stripe)
        )

    def rebuildable(self, rank: int, step: int) -> bool:
        """Whether ``rank``'s ``step`` comes back from the others' parts: D of every stripe it gives data to."""
        return all(
            len(self.alive_slots(step, stripe, [rank])) >= self.group.d for stripe in self.group.data_stripes(rank)
        )

    def survives(self, step: int) -> int:
        """How many more members the group may lose with every shard of ``step`` still rebuildable (< 0: not now)."""
        held = min(len(self.alive_slots(step, s)) for s in range(self.group.layout.size))
        return held - self.group.d

    def manifest_holders(self, rank: int, step: int) -> list[int]:
        """The members holding a copy of ``rank``'s manifest of ``step``."""
        return sorted(r for r, held in self.members.items() if (rank, step) in held.manifests)

    def steps(self) -> list[int]:
        """Every step some member holds a part of."""
        found: set[int] = set()
        for held in self.members.values():
            found |= held.data | {s for s, _, _ in held.parity}
        return sorted(found)

    def encoded(self, step: int) -> bool:
        """Whether every member holds every part of ``step``: the group survives its full P losses."""
        return len(self.members) == self.group.layout.size and self.survives(step) == self.group.p
