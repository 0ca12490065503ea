"""What a coordinator knows of each member: the report it holds, the rank it reports as, whether it is down.

Kept apart from :class:`~tierfs.coordination.coordinator.Coordinator` because it is
bookkeeping with no messages, rounds or timers of its own: the coordinator decides when a
member is pulled and when it counts as down, and this records the outcome and keeps the
view of holdings in step with it. A newer report replaces an older one (never the
reverse), a member found down takes its holdings out of the view but stays listed as its
rank's node (the rank's restore plans still name it), and an old report expires.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierfs.coordination.view import Holdings, HoldingsView


@dataclass
class Report:
    holdings: Holdings
    at: float


class Reports:
    """The reports a coordinator holds, in the order received, and each member's standing."""

    def __init__(self, view: HoldingsView):
        self.view = view
        self.held: dict[str, Report] = {}  # in the order received: the oldest expire first
        self.ranks: dict[int, set[str]] = {}  # rank -> addresses reporting as it (or found down since)
        self._rank_of: dict[str, int] = {}
        self.fresh: set[str] = set()  # members with a report held
        self.down: dict[str, float] = {}  # members found down -> since
        self.failed: dict[str, int] = {}  # member -> pulls unanswered in a row
        self.starting: dict[str, float] = {}  # member whose host refused a pull -> since

    def accept(self, source: str, h: Holdings, now: float, member: bool) -> bool:
        """Take ``source``'s report; False if it is older than the one held.

        ``member``: ``source`` is one of the job's members, so its report settles its standing.
        """
        held = self.held.get(source)
        if held is not None and not h.newer_than(held.holdings):
            return False
        if held is not None:
            del self.held[source]  # re-inserted last: the dict stays in order of arrival
        self._unrank(source, h.rank)
        self.held[source] = Report(h, now)
        self.ranks.setdefault(h.rank, set()).add(source)
        self._rank_of[source] = h.rank
        self.view.put_holdings(source, h)
        if member:
            self.fresh.add(source)
            self.down.pop(source, None)
            self.failed.pop(source, None)
            self.starting.pop(source, None)
        return True

    def found_down(self, member: str, now: float) -> None:
        self.starting.pop(member, None)
        self.forget(member, keep_rank=True)  # what it held went with it; its rank's plans still name it
        self.down[member] = now

    def forget(self, source: str, keep_rank: bool = False) -> None:
        """Drop ``source``'s holdings; ``keep_rank``: still list it as its rank's node (found down)."""
        self.held.pop(source, None)
        if not keep_rank:
            self._unrank(source)
        self.fresh.discard(source)
        self.view.drop(source)

    def _unrank(self, source: str, rank: int | None = None) -> None:
        """Stop listing ``source`` as the node of the rank it had (unless that is ``rank``)."""
        old = self._rank_of.get(source)
        if old is None or old == rank:
            return
        del self._rank_of[source]
        nodes = self.ranks.get(old)
        if nodes is not None:
            nodes.discard(source)
            if not nodes:
                del self.ranks[old]

    def expire(self, now: float, ttl: float) -> None:
        """Forget every report older than ``ttl`` seconds."""
        while self.held:
            source, report = next(iter(self.held.items()))
            if now - report.at <= ttl:
                break
            self.forget(source)

    def clear_standing(self) -> None:
        """Forget who was found down, failed pulls or refused them: the node stopped coordinating."""
        self.down.clear()
        self.failed.clear()
        self.starting.clear()
