"""A daemon process, as its keeper runs it: one :class:`~tierfs.daemon.daemon.Daemon` from its
start until its mount ends, and the exit status that tells the keeper what came of it.

Apart from the composition root because it builds no part: it is the process around one
(the collector frozen, the log set up, a successor's connection taken over first), and how
a failed start reaches whoever mounted: one line on the ready descriptor, after the log.
"""

from __future__ import annotations

import gc
import logging

import trio

from tierfs.config import Config
from tierfs.core.errors import UserError
from tierfs.daemon import host
from tierfs.daemon.connection import Connection
from tierfs.daemon.daemon import Daemon
from tierfs.daemon.keeper import CANNOT_TAKE_OVER, HANDOVER

log = logging.getLogger("tierfs")


def run(cfg: Config, ready_fd: int | None, fuse_fd: int, takeover: bool = False) -> int:
    """Run a daemon in this process until unmounted; report readiness on ``ready_fd``.

    ``fuse_fd``: the keeper's ``/dev/fuse`` descriptor, to mount with, or with ``takeover``
    the live connection of a daemon that is gone, to serve on. Returns the exit status
    (:data:`~tierfs.daemon.keeper.HANDOVER` when it stopped for a successor).
    """
    # The modules, and what they made on import, live as long as the daemon: out of the
    # collector's reach, a full collection walks none of their ~35,000 objects again (each
    # such walk held the interpreter, and so every FUSE request, for 6-9 ms).
    gc.freeze()
    host.setup_logging(cfg)
    try:
        connection = Connection(fuse_fd)
        if takeover:
            connection, ready_fd = Connection.take_over(cfg, fuse_fd, ready_fd)
    except (UserError, OSError) as e:
        log.error("%s", e)
        host.report(ready_fd, f"error: {e}")
        return CANNOT_TAKE_OVER
    daemon = Daemon(cfg, connection)
    try:
        daemon.start()
        trio.run(daemon.serve, ready_fd)
    except UserError as e:
        if daemon.ready:
            raise
        if ready_fd is None:
            raise
        log.error("%s", e)  # before the report, so the log is complete when the caller looks
        host.report(ready_fd, f"error: {e}")
        return 1
    except Exception as e:
        if daemon.ready:
            raise
        log.exception("start-up failed")
        host.report(ready_fd, f"error: daemon failed to start: {e} (log: {daemon.registration.log_path})")
        if ready_fd is None:
            raise UserError(f"daemon failed to start: {e}") from None
        return 1
    finally:
        daemon.stop()
    return HANDOVER if daemon.handing_over else 0
