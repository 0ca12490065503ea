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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import tierfs
from tests.fuse.test_mtc import YAML, handshake
from tests.gcs.test_backup_restore import wait_backed_up
from tests.helpers import free_port, wait_for
from tests.multinode.conftest import cluster  # noqa: F401 (the fixture)
from tests.multinode.test_peers import commit_step, replicated
from tests.security.test_untrusted_bytes import (
    JSON,
    Sandbox,
    check_restored_tree,
    hash_of,
    hostile_manifests,
    one_line,
    sample,
)
from tierfs.core import control_client, mounts
from tierfs.core.errors import UserError
from tierfs.core.manifest import MAX_BYTES as MAX_MANIFEST
from tierfs.core.manifest import Entry, Manifest
from tierfs.daemon import control
from tierfs.daemon.daemon import Daemon
from tierfs.pipeline.namespace import set_aside

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
        vol.mountpoint,
        parent,
        step,
    )


def test_the_daemons_own_files_are_root_only(volumes, shm_dir, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("a-job-secret-of-some-length")
    ramdisk = shm_dir("tierfs-ram") / "new" / "ramdisk"  # nothing of it exists yet
    vol = volumes(job="run", ramdisk_dir=ramdisk, listen=f"127.0.0.29:{free_port('127.0.0.29')}", secret_file=secret)
    handshake(vol.mountpoint, YAML.format(job="run", rank=0, nodes=1))
    write_step(vol, "ckpt", 1)
    rank = ramdisk / "run" / "rank-0"
    private_dirs = [
        ramdisk.parent,
        ramdisk,
        ramdisk / "run",
        rank,
        rank / "steps",
        rank / "steps" / "1",
        rank / "replicas",
    ]
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


@pytest.mark.parametrize(
    "plant",
    [_planted_steps_link, _foreign_mtc_state, _writable_step_state, _foreign_job_dir, _foreign_ramdisk, _linked_lock],
)
@pytest.mark.expect_log('ERROR tierfs: ')
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


@pytest.mark.expect_log('had mode 0777: narrowed to 0700')
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


@pytest.mark.expect_log('could not delete superseded step .* symbolic link')
def test_retention_never_deletes_through_a_link_the_job_swapped_in(volumes, shm_dir):
    """The job commits ckpt/1, then replaces ``ckpt`` by a link to another job's data; when a
    newer step drops step 1, the daemon (root) must not delete what the link points to."""
    vol = volumes(job="run")  # --keep-local 1: step 2 drops step 1
    handshake(vol.mountpoint, YAML.format(job="run", rank=0, nodes=1))  # the node now deletes old steps
    victim = shm_dir("tierfs-victim")
    (victim / "ckpt" / "1").mkdir(parents=True)
    (victim / "ckpt" / "1" / "weights").write_bytes(b"another job's checkpoint")
    write_step(vol, "ckpt", 1)
    as_job(
        "import os, sys; m = sys.argv[1]; os.rename(os.path.join(m, 'ckpt'), os.path.join(m, 'moved'));"
        "os.symlink(sys.argv[2], os.path.join(m, 'ckpt'))",
        vol.mountpoint,
        victim / "ckpt",
    )
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
            reply = await trio.to_thread.run_sync(control_client.request, tmp_path / "run" / "x.sock", {"op": "status"})
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


# -- a restart that presents a step: set aside and linked beneath the tree ----------------------


@pytest.mark.expect_log(
    'is not followed through it',
    'is in the way of step',
    'WARNING tierfs: GCS objects in .* are neither encrypted nor authenticated',
)
def test_a_start_never_moves_or_links_through_a_link_the_job_swapped_in(volumes, shm_dir, gcs_bucket):
    """Rank 0 committed steps 1 and 2, rank 1 only step 1, so a restart restores step 1 and
    takes step 2 out of the volume. The job (uid 1000) moved ``ckpt`` away and put a link to
    another job's data in its place: root must neither move that data aside nor link step 1
    into it."""
    gcs = f"gs://{gcs_bucket}/b"
    vol0 = volumes(job="run", rank=0, nodes=2, gcs=gcs)
    vol1 = volumes(job="run", rank=1, nodes=2, gcs=gcs)
    for vol in (vol0, vol1):
        write_step(vol, "ckpt", 1)
        wait_backed_up(vol, 1)
    write_step(vol0, "ckpt", 2)
    wait_backed_up(vol0, 2)
    victim = shm_dir("tierfs-victim")
    (victim / "2").mkdir()
    (victim / "2" / "weights").write_bytes(b"another job's checkpoint")
    as_job(
        "import os, sys; m = sys.argv[1]; os.rename(os.path.join(m, 'ckpt'), os.path.join(m, 'moved'));"
        "os.symlink(sys.argv[2], os.path.join(m, 'ckpt'))",
        vol0.mountpoint,
        victim,
    )
    tierfs("unmount", vol0.mountpoint)

    volumes(job="run", rank=0, nodes=2, gcs=gcs, mountpoint=vol0.mountpoint)
    assert vol0.status()["cluster"]["restore_step"] == 1
    assert os.listdir(victim) == ["2"], "nothing of step 1 is linked into the other job's data"
    assert (victim / "2" / "weights").read_bytes() == b"another job's checkpoint"
    assert not os.path.islink(vol0.mountpoint / "ckpt")
    assert (vol0.mountpoint / "ckpt" / "1" / "weights").read_bytes() == b"w" * 4096
    rank = vol0.ramdisk / "run" / "rank-0"
    links = [p for p in (rank / "aside").rglob("ckpt") if p.is_symlink()]
    assert [os.readlink(p) for p in links] == [str(victim)], "the job's link itself was set aside"
    for d in (rank / "aside").rglob("*"):
        if d.is_dir() and not d.is_symlink():
            assert mode(d) == 0o700, f"{d}: {mode(d):o}"


def _manifest_of_step_7() -> bytes:
    return json.dumps(
        {
            "format": 1,
            "job": "run",
            "rank": 0,
            "step": 7,
            "chunk_size": 4 << 20,
            "created": 1.0,
            "roots": ["ckpt"],
            "entries": [
                {
                    "path": "ckpt",
                    "kind": "dir",
                    "mode": 0o755,
                    "uid": USER,
                    "gid": USER,
                    "size": 0,
                    "mtime_ns": 0,
                    "target": None,
                    "chunks": [],
                }
            ],
        }
    ).encode()


def _linked_manifest(path: Path, elsewhere: Path) -> None:
    (elsewhere / "manifest.json").write_bytes(_manifest_of_step_7())
    os.symlink(elsewhere / "manifest.json", path)


def _foreign_manifest(path: Path, elsewhere: Path) -> None:
    path.write_bytes(_manifest_of_step_7())
    os.chown(path, USER, USER)


def _oversized_manifest(path: Path, elsewhere: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(MAX_MANIFEST + 1)  # sparse: costs nothing until someone reads it
    os.chmod(path, 0o600)


@pytest.mark.expect_log(
    'ERROR tierfs: unsafe ramdisk: .*tierfs did not write it',
    'WARNING tierfs: GCS objects in .* are neither encrypted nor authenticated',
)
@pytest.mark.parametrize("plant", [_linked_manifest, _foreign_manifest, _oversized_manifest])
def test_an_abandoned_restore_trusts_only_the_manifest_the_daemon_wrote(volumes, shm_dir, gcs_bucket, plant):
    """An unfinished restore of a step no longer chosen is taken out of the volume by the roots
    its manifest names: that file is read as a state file (capped, no link, root's own)."""
    gcs = f"gs://{gcs_bucket}/b"
    vol = volumes(job="run", gcs=gcs)
    write_step(vol, "ckpt", 1)
    wait_backed_up(vol, 1)
    tierfs("unmount", vol.mountpoint)
    rank = vol.ramdisk / "run" / "rank-0"
    step_dir = rank / "steps" / "7"
    os.mkdir(step_dir, 0o700)
    (step_dir / "restore.json").write_text(
        json.dumps({"step": 7, "prepared": True, "linked": True, "peers": [], "in_gcs": True})
    )
    os.chmod(step_dir / "restore.json", 0o600)
    plant(step_dir / "manifest.json", shm_dir("tierfs-elsewhere"))

    result = tierfs("mount", vol.mountpoint, "--ramdisk", vol.ramdisk, "--job", "run", "--gcs", gcs, check=False)
    assert result.returncode != 0, "the start must refuse"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr and "manifest.json" in lines[0], result.stderr
    assert mounts.find_mount(vol.mountpoint) is None
    assert (rank / "tree" / "ckpt" / "1" / "weights").read_bytes() == b"w" * 4096, "nothing was set aside"


# -- modes: everything the daemon keeps for itself is root's alone ------------------------------


def _check_root_only(rank: Path) -> list[str]:
    """What under ``rank`` is not root-only (0700 directories, 0600 files); the job's trees aside."""
    wrong = []
    for dirpath, dirnames, filenames in os.walk(rank):
        here = Path(dirpath)
        if here == rank:
            dirnames.remove("tree")
        if here.parent.name == "steps" and "tree" in dirnames:
            dirnames.remove("tree")  # a snapshot: the job's modes
            wrong += [f"{here / 'tree'}: {mode(here / 'tree'):o}"] if mode(here / "tree") != 0o700 else []
        for name in dirnames:
            if mode(here / name) != 0o700 or os.lstat(here / name).st_uid != 0:
                wrong.append(f"{here / name}: {mode(here / name):o}")
        for name in filenames:
            if mode(here / name) != 0o600 or os.lstat(here / name).st_uid != 0:
                wrong.append(f"{here / name}: {mode(here / name):o}")
    return wrong


def test_every_file_and_directory_the_daemon_makes_for_itself_is_root_only(cluster):
    """The daemon's umask is 0: a manifest, a replica, a restore's progress or the log made
    without an explicit mode would be open to every user of the node."""
    c = cluster(2, replicas=1)
    c.start_all()
    commit_step(c.nodes[0].mountpoint, 3, {"params": os.urandom(5 << 20), "meta/opt": b"{}"})
    wait_for(lambda: replicated(c, 0, 3), what="replication of step 3")
    ranks = [n.ramdisk / c.job / f"rank-{n.index}" for n in c.nodes]
    assert (ranks[0] / "steps" / "3" / "manifest.json").exists()
    assert list((ranks[1] / "replicas" / "manifests").iterdir()), "node 1 holds rank 0's replica"
    wrong = _check_root_only(ranks[0]) + _check_root_only(ranks[1])

    c.kill(0)
    c.wipe(0)
    c.start(0, prefetch=0)  # the restore stays half done: its progress files stay to be seen
    with open(c.nodes[0].mountpoint / "ckpt" / "3" / "params", "rb") as f:
        assert len(f.read(10)) == 10
    assert (ranks[0] / "steps" / "3" / "restore.json").exists()
    assert (ranks[0] / "steps" / "3" / "restored-chunks").read_text().strip()
    wrong += _check_root_only(ranks[0])
    for node in c.nodes:
        log = mounts.Registration(node.mountpoint).log_path
        if mode(log) != 0o600:
            wrong.append(f"{log}: {mode(log):o}")
    assert wrong == [], "\n".join(wrong)


OBSTACLES = st.sampled_from(
    [
        "none",
        "dir",
        "dir",
        "file",
        "link to a directory outside",
        "link to a file outside",
        "dangling link",
        "link inside the tree",
    ]
)


@settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck))
@given(depth=st.integers(1, 3), obstacles=st.lists(OBSTACLES, min_size=4, max_size=4))
def test_whatever_the_job_left_in_the_way_a_restored_step_lands_in_its_tree(shm_dir, depth, obstacles):
    """A restore links its step into the tree at the step's root; along that path the job may
    have left files, directories and links of any kind (to other jobs' data, say). Each is
    set aside or kept, and nothing outside the tree is moved, linked or created."""
    sandbox = Sandbox(shm_dir("tierfs-sec"))
    parts = [f"d{i}" for i in range(depth)] + ["500"]
    root = "/".join(parts)
    entries = [Entry("/".join(parts[: i + 1]), "dir", 0o755, USER, USER, 0, 10 + i) for i in range(len(parts))]
    entries.append(
        Entry(f"{root}/a.bin", "file", 0o644, USER, USER, 9, 20, chunks=[hash_of("0"), hash_of("1"), hash_of("2")])
    )
    manifest = Manifest(job="llama", rank=3, step=500, chunk_size=4, roots=[root], created=1.0, entries=entries)

    tree, planted = sandbox.rank.tree, {}
    for i, what in enumerate(obstacles[: len(parts)]):
        path = tree / "/".join(parts[: i + 1])
        if what == "none":
            break
        planted["/".join(parts[: i + 1])] = what
        if what == "dir":
            path.mkdir()
            (path / "mine").write_bytes(b"the job's")
            continue
        if what == "file":
            path.write_bytes(b"the job's")
        else:
            os.symlink(
                {
                    "link to a directory outside": sandbox.sentinel,
                    "link to a file outside": sandbox.sentinel / "keep",
                    "dangling link": sandbox.base / "nowhere",
                    "link inside the tree": tree,
                }[what],
                path,
            )
        break  # nothing can be planted beneath a file or a link without leaving the tree

    for rel in planted:  # a newer step the whole job cannot restore, under each planted name
        set_aside(sandbox.rank, f"{rel}/keep", "step 600 is not complete on every rank")
    sandbox.restore(manifest)
    assert sandbox.outside_untouched()
    here = tree
    for name in parts:
        here = here / name
        assert stat.S_ISDIR(os.lstat(here).st_mode), f"{here} is not a real directory"
    snap = sandbox.rank.path / "steps" / "500" / "tree" / root / "a.bin"
    assert os.lstat(here / "a.bin").st_ino == os.lstat(snap).st_ino
    aside = sandbox.rank.path / "aside"
    for rel, what in planted.items():
        if what == "dir" and rel != root:
            assert (tree / rel / "mine").read_bytes() == b"the job's", "a real directory above the root is kept"
            continue
        kept = [stamp / rel for stamp in aside.iterdir() if os.path.lexists(stamp / rel)]
        assert len(kept) == 1, (rel, what, "not set aside")
        assert kept[0].is_symlink() == what.startswith(("link", "dangling"))


