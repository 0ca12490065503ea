"""What background work gives way to: the job's bulk writes as the daemon sees them, on every data path.

Replication, backups and the hashing of a committed step wait while the job writes. With
passthrough the kernel writes without telling the daemon, so it watches the files open for
writing. A file merely held open, or one that takes a log line every few milliseconds, must
not hold that work back; a checkpoint being written must.
"""

from __future__ import annotations

import os
import time

from tests.helpers import wait_for
from tierfs.commands.status import fetch
from tierfs.fs.writing import LOOK_EVERY, WRITING


def since_write(volume) -> float | None:
    """Seconds since the daemon last saw the job write in bulk (its control socket, no CLI start-up in the way)."""
    return fetch(volume.mountpoint)["fuse"]["since_write_s"]


def test_log_lines_and_a_file_held_open_are_quiet(volume):
    assert since_write(volume) is None  # nothing written since the mount
    fd = os.open(volume.mountpoint / "train.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for _ in range(50):  # a line, then the daemon looks (each status asks it when the job last wrote)
            os.write(fd, b"step 7 loss 0.25\n")
            time.sleep(LOOK_EVERY)  # the logger's pace: every line is looked at on its own
            assert since_write(volume) is None
    finally:
        os.close(fd)
    assert os.path.getsize(volume.mountpoint / "train.log") == 50 * 17


def test_a_bulk_write_is_seen_growing_the_file_and_rewriting_it(volume):
    fd = os.open(volume.mountpoint / "shard", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for write in ("growing the file", "rewriting its bytes"):
            wait_for(lambda: (s := since_write(volume)) is None or s >= 0.3, 30, "the held-open file to count as quiet")
            before = time.monotonic()
            os.pwrite(fd, b"x" * (4 * WRITING), 0)
            wait_for(
                lambda: (s := since_write(volume)) is not None and s <= time.monotonic() - before + 0.001,
                10,
                f"the daemon to see a write {write}",
                interval=0.01,
            )
    finally:
        os.close(fd)
