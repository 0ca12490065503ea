"""Small files replaced whole: written beside their final name, then renamed over it.

A reader, or a restart after a crash, sees the old content or the new, never half of
either. The file gets ``mode`` from its creation on, so a secret is never readable by
others, even for a moment.
"""

from __future__ import annotations

import os
from pathlib import Path


def temporary_name(path: Path) -> Path:
    """Where ``path``'s next content is written first (``tmp`` in it: never a commit)."""
    return path.with_name(f".tmp.{path.name}")


def write_atomically(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = temporary_name(path)
    tmp.unlink(missing_ok=True)  # a crash's leftover would keep its own mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    with open(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