# -- a restart reads a restore's progress and an abandoned restore's manifest -------------------


def _plant_private(path: Path, data: bytes) -> None:
    """A file as the daemon writes its own: root's, 0600."""
    path.unlink(missing_ok=True)
    path.write_bytes(data)
    os.chmod(path, 0o600)


PROGRESS = st.one_of(
    st.binary(max_size=200),
    JSON.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {
            "step": st.sampled_from([500, 7, "500", None]),
            "prepared": JSON | st.booleans(),
            "linked": JSON | st.booleans(),
        }
    ).map(lambda d: json.dumps(d).encode()),
)
JOURNALS = st.one_of(
    st.binary(max_size=200),
    st.lists(st.sampled_from([hash_of("0"), hash_of("1"), hash_of("2"), "zz", "", "\x00" * 3]), max_size=6).map(
        lambda names: "\n".join(names).encode()
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(progress=PROGRESS, journal=JOURNALS)
def test_a_restore_resumes_from_any_progress_files_or_starts_over(shm_dir, progress, journal):
    """Whatever ``restore.json`` and ``restored-chunks`` hold after a crash, a restart resumes
    or starts the step over, or refuses in one line; it stays in the job's tree."""
    sandbox = Sandbox(shm_dir("tierfs-sec"))
    sandbox.restore(sample())
    step_dir = sandbox.rank.path / "steps" / "500"
    _plant_private(step_dir / "restore.json", progress)
    _plant_private(step_dir / "restored-chunks", journal)
    try:
        sandbox.restore(sample())
    except UserError as e:
        one_line(e)
    assert sandbox.outside_untouched()
    check_restored_tree(sandbox)
    assert stat.S_ISDIR(os.lstat(sandbox.rank.tree / "ckpt" / "500").st_mode)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.one_of(st.binary(max_size=300), JSON.map(lambda v: json.dumps(v).encode()), hostile_manifests()))
def test_abandoning_a_restore_reads_any_manifest_as_roots_or_none(shm_dir, data):
    """The manifest of an unfinished restore that is no longer wanted names what leaves the
    volume: whatever it holds, only paths inside the tree are set aside, and the rest is a
    warning or a one-line refusal."""
    sandbox = Sandbox(shm_dir("tierfs-sec"))
    sandbox.restore(sample())
    daemon = Daemon(sandbox.cfg)
    daemon.steps.load()
    step_dir = sandbox.rank.path / "steps" / "7"
    step_dir.mkdir(mode=0o700)
    _plant_private(step_dir / "restore.json", b'{"step": 7, "prepared": false, "linked": false}')
    _plant_private(step_dir / "manifest.json", data)
    try:
        daemon.planner.abandon(7)
    except UserError as e:
        one_line(e)
    assert sandbox.outside_untouched()
    assert not step_dir.exists()
