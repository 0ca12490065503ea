"""A mount's FUSE connection as a daemon gets it from the keeper: a ``/dev/fuse`` descriptor
to mount with, or, for a successor, a live connection and what the daemon before it left.

The daemon puts its mount in place here (:meth:`Connection.mount`, :meth:`Connection.resume`):
with the engine that can, on the connection it was given.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import trio

from tierfs.config import Config
from tierfs.core.errors import UserError
from tierfs.daemon.keeper import replace_keeper
from tierfs.fs import Operations
from tierfs.fs.engine import Pyfuse3Engine, fallback_engine
from tierfs.fs.recovery import SessionState, Taken, reopen_handles
from tierfs.fs.session import KernelSession
from tierfs.ramtier import RankDir

log = logging.getLogger("tierfs")

Engine = KernelSession | Pyfuse3Engine  # what serves a mount (tierfs.fs.engine)
OWN_ENGINE_ONLY = "the daemon before used tierfs' own FUSE engine: take over with the same --engine and --data-path"


class Connection:
    """The mount's ``/dev/fuse`` descriptor, which the keeper holds too, and, in a successor,
    what the daemon before it left: its record and the handles it gave the kernel."""

    def __init__(self, fd: int | None = None, record: SessionState | None = None, taken: Taken | None = None):
        self.fd, self.record, self.taken = fd, record, taken
        self.keeper = os.getppid() if fd is not None else None  # the process holding the connection too

    def keep_record(self, engine, ops, rank: RankDir, passthrough: bool) -> None:
        """Where the keeper holds the connection, have the engine and the handlers keep what a
        successor needs to take it over (a successor: the record it took over, kept on)."""
        if self.fd is None or not isinstance(engine, KernelSession):
            if self.taken is not None:
                raise UserError(OWN_ENGINE_ONLY)
            return
        if self.record is None:
            self.record = SessionState(rank.session, rank.tree)
            self.record.start()
        elif self.taken is not None and self.taken.init["passthrough"] != passthrough:
            raise UserError(
                "the daemon before served the mount on another data path: take over with the same --data-path"
            )
        engine.record = self.record
        ops.keep_record(self.record)

    def mount(self, engine: Engine, cfg: Config) -> Engine:
        """Mount ``cfg.mountpoint`` served by ``engine``, on this connection where the keeper holds
        one; the engine that serves it: pyfuse3 where the own engine's ``mount(2)`` was refused
        (:func:`~tierfs.fs.engine.fallback_engine`). UserError, in one line, if none can."""
        try:
            try:
                if isinstance(engine, KernelSession):
                    engine.mount(str(cfg.mountpoint), cfg.job, cfg.read_only, fd=self.fd)
                else:
                    engine.mount(str(cfg.mountpoint), cfg.job, cfg.read_only)
            except OSError as e:
                if (fallback := fallback_engine(engine, cfg.engine, e)) is None:
                    raise
                engine = fallback
                engine.mount(str(cfg.mountpoint), cfg.job, cfg.read_only)
        except OSError as e:
            raise UserError(f"could not mount {cfg.mountpoint}: {e.strerror or e} (see the log)") from None
        return engine

    def resume(self, engine: Engine, ops: Operations, mountpoint: str) -> int | None:
        """A successor: serve the live connection with ``engine``, and the handles the daemon before
        gave the kernel with ``ops``; how many it took over (None: this daemon is no successor)."""
        if self.taken is None:
            return None
        if self.fd is None or not isinstance(engine, KernelSession):  # refused before, by keep_record
            raise UserError(OWN_ENGINE_ONLY)
        engine.take_over(self.fd, mountpoint, self.taken.init)
        ops.take_over(self.taken.handles)
        return len(self.taken.handles)

    async def watch_keeper(self, mountpoint: str, registered: Callable[[], None]) -> None:
        """Should the keeper die, start another (and say so with ``registered``): the keeper
        alone would start a successor if this daemon died. Without a keeper, nothing to watch."""
        fd, keeper = self.fd, self.keeper
        if fd is None or keeper is None:
            return
        while True:
            try:
                pidfd = os.pidfd_open(keeper)
            except ProcessLookupError:
                pidfd = None
            if pidfd is not None:
                try:
                    await trio.lowlevel.wait_readable(pidfd)
                finally:
                    os.close(pidfd)
            log.warning("the keeper of %s (pid %d) is gone: starting another one", mountpoint, keeper)
            self.keeper = keeper = replace_keeper(fd)
            registered()

    def report(self) -> dict:
        """For status: who keeps the connection, and whether this daemon took it over."""
        return {
            "keeper": self.keeper,
            "kept": self.record is not None,
            "taken_over": self.taken is not None,
            "handles_taken_over": len(self.taken.handles) if self.taken is not None else 0,
        }

    @classmethod
    def take_over(cls, cfg: Config, fd: int, ready_fd: int | None) -> tuple[Connection, int | None]:
        """The connection of a daemon that died, its handles reopened before anything else
        here opens a descriptor (:func:`reopen_handles`); and where ``ready_fd`` (if any) is now."""
        rank = RankDir(cfg.rank_dir)
        record = SessionState(rank.session, rank.tree)
        try:
            taken = record.take_over()
        except (OSError, ValueError, UserError) as e:
            raise UserError(
                f"cannot take over the FUSE connection of {cfg.mountpoint}: its record in "
                f"{record.dir} is unreadable ({e})"
            ) from None
        keep = ({"ready": ready_fd} if ready_fd is not None else {}) | {"fuse": fd}
        moved = reopen_handles(record, taken, keep)
        return cls(moved["fuse"], record, taken), moved.get("ready")
