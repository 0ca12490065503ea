"""Commits through a real mount: rules, frozen snapshots, copy on write, retention, restart."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import tierfs
from tests.helpers import write_orbax_step

METADATA = {"_CHECKPOINT_METADATA": b"{}"}  # Orbax's marker, inside a temporary dir: no commit yet


def step_tree(vol, step: int) -> Path:
    return vol.ramdisk / vol.job / f"rank-{vol.rank}" / "steps" / str(step) / "tree"


def steps_of(vol) -> dict[int, dict]:
    return {s["step"]: s for s in vol.status()["steps"]}


def test_directory_rename_commits_and_freezes_the_step(volume):
    assert steps_of(volume) == {}
    (volume.mountpoint / "ckpt" / "7.orbax-checkpoint-tmp").mkdir(parents=True)
    (volume.mountpoint / "ckpt" / "7.orbax-checkpoint-tmp" / "_CHECKPOINT_METADATA").write_text("{}")
    assert steps_of(volume) == {}, "a marker inside a temporary directory must not commit"
    write_orbax_step(volume.mountpoint, 5, {"a": b"A" * 5000, "d/b": b"B" * 10, **METADATA})
    steps = steps_of(volume)
    assert list(steps) == [5] and steps[5]["roots"] == ["ckpt/5"]
    snap = step_tree(volume, 5) / "ckpt" / "5"
    assert (snap / "a").read_bytes() == b"A" * 5000
    assert (snap / "d" / "b").read_bytes() == b"B" * 10


def test_committed_files_are_isolated_from_later_changes(volume):
    final = write_orbax_step(volume.mountpoint, 1, {"a": b"old-a" * 1000, "b": b"old-b", "c": b"old-c", **METADATA})
    snap = step_tree(volume, 1) / "ckpt" / "1"
    assert os.stat(final / "a").st_nlink == 1, "snapshot links must not show in st_nlink"
    with open(final / "a", "r+b") as f:  # rewrite in place
        f.write(b"NEW")
    (final / "b").write_bytes(b"truncated and rewritten")  # O_TRUNC
    os.unlink(final / "c")
    os.chmod(final / "a", 0o600)
    assert (final / "a").read_bytes() == b"NEW" + (b"old-a" * 1000)[3:]
    assert (snap / "a").read_bytes() == b"old-a" * 1000
    assert (snap / "b").read_bytes() == b"old-b"
    assert (snap / "c").read_bytes() == b"old-c"
    assert os.stat(snap / "a").st_mode & 0o777 == 0o644
    assert os.stat(final / "a").st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "relpath, root",
    [
        ("dcp/step_3/.metadata", "dcp/step_3"),
        ("hf/checkpoint-40/trainer_state.json", "hf/checkpoint-40"),
        ("model-12.pt", "model-12.pt"),
    ],
)
def test_markers_and_single_files_commit_when_closed(volume, relpath, root):
    path = volume.mountpoint / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "shard-0").write_bytes(b"x" * 100)
    with open(path, "wb") as f:
        f.write(b"done")
        assert steps_of(volume) == {}, "nothing commits before the marker is closed"
    (state,) = steps_of(volume).values()
    assert state["roots"] == [root]
    assert (step_tree(volume, state["step"]) / relpath).read_bytes() == b"done"


def test_a_marker_commits_its_directory_as_it_was_when_closed(volume):
    step = volume.mountpoint / "dcp" / "step_5"
    step.mkdir(parents=True)
    (step / "shard-0").write_bytes(b"x" * 100)
    (step / ".metadata").write_bytes(b"m")  # the marker
    (step / "late").write_bytes(b"l")  # created right after the marker's close
    (state,) = steps_of(volume).values()
    assert state["step"] == 5 and state["roots"] == ["dcp/step_5"]
    assert sorted(p.name for p in (step_tree(volume, 5) / "dcp" / "step_5").iterdir()) == [".metadata", "shard-0"]


def test_rename_of_a_finished_file_into_a_pattern_commits(volume):
    tmp = volume.mountpoint / "weights-8.safetensors.partial"
    tmp.write_bytes(b"w" * 1000)
    assert steps_of(volume) == {}
    os.rename(tmp, volume.mountpoint / "weights-8.safetensors")
    assert steps_of(volume)[8]["roots"] == ["weights-8.safetensors"]


def test_explicit_commit_and_custom_rule(volumes):
    vol = volumes(capacity="256M", commit_rule="file:*.bin")
    (vol.mountpoint / "model-3.pt").write_bytes(b"p")
    assert steps_of(vol) == {}, "--commit-rule replaces the default rules"
    (vol.mountpoint / "data-4.bin").write_bytes(b"b")
    assert list(steps_of(vol)) == [4]
    (vol.mountpoint / "state").mkdir()
    (vol.mountpoint / "state" / "x").write_bytes(b"x")
    out = tierfs("commit", vol.mountpoint / "state", "--step", "9").stdout
    assert "step 9" in out
    assert steps_of(vol)[9]["roots"] == ["state"]
    assert (step_tree(vol, 9) / "state" / "x").read_bytes() == b"x"
    err = tierfs("commit", vol.mountpoint / "missing", check=False)
    assert err.returncode != 0 and len(err.stderr.strip().splitlines()) == 1


def test_a_newer_step_releases_the_older_snapshot_and_its_space(volume):
    write_orbax_step(volume.mountpoint, 1, {"w": os.urandom(8 << 20), **METADATA})
    used_1 = volume.status()["tiers"]["ram"]["used"]
    (volume.mountpoint / "ckpt" / "1" / "w").unlink()  # the job deletes it; the snapshot holds it
    assert volume.status()["tiers"]["ram"]["used"] == used_1
    write_orbax_step(volume.mountpoint, 2, {"w": os.urandom(1 << 20), **METADATA})
    assert list(steps_of(volume)) == [2]
    assert not step_tree(volume, 1).exists()
    assert volume.status()["tiers"]["ram"]["used"] < used_1 - (6 << 20)


def test_steps_survive_a_daemon_restart(volumes):
    vol = volumes(capacity="256M")
    write_orbax_step(vol.mountpoint, 4, {"a": b"a", **METADATA})
    tierfs("unmount", vol.mountpoint)
    vol2 = volumes(mountpoint=vol.mountpoint, capacity="256M")
    assert list(steps_of(vol2)) == [4]
    with open(vol2.mountpoint / "ckpt" / "4" / "a", "r+b") as f:  # copy on write after restart too
        f.write(b"b")
    assert (step_tree(vol2, 4) / "ckpt" / "4" / "a").read_bytes() == b"a"


def test_a_non_root_job_commits_with_a_marker_file(volume):
    """Pods running as uid 1000 cannot reach the control socket; a marker file is their commit."""
    script = (
        "import os, sys; d = os.path.join(sys.argv[1], 'export', 'run-21'); os.makedirs(d);"
        "open(os.path.join(d, 'weights'), 'wb').write(b'w' * 4096);"
        "open(os.path.join(d, '.tierfs-commit'), 'w').close()"
    )
    python = shutil.which("python3", path="/usr/bin:/bin")
    subprocess.run([python, "-c", script, str(volume.mountpoint)], check=True, user=1000, group=1000)
    state = steps_of(volume)[21]
    assert state["roots"] == ["export/run-21"]
    frozen = step_tree(volume, 21) / "export" / "run-21" / "weights"
    assert frozen.read_bytes() == b"w" * 4096 and frozen.stat().st_uid == 1000


def test_a_file_still_open_for_writing_is_copied_and_counted(volume):
    tmp = volume.mountpoint / "ckpt" / "3.orbax-checkpoint-tmp"
    tmp.mkdir(parents=True)
    with open(tmp / "late", "wb") as f:
        f.write(b"a" * (4 << 20))
        f.flush()
        os.rename(tmp, volume.mountpoint / "ckpt" / "3")  # committed while still open
        used = volume.status()["tiers"]["ram"]["used"]
        f.write(b"b" * 10)  # lands in the live file only
    frozen = step_tree(volume, 3) / "ckpt" / "3" / "late"
    assert frozen.read_bytes() == b"a" * (4 << 20)
    assert (volume.mountpoint / "ckpt" / "3" / "late").stat().st_size == (4 << 20) + 10
    assert used >= 2 * (4 << 20), "the snapshot's private copy uses RAM too"
