"""The ``tierfs`` command end to end: mount forms, persistence, crash recovery, errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from tierfs_testing import cleanup_mount, crash, wait_gone

from tests.conftest import tierfs
from tests.helpers import tree_digest
from tierfs.core import mounts
from tierfs.fs.engine import WRITERS


def one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.returncode != 0, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tierfs: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def populate(root: Path) -> None:
    (root / "step" / "state" / "d").mkdir(parents=True)
    for i in range(5):
        (root / "step" / "state" / "d" / f"chunk{i}").write_bytes(os.urandom(100_000 * (i + 1)))
    (root / "step" / "_CHECKPOINT_METADATA").write_text('{"step": 1}')
    os.chmod(root / "step" / "_CHECKPOINT_METADATA", 0o444)
    os.symlink("step/state", root / "latest")
    os.link(root / "step" / "_CHECKPOINT_METADATA", root / "meta-link")
    (root / "sparse").write_bytes(b"")
    os.truncate(root / "sparse", 1 << 30)
    os.chown(root / "step" / "state", 1000, 1000)
    os.chmod(root / "step", 0o2750)


def test_files_survive_unmount_and_remount(volumes):
    vol = volumes(job="persist", rank=3, nodes=4)
    populate(vol.mountpoint)
    before = tree_digest(vol.mountpoint, exact=True)
    tierfs("unmount", vol.mountpoint)
    assert not vol.is_mounted()
    assert not list(vol.mountpoint.iterdir())  # the mountpoint itself is empty
    vol2 = volumes(job="persist", rank=3, nodes=4, mountpoint=vol.mountpoint)
    assert tree_digest(vol2.mountpoint, exact=True) == before


def test_ranks_and_jobs_are_separate(volumes):
    a = volumes(job="j1", rank=0, nodes=2)
    b = volumes(job="j1", rank=1, nodes=2)
    c = volumes(job="j2", rank=0)
    (a.mountpoint / "f").write_text("a")
    assert not (b.mountpoint / "f").exists() and not (c.mountpoint / "f").exists()
    assert (a.ramdisk / "j1" / "rank-0" / "tree" / "f").read_text() == "a"


def test_a_node_crash_mid_write_keeps_closed_files_and_remount_recovers(volumes):
    """Keeper and daemon killed (what a node's crash does): the mount is dead, and mounting
    again over it brings back every file the writer closed."""
    vol = volumes(job="crash")
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            """
import os, sys
root = sys.argv[1]
for i in range(2000):
    data = (b"%08d" % i) * (131072 * (1 + i % 4))
    with open(os.path.join(root, f"f{i}"), "wb") as f:
        f.write(data)
    print(i, flush=True)
""",
            str(vol.mountpoint),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    closed = []
    try:
        for line in writer.stdout:
            closed.append(int(line))
            if len(closed) == 40:
                crash(mounts.Registration(vol.mountpoint).read())
                break
        for line in writer.stdout:  # files the writer closed before it noticed
            closed.append(int(line))
    finally:
        writer.kill()
        writer.wait()
    assert mounts.is_dead(vol.mountpoint)
    vol2 = volumes(job="crash", mountpoint=vol.mountpoint)
    for i in closed:
        assert (vol2.mountpoint / f"f{i}").read_bytes() == (b"%08d" % i) * (131072 * (1 + i % 4))


def test_unmount_clears_a_dead_mount(volumes):
    vol = volumes(job="dead")
    crash(mounts.Registration(vol.mountpoint).read())
    assert mounts.is_dead(vol.mountpoint)
    one_line_error(tierfs("status", vol.mountpoint, check=False), "gone")
    tierfs("unmount", vol.mountpoint)
    assert not vol.is_mounted()


def test_sigterm_to_the_keeper_unmounts(volumes):
    """The keeper passes SIGTERM on: the daemon unmounts, and both exit."""
    vol = volumes(job="keeper-term")
    info = mounts.Registration(vol.mountpoint).read()
    os.kill(info["keeper"], signal.SIGTERM)
    for pid in (info["keeper"], info["pid"]):
        wait_gone(pid)
        assert not mounts.process_alive(pid)
    assert not vol.is_mounted()


@pytest.mark.expect_log(r"giving the connection up", r"was killed by SIGKILL", r"cannot take over the FUSE connection")
def test_a_keeper_gives_up_a_connection_no_successor_can_serve(volumes):
    """A successor that cannot start (its record gone) is retried, then given up: the mount
    answers ENOTCONN as a dead one does, and mounting again recovers it."""
    vol = volumes(job="hopeless")
    (vol.mountpoint / "f").write_text("kept")
    info = mounts.Registration(vol.mountpoint).read()
    shutil.rmtree(vol.ramdisk / "hopeless" / "rank-0.session")
    os.kill(info["pid"], signal.SIGKILL)
    wait_gone(info["keeper"], timeout=60)
    assert not mounts.process_alive(info["keeper"])
    assert mounts.is_dead(vol.mountpoint)
    vol2 = volumes(job="hopeless", mountpoint=vol.mountpoint)
    assert (vol2.mountpoint / "f").read_text() == "kept"


def test_mount_helper_form_and_umount(shm_dir):
    """``mount -t fuse.tierfs JOB MOUNTPOINT -o ...`` through fuse3's mount.fuse3, then umount."""
    if shutil.which("tierfs", path="/usr/local/bin:/usr/bin:/bin") is None:
        pytest.fail("tierfs is not on the standard PATH: run scripts/setup.sh")
    ramdisk, mp = shm_dir("tierfs-ram"), shm_dir("tierfs-mnt")
    try:
        subprocess.run(
            [
                "mount",
                "-t",
                "fuse.tierfs",
                "helperjob",
                str(mp),
                "-o",
                f"rank=1,nodes=2,ramdisk={ramdisk},capacity=64M,nosuid,nodev",
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        entry = mounts.find_mount(mp)
        assert entry and entry.fstype == "fuse.tierfs" and entry.source == "helperjob"
        (mp / "f").write_text("via mount(8)")
        assert (ramdisk / "helperjob" / "rank-1" / "tree" / "f").read_text() == "via mount(8)"
        assert os.statvfs(mp).f_blocks * os.statvfs(mp).f_frsize == 64 << 20
        pid = mounts.Registration(mp).read()["pid"]
        subprocess.run(["umount", str(mp)], check=True, timeout=30)
        wait_gone(pid)
        assert not mounts.process_alive(pid), "daemon kept running after umount"
        assert mounts.find_mount(mp) is None
        bad = subprocess.run(
            ["mount", "-t", "fuse.tierfs", "helperjob", str(mp), "-o", "bogus=1"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode != 0 and "unknown mount option 'bogus=1'" in bad.stderr
    finally:
        cleanup_mount(mp)


def test_only_mountpoint_works_with_defaults(shm_dir):
    mp = shm_dir("tierfs-mnt")
    default_rank = Path("/dev/shm/tierfs/default/rank-0")
    made = [p for p in (default_rank, default_rank.parent, default_rank.parent.parent) if not p.exists()]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERFS_") or k == "TIERFS_RUNTIME_DIR"}
    try:
        tierfs("mount", mp, env=env)
        name = f"probe-{os.getpid()}"
        (mp / name).write_text("x")
        assert (default_rank / "tree" / name).read_text() == "x"
        os.unlink(mp / name)
        tierfs("unmount", mp)
    finally:
        cleanup_mount(mp)
        for path in made:  # only what this test created, deepest first
            shutil.rmtree(path, ignore_errors=True)


def test_options_from_environment(shm_dir):
    ramdisk, mp = shm_dir("tierfs-ram"), shm_dir("tierfs-mnt")
    env = dict(
        os.environ,
        TIERFS_RAMDISK=str(ramdisk),
        TIERFS_JOB="envjob",
        TIERFS_RANK="2",
        TIERFS_NODES="3",
        TIERFS_CAPACITY="128M",
    )
    try:
        tierfs("mount", mp, env=env)
        status = json.loads(tierfs("status", mp, "--json").stdout)
        assert (status["job"], status["rank"], status["nodes"]) == ("envjob", 2, 3)
        assert status["tiers"]["ram"]["capacity"] == 128 << 20
        assert status["tiers"]["ram"]["path"] == str(ramdisk / "envjob" / "rank-2" / "tree")
    finally:
        cleanup_mount(mp)


def test_status_human_and_json(volumes):
    vol = volumes(job="stat", capacity="64M")
    (vol.mountpoint / "f").write_bytes(b"x" * (1 << 20))
    human = tierfs("status", vol.mountpoint).stdout
    assert "job stat" in human and "used 1.0 MiB of 64.0 MiB" in human
    js = vol.status()
    assert js["tiers"]["ram"]["used"] == 1 << 20
    if js["fuse"]["data_path"] == "daemon":
        assert js["fuse"]["bytes_written"] == 1 << 20
    else:  # the kernel wrote the bytes itself; the daemon only saw the open
        assert js["fuse"]["bytes_written"] == 0 and js["fuse"]["passthrough_opens"] == 1
    assert f"data path {js['fuse']['data_path']}" in human


def test_read_only_mount(volumes):
    vol = volumes(job="ro")
    (vol.mountpoint / "f").write_text("x")
    tierfs("unmount", vol.mountpoint)
    ro = volumes(job="ro", mountpoint=vol.mountpoint, read_only=True)
    assert (ro.mountpoint / "f").read_text() == "x"
    with pytest.raises(OSError) as e:
        (ro.mountpoint / "g").write_text("y")
    assert e.value.errno == 30  # EROFS


@pytest.mark.parametrize(
    "asked, engine, path",
    [
        ("auto", "tierfs", "passthrough"),
        ("passthrough", "tierfs", "passthrough"),
        ("daemon", "tierfs", "daemon"),
        ("auto", "pyfuse3", "daemon"),
    ],
)
def test_the_data_path_is_chosen_logged_once_and_reported(volumes, asked, engine, path):
    vol = volumes(job="dp", data_path=asked, engine="auto" if engine == "tierfs" else engine)
    (vol.mountpoint / "f").write_bytes(b"x" * 4096)
    assert (vol.mountpoint / "f").read_bytes() == b"x" * 4096
    fuse = vol.status()["fuse"]
    assert (fuse["engine"], fuse["data_path"]) == (engine, path)
    assert (fuse["passthrough_opens"] > 0) == (path == "passthrough")
    log = mounts.Registration(vol.mountpoint).log_path.read_text()
    assert log.count("data path: ") == 1 and f"data path: {path}" in log
    human = tierfs("status", vol.mountpoint).stdout
    assert f"data path {path} ({engine} engine; {fuse['transfer']})" in human
    assert (
        fuse["transfer"]
        == {
            "passthrough": "others by direct I/O",
            "daemon": f"writes spliced by {WRITERS} threads",
            "pyfuse3": "writes copied by 1 thread",
        }["pyfuse3" if engine == "pyfuse3" else path]
    )
    assert fuse["wake_cpus"] == ("off (daemon engine)" if engine == "pyfuse3" else "on")
    assert f"idle CPUs kept awake in bursts: {fuse['wake_cpus']}" in human


# -- errors: one line, non-zero exit, nothing left mounted -----------------------------------


def test_error_missing_mountpoint(shm_dir):
    p = one_line_error(
        tierfs("mount", "/nonexistent/mnt", "--ramdisk", shm_dir(), check=False), "/nonexistent/mnt", "does not exist"
    )
    assert "mkdir" in p


@pytest.mark.expect_log('is already served by tierfs pid')
def test_error_busy_mountpoint_and_rank_served_twice(volumes, shm_dir):
    vol = volumes(job="busy")
    one_line_error(
        tierfs("mount", vol.mountpoint, "--ramdisk", vol.ramdisk, "--job", "other", check=False),
        "is busy",
        "tierfs unmount",
    )
    other_mp = shm_dir("tierfs-mnt")
    one_line_error(
        tierfs("mount", other_mp, "--ramdisk", vol.ramdisk, "--job", "busy", check=False),
        "already served",
        str(vol.mountpoint),
    )
    assert mounts.find_mount(other_mp) is None
    assert (vol.mountpoint / ".").exists()  # the first mount is unharmed


@pytest.mark.expect_log('ramdisk \\S+ is not writable')
def test_error_ramdisk_not_writable(shm_dir):
    ro = shm_dir("tierfs-ro")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    mp = shm_dir("tierfs-mnt")
    try:
        one_line_error(tierfs("mount", mp, "--ramdisk", ro / "x", check=False), "not writable", str(ro))
        assert mounts.find_mount(mp) is None
    finally:
        subprocess.run(["umount", str(ro)], check=True)


@pytest.mark.expect_log('capacity .* is below')
def test_error_capacity_below_stored(volumes):
    vol = volumes(job="cap")
    (vol.mountpoint / "f").write_bytes(b"x" * (3 << 20))
    tierfs("unmount", vol.mountpoint)
    line = one_line_error(
        tierfs("mount", vol.mountpoint, "--ramdisk", vol.ramdisk, "--job", "cap", "--capacity", "2M", check=False),
        "below",
        "already stored",
    )
    assert "--capacity" in line
    assert mounts.find_mount(vol.mountpoint) is None


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--rank", "5", "--nodes", "2"], "invalid rank 5"),
        (["--rank", "-1"], "invalid rank -1"),
        (["--rank", "one"], "expected a whole number"),
        (["--capacity", "lots"], "invalid capacity"),
        (["--job", "../etc"], "invalid job id"),
        (["--log-level", "loud"], "invalid log level"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_error_bad_input(args, fragment, shm_dir):
    mp = shm_dir("tierfs-mnt")
    one_line_error(tierfs("mount", mp, "--ramdisk", shm_dir(), *args, check=False), fragment)
    assert mounts.find_mount(mp) is None


def test_error_unmount_and_status_of_something_else(shm_dir):
    mp = shm_dir("tierfs-mnt")
    one_line_error(tierfs("unmount", mp, check=False), "is not mounted")
    one_line_error(tierfs("status", mp, check=False), "not a tierfs mount")
    one_line_error(tierfs("unmount", "/dev/shm", check=False), "not a tierfs mount")


def test_error_unmount_busy(volumes):
    vol = volumes(job="inuse")
    holder = subprocess.Popen(["sleep", "60"], cwd=vol.mountpoint)
    try:
        one_line_error(tierfs("unmount", vol.mountpoint, check=False), "is busy")
        assert vol.is_mounted()
    finally:
        holder.kill()
        holder.wait()
    tierfs("unmount", vol.mountpoint)


def test_sigterm_unmounts_and_keeps_files(volumes):
    """SIGTERM stops every task of the daemon, unmounts, and leaves the RAM tier as it was."""
    vol = volumes(job="term")
    (vol.mountpoint / "f").write_bytes(b"kept")
    pid = vol.pid
    os.kill(pid, signal.SIGTERM)
    wait_gone(pid)
    assert not mounts.process_alive(pid)
    assert not vol.is_mounted()
    assert mounts.Registration(vol.mountpoint).read() is None
    assert (vol.tree / "f").read_bytes() == b"kept"
