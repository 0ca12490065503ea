"""The plugin's locks: a short node-wide one for bookkeeping, and one per job for its work.

Starting a job's daemon can take minutes (``restore-wait`` for silent peers, a restore
plan), and nothing another job does may wait for that. So the work on one job (its
daemon, its mounts, its records) is done under that job's lock alone, and the node-wide
lock is only ever held for the few file reads and writes that must see every job at
once: counting the jobs and their capacities against the ceilings and claiming a place
among them. It is never held across a process, a mount or a network call, and it is
always taken after a job's lock, never before, so the two cannot deadlock.

Both are a thread lock (the plugin's gRPC threads) and an ``flock`` (other processes: the
next plugin during a rolling update, ``tierfs csi --gc``). The node-wide one is the
``state_dir/lock`` file every plugin version has used; a job's is
``state_dir/locks/<job>.lock``, root-only like the rest of the state.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600
POLL = 0.02  # seconds between tries of another process's flock while a bounded wait lasts


class Busy(Exception):
    """The job's lock stayed taken for the whole wait: another call is working on the job."""


class StateLocks:
    def __init__(self, state_dir: Path):
        self.state_dir = state_dir
        self.dir = state_dir / "locks"
        self.dir.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
        os.chmod(self.dir, PRIVATE_DIR)
        self._node = threading.Lock()
        self._guard = threading.Lock()
        # A lock lives while a call holds or waits for it: job ids come and go for months.
        self._jobs: weakref.WeakValueDictionary[str, threading.Lock] = weakref.WeakValueDictionary()

    @contextmanager
    def node(self) -> Iterator[None]:
        """Bookkeeping that must see every job at once; held for file reads and writes only."""
        with self._node, _flocked(self.state_dir / "lock", None):
            yield

    @contextmanager
    def job(self, job: str, wait: float | None = None) -> Iterator[None]:
        """The work on one job; raises :class:`Busy` if another call holds it for ``wait`` seconds."""
        with self._guard:
            lock = self._jobs.get(job)
            if lock is None:
                lock = self._jobs[job] = threading.Lock()
        deadline = None if wait is None else time.monotonic() + wait
        if not lock.acquire(timeout=-1 if wait is None else wait):
            raise Busy(job)
        try:
            with _flocked(self.path(job), deadline):
                yield
        finally:
            lock.release()

    def path(self, job: str) -> Path:
        return self.dir / f"{job}.lock"

    def forget(self, job: str) -> None:
        """Remove a collected job's lock file; call with the job's lock held.

        A process waiting on the old file finds, once it gets it, that the path names
        another file now, and starts over on the new one (:func:`_flocked`).
        """
        self.path(job).unlink(missing_ok=True)


@contextmanager
def _flocked(path: Path, deadline: float | None) -> Iterator[None]:
    """An exclusive flock of ``path``, waiting until ``deadline`` (monotonic; None: for ever)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE)
        try:
            _lock(fd, path, deadline)
            if _same_file(fd, path):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed while we waited (a collected job): lock the file there now
    try:
        os.fchmod(fd, PRIVATE_FILE)
        yield
    finally:
        os.close(fd)


def _lock(fd: int, path: Path, deadline: float | None) -> None:
    if deadline is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        if time.monotonic() >= deadline:
            raise Busy(path.stem)
        time.sleep(POLL)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
