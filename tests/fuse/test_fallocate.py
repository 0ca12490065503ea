"""``fallocate(2)`` and ``lseek(SEEK_DATA/SEEK_HOLE)`` through a mount, as tmpfs answers them.

tierfs' own FUSE engine serves FUSE_FALLOCATE and FUSE_LSEEK on the backing file, so
preallocation, ``KEEP_SIZE``, punched holes and the holes ``lseek`` reports are tmpfs'
own, as root and as any user, on both data paths. pyfuse3 has neither handler: there the kernel answers
EOPNOTSUPP and seeks as if the file had no holes.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers import write_orbax_step
from tierfs.core import linux

MiB = 1 << 20
USER = 1000
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")  # any user can run it, unlike a venv under /root
METADATA = {"_CHECKPOINT_METADATA": b"{}"}

# Standard library only: run by the system python3 as a non-root user too.
SCRIPT = r'''
import ctypes, errno, json, os, stat, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
KEEP, PUNCH, ZERO = 0x01, 0x02, 0x10
root = sys.argv[1]
out = {}

def falloc(fd, mode, off, n):
    if libc.fallocate(fd, mode, off, n) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))

def t(key, fn, *a):
    try:
        r = fn(*a)
        out[key] = "ok" if r is None else r
    except OSError as e:
        out[key] = errno.errorcode[e.errno]

def fst(key, fd):
    s = os.fstat(fd)
    out[key] = [stat.filemode(s.st_mode), s.st_size, s.st_blocks]

def seeks(key, fd):
    size = os.fstat(fd).st_size
    res = []
    for off in [*range(0, size + 8192, 16384), 4095, 100000, 100001, 600000, size - 1, size]:
        for whence in (os.SEEK_DATA, os.SEEK_HOLE):
            try:
                res.append(os.lseek(fd, off, whence))
            except OSError as e:
                res.append(errno.errorcode[e.errno])
    out[key] = res

p = os.path.join(root, "f")
fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
# preallocate, then write into it
t("prealloc", falloc, fd, 0, 0, 1 << 20)
fst("prealloc.fstat", fd)
out["prealloc.stat"] = os.stat(p).st_size
out["prealloc.read"] = os.pread(fd, 16, 4096).hex()
os.pwrite(fd, b"a" * 10000, 5000)
fst("written", fd)
out["written.read"] = os.pread(fd, 8, 4996).hex()
# preallocate past the end, keeping the size
t("keep_size", falloc, fd, KEEP, 1 << 20, 1 << 20)
fst("keep_size.fstat", fd)
out["keep_size.stat"] = os.stat(p).st_size
# a hole punched into written bytes reads as zeros, and its pages are freed
os.pwrite(fd, b"b" * (256 << 10), 0)
fst("before_punch", fd)
t("punch", falloc, fd, PUNCH | KEEP, 4096, 128 << 10)
fst("punched", fd)
out["punched.zeros"] = os.pread(fd, 128 << 10, 4096) == bytes(128 << 10)
out["punched.edges"] = [os.pread(fd, 4, 4092).hex(), os.pread(fd, 4, 4096 + (128 << 10)).hex()]
t("punch_unaligned", falloc, fd, PUNCH | KEEP, 200001, 5000)
fst("punched_unaligned", fd)
got = os.pread(fd, 5004, 199999)
out["punched_unaligned.read"] = [got[:2].hex(), got[2:-2] == bytes(5000), got[-2:].hex()]
# new opens see it all too
rfd = os.open(p, os.O_RDONLY)
out["reopened"] = [os.fstat(rfd).st_size, os.pread(rfd, 8, 4092).hex(), os.pread(rfd, 8, 200000).hex()]
# what tmpfs refuses
t("punch_without_keep_size", falloc, fd, PUNCH, 0, 4096)
t("zero_range", falloc, fd, ZERO, 0, 4096)
t("zero_range_keep_size", falloc, fd, ZERO | KEEP, 0, 4096)
t("collapse", falloc, fd, 0x08, 0, 4096)
t("zero_length", falloc, fd, 0, 0, 0)
t("negative", falloc, fd, 0, -1, 4096)
t("read_only_descriptor", falloc, rfd, 0, 0, 4096)
fst("after_refusals", fd)
# set-id bits: a preallocation by anyone but root drops them, as a write does
os.fchmod(fd, 0o6755)
t("setid_prealloc", falloc, fd, KEEP, 0, 4096)
fst("setid_after", fd)
os.fchmod(fd, 0o644)
# SEEK_DATA / SEEK_HOLE on a sparse file
q = os.path.join(root, "sparse")
sfd = os.open(q, os.O_CREAT | os.O_RDWR, 0o644)
os.ftruncate(sfd, 1 << 20)
os.pwrite(sfd, b"x", 100000)
os.pwrite(sfd, b"y" * 8192, 600000)
falloc(sfd, KEEP, 800000, 65536)  # preallocated, never written: a hole to tmpfs
seeks("seeks.sparse", sfd)
falloc(sfd, PUNCH | KEEP, 598016, 4096)
seeks("seeks.punched", sfd)
srd = os.open(q, os.O_RDONLY)
seeks("seeks.read_only", srd)
os.lseek(srd, 0, os.SEEK_SET)
out["seek_moves_position"] = [os.lseek(srd, 0, os.SEEK_DATA), os.lseek(srd, 0, os.SEEK_CUR), len(os.read(srd, 10))]
e = os.open(os.path.join(root, "empty"), os.O_CREAT | os.O_RDWR, 0o644)
seeks("seeks.empty", e)
for x in (fd, rfd, sfd, srd, e):
    os.close(x)
out["closed"] = [os.stat(p).st_size, os.stat(p).st_blocks, os.stat(q).st_blocks]
print(json.dumps(out))
'''


def observe(root, user: int | None = None) -> dict:
    if user is not None:
        root = root / f"user-{user}"
        root.mkdir()
        os.chown(root, user, user)
    python = sys.executable if user is None else SYSTEM_PYTHON
    proc = subprocess.run(
        [python, "-c", SCRIPT, str(root)], capture_output=True, text=True, timeout=120, user=user, group=user
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def fallocate(fd: int, mode: int, offset: int, length: int) -> str:
    try:
        linux.fallocate(fd, mode, offset, length)
    except OSError as e:
        return errno.errorcode[e.errno]
    return "ok"


@pytest.fixture
def own_engine(engine):
    if engine != "tierfs":
        pytest.skip("pyfuse3 has no fallocate or lseek handler (see test_pyfuse3_refuses_fallocate_cleanly)")


@pytest.mark.parametrize(
    "user",
    [
        "root",
        pytest.param(
            "user",
            marks=pytest.mark.skipif(SYSTEM_PYTHON is None, reason="needs a system python3 that any user can run"),
        ),
    ],
)
def test_same_as_tmpfs(own_engine, volume, ref_dir, user):
    uid = USER if user == "user" else None
    expected = observe(ref_dir, uid)
    got = observe(volume.mountpoint, uid)
    assert got == expected
    # what the comparison stands on: tmpfs really did these
    assert expected["prealloc"] == "ok" and expected["prealloc.fstat"][1:] == [MiB, MiB // 512]
    assert expected["punched"][2] < expected["before_punch"][2] and expected["punched.zeros"]
    assert expected["keep_size.fstat"][1] == MiB and expected["keep_size.fstat"][2] == 2 * MiB // 512
    assert expected["seeks.sparse"][:4] == [98304, 0, 98304, 16384]
    assert expected["setid_after"][0] == ("-rwxr-xr-x" if uid else "-rwsr-sr-x")


def test_preallocated_space_is_accounted_and_capacity_refuses_past_it(own_engine, volumes):
    vol = volumes(capacity="16M")
    p = vol.mountpoint / "f"
    keep = os.urandom(MiB)
    (vol.mountpoint / "keep").write_bytes(keep)
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        assert fallocate(fd, 0, 0, 32 * MiB) == "ENOSPC"
        assert os.fstat(fd).st_size == 0 and os.fstat(fd).st_blocks == 0
        assert fallocate(fd, 0, 0, 8 * MiB) == "ok"
        assert os.fstat(fd).st_size == 8 * MiB and os.fstat(fd).st_blocks == 8 * MiB // 512
        assert vol.status()["tiers"]["ram"]["used"] >= 9 * MiB
        assert fallocate(fd, linux.FALLOC_FL_KEEP_SIZE, 8 * MiB, 12 * MiB) == "ENOSPC"
        assert fallocate(fd, 0, 8 * MiB, 12 * MiB) == "ENOSPC"
        assert os.fstat(fd).st_size == 8 * MiB
        # a punched hole gives its space back: the same preallocation then fits
        assert fallocate(fd, linux.FALLOC_FL_PUNCH_HOLE | linux.FALLOC_FL_KEEP_SIZE, 0, 8 * MiB) == "ok"
        assert os.fstat(fd).st_blocks == 0
        assert fallocate(fd, linux.FALLOC_FL_KEEP_SIZE, 8 * MiB, 12 * MiB) == "ok"
        assert os.fstat(fd).st_size == 8 * MiB and os.fstat(fd).st_blocks == 12 * MiB // 512
    finally:
        os.close(fd)
    assert (vol.mountpoint / "keep").read_bytes() == keep
    assert vol.status()["tiers"]["ram"]["used"] <= 16 * MiB


def test_a_committed_step_is_unchanged_by_fallocate_on_the_live_file(own_engine, volume):
    data = os.urandom(256 << 10)
    final = write_orbax_step(volume.mountpoint, 3, {"w": data, **METADATA})
    snap = volume.ramdisk / volume.job / f"rank-{volume.rank}" / "steps" / "3" / "tree" / "ckpt" / "3" / "w"
    assert snap.read_bytes() == data
    fd = os.open(final / "w", os.O_RDWR)
    try:
        assert fallocate(fd, linux.FALLOC_FL_PUNCH_HOLE | linux.FALLOC_FL_KEEP_SIZE, 0, 128 << 10) == "ok"
        assert fallocate(fd, 0, 0, MiB) == "ok"
        assert fallocate(fd, linux.FALLOC_FL_KEEP_SIZE, MiB, MiB) == "ok"
    finally:
        os.close(fd)
    assert (final / "w").read_bytes() == bytes(128 << 10) + data[128 << 10 :] + bytes(MiB - len(data))
    assert snap.read_bytes() == data and os.stat(snap).st_size == len(data)
    assert os.stat(final / "w").st_nlink == 1


def test_seek_data_and_hole_follow_writes_just_made(own_engine, volume):
    """Writes answered before their bytes are in (write-behind, or the kernel's own by
    passthrough) are there before the holes are looked for."""
    p = volume.mountpoint / "f"
    for flags in (os.O_WRONLY, os.O_RDWR):
        fd = os.open(p, os.O_CREAT | os.O_TRUNC | flags, 0o644)
        try:
            os.ftruncate(fd, 4 * MiB)
            for i in range(8):
                os.pwrite(fd, b"z" * 4096, 3 * MiB + i * 4096)
            assert os.lseek(fd, 0, os.SEEK_DATA) == 3 * MiB
            assert os.lseek(fd, 3 * MiB, os.SEEK_HOLE) == 3 * MiB + 8 * 4096
            with pytest.raises(OSError) as e:
                os.lseek(fd, 4 * MiB, os.SEEK_DATA)
            assert e.value.errno == errno.ENXIO
        finally:
            os.close(fd)


def test_seek_data_finds_bytes_written_through_a_shared_mapping(own_engine, volume):
    """Pages dirtied through a mapping stay in the kernel's page cache on the daemon path:
    the kernel is made to write them back before the holes are looked for."""
    p = volume.mountpoint / "f"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.ftruncate(fd, 4 * MiB)
        with mmap.mmap(fd, 4 * MiB) as m:
            m[2 * MiB : 2 * MiB + 5] = b"hello"
            assert os.lseek(fd, 0, os.SEEK_DATA) == 2 * MiB
            assert os.lseek(fd, 2 * MiB, os.SEEK_HOLE) == 2 * MiB + 4096
        assert os.pread(fd, 5, 2 * MiB) == b"hello"
    finally:
        os.close(fd)


def test_pyfuse3_refuses_fallocate_cleanly(volume, engine):
    """pyfuse3 has no fallocate handler: the kernel answers EOPNOTSUPP (glibc then emulates);
    the own engine serves it."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(volume.mountpoint / "f", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        result = libc.fallocate(fd, 0, ctypes.c_long(0), ctypes.c_long(4096))
        if engine == "pyfuse3":
            assert result == -1 and ctypes.get_errno() == errno.EOPNOTSUPP
            assert os.fstat(fd).st_size == 0
        else:
            assert result == 0 and os.fstat(fd).st_size == 4096
    finally:
        os.close(fd)
