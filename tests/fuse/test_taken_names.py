"""Names that change beside the kernel while a user creates them, on a mounted volume.

The kernel holds a directory's lock from its lookup of a name to the create, so no other
caller of the mount gets in between; the RAM tier itself can still change meanwhile (a
restore, the daemon's own work, a second mount of the tree). Here a root process churns
names in the backing tree while uid 1000 creates the same names through the mount,
thousands of times: another user's private file appearing under a name being created must
never be handed over, and a directory put in place of one just made must never be chowned.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

ALICE, BOB = 1000, 1001
PYTHON = shutil.which("python3", path="/usr/bin:/bin")
ATTEMPTS = {"file": 3000, "dir": 20000}  # a mkdir is cheap, and its window narrow
SECONDS = 20

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root"),
    pytest.mark.skipif(PYTHON is None, reason="needs a system python3 that any user can run"),
]

# Beside the kernel, as root: bob's private file (or a root-only directory) appears under
# NAME and is taken away again, over and over. Directories taken away are set aside and
# checked (then removed) a thousand rounds later: how many were put, how many given away.
CHURN = r'''
import collections, json, os, sys, time
where, kind, deadline = sys.argv[1], sys.argv[2], time.monotonic() + float(sys.argv[3])
d = os.open(where, os.O_RDONLY | os.O_DIRECTORY)
put, given, n, aside = [], 0, 0, collections.deque()
def check(gone):
    global given
    if os.stat(gone, dir_fd=d).st_uid != 0:
        given += 1
    os.rmdir(gone, dir_fd=d)
def make(tmp):
    if kind == "file":
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=d)
        os.write(fd, b"secret")
        os.fchown(fd, 1001, 1001)
        os.close(fd)
    else:
        os.mkdir(tmp, 0o700, dir_fd=d)
    put.append(tmp)
# A file stays while the next is made (alice's lookup misses it half the time, her create
# finds it); a directory comes and goes at once (alice's mkdir must find the name free).
if kind == "file":
    make("tmp")
while time.monotonic() < deadline and not os.path.exists(os.path.join(where, "stop")):
    n += 1
    if kind == "dir":
        make("tmp")
    try:
        os.rename("tmp", "NAME", src_dir_fd=d, dst_dir_fd=d)  # over alice's own (empty) one too
    except OSError:
        continue
    if kind == "file":
        make("tmp")
    try:
        if kind == "file":
            os.unlink("NAME", dir_fd=d)
        else:
            os.rename("NAME", "gone-%d" % n, src_dir_fd=d, dst_dir_fd=d)
            aside.append("gone-%d" % n)
    except FileNotFoundError:  # alice removed it first
        pass
    if len(aside) > 1000:
        check(aside.popleft())
while aside:
    check(aside.popleft())
print(json.dumps({"put": len(put), "given": given}))
'''

# Through the mount, as alice: create NAME (a file opened read-write, or a directory).
CREATE = r'''
import errno, json, os, sys, time
where, kind, attempts, deadline = sys.argv[1], sys.argv[2], int(sys.argv[3]), time.monotonic() + float(sys.argv[4])
name = os.path.join(where, "NAME")
out = {"tries": 0, "leaked": 0, "made": 0}
while out["tries"] < attempts and time.monotonic() < deadline:
    out["tries"] += 1
    try:
        if kind == "file":
            fd = os.open(name, os.O_RDWR | os.O_CREAT, 0o644)
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or os.pread(fd, 6, 0) == b"secret":
                out["leaked"] += 1
            else:
                out["made"] += 1
            os.close(fd)
        else:
            os.mkdir(name, 0o755)
            out["made"] += 1
    except OSError as e:
        key = errno.errorcode[e.errno]
        out[key] = out.get(key, 0) + 1
    if kind == "file":  # the kernel's cached entry for the name goes with it, so the next try looks it up
        try:
            os.unlink(name)
        except OSError:
            pass
open(os.path.join(where, "stop"), "w").close()
print(json.dumps(out))
'''


def race(volume, kind: str) -> tuple[dict, dict]:
    where = volume.mountpoint / f"race-{kind}"
    where.mkdir()
    os.chmod(where, 0o777)
    backing = volume.tree / where.name
    churn = subprocess.Popen(
        [sys.executable, "-c", CHURN, str(backing), kind, str(SECONDS + 10)], stdout=subprocess.PIPE, text=True
    )
    try:
        alice = subprocess.run(
            [PYTHON, "-c", CREATE, str(where), kind, str(ATTEMPTS[kind]), str(SECONDS)],
            capture_output=True,
            text=True,
            timeout=SECONDS + 30,
            user=ALICE,
            group=ALICE,
        )
        assert alice.returncode == 0, alice.stderr
        out, _ = churn.communicate(timeout=30)
    finally:
        if churn.poll() is None:
            churn.kill()
            churn.wait()
    assert churn.returncode == 0
    return json.loads(alice.stdout), json.loads(out)


def test_another_users_file_under_a_name_being_created_is_never_handed_over(volume):
    result, churned = race(volume, "file")
    assert result["tries"] >= 1000 and result["made"] > 0, result  # the race was run, both ways
    assert churned["put"] > 1000
    assert result["leaked"] == 0, result


def test_a_directory_swapped_in_for_one_just_made_is_never_chowned(volume):
    result, churned = race(volume, "dir")
    assert result["tries"] >= 1000 and result["made"] > 0 and churned["put"] > 1000, result
    assert churned["given"] == 0, f"{churned['given']} root directories given to uid {ALICE} ({result})"
