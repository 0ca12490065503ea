"""A ``coord_decide`` answer as the asking node reads it: the step to restore and who holds what.

Apart from the member that asks because the restore planner
(:mod:`tierfs.pipeline.coordinating`) plans from it long after the asking is over: which
nodes of a rank still need the step, and which holders to fetch it from. It is parsed
here, every field checked, because the coordinator that sent it is trusted to
authenticate, not to tell the truth.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from tierfs.coordination import fields
from tierfs.coordination.protocol import MAX_LISTED_DOWN, MAX_LISTED_HOLDERS, MAX_LISTED_STEPS
from tierfs.coordination.transport import BadMessage, Message
from tierfs.coordination.view import Summary


@dataclass
class RankView:
    """What a coordinator says about one rank."""

    choice: int | None
    steps: dict[int, list[str]]  # step -> holders (addresses, "gcs")
    nodes: list[str]  # addresses of the nodes reporting as this rank, or found down since


@dataclass
class Decision:
    """The step to restore, as a coordinator answered, with the holdings a restore plans from."""

    step: int | None
    ready: bool  # every member reported or was found down
    coordinator: str | None
    summary: Summary = field(default_factory=dict)
    ranks: dict[int, RankView] = field(default_factory=dict)
    reported: int = 0
    members: int = 0
    down: list[str] = field(default_factory=list)
    at: float = 0.0
    silent: list[str] = field(default_factory=list)  # members that had not reported (when not ready)
    you: bool = False  # the coordinator holds the asker's report
    coordinating: bool = False  # it is a coordinator (it waited for its view), not a stand-in

    @classmethod
    def from_answer(cls, rank: int, group: Collection[int], answer: Message, coordinator: str, at: float) -> Decision:
        """A ``coord_decide`` answer about ``rank`` and its ``group``, every field checked (BadMessage)."""
        try:
            return cls._parse(rank, group, answer, coordinator, at)
        except BadMessage as e:
            raise BadMessage(f"malformed coord_decide answer from {coordinator}: {e}") from None

    @classmethod
    def _parse(cls, rank: int, group: Collection[int], answer: Message, coordinator: str, at: float) -> Decision:
        listed = fields.obj(answer.get("ranks"), "ranks")
        ranks: dict[int, RankView] = {}
        for key, value in listed.items():
            r = fields.number_key(key, "ranks")
            if r != rank and r not in group:
                raise BadMessage(f"ranks names rank {r}, which was not asked about")
            ranks[r] = RankView(*fields.rank_answer(value, f"rank {r}", MAX_LISTED_STEPS, MAX_LISTED_HOLDERS))
        if rank not in ranks:
            raise BadMessage(f"ranks does not answer for rank {rank}")
        gcs = fields.obj(answer.get("gcs", {}), "gcs")
        fields.flag(gcs.get("listed", False), "gcs listed")
        if not (gcs.get("error") is None or isinstance(gcs.get("error"), str)):
            raise BadMessage("gcs error must be a string or null")
        fields.count(answer.get("down_count", 0), "down_count")
        return cls(
            ranks[rank].choice,
            fields.flag(answer.get("ready"), "ready"),
            coordinator,
            fields.summary(answer.get("summary")),
            ranks,
            fields.count(answer.get("reported"), "reported"),
            fields.count(answer.get("members"), "members"),
            fields.addresses(answer.get("down", []), "down", MAX_LISTED_DOWN),
            at,
            fields.addresses(answer.get("silent", []), "silent", MAX_LISTED_DOWN),
            fields.flag(answer.get("you", False), "you"),
            fields.flag(answer.get("coordinating", False), "coordinating"),
        )

    def holders(self, rank: int, step: int) -> list[str]:
        view = self.ranks.get(rank)
        return [] if view is None else view.steps.get(step, [])

    def needing(self, ranks: Iterable[int], step: int) -> dict[int, list[str]]:
        """The nodes of ``ranks`` that do not hold ``step`` of their own rank: they restore it."""
        out: dict[int, list[str]] = {}
        for r in ranks:
            view = self.ranks.get(r)
            if view is not None:
                held = set(view.steps.get(step, ()))
                need = [a for a in view.nodes if a not in held]
                if need:
                    out[r] = need
        return out
