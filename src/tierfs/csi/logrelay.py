"""The daemons' logs on the plugin's stdout, where ``kubectl logs`` and log collectors look.

Each job's daemon writes ``<state_dir>/logs/<job>.log`` itself, not through a pipe to the
plugin: a daemon outlives the plugin (an upgrade of the plugin must not touch a running
mount), and a pipe would end with it. So the plugin tails the files: every
:data:`POLL_EVERY` seconds one thread reads what each file gained and writes it, line by
line, to stdout, prefixed ``job=<job>`` in the text format, and as it is (the line names
its job and rank) in the JSON format.

The daemon rotates its file (:mod:`tierfs.core.logs`). The relay keeps the file it reads
open, so when the path names a new file (another inode) it finishes the old one through
its descriptor, whatever it is called by now, then reads the next newer one from its start
(``.1`` if the file was rotated twice between two passes, else the new file); a file that
shrank was truncated in place and is read again from its start. A plugin that starts
begins at the end of every file there (what is in them was relayed by the plugin before
it, or predates it); a file that appears later is read from its start.

Bounded: at most :data:`MAX_READ` bytes of one file per pass, lines cut at
:data:`MAX_LINE` bytes, and a file more than :data:`MAX_BEHIND` bytes ahead of the relay is
skipped ahead (with a line saying so), so that a daemon logging at debug level can neither
stall the plugin nor keep a rotated file's space held by an open descriptor for long.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from tierfs.core.logs import LOG_BACKUPS

log = logging.getLogger("tierfs.csi")

POLL_EVERY = 0.5  # seconds between passes
MAX_READ = 1 << 20  # bytes read from one file in one pass
MAX_LINE = 16 << 10  # bytes of one line relayed; the rest of it is dropped
MAX_BEHIND = 64 << 20  # a file this far ahead of the relay is skipped to its end
STOP_TIMEOUT = 10.0  # seconds stop() waits for a pass under way (stdout may be a full pipe)


@dataclass
class _Tail:
    """One log file being followed: its open descriptor, where the relay is in it, a line begun."""

    job: str
    fd: int
    ino: tuple[int, int]
    offset: int
    pending: bytearray = field(default_factory=bytearray)
    cutting: bool = False  # dropping the rest of a line cut at MAX_LINE


class LogRelay:
    """Relays ``<log_dir>/*.log`` to ``out`` (stdout) from a thread of its own: :meth:`start`, :meth:`stop`."""

    def __init__(self, log_dir: Path, log_format: str = "text", out: TextIO | None = None, every: float = POLL_EVERY):
        self.log_dir = Path(log_dir)
        self.json = log_format == "json"
        self.out = out
        self.every = every
        self._tails: dict[str, _Tail] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing: str | None = None  # the last pass's error, logged once

    def start(self) -> None:
        """Begin at the end of every log there now; then relay from a thread until :meth:`stop`."""
        self._scan(at_end=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="log-relay", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread after a last pass (what the daemons wrote until now), and close every file."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT)
            if self._thread.is_alive():  # blocked on a stdout nobody reads: it ends with the process
                log.warning("the log relay did not stop within %.0fs: stdout is not read", STOP_TIMEOUT)
                return
            self._thread = None
        for tail in self._tails.values():
            os.close(tail.fd)
        self._tails.clear()

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(self.every)
            try:
                self.poll()
                self._failing = None
            except Exception as e:  # noqa: BLE001 (the next pass may work: the relay must not die)
                if str(e) != self._failing:
                    log.warning("relaying the daemons' logs from %s failed: %s", self.log_dir, e)
                self._failing = str(e)
            if stopping:
                return

    def poll(self) -> None:
        """One pass: relay what every file gained since the last one."""
        lines: list[str] = []
        self._scan(at_end=False)
        for name in list(self._tails):
            self._read(name, lines)
        if lines:
            out = self.out or sys.stdout
            out.write("".join(lines))
            out.flush()

    def _scan(self, at_end: bool) -> None:
        """Follow the files not followed yet: from their end (at start) or their beginning."""
        try:
            names = [e.name for e in os.scandir(self.log_dir) if e.name.endswith(".log") and e.is_file()]
        except FileNotFoundError:
            return
        for name in names:
            if name not in self._tails and (tail := self._open(name, name[: -len(".log")])) is not None:
                if at_end:
                    self._skip_to_end(tail)
                self._tails[name] = tail

    def _open(self, file_name: str, job: str) -> _Tail | None:
        try:
            fd = os.open(self.log_dir / file_name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # gone meanwhile, or not a file to read
            return None
        st = os.fstat(fd)
        return _Tail(job, fd, (st.st_dev, st.st_ino), 0)

    @staticmethod
    def _skip_to_end(tail: _Tail) -> None:
        """To the end of the file; a line written halfway is dropped, not relayed from its middle."""
        tail.offset = os.fstat(tail.fd).st_size
        tail.pending.clear()
        tail.cutting = tail.offset > 0 and os.pread(tail.fd, 1, tail.offset - 1) != b"\n"

    def _inode(self, file_name: str) -> tuple[int, int] | None:
        try:
            st = os.stat(self.log_dir / file_name, follow_symlinks=False)
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def _read(self, name: str, lines: list[str]) -> None:
        """Relay what ``name`` gained; once the file read is rotated away and finished, go on to the next."""
        tail = self._tails[name]
        current = self._inode(name)  # None: removed, or between the rename and the new file of a rotation
        size = os.fstat(tail.fd).st_size
        if current == tail.ino and size < tail.offset:
            tail.offset = 0  # truncated in place: what it holds now is new
            tail.pending.clear()
        if size - tail.offset > MAX_BEHIND:
            lines.append(
                self._line(
                    tail.job,
                    f"tierfs csi: skipped {size - tail.offset} bytes of {name}: "
                    "the daemon logs faster than the plugin relays",
                )
            )
            self._skip_to_end(tail)
        budget = MAX_READ - self._take(tail, MAX_READ, lines)
        if current == tail.ino or tail.offset < size:
            return  # the file at the path, or an older one not finished yet
        if tail.pending:  # the old file's last line had no newline: it will get none
            self._emit(tail, bytes(tail.pending), lines, cut=False)
        os.close(tail.fd)
        del self._tails[name]
        if (new := self._successor(name, tail)) is not None:
            self._tails[name] = new
            self._take(new, budget, lines)

    def _successor(self, name: str, old: _Tail) -> _Tail | None:
        """The file written after ``old``, opened: the next newer of ``name.3`` .. ``name.1``, ``name``
        (several rotations between two passes); ``name`` itself if ``old`` is none of them.
        None if there is none yet: the next pass finds the new file and reads it from its start."""
        chain = [f"{name}.{n}" for n in range(LOG_BACKUPS, 0, -1)] + [name]  # oldest first
        inodes = [self._inode(c) for c in chain]
        after = inodes.index(old.ino) + 1 if old.ino in inodes else len(chain) - 1
        for file_name in chain[after:]:
            if (new := self._open(file_name, old.job)) is not None:
                return new
        return None

    def _take(self, tail: _Tail, budget: int, lines: list[str]) -> int:
        """Read up to ``budget`` bytes from where the relay is; the bytes read."""
        data = os.pread(tail.fd, budget, tail.offset) if budget > 0 else b""
        tail.offset += len(data)
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            piece = data[start:end]
            start = end + 1
            if tail.cutting:  # the end of a line already cut
                tail.cutting = False
                continue
            line = bytes(tail.pending) + piece if tail.pending else piece
            tail.pending.clear()
            self._emit(tail, line, lines, cut=len(line) > MAX_LINE)
        if not tail.cutting:
            tail.pending += data[start:]
            if len(tail.pending) > MAX_LINE:
                self._emit(tail, bytes(tail.pending), lines, cut=True)
                tail.pending.clear()
                tail.cutting = True
        return len(data)

    def _emit(self, tail: _Tail, line: bytes, lines: list[str], cut: bool) -> None:
        text = line[:MAX_LINE].decode(errors="replace").rstrip("\r")
        if text or cut:
            lines.append(self._line(tail.job, text, cut))

    def _line(self, job: str, text: str, cut: bool = False) -> str:
        """One relayed line, with its newline."""
        if not self.json:
            return f"job={job} {text}{f' [cut at {MAX_LINE >> 10} KiB]' if cut else ''}\n"
        if not cut and text.startswith("{"):
            try:
                if isinstance(json.loads(text), dict):
                    return text + "\n"
            except ValueError:
                pass
        return json.dumps({"job": job, "message": text, **({"cut": True} if cut else {})}, ensure_ascii=False) + "\n"
