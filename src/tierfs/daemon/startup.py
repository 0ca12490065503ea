"""The daemon's start-up checks: what can fail with a user error, settled before the kernel mount exists.

Apart from the composition root because each is a decision about the host, not a part of
the volume: which data path the kernel allows, and whether what the rank already holds
fits the capacity asked for. A failed check refuses the start in one line, so a failed
start never leaves a mount behind.
"""

from __future__ import annotations

import logging
from pathlib import Path

from tierfs.config import Config, DataPath, Engine
from tierfs.core.errors import UserError
from tierfs.core.parse import format_size
from tierfs.fs.engine import choose_data_path
from tierfs.ramtier import SpaceAccount
from tierfs.ramtier.tmpfs import own_tmpfs

log = logging.getLogger("tierfs")


def data_path(cfg: Config, rank_path: Path) -> tuple[DataPath, bool]:
    """Passthrough where the kernel allows it; with a capacity, on a tmpfs of that size.

    Also returns whether the rank's home is now a tmpfs of its own of ``--capacity``: the
    kernel enforces the capacity then, and the space account follows that file system.
    """
    try:
        chosen, why = choose_data_path(cfg.data_path if cfg.engine != Engine.PYFUSE3 else DataPath.DAEMON)
    except ValueError as e:
        raise UserError(f"--data-path passthrough is impossible here: {e}; use --data-path auto or daemon") from None
    kernel_bound = False
    if chosen == DataPath.PASSTHROUGH and cfg.capacity is not None:
        if own_tmpfs(rank_path, cfg.capacity):
            kernel_bound = True
        elif cfg.data_path == DataPath.PASSTHROUGH:
            raise UserError(
                f"{rank_path} holds data outside a tmpfs of its own, so --capacity "
                "cannot bind passthrough writes: use --data-path daemon, or move the data"
            )
        else:
            chosen = DataPath.DAEMON
            why = f"{rank_path} already holds data outside a tmpfs of its own, so --capacity is enforced by the daemon"
    if why is None:
        log.info("data path: passthrough (the kernel reads and writes the RAM tier directly)")
    else:
        log.info("data path: daemon (%s)", why)
    return chosen, kernel_bound


def check_capacity(cfg: Config, space: SpaceAccount, tree: Path) -> None:
    """What the rank's tree already holds (with its snapshots, replicas and what a restore set aside) fits."""
    if cfg.capacity is not None and space.used > cfg.capacity:
        raise UserError(
            f"capacity {format_size(cfg.capacity)} is below the {format_size(space.used)} "
            f"already stored in {tree}: raise --capacity or remove files"
        )
