"""Commit rules: how tierfs knows that a checkpoint is complete.

Frameworks never tell a filesystem "this step is done"; each has a last act instead. The
rules below recognise those acts from the operations the mount sees:

``dir:GLOB``     a directory is renamed to a name matching GLOB (Orbax ``<step>.orbax-
                 checkpoint-tmp`` -> ``<step>``, NeMo ``step=<N>`` -> ``<N>``): the
                 directory is the checkpoint.
``marker:GLOB``  a file matching GLOB is closed after writing, or renamed into place
                 (``commit_success.txt``, DCP ``.metadata``, ``_CHECKPOINT_METADATA``, HF
                 ``trainer_state.json``): the directory holding it is the checkpoint.
``file:GLOB``    a file matching GLOB is closed after writing, or renamed into place
                 (``*.pt``, ``*.ckpt``, ``*.safetensors``): the file is the checkpoint.

Anything else commits explicitly: ``tierfs commit PATH`` (root, on the node), or, from
inside a pod running as any user, closing a file named ``.tierfs-commit`` in the
directory to commit.

Paths with a component that looks temporary (``tmp``, ``temp``, ``partial``,
``incomplete``, ``in-progress``) never commit, so a marker written inside Orbax's
``.orbax-checkpoint-tmp`` directory waits for the final rename.

A checkpoint belongs to a step: a labelled number in its path, else its last number
(``ckpt/500`` -> 500, ``checkpoint-500/model-00001-of-00002.safetensors`` -> 500,
``epoch=1-step=200.ckpt`` -> 200; see :func:`step_of`). Checkpoints without a
number get the step after the newest one. Several checkpoints of one step (an HF
directory's ``model.safetensors`` and then its ``trainer_state.json``) form one step.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from tierfs.core.errors import UserError

KINDS = ("dir", "marker", "file")
DEFAULT_RULES = (
    "dir:*[0-9]*",
    "marker:commit_success.txt",
    "marker:.metadata",
    "marker:_CHECKPOINT_METADATA",
    "marker:trainer_state.json",
    "marker:.tierfs-commit",
    "file:*.ckpt",
    "file:*.pt",
    "file:*.safetensors",
)
_TEMPORARY = re.compile(r"tmp|temp|partial|incomplete|in[-_]?progress", re.IGNORECASE)
_NUMBER = re.compile(r"\d+")
_STEP_LABEL = re.compile(r"(?:^|[^a-z])(?:global_step|step|checkpoint|ckpt|iter|iteration)[-_=]?(\d+)", re.IGNORECASE)
_NOT_A_STEP = re.compile(r"\d+-of-\d+|(?:rank|shard|part|node)[-_]?\d+|__\d+(?:_\d+)*", re.IGNORECASE)


@dataclass(frozen=True)
class Rule:
    kind: str
    pattern: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.pattern}"


def parse_rules(text: str) -> tuple[Rule, ...]:
    """Parse ``--commit-rule``: comma-separated rules; ``default`` adds the defaults, ``none`` is none."""
    rules: list[Rule] = []
    for item in filter(None, (s.strip() for s in str(text).split(","))):
        if item == "default":
            rules.extend(parse_rules(",".join(DEFAULT_RULES)))
            continue
        if item == "none":
            continue
        kind, sep, pattern = item.partition(":")
        if not sep or kind not in KINDS or not pattern or "/" in pattern:
            raise UserError(
                f"invalid commit rule {item!r}: use dir:GLOB, marker:GLOB or file:GLOB "
                "(a file-name pattern), 'default' or 'none'"
            )
        rules.append(Rule(kind, pattern))
    return tuple(dict.fromkeys(rules))


def step_of(root: str) -> int | None:
    """The step a checkpoint path names.

    A labelled number wins (``step_120``, ``step=100-consumed_samples=800.0``,
    ``checkpoint-500``, ``iter_0000300``), nearest the end first; otherwise the last number,
    searching from the last component. Shard and rank numbers (``model-00001-of-00002``,
    ``rank-3``, ``shard_2``) are never steps: a wrong step that is newer than the real one
    is what a restore would pick.
    """
    parts = root.split("/")
    for part in reversed(parts):
        labelled = _STEP_LABEL.findall(part)
        if labelled:
            return int(labelled[-1])
    for part in reversed(parts):
        numbers = _NUMBER.findall(_NOT_A_STEP.sub("", part))
        if numbers:
            return int(numbers[-1])
    return None


def _temporary(path: str) -> bool:
    return any(_TEMPORARY.search(part) for part in path.split("/"))


class CommitRules:
    """Decides which path, if any, an operation commits (a path relative to the volume root)."""

    def __init__(self, rules: tuple[Rule, ...]):
        self.rules = rules
        # One expression per kind: this runs at every close after writing.
        self._by_kind = {
            k: re.compile("|".join(fnmatch.translate(r.pattern) for r in rules if r.kind == k) or "(?!)") for k in KINDS
        }

    def _matches(self, kind: str, name: str) -> bool:
        return self._by_kind[kind].match(name) is not None

    def dir_renamed(self, path: str) -> str | None:
        name = path.rpartition("/")[2]
        if self._matches("dir", name) and not _temporary(path):
            return path
        return None

    def file_done(self, path: str) -> str | None:
        """A file was closed after writing, or renamed into ``path``."""
        parent, _, name = path.rpartition("/")
        if self._matches("marker", name) and parent and not _temporary(parent):
            return parent
        if self._matches("file", name) and not _temporary(path):
            return path
        return None
