"""What background work gives way to: the job's writes as the daemon sees them, on every data path.

Replication, backups and the hashing of a committed step wait while the job writes. With
passthrough the kernel writes without telling the daemon, so it watches the files open for
writing; a file merely held open must not hold that work back.
"""

from __future__ import annotations

import os
import time

from tests.helpers import wait_for
from tierfs.commands.status import fetch


def since_write(volume) -> float | None:
    """Seconds since the daemon last saw the job write (its control socket, no CLI start-up in the way)."""
    return fetch(volume.mountpoint)["fuse"]["since_write_s"]


def test_a_file_held_open_is_quiet_and_each_write_is_seen(volume):
    assert since_write(volume) is None  # nothing written since the mount
    fd = os.open(volume.mountpoint / "log", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for write in ("growing the file", "rewriting its bytes"):
            wait_for(lambda: (s := since_write(volume)) is None or s >= 0.3, 30, "the held-open file to count as quiet")
            before = time.monotonic()
            os.pwrite(fd, b"x" * 4096, 0)
            wait_for(lambda: (s := since_write(volume)) is not None and s <= time.monotonic() - before + 0.001, 10,
                     f"the daemon to see a write {write}", interval=0.01)
    finally:
        os.close(fd)
