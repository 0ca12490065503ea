"""Stripes: how a group of D+P ranks lays its committed shards out for the erasure-coded peer tier.

Replicating every shard to P peers costs each node P shards of RAM. A group of D+P members
that erasure-codes its shards instead costs each member P/D of a shard, and still survives
the loss of any P members. This module is the layout alone: which member gives which bytes
to which stripe, which members hold each stripe's parity, and how long everything is. It
moves no bytes and computes no parity (that is :mod:`tierfs.core.erasure`), so the peer
tier, a restore planner and a test can all ask it the same questions cheaply.

The rule (docs/formats.md, "Erasure-coded stripes"): a group of ``n = D+P`` members makes
``n`` stripes. Stripe ``s`` has its parity held by members ``(s + j) mod n`` for ``j`` in
``0..P-1`` and its data given by the other D members, in increasing order. Parity rotates as
in RAID 5, so every member holds parity for exactly P stripes and gives data to exactly D,
and every member has exactly one part in every stripe: losing P members loses at most P
parts of any stripe, which a code with P parity parts rebuilds. Member ``m`` cuts its shard
of ``L`` bytes into D parts of ``ceil(L / D)`` bytes (the last one shorter, or empty) and
gives its part ``k`` to the ``k``-th stripe it gives data to.

Shards differ in size, so the parts of a stripe do too. A stripe is as long as its longest
data part and the others are padded with zeros *virtually*: the zeros are counted, never
stored or sent, since a zero adds nothing to any parity. Parity parts are as long as their
stripe. With equal shards every stripe is ``ceil(L / D)`` long and a member holds
``P * ceil(L / D)`` bytes of parity: P/D of its shard, plus less than P bytes.

The code is applied byte by byte (each parity byte depends only on the data bytes at the
same offset), so a byte range of a stripe, taken at the same offset in every part, is a
stripe of its own: parts this large are encoded, sent and rebuilt window by window.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

MAX_DATA = 32  # data parts per stripe: beyond this a repair reads from too many peers to be quick
MAX_PARITY = 4  # parity parts per stripe: more is replication's cost with erasure coding's repair traffic
MAX_MEMBERS = 36  # members of one group, D+P
MAX_SHARD = 1 << 50  # bytes of one member's shard (1 PiB): far beyond any rank's checkpoint


class BadGroup(ValueError):
    """A group shape (D, P), a member, a stripe or a shard length that no group has."""


@dataclass(frozen=True)
class Part:
    """One of a member's D data parts: the bytes ``[start, end)`` of its shard, and where they go.

    ``slot`` is the part's place among the stripe's data parts, which is its index in the
    codec's data parts; the parity parts of a stripe come after them, in slots D..D+P-1.
    """

    member: int
    index: int
    stripe: int
    slot: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Group:
    """The shape of a group: D data parts and P parity parts per stripe, D+P members and stripes."""

    d: int
    p: int

    def __post_init__(self) -> None:
        check_shape(self.d, self.p)

    @property
    def size(self) -> int:
        """Members in the group, and stripes in its layout: one stripe per member."""
        return self.d + self.p

    def parity_holders(self, stripe: int) -> tuple[int, ...]:
        """The members holding the stripe's parity parts, in slot order (slot D+j is held by the j-th)."""
        return self._parity_holders[self._stripe(stripe)]

    def data_givers(self, stripe: int) -> tuple[int, ...]:
        """The members giving the stripe its data parts, in slot order (increasing)."""
        return self._data_givers[self._stripe(stripe)]

    def data_stripes(self, member: int) -> tuple[int, ...]:
        """The stripes the member gives data to, in increasing order: its part ``k`` goes to the ``k``-th."""
        return self._data_stripes[self._member(member)]

    def parity_stripes(self, member: int) -> tuple[int, ...]:
        """The stripes whose parity the member holds, in increasing order."""
        return self._parity_stripes[self._member(member)]

    def slot(self, stripe: int, member: int) -> int:
        """The member's slot in the stripe: its data part's index (0..D-1) or its parity part's (D..D+P-1).

        Every member has exactly one slot in every stripe, which is why losing P members
        costs no stripe more than P parts.
        """
        return self._slots[self._stripe(stripe)][self._member(member)]

    def member(self, stripe: int, slot: int) -> int:
        """Who has the slot in the stripe: the inverse of :meth:`slot`."""
        if not 0 <= slot < self.size:
            raise BadGroup(f"slot {slot} is not in 0..{self.size - 1}")
        givers = self.data_givers(stripe)
        return givers[slot] if slot < self.d else self.parity_holders(stripe)[slot - self.d]

    @cached_property
    def _parity_holders(self) -> tuple[tuple[int, ...], ...]:
        n = self.size
        return tuple(tuple((s + j) % n for j in range(self.p)) for s in range(n))

    @cached_property
    def _data_givers(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(m for m in range(self.size) if m not in holders) for holders in self._parity_holders)

    @cached_property
    def _data_stripes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(s for s in range(self.size) if m in self._data_givers[s]) for m in range(self.size))

    @cached_property
    def _parity_stripes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(s for s in range(self.size) if m in self._parity_holders[s]) for m in range(self.size))

    @cached_property
    def _slots(self) -> tuple[tuple[int, ...], ...]:
        slots = []
        for givers, holders in zip(self._data_givers, self._parity_holders, strict=True):
            by_member = {m: slot for slot, m in enumerate(givers + holders)}
            slots.append(tuple(by_member[m] for m in range(self.size)))
        return tuple(slots)

    def _stripe(self, stripe: int) -> int:
        if not 0 <= stripe < self.size:
            raise BadGroup(f"stripe {stripe} is not in 0..{self.size - 1} (a {self.d}+{self.p} group)")
        return stripe

    def _member(self, member: int) -> int:
        if not 0 <= member < self.size:
            raise BadGroup(f"member {member} is not in 0..{self.size - 1} (a {self.d}+{self.p} group)")
        return member


