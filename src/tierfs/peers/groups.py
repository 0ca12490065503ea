"""Erasure-coding groups: which ranks code their committed shards together under ``--erasure D+P``.

A group survives the loss of any P of its members (:mod:`tierfs.core.stripes`), so what
matters is which ranks share a group. Every node computes the groups on its own, from the
same inputs, with no exchange: the result depends only on the number of ranks, D and P,
the twin sets and each rank's topology labels, never on the order they arrive in.

Twins (ranks holding the same data, :func:`tierfs.peers.placement.twins`) are kept apart:
a group holds at most one rank of each twin set. A twin in the same group adds nothing the
twin does not already hold, and whatever takes out one twin (a preempted data-parallel
replica) often takes out the other, so two of them spend two of the group's P losses on one
event. With ``--data-parallel R > 1`` every rank has twins and the peer tier already holds R
copies; groups are formed all the same (erasure then covers the loss of every copy of a
shard), each twin set spread one rank per group. Only when a twin set has more ranks than
there are groups is that impossible: it is then spread as evenly as the groups allow
(:meth:`Grouping.twins_together` names the pairs that had to share).

Failure domains are spread: ranks are ordered by their labels, most significant first (a
zone, then a rack within it), and dealt to the groups in turn, as cards. Every domain's
ranks are then consecutive in that order, so each group gets either ``floor(k/G)`` or
``ceil(k/G)`` of a domain of k ranks, at every level at once: as few members of one domain as
any grouping can give it, hence as many distinct zones as there are to spread over, and
members sharing as few labels as the job allows. Keeping twins apart trades ranks between
groups, drawing first on ranks with all the labels of the one that must move: ranks of one
domain changing places change no domain's count, so the trade costs no spreading.
With fewer domains than D+P some domain holds several members of a group; one holding more
than P is a single failure that loses the group's shards: :meth:`Grouping.weak_spots`.

When D+P does not divide the number of ranks N, the groups are as few as keep every group
within D+P members (``ceil(N / (D+P))``) and their sizes differ by at most one: every group
keeps P parity members, and the spare capacity is taken from data members. D+P is the shape
the operator chose for how many members may fail together and how many a repair reads from;
no group exceeds it, and each survives any P losses. The price is parity: a member of a group
of D' data members holds P/D' of a shard, and spreading the shortfall over all groups keeps
D' within one of D once N is at least (D+P)^2, where a single short group at the end could
be down to D' = 1, a full copy per parity member. Every group needs D' >= 1, so P+1 members;
when N is too small for ``ceil(N / (D+P))`` groups of P+1 (only possible when D <= P+1), the
groups are as many as can each have P+1 members, and some exceed D+P, still with P parity.
With fewer than P+1 ranks there is no group at all: :func:`form_groups` raises.

A group's members are its ranks in increasing order: member ``m`` of the layout is the
group's m-th lowest rank. Every member has one part in every stripe, so their order changes
neither what survives nor what a repair reads; increasing order is just the one everyone
agrees on. Groups are numbered by their lowest rank.
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TypeAlias

from tierfs.core import stripes

Labels: TypeAlias = tuple[tuple[str, str], ...]
Domain: TypeAlias = tuple[tuple[str, str], ...]  # a prefix of a rank's labels, in level order
_Key: TypeAlias = tuple[tuple[int, str], ...]  # per level: (1, value), or (0, "") where the rank has no such label


@dataclass(frozen=True)
class RankGroup:
    """One group: its ranks in member order and the stripe layout they follow.

    ``members[m]`` is member ``m`` of ``layout``; every question about stripes is asked of
    the layout and answered here in ranks, so a caller never handles member numbers unless
    it wants to.
    """

    number: int
    members: tuple[int, ...]
    layout: stripes.Group

    def __post_init__(self) -> None:
        if len(self.members) != self.layout.size or len(set(self.members)) != len(self.members):
            raise stripes.BadGroup(f"group {self.number}: {self.members} are not {self.layout.size} distinct ranks")

    @property
    def d(self) -> int:
        return self.layout.d

    @property
    def p(self) -> int:
        return self.layout.p

    def member(self, rank: int) -> int:
        """The rank's member number in the layout."""
        try:
            return self.members.index(rank)
        except ValueError:
            raise stripes.BadGroup(f"rank {rank} is not in group {self.number} {self.members}") from None

    def rank(self, member: int) -> int:
        """The rank that is the layout's member ``member``."""
        if not 0 <= member < len(self.members):
            raise stripes.BadGroup(f"member {member} is not in 0..{len(self.members) - 1} (group {self.number})")
        return self.members[member]

    def parity_holders(self, stripe: int) -> tuple[int, ...]:
        """The ranks holding the stripe's parity parts, in slot order."""
        return tuple(self.members[m] for m in self.layout.parity_holders(stripe))

    def data_givers(self, stripe: int) -> tuple[int, ...]:
        """The ranks giving the stripe its data parts, in slot order."""
        return tuple(self.members[m] for m in self.layout.data_givers(stripe))

    def parity_stripes(self, rank: int) -> tuple[int, ...]:
        """The stripes whose parity the rank holds."""
        return self.layout.parity_stripes(self.member(rank))

    def data_stripes(self, rank: int) -> tuple[int, ...]:
        """The stripes the rank gives data to: its shard's part ``k`` goes to the ``k``-th."""
        return self.layout.data_stripes(self.member(rank))


