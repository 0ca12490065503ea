"""What the daemon asks of the host around a mount: file limits, logging, read-ahead, a free port.

Kept apart from the composition root because none of it is a part of the volume: each is a
system call or two whose failure is either a start-up error or only slower I/O.
"""

from __future__ import annotations

import logging
import os
import resource
import socket

from tierfs.config import Config
from tierfs.core import logs, mounts
from tierfs.core.errors import UserError

log = logging.getLogger(__name__)

READ_AHEAD_KB = 1024  # the kernel's default of 128 KiB halves sequential read speed


def report(fd: int | None, message: str) -> None:
    """Tell whoever started the daemon (``tierfs mount``) that it is ready, or why it is not."""
    if fd is not None:
        try:
            os.write(fd, message.encode() + b"\n")
            os.close(fd)
        except OSError:
            pass


def setup_logging(cfg: Config, rotate: bool = True) -> None:
    """Log to stderr, which is the mount's log file unless the daemon runs in the foreground.

    ``rotate``: this process (the daemon, not its keeper) rotates the file past
    ``--log-max-size``; every process follows the newest file (:mod:`tierfs.core.logs`).
    Called again in the daemon, forked from its keeper: the keeper's handler is replaced.
    """
    path = None if cfg.foreground else cfg.log_file or mounts.Registration(cfg.mountpoint).log_path
    handler = logs.LogFile(path, cfg.log_max_size if rotate else 0)
    handler.setFormatter(logs.formatter(cfg.log_format, job=cfg.job, rank=cfg.rank))
    logging.basicConfig(handlers=[handler], level=cfg.log_level.upper(), force=True)
    if path is not None:
        logs.follow(path)  # a successor forked by a keeper that has not followed a rotation yet


def raise_fd_limit() -> None:
    """One O_PATH descriptor per inode the kernel caches: allow as many as the host does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1 << 20, 1 << 20))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def check_listen(address: tuple[str, int]) -> None:
    """Fail before mounting if the peer service could not listen (the server binds it later)."""
    try:
        with socket.create_server(address, reuse_port=False) as _:
            pass
    except OSError as e:
        raise UserError(
            f"cannot listen on {address[0]}:{address[1]} for peers ({e.strerror or e}): pick a free --listen address"
        ) from None


def set_read_ahead(mountpoint) -> None:
    # Never stat() the mountpoint here: the request would wait for this very daemon.
    entry = mounts.find_mount(mountpoint)
    if entry is None:  # unmounted already: the daemon is about to stop, and there is nothing to tune
        log.info("%s was unmounted before its read-ahead was raised", mountpoint)
        return
    try:
        minor = entry.minor
        with open(f"/sys/class/bdi/0:{minor}/read_ahead_kb", "w") as f:
            f.write(str(READ_AHEAD_KB))
    except OSError as e:  # not fatal: only slower reads
        log.warning("could not raise read-ahead of %s: %s", mountpoint, e)
