"""The demo: a volume on a RAM tier backed up to a local GCS emulator, a lost node, a restore.

1. start a GCS emulator on 127.0.0.1 and mount a volume that backs up to it;
2. write checkpoint step 100 as Orbax does and commit it by rename; watch it reach GCS;
3. write step 200 with one shard in eight changed: only that shard's chunks are uploaded;
4. lose the node: kill -9 the daemon and wipe its RAM tier;
5. mount again on the empty RAM tier: step 200 comes back from GCS, byte for byte.

Everything lives under one /dev/shm directory and is removed at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.gcs_emulator import GcsEmulator  # noqa: E402

TIERFS = [str(REPO / ".venv" / "bin" / "tierfs")]
MiB = 1 << 20


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def tierfs(*args) -> str:
    proc = subprocess.run([*TIERFS, *map(str, args)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"demo: tierfs {args[0]} failed: {proc.stderr.strip()}")
    return proc.stdout


def status(mnt: Path) -> dict:
    return json.loads(tierfs("status", mnt, "--json"))


def wait_backed_up(mnt: Path, step: int) -> dict:
    while True:
        for s in status(mnt)["steps"]:
            if s["step"] == step and s["backed_up"]:
                return s["backup"]
        time.sleep(0.1)


def write_step(mnt: Path, step: int, shards: list[bytes]) -> None:
    tmp = mnt / f"{step}.orbax-checkpoint-tmp"
    tmp.mkdir()
    for i, data in enumerate(shards):
        (tmp / f"shard-{i}").write_bytes(data)
    (tmp / "_CHECKPOINT_METADATA").write_text(json.dumps({"step": step}))
    os.rename(tmp, mnt / str(step))  # the commit


def main() -> int:
    base = Path(tempfile.mkdtemp(prefix="tierfs-demo.", dir="/dev/shm"))
    os.environ["TIERFS_RUNTIME_DIR"] = str(base / "run")
    mnt, ramdisk = base / "mnt", base / "ram"
    mnt.mkdir()
    emulator = GcsEmulator(base / "gcs", backend="memory")
    try:
        say("start a GCS emulator on 127.0.0.1 and mount with --gcs")
        emulator.start()
        os.environ.update(emulator.environ())
        emulator.make_bucket("demo-bucket")
        gcs = "gs://demo-bucket/checkpoints"
        options = ["--ramdisk", ramdisk, "--job", "demo", "--capacity", "2G", "--gcs", gcs]
        tierfs("mount", mnt, *options)
        print(f"{mnt} mounted; STORAGE_EMULATOR_HOST={os.environ['STORAGE_EMULATOR_HOST']}")

        say("write step 100 (8 shards x 32 MiB) as Orbax does, commit it by rename")
        shards = [os.urandom(32 * MiB) for _ in range(8)]
        write_step(mnt, 100, shards)
        b = wait_backed_up(mnt, 100)
        print(f"step 100 backed up in {b['seconds']:.2f}s, {b['lag_s']:.2f}s after its commit: "
              f"{b['uploaded_bytes'] / MiB:.0f} MiB uploaded")

        say("write step 200 with one shard in eight changed")
        shards[5] = os.urandom(32 * MiB)
        write_step(mnt, 200, shards)
        b = wait_backed_up(mnt, 200)
        print(f"step 200: {b['uploaded_bytes'] / MiB:.0f} MiB uploaded, {b['dedup_bytes'] / MiB:.0f} MiB "
              f"already in GCS ({b['uploaded_bytes'] / b['bytes']:.1%} of the step sent)")
        sums = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (mnt / "200").iterdir()}
        print(tierfs("status", mnt), end="")

        say("lose the node: kill -9 the daemon and wipe its RAM tier")
        pid = status(mnt)["pid"]
        os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ramdisk / "demo")
        print(f"killed pid {pid}; {ramdisk / 'demo'} removed")

        say("mount again on the empty RAM tier: the newest step comes back from GCS")
        tierfs("mount", mnt, *options)
        restored = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (mnt / "200").iterdir()}
        if restored != sums:
            raise SystemExit("demo: restored files differ from the committed ones")
        print(f"all {len(sums)} files of step 200 verified (sha256)")
        print(tierfs("status", mnt), end="")
        say("done")
        return 0
    finally:
        subprocess.run([*TIERFS, "unmount", str(mnt)], capture_output=True)
        emulator.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
