"""The daemon's own files on the node: private, checked when read, never reached through a
link the job made.

The daemon runs as root on a node shared with other users and other jobs. These tests
play the local user: a training job (uid 1000) that owns directories in its volume and
swaps one for a symbolic link, or someone who plants a file where the daemon keeps its
state, and check that root never deletes, freezes or trusts anything outside the job's
tree because of it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
from pathlib import Path

import pytest
import trio

from tests.cluster import free_port
from tests.conftest import tierfs
from tests.fuse.test_mtc import YAML, handshake
from tierfs import control, mounts

USER = 1000
PYTHON = shutil.which("python3", path="/usr/bin:/bin")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def as_job(script: str, *args: object) -> None:
    """Run ``script`` as the training job's user (uid 1000), as a pod with runAsUser would."""
    subprocess.run([PYTHON, "-c", script, *map(str, args)], check=True, user=USER, group=USER, timeout=60)


def write_step(vol, parent: str, step: int) -> None:
    """An Orbax-style step ``<parent>/<step>`` written and committed by the job (uid 1000)."""
    as_job(
        "import os, sys; base = os.path.join(sys.argv[1], sys.argv[2]); os.makedirs(base, exist_ok=True);"
        "tmp = os.path.join(base, sys.argv[3] + '.orbax-checkpoint-tmp'); os.mkdir(tmp);"
        "open(os.path.join(tmp, 'weights'), 'wb').write(b'w' * 4096);"
        "open(os.path.join(tmp, 'commit_success.txt'), 'w').close();"
        "os.rename(tmp, os.path.join(base, sys.argv[3]))",
        vol.mountpoint, parent, step,
    )


