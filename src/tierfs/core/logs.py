"""Log lines as operators read them: text or JSON, in a file that rotates under its writers.

A mount's log file has several writers at once, each with the file on its stdout and
stderr (where a traceback lands, and libfuse's messages): the keeper, its daemon, and for
a moment a successor (``tierfs upgrade``, a CSI plugin's rollout). Renaming a file does
not move anyone's descriptor, so the scheme is: only the daemon rotates (:class:`LogFile`
with ``max_size``), under an ``flock`` of the file it renames, and only when that file is
still the one at the path; every writer, the daemon included, checks now and then whether
the path names another file than its stderr, and if so puts the file at the path on its
stdout and stderr (:func:`follow`). So lines go to the newest file, and none is lost:
a line written to a file just renamed is in ``.1``.

The JSON format is one object per line, so that a log collector needs no parser of ours.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TextIO

LOG_FORMATS = ("text", "json")
LOG_BACKUPS = 3  # rotated files kept: <log>.1 (the newest) to <log>.3
DEFAULT_MAX_SIZE = 64 << 20
MIN_MAX_SIZE = 16 << 10  # below, a rotation every few lines: nothing to read in one file
TEXT_FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"
FOLLOW_EVERY = 1.0  # seconds between checks whether the path names a newer file
ROTATE_RETRY = 60.0  # seconds before a failed rotation is tried again

# What every LogRecord carries; anything else on one came from a call's extra=.
_RECORD_FIELDS = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (RFC 3339, UTC), level, logger, message, the process's
    ``fields`` (a daemon's job and rank), pid, the call's ``extra=`` fields, and exc if any."""

    def __init__(self, **fields: object) -> None:
        super().__init__()
        self.fields = fields

    def format(self, record: logging.LogRecord) -> str:
        when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = {
            "time": f"{when}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **self.fields,
            "pid": record.process,
        }
        for key, value in record.__dict__.items():
            if key not in _RECORD_FIELDS and not key.startswith("_"):
                line.setdefault(key, value)  # never over what every line has
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, ensure_ascii=False)


def formatter(log_format: str, **fields: object) -> logging.Formatter:
    """The formatter of ``--log-format`` (``fields``: what each JSON line names, e.g. job and rank)."""
    return JsonFormatter(**fields) if log_format == "json" else logging.Formatter(TEXT_FORMAT)


class LogFile(logging.StreamHandler[TextIO]):
    """Records to stderr, which is the log file at ``path`` (None: stderr is no file of ours).

    With ``max_size`` this process rotates the file once a record takes it past that size;
    without, it only follows rotations made by another process."""

    def __init__(self, path: Path | None, max_size: int = 0):
        super().__init__(sys.stderr)
        self.path = path
        self.max_size = max_size
        self._next_check = 0.0
        self._rotate_after = 0.0  # after a failed rotation, the next try waits

    def emit(self, record: logging.LogRecord) -> None:
        now = time.monotonic()
        if self.path is not None and now >= self._next_check:
            self._next_check = now + FOLLOW_EVERY
            follow(self.path)
        super().emit(record)
        if self.path is not None and self.max_size and now >= self._rotate_after:
            try:
                if os.fstat(2).st_size >= self.max_size:
                    rotate(self.path, self.max_size)
            except OSError as e:  # a full disk, say: keep writing where it goes, try again later
                self._rotate_after = now + ROTATE_RETRY
                sys.stderr.write(
                    f"tierfs: cannot rotate {self.path}: {e.strerror or e}; trying again in {ROTATE_RETRY:.0f}s\n"
                )


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def follow(path: Path) -> None:
    """Put the file at ``path`` on stdout and stderr if they hold another one (rotated away)."""
    try:
        if not _same(os.stat(path), os.fstat(2)):
            reopen(path)
    except OSError:  # gone for a moment (mid-rotation) or for good: keep what is open
        pass


def reopen(path: Path) -> None:
    """Open (or create, root-only) the log at ``path`` as this process's stdout and stderr."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def rotate(path: Path, max_size: int, backups: int = LOG_BACKUPS) -> None:
    """Rename ``path`` to ``path.1`` (``.1`` to ``.2``..., the oldest dropped) and write a new one.

    Only if the file at ``path`` is this process's stderr and still past ``max_size`` once
    locked: another rotator (a successor that started meanwhile) may have rotated it
    already, and then this one only follows."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:  # removed by hand: start a new one
        reopen(path)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the close below
        here = os.fstat(fd)
        if not (_same(here, os.stat(path)) and _same(here, os.fstat(2)) and here.st_size >= max_size):
            follow(path)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        for n in range(backups - 1, 0, -1):
            try:
                os.replace(f"{path}.{n}", f"{path}.{n + 1}")
            except FileNotFoundError:
                pass
        os.replace(path, f"{path}.1")
        reopen(path)
    finally:
        os.close(fd)
