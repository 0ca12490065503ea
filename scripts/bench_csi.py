#!/usr/bin/env python3
"""CSI plugin latency: how long kubelet waits on NodePublishVolume and NodeUnpublishVolume.

A real ``tierfs csi`` on a unix socket (the test suite's harness, tierfs_testing.csi),
called as kubelet calls it. For each of ``--jobs`` jobs: the first publish (which starts the
job's daemon), an unpublish, and a publish for the job's next pod (which reuses the running
daemon). The baseline is the daemon's own start-up: ``tierfs mount`` of the same volume by
hand, timed the same way, so the first publish reads as plugin overhead on top of it.
Medians. Everything it mounts and starts is unmounted and stopped on exit.

    .venv/bin/python scripts/bench_csi.py [--jobs 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

os.environ.setdefault("TIERFS_RUNTIME_DIR", f"/dev/shm/bench-csi-run-{uuid.uuid4().hex[:6]}")

from tierfs_testing import TIERFS, cleanup_mount
from tierfs_testing.csi import Plugin, PodApi


def timed(fn) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


def one_job(plugin: Plugin, base: Path, i: int, times: dict[str, list[float]]) -> None:
    """Job ``i``: a mount by hand, then a first publish, an unpublish and a second publish."""
    by_hand = base / f"hand-{i}"
    by_hand.mkdir()
    times["tierfs mount by hand"].append(
        timed(
            lambda: subprocess.run(
                [
                    *TIERFS,
                    "mount",
                    str(by_hand),
                    "--ramdisk",
                    str(base / "ram-hand"),
                    "--job",
                    f"h{i}",
                    "--capacity",
                    "64M",
                ],
                check=True,
            )
        )
    )
    subprocess.run([*TIERFS, "unmount", str(by_hand)], check=True)
    job = {"job": f"j{i}", "rank": "0", "capacity": "64M"}
    target = plugin.target()
    volume: list[str] = []
    times["first publish (starts the daemon)"].append(timed(lambda: volume.append(plugin.publish(target, job))))
    times["unpublish"].append(timed(lambda: plugin.unpublish(volume[0], target)))
    target = plugin.target()
    times["publish to the running daemon"].append(timed(lambda: volume.append(plugin.publish(target, job))))
    plugin.unpublish(volume[1], target)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=5, help="jobs to publish, one after the other (default 5)")
    args = p.parse_args()
    base = Path(f"/dev/shm/bench-csi-{uuid.uuid4().hex[:6]}")
    base.mkdir()
    api = PodApi()
    config = base / "config.yaml"  # every job stays on the node until the end: room for all of them
    config.write_text(f'max-jobs-per-node: "{args.jobs}"\nmax-jobs-per-namespace: "{args.jobs}"\n')
    plugin = Plugin(base, api, ("--config", str(config)))
    times: dict[str, list[float]] = {
        "tierfs mount by hand": [],
        "first publish (starts the daemon)": [],
        "unpublish": [],
        "publish to the running daemon": [],
    }
    try:
        plugin.start()
        for i in range(args.jobs):
            one_job(plugin, base, i, times)
        for what, values in times.items():
            print(f"{what:36s} median {statistics.median(values):.3f} s  (n={len(values)})")
        return 0
    finally:
        for by_hand in base.glob("hand-*"):
            cleanup_mount(by_hand)  # what an error left mounted
        plugin.cleanup()
        api.close()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(os.environ["TIERFS_RUNTIME_DIR"], ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
