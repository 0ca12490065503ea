"""Extended attributes and inode flags through a mount, case by case, as tmpfs answers them.

Each script runs after :data:`tests.fuse.users.PRELUDE` on a tmpfs and on a mount, as root
and as a user of the volume, and every result must be the same: the flags of ``setxattr``,
size queries and short buffers, empty and largest values, each namespace, symlinks and
special files, ``trusted.*`` hidden from a lister without CAP_SYS_ADMIN; ``lsattr`` and
``chattr``, and what append-only and immutable then refuse. The pyfuse3 engine has no
ioctl handler (lsattr fails there with ENOTTY): its flags tests are skipped.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.fuse.differential import APPEND, IMMUTABLE, NODUMP, get_flags, link_fd, set_flags
from tests.fuse.users import PYTHON, differences, run_script
from tests.helpers import kill_daemon, write_orbax_step

USER, SUPP = 1000, 2000
AS_USER = {"user": USER, "group": USER, "extra_groups": [SUPP]}

XATTRS = r'''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.getxattr.restype = libc.listxattr.restype = ctypes.c_ssize_t
def get(path, name, size):
    buf = ctypes.create_string_buffer(max(size, 1))
    n = libc.getxattr(path.encode(), name.encode(), buf, ctypes.c_size_t(size))
    if n < 0:
        raise OSError(ctypes.get_errno(), "")
    return f"size {n}" if size == 0 else buf.raw[:n].decode()
def names(path, size):
    buf = ctypes.create_string_buffer(max(size, 1))
    n = libc.listxattr(path.encode(), buf, ctypes.c_size_t(size))
    if n < 0:
        raise OSError(ctypes.get_errno(), "")
    return f"size {n}" if size == 0 else sorted(buf.raw[:n].decode().split("\0")[:-1])
uid = os.getuid()
f = P(f"file-{uid}")
write(f, b"x")
t("create_new", os.setxattr, f, "user.a", b"one", os.XATTR_CREATE)
t("create_taken", os.setxattr, f, "user.a", b"two", os.XATTR_CREATE)
t("replace_missing", os.setxattr, f, "user.b", b"two", os.XATTR_REPLACE)
t("replace_taken", os.setxattr, f, "user.a", b"three", os.XATTR_REPLACE)
t("value", get, f, "user.a", 64)
t("size_query", get, f, "user.a", 0)
t("short_buffer", get, f, "user.a", 2)
t("exact_buffer", get, f, "user.a", 5)
t("empty_value", os.setxattr, f, "user.empty", b"")
t("empty_read", get, f, "user.empty", 16)
t("largest_value", os.setxattr, f, "user.big", b"v" * 65536)
t("largest_read", lambda: str(len(os.getxattr(f, "user.big"))))
t("too_large", os.setxattr, f, "user.huge", b"v" * 65537)
t("longest_name", os.setxattr, f, "user." + "n" * 250, b"1")
t("too_long_name", os.setxattr, f, "user." + "n" * 251, b"1")
t("empty_suffix", os.setxattr, f, "user.", b"1")
t("no_namespace", os.setxattr, f, "plain", b"1")
t("unknown_system", os.setxattr, f, "system.other", b"1")
t("trusted_set", os.setxattr, f, "trusted.t", b"1")
t("security_set", os.setxattr, f, "security.s", b"1")
t("list_size", names, f, 0)
t("list_short", names, f, 3)
t("list", names, f, 4096)
t("remove", os.removexattr, f, "user.a")
t("remove_missing", os.removexattr, f, "user.a")
t("get_removed", get, f, "user.a", 64)
t("other_users_file", os.setxattr, P("root-file"), "user.x", b"1")
t("other_users_list", names, P("root-file"), 4096)
t("symlink_user", os.setxattr, P("link"), "user.x", b"1", follow_symlinks=False)
t("symlink_trusted", os.setxattr, P("link"), "trusted.x", b"1", follow_symlinks=False)
t("symlink_list", lambda: sorted(os.listxattr(P("link"), follow_symlinks=False)))
t("symlink_followed", lambda: sorted(os.listxattr(P("link"))))
t("fifo_user", os.setxattr, P("fifo"), "user.x", b"1")
t("fifo_trusted", os.setxattr, P("fifo"), "trusted.x", b"1")
t("dir_user", os.setxattr, P("dir"), "user.d", b"1")
t("sticky_dir_other", os.setxattr, P("sticky"), "user.d", b"1")
'''


def prepare(root) -> None:
    os.chmod(root, 0o1777)
    (root / "root-file").write_bytes(b"r")
    os.chmod(root / "root-file", 0o666)
    os.setxattr(root / "root-file", "trusted.hidden", b"1")
    os.setxattr(root / "root-file", "user.shown", b"1")
    (root / "target").write_bytes(b"t")
    os.symlink("target", root / "link")
    os.setxattr(root / "link", "trusted.on-link", b"1", follow_symlinks=False)
    os.mkfifo(root / "fifo", 0o666)
    (root / "dir").mkdir(mode=0o777)
    os.chmod(root / "dir", 0o777)
    (root / "sticky").mkdir()
    os.chmod(root / "sticky", 0o1777)


@pytest.mark.parametrize("who", ["root", "user"])
def test_extended_attributes_as_on_tmpfs(volume, ref_dir, who):
    credentials = AS_USER if who == "user" else {}
    for root in (ref_dir, volume.mountpoint):
        prepare(root)
    expected = run_script(XATTRS, ref_dir, **credentials)
    got = run_script(XATTRS, volume.mountpoint, **credentials)
    assert not differences(got, expected), differences(got, expected)
    # what the comparison stands on: tmpfs really answered these
    assert expected["create_taken"] == "EEXIST" and expected["replace_missing"] == "ENODATA"
    assert (
        expected["short_buffer"] == "ERANGE"
        and expected["size_query"] == "size 5"
        and expected["list_short"] == "ERANGE"
    )
    assert expected["largest_read"] == "65536" and expected["too_large"] == "E2BIG"
    shown = expected["other_users_list"]
    assert ("trusted.hidden" in shown) == (who == "root") and "user.shown" in shown
    assert expected["symlink_user"] == "EPERM"
    assert expected["symlink_trusted"] == ("ok" if who == "root" else "EPERM")


FLAGS = r'''
import fcntl, struct
def on(path, fn, flags=os.O_RDONLY | os.O_NONBLOCK):
    fd = os.open(path, flags)
    try:
        return fn(fd)
    finally:
        os.close(fd)
def ioctl(path, request, size, arg=b""):
    buf = bytearray(arg.ljust(size, b"\0"))
    on(path, lambda fd: fcntl.ioctl(fd, request, buf))
    return hex(struct.unpack_from("<I", buf)[0])
def getflags(path):
    return ioctl(path, 0x80086601, 8)
def setflags(path, flags):
    ioctl(path, 0x40086602, 8, struct.pack("<q", flags))
def xflags(path):
    return ioctl(path, 0x801C581F, 28)
def append(path, data):
    return str(on(path, lambda fd: os.write(fd, data), os.O_WRONLY | os.O_APPEND))
t("flags_appendonly", getflags, P("appendonly"))
t("xflags_appendonly", xflags, P("appendonly"))
t("flags_immutable_dir", getflags, P("frozen-dir"))
t("flags_fifo", getflags, P("fifo"))
t("own_nodump", setflags, P("own"), 0x40)
t("own_nodump_read", getflags, P("own"))
t("own_noatime", setflags, P("own"), 0x80)
t("own_append", setflags, P("own"), 0x20)
t("own_unsupported", setflags, P("own"), 0x4)
t("other_nodump", setflags, P("appendonly"), 0x60)
t("append_write_no_o_append", write, P("appendonly"), b"y", os.O_WRONLY)
t("append_with_o_append", append, P("appendonly"), b"+")
t("append_read", read, P("appendonly"))
t("append_truncate", os.truncate, P("appendonly"), 0)
t("append_trunc_open", write, P("appendonly"), b"y", os.O_WRONLY | os.O_TRUNC | os.O_APPEND)
t("append_unlink", os.unlink, P("appendonly"))
t("append_rename", os.rename, P("appendonly"), P("moved"))
t("append_link", os.link, P("appendonly"), P("linked"))
t("append_chmod", os.chmod, P("appendonly"), 0o600)
t("append_utime_now", os.utime, P("appendonly"), None)
t("append_utime_set", os.utime, P("appendonly"), (1, 2))
t("append_setxattr", os.setxattr, P("appendonly"), "user.x", b"1")
t("immutable_write", write, P("immutable"), b"y", os.O_WRONLY)
t("immutable_append", append, P("immutable"), b"y")
t("immutable_read", read, P("immutable"))
t("immutable_unlink", os.unlink, P("immutable"))
t("immutable_chmod", os.chmod, P("immutable"), 0o600)
t("immutable_setxattr", os.setxattr, P("immutable"), "user.x", b"1")
t("immutable_clear", setflags, P("immutable"), 0)
t("frozen_dir_create", write, P("frozen-dir", "new"))
t("frozen_dir_unlink", os.unlink, P("frozen-dir", "inside"))
t("frozen_dir_read", read, P("frozen-dir", "inside"))
t("frozen_dir_inside_write", write, P("frozen-dir", "inside"), b"w", os.O_WRONLY)
'''


def prepare_flags(root) -> None:
    os.chmod(root, 0o1777)
    (root / "appendonly").write_bytes(b"x")
    os.chmod(root / "appendonly", 0o666)
    (root / "immutable").write_bytes(b"i")
    os.chmod(root / "immutable", 0o666)
    (root / "frozen-dir").mkdir(mode=0o777)
    os.chmod(root / "frozen-dir", 0o777)
    (root / "frozen-dir" / "inside").write_bytes(b"in")
    os.chmod(root / "frozen-dir" / "inside", 0o666)
    os.mkfifo(root / "fifo", 0o666)
    for name, flags in (("appendonly", APPEND), ("immutable", IMMUTABLE), ("frozen-dir", IMMUTABLE)):
        fd = os.open(root / name, os.O_RDONLY)
        try:
            set_flags(fd, flags)
        finally:
            os.close(fd)


def unfreeze(root) -> None:
    subprocess.run([PYTHON, str(Path(__file__).with_name("differential.py")), "unfreeze", str(root)], check=True)


@pytest.fixture
def own_engine(engine):
    if engine != "tierfs":
        pytest.skip("pyfuse3 has no ioctl handler: lsattr and chattr fail with ENOTTY there")


@pytest.mark.parametrize("who", ["root", "user"])
def test_inode_flags_as_on_tmpfs(own_engine, volume, ref_dir, who):
    credentials = AS_USER if who == "user" else {}
    try:
        for root in (ref_dir, volume.mountpoint):
            prepare_flags(root)
            own = root / "own"
            own.write_bytes(b"o")
            os.chown(own, USER if who == "user" else 0, USER if who == "user" else 0)
        expected = run_script(FLAGS, ref_dir, **credentials)
        got = run_script(FLAGS, volume.mountpoint, **credentials)
    finally:
        for root in (ref_dir, volume.mountpoint):
            unfreeze(root)
    assert not differences(got, expected), differences(got, expected)
    # what the comparison stands on
    assert expected["flags_appendonly"] == hex(APPEND) and expected["flags_immutable_dir"] == hex(IMMUTABLE)
    assert expected["append_write_no_o_append"] == "EPERM" and expected["append_with_o_append"] == "1"
    assert expected["append_read"] == "x+" and expected["immutable_write"] == "EPERM"
    assert expected["frozen_dir_create"] == "EPERM"
    assert expected["own_append"] == ("ok" if who == "root" else "EPERM")
    assert expected["own_unsupported"] == "ENOTSUP"


@pytest.mark.expect_log(r"tierfs.keeper: the daemon of .* was killed by SIGKILL")
def test_flags_outlive_the_daemon(own_engine, volume):
    """The flags are the inode's, kept by tmpfs: a successor finds them, and an append-only
    file held open to append through the daemon's death goes on appending."""
    p, log = volume.mountpoint / "f", volume.mountpoint / "log"
    p.write_bytes(b"kept")
    log.write_bytes(b"a")
    _chattr(p, IMMUTABLE | NODUMP)
    _chattr(log, APPEND)
    appender = os.open(log, os.O_WRONLY | os.O_APPEND)
    try:
        kill_daemon(volume.mountpoint)
        os.write(appender, b"b")
        fd = os.open(p, os.O_RDONLY)
        try:
            assert get_flags(fd) == IMMUTABLE | NODUMP
        finally:
            os.close(fd)
        with pytest.raises(PermissionError):
            os.open(p, os.O_WRONLY)
        with pytest.raises(PermissionError):
            os.open(log, os.O_WRONLY)
        assert p.read_bytes() == b"kept" and log.read_bytes() == b"ab"
    finally:
        os.close(appender)
        _chattr(p, 0)
        _chattr(log, 0)


