"""A mount's FUSE connection as a daemon gets it from the keeper: a ``/dev/fuse`` descriptor
to mount with, or, for a successor, a live connection and what the daemon before it left."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import trio

from tierfs.config import Config
from tierfs.core.errors import UserError
from tierfs.daemon.keeper import replace_keeper
from tierfs.fs.recovery import SessionState, Taken, reopen_handles
from tierfs.fs.session import KernelSession
from tierfs.ramtier import RankDir

log = logging.getLogger("tierfs")


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
                raise UserError(
                    "the daemon before used tierfs' own FUSE engine: take over with the same --engine and --data-path"
                )
            return
        if self.record is None:
            self.record = SessionState(rank.session, rank.tree)
            self.record.start()
        elif self.taken.init["passthrough"] != passthrough:
            raise UserError(
                "the daemon before served the mount on another data path: take over with the same --data-path"
            )
        engine.record = ops.record = ops.inodes.record = self.record

    async def watch_keeper(self, mountpoint: str, registered: Callable[[], None]) -> None:
        """Should the keeper die, start another (and say so with ``registered``): the keeper
        alone would start a successor if this daemon died."""
        while True:
            try:
                pidfd = os.pidfd_open(self.keeper)
            except ProcessLookupError:
                pidfd = None
            if pidfd is not None:
                try:
                    await trio.lowlevel.wait_readable(pidfd)
                finally:
                    os.close(pidfd)
            log.warning("the keeper of %s (pid %d) is gone: starting another one", mountpoint, self.keeper)
            self.keeper = replace_keeper(self.fd)
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
    def take_over(cls, cfg: Config, fd: int, ready_fd: int) -> tuple[Connection, int]:
        """The connection of a daemon that died, its handles reopened before anything else
        here opens a descriptor (:func:`reopen_handles`); and where ``ready_fd`` is now."""
        rank = RankDir(cfg.rank_dir)
        record = SessionState(rank.session, rank.tree)
        try:
            taken = record.take_over()
        except (OSError, ValueError, UserError) as e:
            raise UserError(
                f"cannot take over the FUSE connection of {cfg.mountpoint}: its record in "
                f"{record.dir} is unreadable ({e})"
            ) from None
        moved = reopen_handles(record, taken, {"ready": ready_fd, "fuse": fd})
        return cls(moved["fuse"], record, taken), moved["ready"]
