"""Permissions as a training pod running as a non-root user sees them.

The same script runs as uid 1000 (supplementary group 2000) on a tmpfs directory and on a
tierfs mount prepared identically by root; every result must be the same: ownership of new
files, umask, sticky directories, group access, setgid inheritance, chmod/chown/utime rules.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.fuse.users import PYTHON, differences, run_script

USER, GROUP, SUPP = 1000, 1000, 2000

# Run after tests.fuse.users.PRELUDE, as each user, on tmpfs and on the mount.
SCRIPT = r'''
t("create_root", write, P("mine"))
s("create_root_st", P("mine"))
os.umask(0o027)
t("create_umask", write, P("masked"))
s("create_umask_st", P("masked"))
t("mkdir_umask", os.mkdir, P("mydir"), 0o777)
s("mkdir_umask_st", P("mydir"))
os.umask(0o022)
t("list_private", os.listdir, P("private"))
t("open_private", read, P("private", "secret"))
t("stat_private_child", os.stat, P("private", "secret"))
t("read_pub", read, P("readonly", "pub"))
t("write_pub", write, P("readonly", "pub"), flags=os.O_WRONLY)
t("create_in_readonly", write, P("readonly", "new"))
t("unlink_in_readonly", os.unlink, P("readonly", "pub"))
t("rename_in_readonly", os.rename, P("readonly", "pub"), P("stolen"))
t("unlink_sticky_other", os.unlink, P("sticky", "other"))
t("rename_sticky_other", os.rename, P("sticky", "other"), P("sticky", "moved"))
t("write_sticky_other", write, P("sticky", "other"), b"hi", os.O_WRONLY)
t("create_sticky_own", write, P("sticky", "own"))
t("rename_sticky_own", os.rename, P("sticky", "own"), P("sticky", "own2"))
t("unlink_sticky_own", os.unlink, P("sticky", "own2"))
t("create_group", write, P("group", "f"))
s("create_group_st", P("group", "f"))
t("create_setgid", write, P("setgid", "f"))
s("create_setgid_st", P("setgid", "f"))
t("mkdir_setgid", os.mkdir, P("setgid", "d"))
s("mkdir_setgid_st", P("setgid", "d"))
t("symlink_setgid", os.symlink, "f", P("setgid", "l"))
s("symlink_setgid_st", P("setgid", "l"))
t("chmod_own", os.chmod, P("mine"), 0o640)
t("chmod_other", os.chmod, P("readonly", "pub"), 0o666)
t("chmod_suid_own", os.chmod, P("mine"), 0o4755)
s("chmod_suid_own_st", P("mine"))
t("write_suid_own", write, P("mine"), b"y", os.O_WRONLY)
s("write_suid_own_st", P("mine"))
t("chmod_sgid_nonmember", os.chmod, P("sticky", "other"), 0o2666)
t("chown_own_to_other", os.chown, P("mine"), 1001, -1)
t("chgrp_own_member", os.chown, P("mine"), -1, 2000)
s("chgrp_own_member_st", P("mine"))
t("chgrp_own_nonmember", os.chown, P("mine"), -1, 3000)
t("utime_own", os.utime, P("mine"), (1, 2))
t("utime_other_explicit", os.utime, P("sticky", "other"), (1, 2))
t("utime_other_now", os.utime, P("sticky", "other"), None)
t("truncate_other_writable", os.truncate, P("sticky", "other"), 1)
t("truncate_pub", os.truncate, P("readonly", "pub"), 0)
t("access_pub_w", lambda: os.access(P("readonly", "pub"), os.W_OK))
t("access_pub_r", lambda: os.access(P("readonly", "pub"), os.R_OK))
t("setxattr_other", os.setxattr, P("readonly", "pub"), "user.x", b"1")
t("setxattr_own", os.setxattr, P("mydir"), "user.x", b"1")
t("link_other", os.link, P("readonly", "pub"), P("linked"))
t("rmdir_private", os.rmdir, P("private"))
t("exec_noexec", os.access, P("mine"), os.X_OK)
'''


def prepare(root: Path) -> None:
    """The same layout, made by root, on both sides."""
    os.chmod(root, 0o1777)
    (root / "private").mkdir(mode=0o700)
    (root / "private" / "secret").write_text("s")
    os.chmod(root / "private" / "secret", 0o600)
    (root / "readonly").mkdir(mode=0o755)
    (root / "readonly" / "pub").write_text("public")
    os.chmod(root / "readonly" / "pub", 0o644)
    (root / "sticky").mkdir()
    os.chmod(root / "sticky", 0o1777)
    (root / "sticky" / "other").write_text("other")
    os.chmod(root / "sticky" / "other", 0o666)
    os.chown(root / "sticky" / "other", 1001, 1001)
    (root / "group").mkdir()
    os.chown(root / "group", 0, SUPP)
    os.chmod(root / "group", 0o770)
    (root / "setgid").mkdir()
    os.chown(root / "setgid", 0, 3000)
    os.chmod(root / "setgid", 0o2777)


def run_as_user(root: Path) -> dict:
    return run_script(SCRIPT, root, user=USER, group=GROUP, extra_groups=[SUPP])


@pytest.mark.skipif(PYTHON is None, reason="needs a system python3 that any user can run")
def test_non_root_user_sees_tmpfs_permissions(volume, ref_dir):
    prepare(ref_dir)
    prepare(volume.mountpoint)
    expected = run_as_user(ref_dir)
    got = run_as_user(volume.mountpoint)
    # The scenario really exercises refusals and ownership (guards against a vacuous run).
    assert expected["open_private"] == "EACCES" and expected["unlink_sticky_other"] == "EPERM"
    assert expected["create_setgid_st"][2] == 3000
    diff = differences(got, expected)
    assert not diff, f"differs from tmpfs (tierfs, tmpfs): {diff}"


def test_backing_files_owned_like_the_view(volume):
    """What a non-root user creates is owned by them on the RAM tier too (it survives restarts)."""
    subprocess.run(
        [PYTHON, "-c", f"open({str(volume.mountpoint / 'f')!r}, 'w').write('x')"], check=True, user=USER, group=GROUP
    )
    st = os.stat(volume.tree / "f")
    assert (st.st_uid, st.st_gid) == (USER, GROUP)
