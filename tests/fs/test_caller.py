"""The daemon's own checks: what it creates or opens on a caller's behalf, it does as that caller.

The kernel checks a request against the mount's attributes, but the RAM tier can change
beside it (a restore, the daemon's own work, a second mount of the tree). Here Operations
is called as the engines call it, on a real tmpfs tree, for a real process of another user
(its supplementary groups are read from /proc), with the names already taken or the
directories closed as the kernel could not have seen them: tmpfs must refuse what it would
refuse that user, and never hand over a file root opened.
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import threading
from pathlib import Path

import pyfuse3
import pytest

from tierfs.fs import Operations
from tierfs.fs.caller import acting_as, supplementary_groups
from tierfs.fs.messages import Context
from tierfs.ramtier import SpaceAccount

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="acting as other users needs root")

ALICE, BOB, SUPP = 1000, 1001, 2000
ROOT = pyfuse3.ROOT_INODE


@pytest.fixture
def caller():
    """A live process of uid 1000, gid 1000 and supplementary group 2000: the request's caller."""
    proc = subprocess.Popen(["sleep", "60"], user=ALICE, group=ALICE, extra_groups=[SUPP])
    try:
        yield Context(ALICE, ALICE, proc.pid, umask=0o022)
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def ops(shm_dir):
    tree = shm_dir("tierfs-tree")
    os.chmod(tree, 0o755)  # root's: nobody else may make names here
    ops = Operations(tree, SpaceAccount(None, tree))
    ops.root = Path(tree)
    (ops.root / "open").mkdir()
    os.chmod(ops.root / "open", 0o777)
    yield ops
    ops.close()


def errno_of(fn, *args):
    try:
        result = fn(*args)
    except (OSError, pyfuse3.FUSEError) as e:
        return errno.errorcode[e.errno]
    return result


def put(path: Path, mode: int, uid: int, gid: int, data: bytes = b"secret") -> None:
    path.write_bytes(data)
    os.chown(path, uid, gid)
    os.chmod(path, mode)


def own_credentials() -> tuple[str, str, str]:
    with open("/proc/thread-self/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return fields["Uid"].split()[3], fields["Gid"].split()[3], fields["Groups"].strip()


def test_a_taken_name_is_opened_only_as_its_caller_may(ops, caller):
    """The kernel looked the name up as free; another user's file is there by the create."""
    parent = ops.lookup(ROOT, b"open")[0]
    put(ops.root / "open" / "bobs", 0o600, BOB, BOB)
    rw_create = os.O_RDWR | os.O_CREAT
    before = own_credentials()
    assert errno_of(ops.create, parent, b"bobs", 0o100644, rw_create, caller) == "EACCES"
    assert own_credentials() == before  # root's own credentials are back, after a refusal too
    # What the caller may open it gets, by its supplementary group too, as tmpfs decides.
    put(ops.root / "open" / "shared", 0o660, BOB, SUPP)
    fi, ino, st = ops.create(parent, b"shared", 0o100644, rw_create, caller)
    try:
        assert os.pread(fi.fh, 6, 0) == b"secret" and st.st_uid == BOB
    finally:
        ops.release(fi.fh)
    assert own_credentials() == before


async def test_names_are_made_only_where_the_caller_may_and_never_chowned_after(ops, caller):
    """mknod, mkdir, symlink and link as the caller: refused in a directory it may not write
    (root would pass), and what they make is the caller's from the start."""
    victim = ops.root / "victim"
    put(victim, 0o600, 0, 0)
    node = ops.lookup(ROOT, b"victim")[0]
    assert errno_of(ops.create, ROOT, b"victim", 0o100644, os.O_RDWR | os.O_CREAT, caller) == "EACCES"
    for make in (
        lambda: ops.mknod(ROOT, b"n", stat.S_IFREG | 0o644, 0, caller),
        lambda: ops.mkdir(ROOT, b"d", 0o755, caller),
        lambda: ops.symlink(ROOT, b"l", b"victim", caller),
    ):
        with pytest.raises(OSError) as refused:
            await make()
        assert refused.value.errno == errno.EACCES
    # Into a directory the caller may write: a hard link of root's private file is still
    # not the caller's to make (protected_hardlinks), which root would pass.
    with open("/proc/sys/fs/protected_hardlinks") as f:
        if f.read().strip() == "1":
            parent = ops.lookup(ROOT, b"open")[0]
            with pytest.raises(OSError) as refused:
                await ops.link(node, parent, b"h", caller)
            assert refused.value.errno == errno.EPERM
    assert sorted(os.listdir(ops.root)) == ["open", "victim"] and os.listdir(ops.root / "open") == []
    assert os.stat(victim).st_uid == 0

    setgid = ops.root / "open" / "setgid"
    setgid.mkdir()
    os.chown(setgid, 0, 3000)
    os.chmod(setgid, 0o2777)
    sg = ops.lookup(parent, b"setgid")[0]
    made = {
        "n": await ops.mknod(sg, b"n", stat.S_IFREG | 0o666, 0, caller),
        "d": await ops.mkdir(sg, b"d", 0o777, caller),
        "l": await ops.symlink(sg, b"l", b"n", caller),
    }
    for name, (_, attr) in made.items():
        st = os.lstat(setgid / name)
        assert (attr.st_uid, attr.st_gid, st.st_uid, st.st_gid) == (ALICE, 3000, ALICE, 3000), name
    assert stat.S_IMODE(os.stat(setgid / "n").st_mode) == 0o644  # the caller's umask, applied by the daemon
    assert stat.S_IMODE(os.stat(setgid / "d").st_mode) == 0o2755  # set-gid inherited as tmpfs does


async def test_a_caller_that_is_gone_or_changed_gets_a_clean_error(ops, caller):
    gone = subprocess.Popen(["true"], user=ALICE, group=ALICE)
    gone.wait()
    parent = ops.lookup(ROOT, b"open")[0]
    for ctx, expected in (
        (Context(ALICE, ALICE, gone.pid), errno.ESRCH),
        (Context(BOB, BOB, caller.pid), errno.EACCES),
    ):  # not that process's ids
        with pytest.raises(OSError) as refused:
            await ops.mkdir(parent, b"d", 0o755, ctx)
        assert refused.value.errno == expected
    assert os.listdir(ops.root / "open") == []
    assert supplementary_groups(caller.pid, ALICE, ALICE) == [SUPP]


def test_only_the_calling_thread_takes_on_the_callers_credentials(caller):
    """Raw per-thread system calls: glibc's setgroups would change every thread of the daemon."""
    parked = threading.Event()
    release = threading.Event()
    tid = []

    def other():
        tid.append(threading.get_native_id())
        parked.set()
        release.wait(10)

    worker = threading.Thread(target=other)
    worker.start()
    parked.wait(10)
    try:

        def creds(task: int) -> tuple[str, str]:
            with open(f"/proc/self/task/{task}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            return fields["Uid"].split()[3], fields["Groups"].strip()

        theirs = creds(tid[0])
        with acting_as(caller):
            assert creds(threading.get_native_id()) == (str(ALICE), str(SUPP))
            assert creds(tid[0]) == theirs
        assert creds(threading.get_native_id()) == theirs
    finally:
        release.set()
        worker.join()
