"""The multi-tier checkpointing protocol through a real mount, job side as Orbax runs it.

``handshake`` follows orbax-checkpoint's ``initialize_multi_tier_checkpointing`` file for
file (write ``replicator.yaml`` by rename, wait for its deletion, raise on
``replicator.failed``, rename the newest ``.restore`` entry onto its step); the framework
tests run the real package.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import tierfs
from tests.fuse.test_commit import METADATA
from tests.helpers import wait_for, write_orbax_step

YAML = """job-name: {job}
framework: orbax
assume-data-parallelism: 1
node-rank: {rank}
nodes: {nodes}
peer-ranks: []
backup-interval-minutes: 30"""
NO_GCS = "tierfs: this volume has no --gcs: nothing is backed up, whatever the interval\n"
SUCCESS = {"commit_success.txt": b"ok"}  # the marker of a step Orbax writes at the root (multi-tier checkpointing)


def handshake(mnt: Path, text: str, timeout: float = 15) -> tuple[int, str | None]:
    """Returns (restore step or 0, what replicator.errors said); raises as Orbax does on .failed."""
    (mnt / "replicator.yaml.tmp").write_text(text)
    os.replace(mnt / "replicator.yaml.tmp", mnt / "replicator.yaml")
    wait_for(lambda: not (mnt / "replicator.yaml").exists(), timeout, "replicator.yaml to be acknowledged", 0.05)
    errors = None
    if (mnt / "replicator.errors").exists():
        errors = (mnt / "replicator.errors").read_text()
        (mnt / "replicator.errors").unlink()
    if (mnt / "replicator.failed").exists():
        fatal = (mnt / "replicator.failed").read_text()
        (mnt / "replicator.failed").unlink()
        raise RuntimeError(f"Replicator fatal errors: {fatal}")
    deadline = time.monotonic() + timeout
    while True:
        markers = sorted(mnt.glob("*.restore"))
        steps = [(int(re.search(r"-s(\d+)-n\d+-w\d+\.restore$", p.name).group(1)), p) for p in markers]
        real = [(s, p) for s, p in steps if not (s == 0 and p.is_file())]
        if real:
            step, marker = max(real)
            os.replace(marker, mnt / str(step))
            for _, p in steps:
                if p != marker:
                    p.unlink(missing_ok=True)
            return step, errors
        if steps:
            for _, p in steps:
                p.unlink()
            return 0, errors
        assert time.monotonic() < deadline, "no .restore entry appeared"
        time.sleep(0.05)


def orbax_steps(mnt: Path) -> list[int]:
    """How Orbax finds steps: numeric names of directories (or symlinks to them)."""
    return sorted(int(p.name) for p in mnt.iterdir() if re.fullmatch(r"0|[1-9]\d*", p.name) and p.is_dir())


def mtc_status(vol) -> dict:
    return vol.status()["mtc"]


def test_jax_init_info_and_a_first_start_with_nothing_to_restore(volumes):
    vol = volumes(job="run", coordinator="10.1.2.3")
    info = vol.mountpoint / "jax-init-info.txt"
    assert info.read_text() == "0\n10.1.2.3:8476\n"
    assert stat.S_IMODE(info.stat().st_mode) == 0o555
    assert handshake(vol.mountpoint, YAML.format(job="run", rank=0, nodes=1)) == (0, NO_GCS)
    assert (vol.mountpoint / "replicator.prerestore").read_text() == "{}\n"
    assert not list(vol.mountpoint.glob("*.restore"))
    spec = mtc_status(vol)["spec"]
    assert spec["job_name"] == "run" and spec["nodes"] == 1 and mtc_status(vol)["error"] is None


def test_restart_presents_the_newest_step_and_the_rename_takes_it(volumes):
    vol = volumes(job="run", keep_local=3)
    handshake(vol.mountpoint, YAML.format(job="run", rank=0, nodes=1))
    for step in (10, 20):
        write_orbax_step(vol.mountpoint, step, {"state/d/0": os.urandom(5000) + bytes([step]), **SUCCESS}, base="")
    expected = (vol.mountpoint / "20" / "state" / "d" / "0").read_bytes()
    tierfs("unmount", vol.mountpoint)

    again = volumes(job="run", keep_local=3, mountpoint=vol.mountpoint)
    mnt = again.mountpoint
    entry = mnt / "run-s20-n0-w0.restore"
    step, errors = handshake_inspecting(mnt, YAML.format(job="run", rank=0, nodes=1), entry)
    assert (step, errors) == (20, NO_GCS)
    assert (mnt / "replicator.prerestore").read_text() == "restore-step: 20\n"
    assert not entry.exists() and not entry.is_symlink()
    assert (mnt / "20").is_dir() and not (mnt / "20").is_symlink()
    assert (mnt / "20" / "state" / "d" / "0").read_bytes() == expected
    assert orbax_steps(mnt) == [10, 20]
    assert sorted(s["step"] for s in again.status()["steps"]) == [10, 20], "taking the step is not a new commit"
    assert [s["version"] for s in again.status()["steps"] if s["step"] == 20] == [1]


@pytest.mark.expect_log(
    'ERROR tierfs.mtc.protocol: replicator.yaml: ', "moved 20 out of the volume", "rolling job run back to step 10"
)
def test_a_rollback_the_spec_asks_for_is_made_when_the_volume_starts_again(volumes):
    vol = volumes(job="run", keep_local=3)
    spec = YAML.format(job="run", rank=0, nodes=1)
    handshake(vol.mountpoint, spec)
    for step in (10, 20):
        write_orbax_step(vol.mountpoint, step, {"state/d/0": os.urandom(5000) + bytes([step]), **SUCCESS}, base="")
    expected = (vol.mountpoint / "10" / "state" / "d" / "0").read_bytes()
    # Serving already: the job is told, not handed step 20.
    with pytest.raises(RuntimeError, match=r"asks for step 10 \(restore-step\), but this volume started from no step"):
        handshake(vol.mountpoint, spec + "\nrestore-step: 10")
    tierfs("unmount", vol.mountpoint)

    again = volumes(job="run", keep_local=3, mountpoint=vol.mountpoint)  # the kept spec makes the rollback
    assert handshake(again.mountpoint, spec + "\nrestore-step: 10") == (10, NO_GCS)
    assert (again.mountpoint / "10" / "state" / "d" / "0").read_bytes() == expected
    assert orbax_steps(again.mountpoint) == [10]
    assert sorted(s["step"] for s in again.status()["steps"]) == [10]
    tierfs("unmount", again.mountpoint)

    third = volumes(job="run", keep_local=3, mountpoint=vol.mountpoint)  # made once: the spec still says 10
    write_orbax_step(third.mountpoint, 20, {"state/d/0": b"new", **SUCCESS}, base="")
    assert handshake(third.mountpoint, spec + "\nrestore-step: 10") == (20, NO_GCS)


def handshake_inspecting(mnt: Path, text: str, entry: Path) -> tuple[int, str | None]:
    """As ``handshake``, noting what the entry was when the job took it."""
    original = os.replace
    seen = {}

    def replace(src, dst):
        if Path(src) == entry:
            seen["link"] = "dir" if entry.is_dir() and not entry.is_symlink() else "other"
            seen["step visible"] = os.path.lexists(dst)
        return original(src, dst)

    os.replace = replace
    try:
        result = handshake(mnt, text)
    finally:
        os.replace = original
    # The step is the entry itself until the job renames it back: ``20`` must not exist then.
    assert seen == {"link": "dir", "step visible": False}
    return result


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (YAML.format(job="run", rank=0, nodes=1).replace("nodes: 1", ""), "lacks 'nodes'"),
        (YAML.format(job="run", rank=3, nodes=2), "'node-rank' 3 is out of range for 2 node(s)"),
        (YAML.format(job="run", rank=0, nodes=4).replace("[]", "[2, 2]"), "lists rank 2 more than once"),
        (YAML.format(job="run", rank=0, nodes=1) + "\nbackup-interval-steps: 5", "(both given)"),
        (YAML.format(job="run", rank=1, nodes=2), "'node-rank' is 1 but this volume holds rank 0's data"),
    ],
)
@pytest.mark.expect_log('ERROR tierfs.mtc.protocol: replicator.yaml: ')
def test_a_malformed_spec_fails_the_job_with_its_reason(volumes, text, message):
    vol = volumes(job="run")
    with pytest.raises(RuntimeError, match=re.escape(message)):
        handshake(vol.mountpoint, text)
    assert not (vol.mountpoint / "replicator.yaml").exists()
    assert message in mtc_status(vol)["error"]
    # The job can correct itself: a good spec is taken at once.
    assert handshake(vol.mountpoint, YAML.format(job="run", rank=0, nodes=1)) == (0, NO_GCS)
    assert mtc_status(vol)["error"] is None


@pytest.mark.expect_log('ERROR tierfs.mtc.protocol: replicator.yaml: ')
def test_a_new_pod_does_not_read_the_answers_meant_for_a_pod_that_died(volumes):
    vol = volumes(job="run")
    mnt = vol.mountpoint
    (mnt / "replicator.yaml").write_text(YAML.format(job="run", rank=5, nodes=2))  # bad, and nobody reads
    wait_for(lambda: not (mnt / "replicator.yaml").exists(), 15, "replicator.yaml to be acknowledged", 0.05)
    assert (mnt / "replicator.failed").exists()
    # The volume outlives that pod (the CSI plugin reuses the daemon); the next pod's good spec is taken.
    assert handshake(mnt, YAML.format(job="run", rank=0, nodes=1)) == (0, NO_GCS)


def test_warnings_go_to_replicator_errors(volumes):
    vol = volumes(job="run")
    step, errors = handshake(vol.mountpoint, YAML.format(job="other", rank=0, nodes=1) + "\ncolour: blue")
    assert step == 0
    assert "job-name 'other' differs from the volume's job 'run'" in errors and "'colour'" in errors


def test_old_steps_are_deleted_once_the_job_speaks_the_protocol(volumes):
    vol = volumes(job="run")  # --keep-local 1: only the newest step stays in RAM
    handshake(vol.mountpoint, YAML.format(job="run", rank=0, nodes=1))
    for step in (1, 2, 3):
        write_orbax_step(vol.mountpoint, step, {"state/x": bytes([step]) * 1000, **SUCCESS}, base="")
    deadline = time.monotonic() + 10
    while orbax_steps(vol.mountpoint) != [3]:
        assert time.monotonic() < deadline, f"old steps stay: {orbax_steps(vol.mountpoint)}"
        time.sleep(0.1)
    assert (vol.mountpoint / "3" / "state" / "x").read_bytes() == b"\x03" * 1000


def test_without_the_protocol_old_steps_are_left_to_the_job(volume):
    for step in (1, 2):
        write_orbax_step(volume.mountpoint, step, {"x": b"x", **METADATA})
    time.sleep(1)
    assert sorted(p.name for p in (volume.mountpoint / "ckpt").iterdir()) == ["1", "2"]


@pytest.mark.expect_log('ERROR tierfs.mtc.protocol: replicator.yaml: ')
def test_a_job_running_as_another_user_consumes_the_answers(volumes):
    """Pods often run as uid 1000: the volume's root is sticky (1777), so the job can delete
    the node's answers only if they are its own."""
    vol = volumes(job="run", keep_local=3)
    write_orbax_step(vol.mountpoint, 10, {"x": b"x", **SUCCESS}, base="")
    script = (
        "import os, sys, time; m = sys.argv[1]\n"
        "def ack():\n"
        "    while os.path.lexists(os.path.join(m, 'replicator.yaml')): time.sleep(0.05)\n"
        "def consume():\n"
        "    for n in os.listdir(m):\n"
        "        if n.startswith('replicator.')"
        " or (n.endswith('.restore') and not os.path.isdir(os.path.join(m, n))):\n"
        "            os.unlink(os.path.join(m, n))\n"
        "open(os.path.join(m, 'replicator.yaml'), 'w').write(sys.argv[2]); ack(); consume()\n"
        "open(os.path.join(m, 'replicator.yaml'), 'w').write(sys.argv[3]); ack(); consume()\n"
        "print(sorted(os.listdir(m)))\n"
    )
    bad = YAML.format(job="run", rank=5, nodes=2)  # replicator.failed
    good = YAML.format(job="run", rank=0, nodes=1) + "\ncolour: blue"  # errors, prerestore, a .restore entry
    python = shutil.which("python3", path="/usr/bin:/bin")
    out = subprocess.run(
        [python, "-c", script, str(vol.mountpoint), bad, good],
        user=1000,
        group=1000,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(["run-s10-n0-w0.restore"]), "every answer file is gone; the step remains"
