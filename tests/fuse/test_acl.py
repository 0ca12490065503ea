"""POSIX ACLs as tmpfs enforces them, as root and as users of the volume.

Root sets the same ACLs with ``setfacl`` on a tmpfs directory and on a tierfs mount; then
root, uid 1000 (supplementary group 2000) and uid 1001 each run the same script on both
sides, and every result must be the same: who an ACL entry grants and who it does not, the
mask, ``chmod``'s effect on the mask, default ACLs inherited by files and directories, the
umask ignored under a default ACL and applied without one, ``getfacl``'s view of it all.

The own FUSE engine negotiates ``FUSE_POSIX_ACL``. pyfuse3 cannot leave the umask to the
daemon (``FUSE_DONT_MASK``), without which default ACLs cannot be inherited as tmpfs does,
so on pyfuse3 the volume has no ACLs at all: ``setfacl`` is refused as by a file system
without ACL support, never stored and ignored.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.fuse.users import PYTHON, differences, run_script

ALICE, BOB, SUPP = 1000, 1001, 2000
SETFACL, GETFACL = shutil.which("setfacl"), shutil.which("getfacl")

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root"),
    pytest.mark.skipif(None in (PYTHON, SETFACL, GETFACL), reason="needs python3 and the acl tools"),
]

# Run after tests.fuse.users.PRELUDE, as each user, on tmpfs and on the mount.
SCRIPT = r'''
who = sys.argv[2]
def acl(key, path):
    p = subprocess.run(["getfacl", "-n", "-p", "--omit-header", path], capture_output=True, text=True)
    out[key] = [p.returncode, p.stdout.strip()]
def setfacl(key, *args):
    p = subprocess.run(["setfacl", *args], capture_output=True, text=True)
    out[key] = [p.returncode, "Operation not permitted" in p.stderr]

t("read_named", read, P("named"))
t("write_named", write, P("named"), b"w", os.O_WRONLY)
t("read_masked", read, P("masked"))
t("write_masked", write, P("masked"), b"w", os.O_WRONLY)
t("read_chmodded", read, P("chmodded"))
t("write_chmodded", write, P("chmodded"), b"w", os.O_WRONLY)
t("list_dir_acl", os.listdir, P("dir_acl"))
t("create_dir_acl", write, P("dir_acl", "by-" + who))
t("access_named_w", lambda: os.access(P("named"), os.W_OK))
os.umask(0o077)
t("create_inherit", write, P("inherit", "f-" + who))
s("create_inherit_st", P("inherit", "f-" + who))
acl("create_inherit_acl", P("inherit", "f-" + who))
t("mkdir_inherit", os.mkdir, P("inherit", "d-" + who), 0o777)
s("mkdir_inherit_st", P("inherit", "d-" + who))
acl("mkdir_inherit_acl", P("inherit", "d-" + who))
t("mknod_inherit", os.mknod, P("inherit", "n-" + who), 0o666 | stat.S_IFREG)
s("mknod_inherit_st", P("inherit", "n-" + who))
t("deep_inherit", write, P("inherit", "d-" + who, "f"))
acl("deep_inherit_acl", P("inherit", "d-" + who, "f"))
os.umask(0o027)
t("create_plain", write, P("plain", "f-" + who))
s("create_plain_st", P("plain", "f-" + who))
t("mkdir_plain", os.mkdir, P("plain", "d-" + who), 0o777)
s("mkdir_plain_st", P("plain", "d-" + who))
os.umask(0o022)
t("own_file", write, P("plain", "own-" + who))
setfacl("setfacl_own", "-m", "u:%d:rw" % (1001 if who != "bob" else 1000), P("plain", "own-" + who))
acl("setfacl_own_acl", P("plain", "own-" + who))
if who != "root":  # not the owner: refused
    setfacl("setfacl_other", "-m", "u:%d:rwx" % os.getuid(), P("named"))
acl("named_acl", P("named"))
acl("masked_acl", P("masked"))
acl("chmodded_acl", P("chmodded"))
acl("inherit_acl", P("inherit"))
'''


def prepare(root: Path) -> None:
    """The same files and ACLs, set by root, on both sides."""

    def setfacl(*args):
        subprocess.run([SETFACL, *args], check=True, capture_output=True)

    os.chmod(root, 0o1777)
    for name in ("named", "masked", "chmodded"):
        (root / name).write_text("data")
        os.chown(root / name, 0, SUPP)
        os.chmod(root / name, 0o600)
    setfacl("-m", f"u:{BOB}:rw", root / "named")  # bob may, the group (alice's 2000) may not
    setfacl("-m", f"u:{BOB}:rw,m::r", root / "masked")  # the mask leaves bob reading only
    setfacl("-m", f"u:{BOB}:rw", root / "chmodded")
    os.chmod(root / "chmodded", 0o640)  # the group bits are the mask: bob may read only
    (root / "dir_acl").mkdir()
    os.chmod(root / "dir_acl", 0o700)
    setfacl("-m", f"u:{BOB}:rwx", root / "dir_acl")
    (root / "inherit").mkdir()
    os.chmod(root / "inherit", 0o777)
    setfacl("-d", "-m", f"u:{BOB}:rw,g::rwx,o::r", root / "inherit")
    (root / "plain").mkdir()
    os.chmod(root / "plain", 0o777)


def run_as(root: Path, who: str) -> dict:
    users = {
        "root": {},
        "alice": dict(user=ALICE, group=ALICE, extra_groups=[SUPP]),
        "bob": dict(user=BOB, group=BOB, extra_groups=[]),
    }
    return run_script(SCRIPT, root, who, **users[who])


def test_acls_are_enforced_and_inherited_as_on_tmpfs(volume, ref_dir, engine):
    prepare(ref_dir)
    if engine == "pyfuse3":
        with pytest.raises(subprocess.CalledProcessError) as refused:
            prepare(volume.mountpoint)
        assert b"Operation not supported" in refused.value.stderr
        return
    prepare(volume.mountpoint)
    for who in ("alice", "bob", "root"):
        expected = run_as(ref_dir, who)
        got = run_as(volume.mountpoint, who)
        if who == "alice":  # the scenario really exercises the ACLs (guards against a vacuous run)
            assert expected["read_named"] == "EACCES"
            assert expected["create_inherit_st"][0] == "-rw-rw-r--"  # umask 077 ignored
        if who == "bob":
            assert expected["read_named"] == "data" and expected["write_masked"] == "EACCES"
        diff = differences(got, expected)
        assert not diff, f"{who}: differs from tmpfs (tierfs, tmpfs): {diff}"


def test_pyfuse3_refuses_acls_as_a_file_system_without_them(volume, engine):
    """No ACL is stored where it would not be enforced: its mask would become group bits."""
    if engine != "pyfuse3":
        pytest.skip("the own engine enforces ACLs (test_acls_are_enforced_and_inherited_as_on_tmpfs)")
    f = volume.mountpoint / "f"
    f.write_text("x")
    os.chmod(f, 0o600)
    proc = subprocess.run([SETFACL, "-m", f"u:{BOB}:rw", f], capture_output=True, text=True)
    assert proc.returncode != 0 and "Operation not supported" in proc.stderr
    assert oct(os.stat(f).st_mode & 0o777) == oct(0o600)  # the group gained nothing
    assert "system.posix_acl_access" not in os.listxattr(volume.tree / "f")