@dataclass(frozen=True)
class WeakSpot:
    """A failure domain holding more than P members of one group: losing it loses the group's shards.

    A domain is reported only where it says something its enclosing domain does not: a rack
    holding the same members as its zone is the zone's weak spot already.
    """

    group: int
    domain: Domain
    members: tuple[int, ...]


@dataclass(frozen=True)
class Grouping:
    """Every rank of the job in exactly one group, and what the grouping could not avoid."""

    n_ranks: int
    d: int  # as asked for: a group's own d may be smaller, or larger where D <= P+1 (see above)
    p: int
    groups: tuple[RankGroup, ...]
    levels: tuple[str, ...]  # topology label names, most significant first
    owner: tuple[int, ...] = field(repr=False)  # rank -> group number
    twin_set: tuple[int, ...] = field(repr=False)  # rank -> its twin set, named by its lowest rank
    rank_domains: tuple[tuple[Domain, ...], ...] = field(repr=False)  # rank -> its domains, outermost first

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[RankGroup]:
        return iter(self.groups)

    def group_of(self, rank: int) -> RankGroup:
        """The group the rank codes its shard in."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.n_ranks:
            raise stripes.BadGroup(f"rank {rank!r} is not in 0..{self.n_ranks - 1}")
        return self.groups[self.owner[rank]]

    def domains(self, rank: int) -> tuple[Domain, ...]:
        """The failure domains the rank is in, outermost first: its labels in level order, cut after each."""
        self.group_of(rank)  # refuses a rank outside the job
        return self.rank_domains[rank]

    def weak_spots(self) -> tuple[WeakSpot, ...]:
        """Domains holding more than P members of one group, by group then outermost first."""
        spots: list[WeakSpot] = []
        for group in self.groups:
            inside: defaultdict[Domain, list[int]] = defaultdict(list)
            for rank in group.members:
                for domain in self.rank_domains[rank]:
                    inside[domain].append(rank)
            for domain in sorted(inside, key=lambda dom: (len(dom), dom)):
                members = inside[domain]
                if len(members) > group.p and (len(domain) == 1 or inside[domain[:-1]] != members):
                    spots.append(WeakSpot(group.number, domain, tuple(members)))
        return tuple(spots)

    def twins_together(self) -> tuple[tuple[int, ...], ...]:
        """Ranks of one twin set sharing a group: empty unless a twin set outnumbers the groups."""
        shared: list[tuple[int, ...]] = []
        for group in self.groups:
            by_set: defaultdict[int, list[int]] = defaultdict(list)
            for rank in group.members:
                by_set[self.twin_set[rank]].append(rank)
            shared.extend(tuple(ranks) for ranks in by_set.values() if len(ranks) > 1)
        return tuple(shared)


def group_count(n_ranks: int, d: int, p: int) -> int:
    """How many groups N ranks make: as few as keep each within D+P, unless that leaves one below P+1."""
    stripes.check_shape(d, p)
    _check_ranks(n_ranks, d, p)
    return min(-(-n_ranks // (d + p)), n_ranks // (p + 1))


def form_groups(
    n_ranks: int,
    d: int,
    p: int,
    *,
    topology: Mapping[int, Labels] | None = None,
    twins: Callable[[int], Iterable[int]] | None = None,
    data_parallel: int = 1,
) -> Grouping:
    """Partition ranks ``0..n_ranks-1`` into erasure-coding groups of (at most) D+P members.

    ``topology`` gives a rank's labels, most significant first (a rank it omits has none).
    ``twins`` gives the ranks holding the same data as a rank (replicator.yaml's peer-ranks);
    it need not be symmetric or transitive, since holding the same data is. Without it,
    twins follow from ``data_parallel`` as in :func:`tierfs.peers.placement.twins`.
    """
    count = group_count(n_ranks, d, p)
    sets = _twin_sets(n_ranks, twins, data_parallel)
    levels, keys = _topology_keys(n_ranks, topology)
    order = sorted(range(n_ranks), key=lambda r: (keys[r], r))
    column = _deal(order, keys, sets, count)
    by_column: list[list[int]] = [[] for _ in range(count)]
    for rank in range(n_ranks):
        by_column[column[rank]].append(rank)
    by_column.sort(key=lambda members: members[0])
    shapes: dict[int, stripes.Group] = {}
    groups = []
    owner = [0] * n_ranks
    for number, members in enumerate(by_column):
        size = len(members)
        if size not in shapes:
            shapes[size] = stripes.Group(size - p, p)
        groups.append(RankGroup(number, tuple(members), shapes[size]))
        for rank in members:
            owner[rank] = number
    domains = tuple(_domains(levels, key) for key in keys)
    return Grouping(n_ranks, d, p, tuple(groups), levels, tuple(owner), tuple(sets), domains)


def _check_ranks(n_ranks: int, d: int, p: int) -> None:
    if isinstance(n_ranks, bool) or not isinstance(n_ranks, int):
        raise ValueError(f"the number of ranks must be a whole number, not {n_ranks!r}")
    if n_ranks < p + 1:
        raise ValueError(
            f"{n_ranks} ranks cannot make a {d}+{p} group: one needs at least P+1 = {p + 1} members "
            f"(one data member and {p} parity)"
        )


def _twin_sets(n_ranks: int, twins: Callable[[int], Iterable[int]] | None, data_parallel: int) -> list[int]:
    """Each rank's twin set, named by its lowest rank: the closure of the twin relation."""
    if twins is not None:
        if data_parallel != 1:
            raise ValueError(f"twins are given both as a list and by --data-parallel {data_parallel}: give one")
        return _closure(n_ranks, twins)
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise ValueError(f"--data-parallel {data_parallel!r} must be a whole number of replicas, at least 1")
    if n_ranks % data_parallel:
        raise ValueError(f"--data-parallel {data_parallel} must divide the {n_ranks} ranks")
    width = n_ranks // data_parallel  # placement.twins: ranks ``width`` apart hold the same data
    return [rank % width for rank in range(n_ranks)]


def _closure(n_ranks: int, twins: Callable[[int], Iterable[int]]) -> list[int]:
    parent = list(range(n_ranks))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for rank in range(n_ranks):
        for twin in twins(rank):
            if isinstance(twin, bool) or not isinstance(twin, int) or not 0 <= twin < n_ranks:
                raise ValueError(f"rank {rank}'s twin {twin!r} is not a rank of the job (0..{n_ranks - 1})")
            a, b = root(rank), root(twin)
            if a != b:
                parent[max(a, b)] = min(a, b)  # a set's root stays its lowest rank
    return [root(rank) for rank in range(n_ranks)]


def _topology_keys(n_ranks: int, topology: Mapping[int, Labels] | None) -> tuple[tuple[str, ...], list[_Key]]:
    """The label names in order of significance, and each rank's labels as a sortable key.

    A label's significance is its mean place in the ranks that list it (ties by name): one
    rank listing its labels in another order, or lacking one, does not reorder everyone's.
    """
    labels: list[dict[str, str]] = [{} for _ in range(n_ranks)]
    places: defaultdict[str, list[int]] = defaultdict(lambda: [0, 0])  # name -> [sum of places, ranks]
    for rank, pairs in (topology or {}).items():
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n_ranks:
            raise ValueError(f"the topology names rank {rank!r}, not a rank of the job (0..{n_ranks - 1})")
        for place, (name, value) in enumerate(pairs):
            if name in labels[rank]:
                raise ValueError(f"rank {rank}'s topology names {name!r} twice: {pairs!r}")
            labels[rank][name] = str(value)
            places[name][0] += place
            places[name][1] += 1
    levels = tuple(sorted(places, key=lambda name: (Fraction(*places[name]), name)))
    keys = [tuple((1, own[name]) if name in own else (0, "") for name in levels) for own in labels]
    return levels, keys


def _domains(levels: Sequence[str], key: _Key) -> tuple[Domain, ...]:
    named = [(name, value) if present else None for name, (present, value) in zip(levels, key, strict=True)]
    return tuple(tuple(pair for pair in named[: i + 1] if pair) for i, pair in enumerate(named) if pair)


def _deal(order: Sequence[int], keys: Sequence[_Key], sets: Sequence[int], count: int) -> list[int]:
    """Each rank's group (a column), dealt in turn along ``order``, then traded until twins are apart.

    A twin set of s ranks may have ``ceil(s / count)`` in one group: one, unless it
    outnumbers the groups.
    """
    deal = _Dealing(order, sets, count)
    if deal.apart():
        return deal.column
    runs = _runs(order, keys)
    for position, rank in enumerate(order):
        if not deal.fits(sets[rank], deal.column[rank], own=True) and not deal.repair(position, runs):
            return _set_major(order, sets, count)
    return deal.column


class _Dealing:
    """The columns being traded, and how many of each twin set every column holds.

    A trade moves ranks round a cycle of columns, so every column keeps its size. It draws
    on the ranks sharing the most labels with the one that must move, and moves as few as it
    can: ranks of one domain changing places change no count of that domain, and a domain
    spread as evenly as it can be stays so.
    """

    def __init__(self, order: Sequence[int], sets: Sequence[int], count: int) -> None:
        self.order, self.sets = order, sets
        self.column = [0] * len(order)
        for position, rank in enumerate(order):
            self.column[rank] = position % count
        self.cap = {k: -(-s // count) for k, s in Counter(sets).items()}
        self.held = Counter((self.column[rank], sets[rank]) for rank in order)

    def apart(self) -> bool:
        return all(n <= self.cap[k] for (_, k), n in self.held.items())

    def fits(self, twin_set: int, column: int, own: bool = False) -> bool:
        """Whether the column has room for one more of the set (``own``: or holds no more than its share)."""
        return self.held[column, twin_set] < self.cap[twin_set] + own

    def repair(self, position: int, runs: Sequence[tuple[list[int], list[int]]]) -> bool:
        """Move the rank at ``position`` out of a column holding too many of its set."""
        inner = (position, position + 1)
        for start, end in runs:
            lo, hi = start[position], end[position]
            if self._swap(position, lo, hi, inner) or self._cycle(position, lo, hi):
                return True
            inner = (lo, hi)
        return False

    def _swap(self, position: int, lo: int, hi: int, inner: tuple[int, int]) -> bool:
        order, column, sets, held, cap = self.order, self.column, self.sets, self.held, self.cap
        b = order[position]
        x, kb = column[b], sets[b]
        for other in _nearest(position, lo, hi, inner):
            c = order[other]
            y, kc = column[c], sets[c]
            if kc != kb and y != x and held[y, kb] < cap[kb] and held[x, kc] < cap[kc]:
                self._move([(b, y), (c, x)])
                return True
        return False

    def _cycle(self, position: int, lo: int, hi: int) -> bool:
        """The shortest cycle of moves among positions ``lo..hi-1``: b to Y1, one of Y1's to Y2, ..., one to X."""
        b = self.order[position]
        x, kb = self.column[b], self.sets[b]
        pool: dict[int, list[int]] = {}
        for other in _nearest(position, lo, hi, (position, position + 1)):
            c = self.order[other]
            if self.column[c] != x:
                pool.setdefault(self.column[c], []).append(c)
        came: dict[int, tuple[int, int]] = {}  # column -> (the column its new rank leaves, that rank)
        frontier: deque[int] = deque()
        for y in pool:
            if self.fits(kb, y):
                came[y] = (x, b)
                frontier.append(y)
        followed = {kb}  # where a set's rank may go depends on its set alone: follow each set once
        while frontier:
            y = frontier.popleft()
            for c in pool[y]:
                kc = self.sets[c]
                if kc in followed:
                    continue
                if self.fits(kc, x):
                    moves = [(c, x)]
                    while y != x:
                        before, rank = came[y]
                        moves.append((rank, y))
                        y = before
                    self._move(moves)
                    return True
                followed.add(kc)
                for z in pool:
                    if z not in came and self.fits(kc, z):
                        came[z] = (y, c)
                        frontier.append(z)
        return False

    def _move(self, moves: Iterable[tuple[int, int]]) -> None:
        for rank, to in moves:
            k = self.sets[rank]
            self.held[self.column[rank], k] -= 1
            self.held[to, k] += 1
            self.column[rank] = to


def _runs(order: Sequence[int], keys: Sequence[_Key]) -> list[tuple[list[int], list[int]]]:
    """For each depth, finest first, the [start, end) of the run of positions sharing that many labels."""
    n = len(order)
    depth = len(keys[order[0]]) if n else 0
    runs = []
    for level in range(depth, -1, -1):
        start, end = [0] * n, [n] * n
        begin = 0
        for position in range(1, n + 1):
            if position == n or keys[order[position]][:level] != keys[order[begin]][:level]:
                for q in range(begin, position):
                    start[q], end[q] = begin, position
                begin = position
        runs.append((start, end))
    return runs


def _nearest(position: int, lo: int, hi: int, inner: tuple[int, int]) -> Iterator[int]:
    """Positions ``lo..hi-1`` outside ``inner`` (which holds ``position``), nearest first."""
    left, right = inner[0] - 1, inner[1]
    while left >= lo or right < hi:
        if right < hi and (left < lo or right - position <= position - left):
            yield right
            right += 1
        else:
            yield left
            left -= 1


def _set_major(order: Sequence[int], sets: Sequence[int], count: int) -> list[int]:
    """The deal with each twin set's ranks consecutive, which keeps every set within its cap.

    The fallback for twin sets no trade was found for: twins apart matter more than the
    spreading of domains this gives up.
    """
    place = {rank: position for position, rank in enumerate(order)}
    first: dict[int, int] = {}
    for rank in order:
        first.setdefault(sets[rank], place[rank])
    column = [0] * len(order)
    for position, rank in enumerate(sorted(order, key=lambda r: (first[sets[r]], place[r]))):
        column[rank] = position % count
    return column
