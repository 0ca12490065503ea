"""Unmodified PyTorch checkpoints on tierfs: ``torch.save`` files and DCP directories.

PyTorch never tells a filesystem that a checkpoint is done; tierfs's default commit rules
must recognise its last acts (closing a ``*.pt`` file; DCP renaming ``.metadata`` into
place). A job on node 0 of two saves two steps, each as both kinds; the test waits until
the newest step is on the peer and in GCS, loses node 0 with its RAM, and loads the same
values back: from the peer, then, with the peer gone too, from GCS.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("torch_job.py")
STEPS = 2


def run_job(mnt: Path, action: str, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(JOB), str(mnt), action, *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_restored(result: dict) -> None:
    """The restored volume holds the newest step alone, and both checkpoints load equal."""
    assert result["steps"] == [STEPS] and result["pt_step"] == STEPS, result
    assert result["pt_equal"] is True and result["dcp_equal"] is True, result
    assert result["pt_tensors"] == result["dcp_tensors"] == 24, result  # 6 parameters, 3 Adam tensors each


@pytest.mark.expect_log(
    'not answer yet', 'delayed, retrying', 'chunk \\w+ from \\S+( \\S+)? failed', 'trying the next tier'
)
def test_torch_save_and_dcp_restore_after_node_loss_from_a_peer_then_from_gcs(cluster, gcs_bucket: str) -> None:
    c = cluster(2, job="torch-run", replicas=1, restore_wait="2s", gcs=f"gs://{gcs_bucket}/pt")
    c.start_all()
    mnt = c.nodes[0].mountpoint
    assert run_job(mnt, "save", str(STEPS)) == {"saved": list(range(1, STEPS + 1))}
    state = c.wait_safe(0, STEPS)
    # Both checkpoints of the step committed through the default rules, as one step.
    assert state["roots"] == [f"checkpoints/step-{STEPS}/dcp", f"checkpoints/step-{STEPS}/model.pt"], state
    assert state["version"] == 2, state

    c.kill(0)
    c.wipe(0)
    c.start(0)
    assert_restored(run_job(mnt, "load"))
    restored = c.status(0)["restored"]
    assert restored["step"] == STEPS and restored["tier"] == "peer", restored

    c.kill_all()
    c.wipe(0)
    c.start(0)  # its peer stays down: GCS is the only tier left
    assert_restored(run_job(mnt, "load"))
    restored = c.status(0)["restored"]
    assert restored["step"] == STEPS and restored["tier"] == "gcs", restored