def test_the_daemons_own_files_are_root_only(volumes, shm_dir, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("a-job-secret-of-some-length")
    ramdisk = shm_dir("tierfs-ram") / "new" / "ramdisk"  # nothing of it exists yet
    vol = volumes(job="run", ramdisk_dir=ramdisk, listen=f"127.0.0.29:{free_port('127.0.0.29')}",
                  secret_file=secret)
    handshake(vol.mountpoint, YAML.format(job="run", rank=0, nodes=1))
    write_step(vol, "ckpt", 1)
    rank = ramdisk / "run" / "rank-0"
    private_dirs = [ramdisk.parent, ramdisk, ramdisk / "run", rank, rank / "steps", rank / "steps" / "1",
                    rank / "replicas"]
    private_files = [rank / "mtc.json", rank / "daemon.lock", rank / "steps" / "1" / "state.json"]
    reg = mounts.Registration(vol.mountpoint)
    private_files += [reg.info_path, reg.socket_path]
    for path in private_dirs:
        st = os.lstat(path)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and mode(path) == 0o700, f"{path}: {mode(path):o}"
    for path in private_files:
        st = os.lstat(path)
        assert st.st_uid == 0 and mode(path) == 0o600, f"{path}: {mode(path):o}"
    assert mode(rank / "tree") == 0o1777, "the job's tree keeps tmpfs' root mode"
    assert os.lstat(rank / "tree" / "ckpt" / "1" / "weights").st_uid == USER


def _planted_steps_link(rank: Path, elsewhere: Path) -> str:
    shutil.rmtree(rank / "steps")
    os.symlink(elsewhere, rank / "steps")
    return "steps"


def _foreign_mtc_state(rank: Path, elsewhere: Path) -> str:
    os.chown(rank / "mtc.json", USER, USER)
    return "mtc.json"


def _writable_step_state(rank: Path, elsewhere: Path) -> str:
    os.chmod(rank / "steps" / "1" / "state.json", 0o666)
    return "state.json"


def _foreign_job_dir(rank: Path, elsewhere: Path) -> str:
    os.chown(rank.parent, USER, USER)
    return str(rank.parent)


def _foreign_ramdisk(rank: Path, elsewhere: Path) -> str:
    os.chown(rank.parent.parent, USER, USER)
    return str(rank.parent.parent)


def _linked_lock(rank: Path, elsewhere: Path) -> str:
    os.unlink(rank / "daemon.lock")
    os.symlink(elsewhere / "precious", rank / "daemon.lock")
    return "daemon.lock"


@pytest.mark.parametrize("plant", [_planted_steps_link, _foreign_mtc_state, _writable_step_state,
                                   _foreign_job_dir, _foreign_ramdisk, _linked_lock])
def test_a_start_refuses_state_it_did_not_write(volumes, shm_dir, plant):
    """What a local user planted where the daemon keeps its state must not steer the next start."""
    vol = volumes(job="run")
    handshake(vol.mountpoint, YAML.format(job="run", rank=0, nodes=1))
    write_step(vol, "ckpt", 1)
    tierfs("unmount", vol.mountpoint)
    elsewhere = shm_dir("tierfs-elsewhere")  # root's, outside every job: e.g. another job's data
    (elsewhere / ".staging-not-yours").mkdir()
    (elsewhere / "precious").write_text("keep")
    rank = vol.ramdisk / "run" / "rank-0"
    named = plant(rank, elsewhere)

    result = tierfs("mount", vol.mountpoint, "--ramdisk", vol.ramdisk, "--job", "run", check=False)
    try:
        assert result.returncode != 0, "the start must refuse"
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr and named in lines[0], result.stderr
        assert mounts.find_mount(vol.mountpoint) is None
        assert (elsewhere / ".staging-not-yours").is_dir() and (elsewhere / "precious").read_text() == "keep"
    finally:
        os.chown(rank.parent.parent, 0, 0)  # let the fixture clean up
        os.chown(rank.parent, 0, 0)


def test_a_directory_an_older_version_left_wide_open_is_narrowed(volumes):
    vol = volumes(job="run")
    write_step(vol, "ckpt", 1)
    tierfs("unmount", vol.mountpoint)
    rank = vol.ramdisk / "run" / "rank-0"
    for path in (rank.parent, rank, rank / "steps"):
        os.chmod(path, 0o777)  # what umask 0 made before
    volumes(job="run", mountpoint=vol.mountpoint)
    assert [mode(p) for p in (rank.parent, rank, rank / "steps")] == [0o700] * 3
    assert (vol.mountpoint / "ckpt" / "1" / "weights").read_bytes() == b"w" * 4096


def test_retention_never_deletes_through_a_link_the_job_swapped_in(volumes, shm_dir):
    """The job commits ckpt/1, then replaces ``ckpt`` by a link to another job's data; when a
    newer step drops step 1, the daemon (root) must not delete what the link points to."""
    vol = volumes(job="run")  # --keep-local 1: step 2 drops step 1
    handshake(vol.mountpoint, YAML.format(job="run", rank=0, nodes=1))  # the node now deletes old steps
    victim = shm_dir("tierfs-victim")
    (victim / "ckpt" / "1").mkdir(parents=True)
    (victim / "ckpt" / "1" / "weights").write_bytes(b"another job's checkpoint")
    write_step(vol, "ckpt", 1)
    as_job("import os, sys; m = sys.argv[1]; os.rename(os.path.join(m, 'ckpt'), os.path.join(m, 'moved'));"
           "os.symlink(sys.argv[2], os.path.join(m, 'ckpt'))", vol.mountpoint, victim / "ckpt")
    write_step(vol, "moved", 2)  # commits step 2; retention drops step 1, whose root was ckpt/1
    assert sorted(s["step"] for s in vol.status()["steps"]) == [2]
    # The node answers replicator.yaml only after the deletions queued before it: a barrier.
    handshake(vol.mountpoint, YAML.format(job="run", rank=0, nodes=1))
    assert (victim / "ckpt" / "1" / "weights").read_bytes() == b"another job's checkpoint"
    assert (vol.mountpoint / "moved" / "2" / "weights").read_bytes() == b"w" * 4096
    assert os.path.islink(vol.mountpoint / "ckpt")


def test_an_explicit_commit_never_freezes_files_through_a_link(volume, shm_dir):
    victim = shm_dir("tierfs-victim")
    (victim / "5").mkdir()
    (victim / "5" / "weights").write_bytes(b"another job's checkpoint")
    as_job("import os, sys; os.symlink(sys.argv[2], os.path.join(sys.argv[1], 'export'))", volume.mountpoint, victim)
    result = tierfs("commit", volume.mountpoint / "export" / "5", check=False)
    assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "symbolic link" in result.stderr and "Traceback" not in result.stderr
    assert os.lstat(victim / "5" / "weights").st_nlink == 1, "no snapshot links another job's file"
    assert volume.status()["steps"] == []


def test_the_control_socket_is_never_open_to_others(tmp_path, monkeypatch):
    """The socket file bind() creates already has its final mode: there is no moment at which
    another user could connect and commit or ask."""
    seen: list[int] = []

    async def main() -> None:
        cls = type(trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        real_bind = cls.bind

        async def bind(self, address):
            await real_bind(self, address)
            seen.append(mode(Path(address)))  # the instant the file exists

        monkeypatch.setattr(cls, "bind", bind)

        async def handler(request: dict) -> dict:
            return {"ok": True}

        async with trio.open_nursery() as nursery:
            await nursery.start(control.serve, tmp_path / "run" / "x.sock", handler)
            reply = await trio.to_thread.run_sync(control.request, tmp_path / "run" / "x.sock", {"op": "status"})
            assert reply == {"ok": True}
            nursery.cancel_scope.cancel()

    old = os.umask(0)  # the daemon's
    try:
        trio.run(main)
    finally:
        os.umask(old)
    assert seen == [0o600]
    assert mode(tmp_path / "run") == 0o700


def test_a_registration_someone_else_wrote_is_not_believed(volume):
    reg = mounts.Registration(volume.mountpoint)
    info = reg.read()
    assert info is not None and info["pid"] == volume.pid
    os.chown(reg.info_path, USER, USER)
    try:
        assert reg.read() is None, "a pid from a file another user could write is never acted on"
    finally:
        os.chown(reg.info_path, 0, 0)
    assert json.loads(reg.info_path.read_text())["pid"] == info["pid"]
