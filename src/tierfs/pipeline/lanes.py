"""A replicator lane: the tiers that share it, how putting steps on them goes, and what it does next.

Apart from :mod:`tierfs.pipeline.replicator`, which runs the lanes, because these are each
lane's own decisions, made from its record and the steps' states alone: which step it puts
next (the milestones it owes first, the newest step else), whether its schedule lets that
step go yet, which of its tiers still hold a step, and what ``tierfs status`` shows of it.
Nothing here puts, saves or logs anything: the replicator does, around these answers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import trio

from tierfs.config import Config
from tierfs.core.milestones import Milestones
from tierfs.pipeline.policy import LanePolicy, policy_for
from tierfs.ramtier.steps import StepState
from tierfs.tiers.base import Progress, Tier, TierError, by_cost, first_line


class Lane:
    """The tiers that share one lane, and how putting steps on them is going."""

    def __init__(self, name: str, tiers: list[Tier], policy: LanePolicy):
        self.name, self.tiers, self.policy = name, tiers, policy
        self.lead = tiers[0]  # what the lane's tiers are (shared, spill), as its first says
        self.interval, self.every_steps = policy.schedule()
        self.volatile = any(t.volatile for t in tiers)  # when idle: is the newest step still where we put it?
        self.last_step: int | None = None  # the step this lane last put, and when
        self.last_at: float | None = None
        self.wake = trio.Event()
        self.busy: int | None = None
        self.progress: Progress | None = None
        self.status: dict = {"state": "idle", "error": None, "since": time.time()}

    def copies(self) -> int:
        return self.policy.copies()

    def configure(self, cfg: Config) -> None:
        """Follow the job's new shape: its policy, and the schedule it gives."""
        self.policy.configure(cfg)
        self.interval, self.every_steps = self.policy.schedule()
        self.wake.set()

    def done(self, state: StepState) -> bool:
        """Whether the step's current version is on enough of this lane's tiers."""
        record = state.copies.get(self.name, {})
        return record.get("version") == state.version and len(record.get("tiers", ())) >= self.copies()

    def set(self, state: str, error: str | None = None) -> None:
        if self.status["state"] != state:
            self.status["since"] = time.time()
        self.status.update(state=state, error=error)

    # -- what to put next ------------------------------------------------------------------

    def milestones_owed(self, states: Mapping[int, StepState], milestones: Milestones, now: float) -> list[StepState]:
        """The milestones among ``states`` newer than the lane's last put step that it lacks, oldest first."""
        if not milestones or not self.policy.keeps_milestones:
            return []
        after = self.last_step
        return [
            s
            for _, s in sorted(states.items())
            if (after is None or s.step > after)
            and not self.done(s)
            and s.refusal() is None
            and milestones.is_milestone(s.step, s.committed_at, now)
        ]

    def next_step(self, newest: StepState | None, owed: list[StepState]) -> tuple[StepState | None, bool]:
        """The step to put next, and whether the schedule paces it (it paces ordinary steps only).

        The oldest milestone owed goes first; else the newest step.
        """
        state = next((s for s in owed if s is not newest), newest)
        return state, all(s is not state for s in owed)

    def early(self, state: StepState, paced: bool) -> bool:
        """Whether a paced ``state`` comes sooner than every ``every_steps`` steps after the last one put."""
        return (
            paced
            and bool(self.every_steps)
            and self.last_step is not None
            and state.step < self.last_step + self.every_steps
        )

    def wait(self, paced: bool) -> float:
        """Seconds until the interval since the last put lets a paced step go (0: now)."""
        return self.last_at + self.interval - time.time() if paced and self.interval and self.last_at else 0.0

    # -- what it put -----------------------------------------------------------------------

    async def still_holding(self, held: Sequence[str], rank: int, step: int) -> tuple[list[str], dict[str, str]]:
        """Which of the tiers named ``held`` still hold ``rank``'s ``step``, and why those that did not answer did not.

        Only a volatile tier (a peer's RAM, a replaced node) can lose what it held: the
        others are kept without asking.
        """
        by_name = {t.name: t for t in self.tiers}
        kept: list[str] = []
        silent: dict[str, str] = {}  # tier name -> why it did not answer
        for name in held:
            tier = by_name.get(name)
            if tier is None or not tier.volatile:
                kept.append(name)
                continue
            try:
                listed = await tier.list_manifests()
            except TierError as e:  # down, or too busy to answer: the step goes to another tier meanwhile
                silent[name] = first_line(e)
                continue
            if (rank, step) in listed:
                kept.append(name)
        return kept, silent

    def report(self, states: Mapping[int, StepState], now: float) -> dict:
        """The lane's state, lag and progress, with what its tiers say of themselves."""
        pending = [s for s in states.values() if not self.done(s) and s.refusal() is None]
        lag = now - min(s.committed_at for s in pending) if pending else 0.0
        return {
            **self.status,
            "working_on": self.busy,
            "lag_s": round(lag, 3),
            "last_at": self.last_at,
            "progress": self.progress.as_dict() if self.busy and self.progress else None,
            "tiers": [t.name for t in self.tiers],
            **self.policy.report(self.tiers),
        }


def lanes_of(tiers: list[Tier], cfg: Config) -> dict[str, Lane]:
    """The lanes of ``tiers``, cheapest first, each with its policy; tiers without a lane (this node's RAM) get none."""
    grouped: dict[str, list[Tier]] = {}
    for tier in by_cost(tiers):
        if tier.lane is not None:
            grouped.setdefault(tier.lane, []).append(tier)
    return {name: Lane(name, members, policy_for(name, cfg)) for name, members in grouped.items()}
