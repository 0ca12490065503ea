"""What a restore keeps in its step's directory, so that a daemon killed mid-restore resumes it.

``restore.json`` says how far the step's preparation got (placeholders made, linked into
the volume) and which tiers it came from; ``restored-chunks`` names the chunks written and
verified, one per line. Apart from :mod:`tierfs.pipeline.restore` because more than the
running restore reads them: at start, planning (:mod:`tierfs.pipeline.planning`) finds the
restores a previous run left unfinished. Both are the daemon's own files, read as such: one
that is not (planted, or a link) is refused as :class:`~tierfs.core.atomic.UnsafeFile`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TextIO

from tierfs.core.atomic import UnsafeFile, read_state, write_atomically
from tierfs.core.manifest import MAX_CHUNKS
from tierfs.ramtier.steps import Steps

STATE_FILE = "restore.json"  # present while the step is being restored
JOURNAL = "restored-chunks"  # names of the chunks written and verified, one per line
STATE_LIMIT = 1 << 20  # restore.json: a step number, two flags and the peers it came from
JOURNAL_LIMIT = MAX_CHUNKS * 33  # one 32-digit name and a newline per chunk of the largest manifest


def read_progress(step_dir: Path) -> dict[str, Any] | None:
    """The progress of an interrupted restore of the step in ``step_dir``; None if there is none to resume.

    Raises UnsafeFile (a UserError) if the file is not the daemon's own: it decides what
    this start deletes and links into the volume.
    """
    try:
        state = json.loads(read_state(step_dir / STATE_FILE, STATE_LIMIT))
    except UnsafeFile as e:
        raise UnsafeFile(f"unsafe ramdisk: {e}") from None
    except (OSError, ValueError):
        return None
    if not (
        isinstance(state, dict) and isinstance(state.get("prepared"), bool) and isinstance(state.get("linked"), bool)
    ):
        return None  # not what write_progress writes: start the step over
    return state


def write_progress(step_dir: Path, state: dict[str, Any]) -> None:
    write_atomically(step_dir / STATE_FILE, json.dumps(state))


def journal_path(step_dir: Path) -> Path:
    return step_dir / JOURNAL


def read_journal(step_dir: Path) -> set[str] | None:
    """The chunks an interrupted restore wrote and verified; None if it left no journal."""
    try:
        return set(read_state(journal_path(step_dir), JOURNAL_LIMIT).decode("ascii", "replace").split())
    except FileNotFoundError:
        return None
    except UnsafeFile as e:
        raise UnsafeFile(f"unsafe ramdisk: {e}") from None


def open_journal(step_dir: Path) -> TextIO:
    """The journal, to append each chunk's name to once it is in: line-buffered, so each line is written at once."""
    fd = os.open(journal_path(step_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return open(fd, "a", buffering=1)


def finished(step_dir: Path) -> None:
    """The step is in: nothing is left to resume."""
    (step_dir / STATE_FILE).unlink()
    journal_path(step_dir).unlink(missing_ok=True)


def restoring_steps(steps: Steps) -> list[int]:
    """Steps a previous run began to restore and did not finish."""
    return [s for s in steps.snapshots.steps() if (steps.snapshots.step_dir(s) / STATE_FILE).exists()]
