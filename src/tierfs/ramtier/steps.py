"""This rank's committed steps: what was committed, when, and how far each got.

The state of a step lives beside its snapshot (``steps/<step>/state.json``) and is
rewritten atomically, so a daemon restart resumes backups where they stopped. It is
root's alone (0600 in root-only directories) and checked again when a start reads it: it
decides what that start serves, replicates and deletes.

Commits come from the mount's events (through the commit rules) or from ``tierfs
commit``; both run on the trio thread, so a rename's commit is complete before the rename
returns to the job, and a close's before any later request that could tell
(:mod:`tierfs.fs.releases`).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tierfs.core.atomic import UnsafeFile, read_state, write_atomically
from tierfs.core.commit import CommitRules, step_of
from tierfs.ramtier.snapshots import Snapshots

log = logging.getLogger(__name__)
RECENT_COMMITS = 32  # enough for a median interval that one odd save does not move


@dataclass
class StepState:
    step: int
    roots: list[str]
    committed_at: float
    version: int = 1  # bumped by every commit into the step; a copy on a tier covers one version
    source: str = "local"  # where the data came from: local writes, or the kind of tier it was restored from
    # Where the step went, by replicator lane ("peers", "gcs", "disk"): version, tiers, at, bytes sent...
    # (Records as saved in state.json and read back: JSON values, typed by their writers.)
    copies: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Why no tier can take a version of the step (no manifest can describe it): {"version", "error"}
    refused: dict[str, Any] | None = None

    def held_by(self, lane: str) -> bool:
        """Whether the lane's tiers hold the current version."""
        return self.copies.get(lane, {}).get("version") == self.version

    def refusal(self) -> str | None:
        """Why the current version can go to no tier, if it cannot; a later commit into the step may fix it."""
        refused = self.refused or {}
        return refused.get("error") if refused.get("version") == self.version else None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StepState:
        """A step's saved state; also the shape earlier versions saved (``backup``, ``replicas``)."""
        d = dict(d)
        copies = dict(d.pop("copies", None) or {})
        backup, replicas = d.pop("backup", None), d.pop("replicas", None)
        if backup:
            copies.setdefault("gcs", {**backup, "tiers": ["gcs"], "sent_bytes": backup.get("uploaded_bytes", 0)})
        if replicas:
            copies.setdefault("peers", {**replicas, "tiers": [f"peer {p}" for p in replicas.get("peers", ())]})
        return cls(**d, copies=copies)

    def add_root(self, root: str) -> None:
        if any(root == r or root.startswith(r + "/") for r in self.roots):
            return  # already inside a committed root of this step
        self.roots = sorted([r for r in self.roots if not r.startswith(root + "/")] + [root])


class Steps:
    def __init__(self, snapshots: Snapshots, rules: CommitRules, writing: Callable[[], set[int]]):
        self.snapshots = snapshots
        self.rules = rules
        self._writing = writing  # inodes open for writing, copied rather than linked
        self.states: dict[int, StepState] = {}
        self.restoring: set[int] = set()  # steps whose bytes are still arriving (see tierfs.pipeline.restore)
        self.on_commit: Callable[[StepState], None] = lambda state: None
        self.commits = 0  # by the job, since the start: tierfs_steps_committed_total
        # (committed at, seconds its files were written before) of the newest new steps, for goodput
        self.recent: deque[tuple[float, float]] = deque(maxlen=RECENT_COMMITS)

    def load(self) -> None:
        self.snapshots.load()
        for step in self.snapshots.steps():
            if (self.snapshots.step_dir(step) / "restore.json").exists():
                continue  # a restore that did not finish: the restore resumes or drops it
            path = self.snapshots.step_dir(step) / "state.json"
            try:
                self.states[step] = StepState.from_dict(json.loads(read_state(path)))
            except UnsafeFile as e:  # not the daemon's own: refuse to act on it (UserError)
                raise UnsafeFile(f"unsafe ramdisk: {e}") from None
            except (OSError, ValueError, TypeError) as e:
                # Frozen but never recorded: the commit did not finish before a crash.
                log.warning("dropping step %d, its state is unreadable (%s)", step, e)
                trash = self.snapshots.drop(step)
                if trash is not None:
                    shutil.rmtree(trash, ignore_errors=True)

    def save(self, state: StepState) -> None:
        path = self.snapshots.step_dir(state.step) / "state.json"
        write_atomically(path, json.dumps(asdict(state), sort_keys=True), 0o600)

    # -- commits -----------------------------------------------------------------------

    def file_done(self, path: str) -> None:
        self._commit_quietly(self.rules.file_done(path))

    def dir_renamed(self, path: str) -> None:
        self._commit_quietly(self.rules.dir_renamed(path))

    def _commit_quietly(self, root: str | None) -> None:
        """A commit the job did not ask for must not fail the close or rename that caused it."""
        if root is None:
            return
        try:
            self.commit(root)
        except Exception:
            log.exception("could not commit %s; it stays uncommitted", root)

    def commit(self, root: str, step: int | None = None) -> StepState | None:
        """Freeze ``root`` (relative to the volume root) as part of ``step`` (default: from its name)."""
        if step is None:
            step = step_of(root)
        if step is None:
            step = max(self.states, default=0) + 1
        if step in self.restoring:
            log.warning("commit of %s into step %d ignored: that step is still being restored", root, step)
            return None
        born = self.snapshots.freeze(step, root, self._writing())
        if born is None:
            log.warning("commit of %s: it is gone", root)
            return None
        state = self.states.get(step)
        if state is None:
            state = self.states[step] = StepState(step, [root], time.time())
            self.recent.append((state.committed_at, max(0.0, state.committed_at - born) if born else 0.0))
        else:
            state.add_root(root)
            state.version += 1
            state.committed_at = time.time()
        self.save(state)
        self.commits += 1
        log.info(
            "committed step %d: %s (version %d)", step, root, state.version, extra={"event": "committed", "step": step}
        )
        self.on_commit(state)
        return state

    # -- queries and retention ---------------------------------------------------------

    def newest(self) -> StepState | None:
        """The newest step a tier can take: one whose current version is refused is passed over."""
        fit = [step for step, state in self.states.items() if state.refusal() is None]
        return self.states[max(fit)] if fit else None

    def verifiable(self) -> list[int]:
        """Committed steps whose manifest is beside their snapshot, oldest first.

        This node vouches for these itself, with no other node's word: committed here and
        hashed into a manifest (the replicator writes it once the step's writes settle; a
        restore, before its first byte, and the step commits only once every chunk matched
        it). What another node says about the job never removes the newest of them.
        """
        return sorted(s for s in self.states if (self.snapshots.step_dir(s) / "manifest.json").is_file())

    def drop(self, step: int) -> Path | None:
        """Forget a step; returns what is left to delete (see :meth:`Snapshots.drop`)."""
        self.states.pop(step, None)
        log.info("dropped local snapshot of step %d", step)
        return self.snapshots.drop(step)