def check_shape(d: int, p: int) -> None:
    """Refuse a shape no group may have, before anything is sized from it."""
    if isinstance(d, bool) or isinstance(p, bool) or not isinstance(d, int) or not isinstance(p, int):
        raise BadGroup(f"D and P must be whole numbers, not {d!r} and {p!r}")
    if not 1 <= d <= MAX_DATA:
        raise BadGroup(f"D={d}: a stripe has 1 to {MAX_DATA} data parts")
    if not 1 <= p <= MAX_PARITY:
        raise BadGroup(f"P={p}: a stripe has 1 to {MAX_PARITY} parity parts")
    if d + p > MAX_MEMBERS:
        raise BadGroup(f"D+P={d + p}: a group has at most {MAX_MEMBERS} members")


def parse_shape(text: str) -> Group:
    """The group ``--erasure D+P`` names, e.g. ``4+2``."""
    d, plus, p = text.strip().partition("+")
    if len(text) > 16 or not plus or not d.strip().isdecimal() or not p.strip().isdecimal():
        raise BadGroup(f"--erasure {text!r}: expected D+P, e.g. 4+2")
    return Group(int(d), int(p))


def part_size(group: Group, shard_length: int) -> int:
    """Bytes in each of a shard's D parts but the last: ``ceil(L / D)``."""
    return -(-_shard_length(shard_length) // group.d)


def parts(group: Group, member: int, shard_length: int) -> tuple[Part, ...]:
    """The member's D data parts, in order: the byte ranges of its shard and the stripe slot each fills.

    The ranges are consecutive and cover the shard; the last ones are short or empty when
    D does not divide its length (an empty part is still a part: its stripe pads it).
    """
    size = part_size(group, shard_length)
    return tuple(
        Part(
            member=member,
            index=k,
            stripe=stripe,
            slot=group.slot(stripe, member),
            start=min(k * size, shard_length),
            end=min((k + 1) * size, shard_length),
        )
        for k, stripe in enumerate(group.data_stripes(member))
    )


def data_lengths(group: Group, shard_lengths: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """For each stripe, the lengths of its D data parts in slot order, before padding.

    This is what a codec needs to tell a rebuilt data part's real end from its padding.
    """
    lengths = _shard_lengths(group, shard_lengths)
    by_member = [{p.stripe: p.length for p in parts(group, m, n)} for m, n in enumerate(lengths)]
    return tuple(tuple(by_member[m][s] for m in group.data_givers(s)) for s in range(group.size))


def stripe_lengths(group: Group, shard_lengths: Sequence[int]) -> tuple[int, ...]:
    """Each stripe's length, which is also each of its parity parts': its longest data part."""
    return tuple(max(lengths) for lengths in data_lengths(group, shard_lengths))


def parity_bytes(group: Group, shard_lengths: Sequence[int]) -> tuple[int, ...]:
    """The parity bytes each member holds: the lengths of the stripes it holds parity for, P parts each."""
    stripes = stripe_lengths(group, shard_lengths)
    return tuple(sum(stripes[s] for s in group.parity_stripes(m)) for m in range(group.size))


def held_bytes(group: Group, shard_lengths: Sequence[int]) -> tuple[int, ...]:
    """What each member keeps for the group: its own shard and its parity parts."""
    lengths = _shard_lengths(group, shard_lengths)
    return tuple(own + parity for own, parity in zip(lengths, parity_bytes(group, lengths), strict=True))


def pieces(chunk_lengths: Sequence[int], start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """The ``(chunk, offset, length)`` pieces of a shard's chunks that make its bytes ``[start, end)``.

    A shard is a stream of chunks of different sizes and a part's range cuts through them,
    so sending or reading a part means reading these pieces in order.
    """
    if not 0 <= start <= end:
        raise BadGroup(f"byte range [{start}, {end}) is not a range")
    offsets = list(itertools.accumulate(chunk_lengths, initial=0))
    if any(n < 0 for n in chunk_lengths) or end > offsets[-1]:
        raise BadGroup(f"byte range [{start}, {end}) is not within the shard's {offsets[-1]} bytes")
    chunk = bisect.bisect_right(offsets, start) - 1
    position = start
    while position < end:
        chunk_end = offsets[chunk + 1]
        if chunk_end > position:
            stop = min(end, chunk_end)
            yield chunk, position - offsets[chunk], stop - position
            position = stop
        chunk += 1


def _shard_length(length: int) -> int:
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= MAX_SHARD:
        raise BadGroup(f"shard length {length!r} is not a whole number of bytes in 0..{MAX_SHARD}")
    return length


def _shard_lengths(group: Group, shard_lengths: Sequence[int]) -> tuple[int, ...]:
    if len(shard_lengths) != group.size:
        raise BadGroup(f"{len(shard_lengths)} shard lengths for a group of {group.size} members")
    return tuple(_shard_length(n) for n in shard_lengths)
