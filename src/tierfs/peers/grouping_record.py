"""The erasure grouping a job's nodes use, as a record: formed once from every rank's labels, then kept.

Placing groups by topology (:func:`tierfs.peers.groups.form_groups`) needs every rank's
topology labels and twins, and each node knows only its own. Parity, once summed, is only
good under the grouping that summed it: a node coming back with other labels (rescheduled
to another rack), a new release that deals ranks differently, or two nodes that saw
different answers must never regroup a job under its parity. So the groups are a record:
formed the first time every rank answers (the same answers give the same record on every
node, however many form it at once), kept by every node beside its parity, handed to a node
that lost its own by any node that has one, and named by a digest that every erasure request
carries, so that a member using other groups is refused rather than summed in.

Parity kept from before records existed was summed under the groups that rank numbers and
``--data-parallel`` alone give (:func:`legacy`): a node holding such parity and no record
takes that grouping as its record.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tierfs.core import stripes
from tierfs.peers.groups import Grouping, Labels, RankGroup, form_groups
from tierfs.peers.placement import twins as data_parallel_twins

VERSION = 1
MAX_BYTES = 8 << 20  # a record of 10,000 ranks with every weak spot named is well under a megabyte
MAX_RANKS = 100_000  # ranks of one job a record may hold
MAX_NOTES = 10_000  # weak spots, or twin sets sharing a group, named in one record
MAX_DOMAIN = 1024  # characters of a failure domain's name


class BadRecord(ValueError):
    """A grouping record that is not one (from disk or from a peer): it is never used."""


@dataclass(frozen=True)
class GroupingRecord:
    """The job's groups, and what their forming could not avoid (for ``tierfs status``)."""

    nodes: int
    d: int
    p: int
    groups: tuple[tuple[int, ...], ...]  # each group's ranks in increasing order; groups by their lowest rank
    weak_spots: tuple[tuple[int, str, tuple[int, ...]], ...] = ()  # (group, domain, its members in it)
    twins_together: tuple[tuple[int, ...], ...] = ()  # twins that had to share a group

    @property
    def shape(self) -> str:
        return f"{self.d}+{self.p}"

    @property
    def digest(self) -> str:
        """What names the grouping on the wire: only the groups count, not the notes about them."""
        groups = json.dumps([self.nodes, self.shape, self.groups], separators=(",", ":"))
        return hashlib.sha256(groups.encode()).hexdigest()[:16]

    def group_of(self, rank: int) -> RankGroup:
        for number, members in enumerate(self.groups):
            if rank in members:
                return RankGroup(number, members, stripes.Group(len(members) - self.p, self.p))
        raise BadRecord(f"rank {rank} is in no group of the record")

    def matches(self, nodes: int, shape: stripes.Group) -> bool:
        return (self.nodes, self.d, self.p) == (nodes, shape.d, shape.p)

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "version": VERSION,
                "nodes": self.nodes,
                "erasure": self.shape,
                "groups": self.groups,
                "weak_spots": [[g, domain, list(m)] for g, domain, m in self.weak_spots],
                "twins_together": self.twins_together,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> GroupingRecord:
        """A record as stored or as a peer sent it, checked whole: every rank in exactly one valid group."""
        if len(data) > MAX_BYTES:
            raise BadRecord(f"a grouping record of {len(data)} bytes: at most {MAX_BYTES}")
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict) or type(raw.get("version")) is not int or raw["version"] != VERSION:
                raise BadRecord(f"not a version {VERSION} grouping record")
            shape = stripes.parse_shape(str(raw["erasure"]))
            record = cls(
                nodes=_count(raw["nodes"]),
                d=shape.d,
                p=shape.p,
                groups=tuple(_ranks(g) for g in _list(raw["groups"], MAX_RANKS)),
                weak_spots=tuple(_weak_spot(w) for w in _list(raw.get("weak_spots", []), MAX_NOTES)),
                twins_together=tuple(_ranks(t) for t in _list(raw.get("twins_together", []), MAX_NOTES)),
            )
        except BadRecord:
            raise
        except (ValueError, KeyError, TypeError, RecursionError, stripes.BadGroup) as e:
            raise BadRecord(f"not a grouping record: {e}") from None
        record.check()
        return record

    def check(self) -> None:
        """Every rank of the job in exactly one group, each a group a D+P layout can code."""
        if self.nodes < self.p + 1 or not all(self.groups):
            raise BadRecord(f"{self.nodes} ranks with an empty group or too few for one {self.shape} group")
        seen = [r for members in self.groups for r in members]
        if sorted(seen) != list(range(self.nodes)):
            raise BadRecord(f"its groups do not hold each of the {self.nodes} ranks exactly once")
        if list(self.groups) != sorted(self.groups, key=lambda m: m[0]):
            raise BadRecord("its groups are not in order of their lowest rank")
        for members in self.groups:
            if list(members) != sorted(members):
                raise BadRecord(f"group {list(members)} is not in increasing order")
            try:
                stripes.Group(len(members) - self.p, self.p)
            except (stripes.BadGroup, ValueError) as e:
                raise BadRecord(f"group {list(members)}: {e}") from None
        for number, _, members in self.weak_spots:
            if number >= len(self.groups) or not set(members) <= set(self.groups[number]):
                raise BadRecord(f"a weak spot names ranks {list(members)} outside group {number}")


def formed(grouping: Grouping) -> GroupingRecord:
    """The record of groups just formed."""
    return GroupingRecord(
        nodes=grouping.n_ranks,
        d=grouping.d,
        p=grouping.p,
        groups=tuple(g.members for g in grouping.groups),
        weak_spots=tuple(
            (s.group, "/".join(f"{k}={v}" for k, v in s.domain)[:MAX_DOMAIN], s.members)
            for s in grouping.weak_spots()[:MAX_NOTES]
        ),
        twins_together=grouping.twins_together()[:MAX_NOTES],
    )


def form(
    nodes: int,
    shape: stripes.Group,
    data_parallel: int,
    labels: Mapping[int, Labels],
    named_twins: Mapping[int, Sequence[int]],
) -> GroupingRecord:
    """The groups of every rank's labels and twins (``named_twins``: the ranks whose replicator.yaml names
    theirs; the others' follow ``--data-parallel``)."""
    if not named_twins:
        return formed(form_groups(nodes, shape.d, shape.p, topology=labels, data_parallel=data_parallel))

    def twins(rank: int) -> Sequence[int] | set[int]:
        named = named_twins.get(rank)
        return named if named is not None else data_parallel_twins(rank, nodes, data_parallel)

    return formed(form_groups(nodes, shape.d, shape.p, topology=labels, twins=twins))


def legacy(nodes: int, shape: stripes.Group, data_parallel: int) -> GroupingRecord:
    """The groups parity was summed under before records were kept: by rank numbers and data parallelism."""
    return formed(form_groups(nodes, shape.d, shape.p, data_parallel=data_parallel))


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RANKS:
        raise BadRecord(f"{value!r} is not a number of ranks")
    return value


def _list(value: Any, limit: int) -> list[Any]:
    if not isinstance(value, list) or len(value) > limit:
        raise BadRecord(f"expected a list of at most {limit} items")
    return value


def _ranks(value: Any) -> tuple[int, ...]:
    return tuple(_count(r) for r in _list(value, MAX_RANKS))


def _weak_spot(value: Any) -> tuple[int, str, tuple[int, ...]]:
    group, domain, members = _list(value, 3)
    if not isinstance(domain, str) or len(domain) > MAX_DOMAIN or not domain.isprintable():
        raise BadRecord("a weak spot's domain is not a printable name")
    return _count(group), domain, _ranks(members)