def test_a_step_commits_and_goes_with_frozen_files(own_engine, volume):
    """A committed step is a set of hard links, which tmpfs refuses an append-only or
    immutable file: such a file is copied into the step instead, and one that becomes so
    after its commit is first detached from the step, which stays as committed and can be
    dropped like any other."""
    prepare = lambda tmp: _chattr(tmp / "frozen", IMMUTABLE)  # noqa: E731
    final = write_orbax_step(
        volume.mountpoint, 1, {"frozen": b"cold", "later": b"warm", "_CHECKPOINT_METADATA": b"{}"}, prepare=prepare
    )
    steps = volume.ramdisk / volume.job / f"rank-{volume.rank}" / "steps"
    try:
        snap = steps / "1" / "tree" / "ckpt" / "1"
        assert (snap / "frozen").read_bytes() == b"cold" and (snap / "later").read_bytes() == b"warm"
        _chattr(final / "later", APPEND)
        assert (snap / "later").read_bytes() == b"warm"
        assert os.stat(snap / "later").st_ino != os.stat(final / "later").st_ino
        for s in (2, 3):  # newer steps: retention drops step 1 with its frozen files' copies
            write_orbax_step(volume.mountpoint, s, {"w": b"x", "_CHECKPOINT_METADATA": b"{}"})
        assert not (steps / "1").exists()
        assert (final / "frozen").read_bytes() == b"cold"
    finally:
        for name in ("frozen", "later"):
            _chattr(final / name, 0)


def _chattr(path, flags: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        set_flags(fd, flags)
    finally:
        os.close(fd)


def test_tmpfile_linked_into_the_tree(volume, ref_dir, engine):
    if engine != "tierfs":
        pytest.skip("pyfuse3 has no O_TMPFILE handler: open answers EOPNOTSUPP there")
    for root in (ref_dir, volume.mountpoint):
        fd = os.open(root, os.O_TMPFILE | os.O_RDWR, 0o640)
        try:
            os.write(fd, b"unnamed")
            assert os.fstat(fd).st_nlink == 0
            link_fd(fd, str(root / "named"))
        finally:
            os.close(fd)
        st = os.stat(root / "named")
        assert (root / "named").read_bytes() == b"unnamed"
        assert (stat.filemode(st.st_mode), st.st_nlink) == ("-rw-r-----", 1)
