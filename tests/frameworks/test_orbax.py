"""Unmodified orbax-checkpoint on tierfs: multi-tier checkpointing through the file protocol.

One JAX process on node 0 (the second node holds the replicas; a two-process run is not
made to work here yet), so ``replicator.yaml`` says ``nodes: 1``. The job initialises through
``jax-init-info.txt`` and ``replicator.yaml``, saves with ``ReplicatorCheckpointManager``,
loses its node and RAM, and restores the same values: from the peer, then with the peer
gone, from GCS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port

JOB = Path(__file__).with_name("orbax_job.py")


def run_job(mnt: Path, action: str, *args: str) -> dict:
    # JAX on CPU learns the process count from a cluster environment; Slurm's variables are
    # the smallest one. The rank and coordinator come from jax-init-info.txt, as on GKE.
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "SLURM_JOB_ID": "1",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }
    proc = subprocess.run(
        [sys.executable, str(JOB), str(mnt), "orbax-run", action, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.expect_log(
    'not answer yet', 'delayed, retrying', 'chunk \\w+ from \\S+( \\S+)? failed', 'trying the next tier'
)
def test_orbax_restores_after_node_loss_from_a_peer_then_from_gcs(cluster, gcs_bucket):
    c = cluster(
        2,
        job="orbax-run",
        replicas=1,
        keep_local=2,
        restore_wait="2s",
        gcs=f"gs://{gcs_bucket}/mtc",
        coordinator=f"127.0.0.1:{free_port('127.0.0.1')}",
    )
    c.start_all()
    mnt = c.nodes[0].mountpoint
    saved = run_job(mnt, "save", "3")
    assert saved["steps"] == [] and saved["latest"] is None
    c.wait_safe(0, 3)
    assert c.status(0)["mtc"]["spec"]["nodes"] == 1

    c.kill(0)
    c.wipe(0)
    c.start(0)
    from_peer = run_job(mnt, "restore")
    assert from_peer["latest"] == 3 and from_peer["equal"] is True
    restored = c.status(0)["restored"]
    assert restored["step"] == 3 and restored["tier"] == "peer", restored

    c.kill_all()
    c.wipe(0)
    c.start(0)  # its peer stays down: GCS is the only tier left
    from_gcs = run_job(mnt, "restore")
    assert from_gcs["latest"] == 3 and from_gcs["equal"] is True
    assert c.status(0)["restored"]["tier"] == "gcs"
