"""The volume against tmpfs, call by call: a seeded random client (:mod:`tests.fuse.differential`)
makes the same calls on a tmpfs of the rank's size and through a mount, first as root and
then as a user of the volume, and every call's result and errno must agree; then so must the
whole trees, extended attributes and inode flags included. A difference names the seed and
the first call that diverged, with the calls before it.

The pyfuse3 engine has no handler for fallocate, lseek's holes, POSIX ACLs, ioctls,
O_TMPFILE or statx, and passes no setxattr flags (docs/architecture.md): its runs leave
those calls out.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.fuse.users import PYTHON

CLIENT = str(Path(__file__).with_name("differential.py"))
USER, SUPP = 1000, 2000
WITHOUT = {"pyfuse3": ["fallocate", "seek_holes", "acl", "ioctl", "tmpfile", "setxattr_flags", "statx"]}


def client(*args: str, **credentials) -> list | dict:
    proc = subprocess.run([PYTHON, CLIENT, *args], capture_output=True, text=True, timeout=600, **credentials)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout) if proc.stdout else {}


# The kernel checks a tmpfs inode for the immutable and append-only flags before much else,
# and a FUSE inode the same way, but FUSE cannot tell the kernel that an inode has those
# flags (Linux 6.18 has no FUSE_ATTR_IMMUTABLE). Where tmpfs refuses a call on such an inode
# with EPERM first, the kernel may find another fault in it on the volume, or pass a call
# that changes nothing (access(W_OK), a copy of no bytes); every call that would change the
# inode still reaches the daemon, and tmpfs refuses it there. The final trees must agree.
FOUND_NEXT = {"EPERM", "ENOTDIR", "EISDIR", "EACCES", "EINVAL", "ENOTSUP", "EBADF", "ENOENT"}


def agrees(result, want) -> bool:
    if result == want:
        return True
    if want == ["EPERM", "frozen"]:
        errno_name = result[0] if isinstance(result, list) else result
        return errno_name in FOUND_NEXT or not (isinstance(errno_name, str) and errno_name.startswith("E"))
    return False


def first_difference(seed: int, phase: str, got: list, expected: list) -> str | None:
    """The first call whose result differs, with the five calls before it, or None."""
    for n, ((i, desc, result, after), (_, _, want, want_after)) in enumerate(zip(got, expected, strict=False)):
        if not agrees(result, want) or after != want_after:
            before = "\n".join(f"  #{j} {d}: {r}" for j, d, r, _ in got[max(0, n - 5) : n])
            return (
                f"seed {seed}, {phase}: call #{i} {desc}\n  volume: {result} leaving {after}\n"
                f"  tmpfs:  {want} leaving {want_after}\ncalls before it:\n{before}"
            )
    return None if len(got) == len(expected) else f"seed {seed}, {phase}: {len(got)} calls against {len(expected)}"


def tree_differences(got: dict, expected: dict) -> dict:
    return {p: (got.get(p), expected.get(p)) for p in sorted(set(got) | set(expected)) if got.get(p) != expected.get(p)}


def compare(seed: int, count: int, volume_root: Path, ref_root: Path, without: list[str]) -> None:
    """Run the seed on both trees as root, then as a user (and another seed), and compare."""
    phases = [
        ("root", seed, count, {}),
        (f"uid {USER}", seed + 1, count, {"user": USER, "group": USER, "extra_groups": [SUPP]}),
    ]
    try:
        for root in (volume_root, ref_root):
            os.chmod(root, 0o1777)
        for phase, phase_seed, n, credentials in phases:
            args = ["run", None, str(phase_seed), str(n)] + (["--without", *without] if without else [])
            expected = client(*[str(ref_root) if a is None else a for a in args], **credentials)
            got = client(*[str(volume_root) if a is None else a for a in args], **credentials)
            diff = first_difference(phase_seed, phase, got, expected)
            assert diff is None, diff
        trees = [
            client("tree", str(root), *(["--without", *without] if without else [])) for root in (volume_root, ref_root)
        ]
        diff = tree_differences(*trees)
        assert not diff, f"seed {seed}: the trees differ (volume, tmpfs): {json.dumps(diff, indent=1)[:4000]}"
    finally:
        for root in (volume_root, ref_root):
            client("unfreeze", str(root))


@pytest.mark.parametrize("seed", [1, 2])
def test_random_calls_agree_with_tmpfs(seed, volume, small_tmpfs, engine):
    compare(seed, 1500, volume.mountpoint, small_tmpfs(1 << 30, "nosuid,nodev"), WITHOUT.get(engine, []))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 110))
def test_many_random_calls_agree_with_tmpfs(seed, volume, small_tmpfs, engine):
    compare(seed, 20000, volume.mountpoint, small_tmpfs(1 << 30, "nosuid,nodev"), WITHOUT.get(engine, []))
