"""Rolling a job of three real daemons back to a milestone (``--restore-step``), once, with GCS."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers import wait_for
from tests.multinode.test_peers import commit_step, sums
from tests.multinode.test_restore import files_of
from tierfs.tiers.gcs_store import GcsStore

KiB = 1 << 10
STEPS = range(100, 1000, 100)


def listed(c, i: int = 0) -> dict[int, dict]:
    return {s["step"]: s for s in json.loads(c.tierfs("steps", c.nodes[i].mountpoint, "--json").stdout)}


def commit_all(c, step: int, ranks=(1, 2, 0)) -> dict[int, dict[str, str]]:
    """``step`` committed on ``ranks`` and held by a peer and GCS; each rank's files' sums.

    One rank after the other, rank 0 last: its GCS retention, which follows its own backup,
    then sees every rank's step. Like Orbax's ``max_to_keep=2``, the job keeps two steps in
    the volume.
    """
    expected = {}
    for i in ranks:
        expected[i] = commit_step(c.nodes[i].mountpoint, step, files_of(i, step, 256 * KiB))
        c.wait_safe(i, step)
        shutil.rmtree(c.nodes[i].mountpoint / "ckpt" / str(step - 200), ignore_errors=True)
    return expected


@pytest.mark.expect_log(
    "moved ckpt/\\d+ out of the volume", "rolling job \\S+ back to step 300", "cannot roll job \\S+ back to step 500"
)
def test_every_node_rolls_back_to_a_milestone_once_and_a_step_another_rank_lacks_is_refused(cluster, gcs_bucket):
    url = f"gs://{gcs_bucket}/rollback"
    c = cluster(3, replicas=1, capacity="256M", gcs=url, keep=2, keep_every=300)
    c.start_all()
    expected = {step: commit_all(c, step) for step in STEPS}

    # GCS keeps the newest 2 and the milestones; RAM and the peers the newest.
    wait_for(lambda: sorted(listed(c)) == [300, 600, 800, 900], what="retention of steps 100-900", timeout=60)
    seen = listed(c, 1)
    assert {s: (v["tiers"], v["complete"]) for s, v in seen.items()} == {
        300: (["gcs"], 3),
        600: (["gcs"], 3),
        800: (["gcs"], 3),
        900: (["ram", "peers", "gcs"], 3),
    }
    assert sorted(s for s, v in seen.items() if v["milestone"]) == [300, 600, 900]

    # Every node restarts with --restore-step 300: step 300 is in GCS only.
    c.kill_all()
    c.start_all(restore_step=300)
    for i in range(3):
        status = c.status(i)
        assert status["cluster"]["restore_step"] == 300 and status["cluster"]["rollback"]["step"] == 300
        # The bytes arrive in the background: which tier gave them is known once they are in.
        restored = wait_for(lambda: (r := c.status(i)["restored"])["state"] == "done" and r, what="the restore")
        assert restored["step"] == 300 and restored["tier"] == "gcs"
        mnt = c.nodes[i].mountpoint
        assert sums(mnt, 300, expected[300][i]) == expected[300][i]
        assert sorted(p.name for p in (mnt / "ckpt").iterdir()) == ["300"]  # 900 left the volume
    text = c.tierfs("status", c.nodes[0].mountpoint).stdout
    assert "        rolled back to step 300 (restore-step) at " in text, text
    after = listed(c, 2)
    assert sorted(after) == [300], after  # 600, 800 and 900 are the old timeline's: set aside
    aside = GcsStore(url, c.job).list_aside()
    assert {to: dict(listing) for to, listing in aside.items()} == {300: {r: [600, 800, 900] for r in range(3)}}

    # The job goes on from 300; a restart with the flag still given follows it, not 300 again,
    # also on a node that lost its RAM (and its own record of the rollback): the bucket's says when.
    expected[400] = commit_all(c, 400)
    c.kill_all()
    c.wipe(0)
    c.start_all(restore_step=300)
    for i in range(3):
        assert c.status(i)["cluster"]["restore_step"] == 400
        assert sums(c.nodes[i].mountpoint, 400, expected[400][i]) == expected[400][i]
    assert c.status(0)["restored"]["step"] == 400
    assert GcsStore(url, c.job).list_aside().keys() == {300}

    # A step only rank 0 committed: a node asked for it refuses, in one line, and mounts nothing.
    commit_all(c, 500, ranks=(0,))
    c.kill(1)
    proc = c.start(1, check=False, restore_step=500)
    assert proc.returncode != 0
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"tierfs: cannot roll job {c.job} back to step 500: rank(s) 1, 2 hold no copy of it"), line
    assert c.tierfs("status", c.nodes[1].mountpoint, check=False).returncode != 0

    # From a machine with no mount: the bucket names what the rollback set aside; the operator discards it.
    proc = c.tierfs("steps", "--job", c.job, "--gcs", url)
    assert [s.split()[0] for s in proc.stdout.splitlines()[1:]] == ["500", "400", "300"]
    assert proc.stderr == (
        f"tierfs: note: the rollback to step 300 set aside step(s) 600, 800, 900, kept until "
        f"'tierfs steps --job {c.job} --gcs {url} --discard-set-aside 300'\n"
    )
    proc = c.tierfs("steps", "--job", c.job, "--gcs", url, "--discard-set-aside", "300")
    assert proc.stdout.startswith(
        "discarded 9 manifest(s) of step(s) 600, 800, 900 set aside by the rollback to step 300"
    )
    assert GcsStore(url, c.job).list_aside() == {}
    assert c.tierfs("steps", "--job", c.job, "--gcs", url).stderr == ""
