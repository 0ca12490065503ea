"""The demo: a 3-node local cluster with peer replication and GCS backup, a lost node, a restore.

1. start a GCS emulator and three tierfs nodes on 127.0.0.2-4, each replicating its
   committed steps to one peer and backing them up to the emulator;
2. every node writes its rank's checkpoint step 100 as Orbax does and commits it by rename;
   watch each reach a peer and GCS;
3. every node writes step 200 with one shard in eight changed: only that shard's chunks
   travel;
4. kill -9 node 0's daemon while a file of it is open: its keeper starts a successor,
   which takes the live mount over; the open file reads on, byte for byte;
5. lose node 1 (its keeper and daemon killed, as a crash of the node does) and wipe its RAM tier;
6. bring it back with the same rank on an empty RAM tier: the cluster agrees that step 200
   is complete on every rank, its files appear at once and their bytes follow from the peer
   that holds its replica, byte for byte.

Everything lives under one /dev/shm directory and is removed at the end.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from tierfs_testing.cluster import LocalCluster
from tierfs_testing.gcs_emulator import GcsEmulator

MiB = 1 << 20
NODES, SHARDS, SHARD = 3, 8, 16 * MiB


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def write_step(mnt: Path, step: int, shards: list[bytes]) -> dict[str, str]:
    tmp = mnt / f"{step}.orbax-checkpoint-tmp"
    tmp.mkdir()
    for i, data in enumerate(shards):
        (tmp / f"shard-{i}").write_bytes(data)
    (tmp / "_CHECKPOINT_METADATA").write_text(f'{{"step": {step}}}')
    os.rename(tmp, mnt / str(step))  # the commit
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (mnt / str(step)).iterdir()}


def wait_safe(cluster: LocalCluster, i: int, step: int) -> dict:
    """Until step ``step`` of node ``i`` is on a peer and in GCS; returns its state."""
    while True:
        for s in cluster.status(i)["steps"]:
            if s["step"] == step and s["backed_up"] and s["replicas"].get("version") == s["version"]:
                return s
        time.sleep(0.1)


def main() -> int:
    base = Path(tempfile.mkdtemp(prefix="tierfs-demo.", dir="/dev/shm"))
    os.environ["TIERFS_RUNTIME_DIR"] = str(base / "run")
    emulator = GcsEmulator(base / "gcs", backend="memory")
    cluster = None
    try:
        say("start a GCS emulator on 127.0.0.1 and 3 nodes on 127.0.0.2-4")
        emulator.start()
        os.environ.update(emulator.environ())
        emulator.make_bucket("demo-bucket")
        cluster = LocalCluster(
            base / "cluster", NODES, job="demo", replicas=1, capacity="2G", gcs="gs://demo-bucket/checkpoints"
        )
        cluster.start_all()
        for node in cluster.nodes:
            print(f"node {node.index}: rank {node.index} at {node.mountpoint}, peers on {node.address}")

        say(f"every node writes step 100 ({SHARDS} shards x {SHARD // MiB} MiB) and commits it by rename")
        shards = {n.index: [os.urandom(SHARD) for _ in range(SHARDS)] for n in cluster.nodes}
        for n in cluster.nodes:
            write_step(n.mountpoint, 100, shards[n.index])
        for n in cluster.nodes:
            s = wait_safe(cluster, n.index, 100)
            print(
                f"node {n.index}: step 100 on peer {', '.join(s['replicas']['peers'])} after "
                f"{s['replicas']['lag_s']:.2f}s, in GCS after {s['backup']['lag_s']:.2f}s"
            )

        say("every node writes step 200 with one shard in eight changed")
        sums = {}
        for n in cluster.nodes:
            shards[n.index][3] = os.urandom(SHARD)
            sums[n.index] = write_step(n.mountpoint, 200, shards[n.index])
        for n in cluster.nodes:
            s = wait_safe(cluster, n.index, 200)
            r, b = s["replicas"], s["backup"]
            print(
                f"node {n.index}: {r['sent_bytes'] // MiB} MiB sent to the peer "
                f"({r['skipped_bytes'] // MiB} MiB it had), {b['uploaded_bytes'] // MiB} MiB uploaded "
                f"({b['dedup_bytes'] // MiB} MiB already in GCS)"
            )
        print(cluster.tierfs("status", cluster.nodes[1].mountpoint).stdout, end="")

        say("kill -9 node 0's daemon while a file is open: its keeper starts a successor")
        shard = cluster.nodes[0].mountpoint / "200" / "shard-0"
        with open(shard, "rb", buffering=0) as f:
            head = f.read(SHARD // 2)
            before = cluster.status(0)["pid"]
            t0 = time.monotonic()
            os.kill(before, signal.SIGKILL)
            rest = f.read()  # waits only while no daemon serves
            paused = time.monotonic() - t0
        if hashlib.sha256(head + rest).hexdigest() != sums[0][shard.name]:
            raise SystemExit("demo: the open file read differently after the daemon was killed")
        cluster.refresh(0)
        print(
            f"daemon {before} killed; pid {cluster.nodes[0].pid} serves the mount now; the open file "
            f"read on after {paused * 1000:.0f} ms, every byte as committed"
        )

        say("lose node 1: its keeper and daemon killed (the node crashes), its RAM tier wiped")
        cluster.kill(1)
        cluster.wipe(1)
        print(f"{cluster.nodes[1].ramdisk / 'demo'} removed")

        say("bring node 1 back with rank 1 on an empty RAM tier")
        started = time.monotonic()
        cluster.start(1)
        mounted = time.monotonic() - started
        mnt = cluster.nodes[1].mountpoint / "200"
        print(f"mounted after {mounted:.1f}s with {len(os.listdir(mnt))} files of step 200 listed")
        restored = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in mnt.iterdir()}
        if restored != sums[1]:
            raise SystemExit("demo: restored files differ from the committed ones")
        took = time.monotonic() - started
        info = cluster.status(1)["restored"]
        print(
            f"step {info['step']} (newest complete on every rank: {cluster.status(1)['cluster']['newest_complete']}) "
            f"read back from {info['from']} in {took:.1f}s; all {len(restored)} files verified (sha256)"
        )
        print(cluster.tierfs("status", cluster.nodes[1].mountpoint).stdout, end="")
        say("done")
        return 0
    finally:
        if cluster is not None:
            cluster.close()
        emulator.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
