"""Milestones: committed steps kept beyond retention's newest few (``--keep-every``, ``--keep-for``).

A job keeps its newest ``--keep`` steps for a restart; an evaluation, a comparison or a
rollback past a divergence needs some older ones too. Every step divisible by
``--keep-every`` is a milestone: the tiers whose retention counts ``--keep`` (GCS and
``--disk``) keep it besides their newest steps, for ``--keep-for`` seconds after its commit
(0: for good). Once that has passed it is an ordinary old step, and retention drops it.

The rules are here, pure, so that every tier applies the same ones; each tier says what it
knows of a step's commit time (GCS: its manifest object's creation; ``--disk``: its
manifest file's mtime). Peers' replicas in RAM keep no milestones: RAM is the scarce tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class _Retention(Protocol):
    """What :meth:`Milestones.from_config` reads (the daemon's configuration)."""

    # Read-only: a frozen Config satisfies it.
    @property
    def keep_every(self) -> int: ...
    @property
    def keep_for(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Milestones:
    """Which committed steps are milestones, and for how long.

    ``every``: each step divisible by it is one (step 0 included); 0: none.
    ``keep_for``: seconds after its commit a step stays one; 0: for good.
    """

    every: int = 0
    keep_for: float = 0.0

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep_for < 0:
            raise ValueError(f"invalid milestones: every {self.every}, keep_for {self.keep_for}")

    def __bool__(self) -> bool:
        """Whether any step can be a milestone (so a tier can skip asking)."""
        return self.every > 0

    def is_milestone(self, step: int, committed_at: float | None, now: float) -> bool:
        """Whether ``step``, committed at ``committed_at`` (unix time), is a milestone at ``now``.

        An unknown commit time (None) counts as recent: a milestone is kept rather than
        lost because a tier cannot tell its age. A commit time ahead of ``now`` (another
        clock) counts as recent too. A step exactly ``keep_for`` old has expired.
        """
        if not self.every or step % self.every:
            return False
        if not self.keep_for or committed_at is None:
            return True
        return now - committed_at < self.keep_for

    @classmethod
    def from_config(cls, cfg: _Retention) -> Milestones:
        """The milestones ``cfg`` asks for (``keep_every``, ``keep_for``)."""
        return cls(cfg.keep_every, cfg.keep_for)


NO_MILESTONES = Milestones()
