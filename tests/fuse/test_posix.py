"""POSIX conformance: every scenario runs on a plain tmpfs directory and through a tierfs
mount, and the observations (results, errno names, normalised stat) must be identical.

The scenarios are the operations checkpoint writers use (Orbax/tensorstore, PyTorch DCP,
NeMo, HF): see the "Filesystem behaviour" list of the MTC interface.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import shutil
import stat
import struct
import time
from pathlib import Path

import pytest

from tierfs.core import linux

MiB = 1 << 20


def attempt(fn, *args, **kwargs):
    """The result of a call, or the errno name it failed with."""
    try:
        result = fn(*args, **kwargs)
    except OSError as e:
        return "E" + errno.errorcode.get(e.errno, str(e.errno))
    return "ok" if result is None else result


def st(path, follow: bool = False):
    """The parts of stat that must agree with tmpfs (not inode numbers, devices or times)."""
    try:
        s = os.stat(path, follow_symlinks=follow)
    except OSError as e:
        return "E" + errno.errorcode[e.errno]
    return (stat.filemode(s.st_mode), s.st_nlink, s.st_uid, s.st_gid, s.st_size, s.st_blocks)


def fst(fd):
    s = os.fstat(fd)
    return (stat.filemode(s.st_mode), s.st_nlink, s.st_size, s.st_blocks)


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# -- scenarios ----------------------------------------------------------------------------


def open_flags(root: Path):
    out = []
    p = root / "f"
    fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640)
    out.append(fst(fd))
    out.append(attempt(os.open, p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    os.write(fd, b"0123456789")
    out.append(os.pwrite(fd, b"ab", 3))
    out.append(fst(fd))
    os.close(fd)
    out.append(read(p))
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"XY")
    os.pwrite(fd, b"Z", 0)  # Linux appends on O_APPEND whatever the offset
    os.close(fd)
    out.append(read(p))
    fd = os.open(p, os.O_RDWR | os.O_TRUNC)
    out.append(fst(fd))
    os.write(fd, b"hello world")
    out.append(os.pread(fd, 5, 6))
    out.append(os.pread(fd, 100, 20))  # past EOF
    os.close(fd)
    out.append(attempt(os.open, root / "missing", os.O_RDONLY))
    out.append(attempt(os.open, root / "nodir" / "x", os.O_CREAT | os.O_WRONLY, 0o644))
    out.append(attempt(os.open, p, os.O_RDONLY | os.O_DIRECTORY))
    os.mkdir(root / "d")
    out.append(attempt(os.open, root / "d", os.O_WRONLY))
    out.append(attempt(os.open, root / ("n" * 256), os.O_CREAT | os.O_WRONLY, 0o644))
    out.append(st(p))
    return out


def holes_and_truncate(root: Path):
    out = []
    p = root / "sparse"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    os.pwrite(fd, b"end", 10 << 20)
    out.append(fst(fd))
    out.append(os.pread(fd, 4, 5 << 20))
    os.ftruncate(fd, 4096)
    out.append(fst(fd))
    os.ftruncate(fd, 1 << 20)
    out.append(fst(fd))
    os.close(fd)
    os.truncate(p, 100)
    out.append(st(p))
    out.append(attempt(os.truncate, root / "missing", 0))
    out.append(attempt(os.truncate, root, 0))
    return out


def renames(root: Path):
    out = []
    (root / "a").write_bytes(b"A")
    (root / "b").write_bytes(b"B")
    os.rename(root / "a", root / "b")  # replace an existing file
    out.append((read(root / "b"), attempt(os.stat, root / "a") != "ok"))
    # A non-empty directory tree, renamed like Orbax commits a step.
    tmp = root / "7.orbax-checkpoint-tmp"
    (tmp / "state" / "d").mkdir(parents=True)
    (tmp / "state" / "d" / "x").write_bytes(b"x" * 5000)
    (tmp / "_CHECKPOINT_METADATA").write_text("{}")
    fd = os.open(tmp / "state" / "d" / "x", os.O_RDONLY)  # open across the rename
    os.rename(tmp, root / "7")
    out.append(os.pread(fd, 3, 0))
    os.close(fd)
    out.append(sorted(os.listdir(root / "7")))
    out.append(read(root / "7" / "state" / "d" / "x")[:2])
    out.append(st(root / "7" / "state"))
    # Directory over an empty directory, over a non-empty one, over a file, and back.
    (root / "empty").mkdir()
    (root / "full").mkdir()
    (root / "full" / "f").write_bytes(b"")
    (root / "src").mkdir()
    out.append(attempt(os.rename, root / "src", root / "empty"))
    out.append(attempt(os.rename, root / "empty", root / "full"))
    out.append(attempt(os.rename, root / "empty", root / "b"))
    out.append(attempt(os.rename, root / "b", root / "full"))
    out.append(attempt(os.rename, root / "full", root / "full" / "sub"))
    out.append(attempt(os.rename, root / "b", root / "b"))
    out.append(attempt(os.rename, root / "missing", root / "x"))
    out.append(attempt(os.replace, root / "b", root / "7" / "b"))
    out.append(st(root / "7"))
    out.append(st(root))
    return out


def rename_flags(root: Path):
    out = []
    (root / "a").write_bytes(b"A")
    (root / "b").write_bytes(b"BB")
    (root / "d").mkdir()
    at = linux.AT_FDCWD
    a, b, d = (os.fsencode(root / n) for n in ("a", "b", "d"))
    out.append(attempt(linux.renameat2, at, a, at, b, linux.RENAME_NOREPLACE))
    out.append(attempt(linux.renameat2, at, a, at, b, linux.RENAME_EXCHANGE))
    out.append((read(root / "a"), read(root / "b")))
    out.append(attempt(linux.renameat2, at, a, at, d, linux.RENAME_EXCHANGE))
    out.append((st(root / "a"), st(root / "d")))
    out.append(attempt(linux.renameat2, at, b, at, os.fsencode(root / "c"), linux.RENAME_NOREPLACE))
    out.append(attempt(linux.renameat2, at, a, at, os.fsencode(root / "zz"), linux.RENAME_EXCHANGE))
    out.append(attempt(linux.renameat2, at, a, at, b, linux.RENAME_EXCHANGE | linux.RENAME_NOREPLACE))
    out.append(sorted(os.listdir(root)))
    return out


def removal(root: Path):
    out = []
    (root / "d" / "e").mkdir(parents=True)
    (root / "d" / "f").write_bytes(b"f")
    out.append(attempt(os.rmdir, root / "d"))
    out.append(attempt(os.unlink, root / "d"))
    out.append(attempt(os.rmdir, root / "d" / "f"))
    out.append(attempt(os.unlink, root / "missing"))
    out.append(attempt(os.rmdir, root / "missing"))
    out.append(attempt(os.mkdir, root / "d"))
    out.append(attempt(os.mkdir, root / "nodir" / "x"))
    out.append(st(root / "d"))
    out.append(attempt(os.rmdir, root / "d" / "e"))
    out.append(st(root / "d"))
    shutil.rmtree(root / "d")
    out.append(os.listdir(root))
    # A file unlinked while open stays readable through its descriptor.
    (root / "g").write_bytes(b"still here")
    fd = os.open(root / "g", os.O_RDONLY)
    os.unlink(root / "g")
    out.append((os.pread(fd, 100, 0), fst(fd)[1]))
    os.close(fd)
    return out


def symlinks(root: Path):
    out = []
    (root / "dir").mkdir()
    (root / "dir" / "t").write_bytes(b"target")
    os.symlink("dir/t", root / "rel")
    os.symlink("dir", root / "dl")
    os.symlink("nowhere", root / "dangling")
    out.append(os.readlink(root / "rel"))
    out.append((st(root / "rel"), st(root / "rel", follow=True)))
    out.append(read(root / "rel"))
    out.append(read(root / "dl" / "t"))
    out.append((st(root / "dangling"), st(root / "dangling", follow=True)))
    out.append(attempt(os.readlink, root / "dir"))
    out.append(attempt(os.symlink, "x", root / "rel"))
    # os.replace of a symlink (Orbax renames the .restore link onto the step name).
    os.replace(root / "dl", root / "5")
    out.append((os.readlink(root / "5"), sorted(os.listdir(root / "5"))))
    out.append(attempt(os.replace, root / "rel", root / "dir" / "t"))
    out.append((st(root / "dir" / "t"), os.readlink(root / "dir" / "t")))
    os.symlink("x" * 4000, root / "long")
    out.append(len(os.readlink(root / "long")))
    out.append(st(root / "long"))
    return out


def hard_links(root: Path):
    out = []
    (root / "a").write_bytes(b"shared")
    os.link(root / "a", root / "b")
    out.append((st(root / "a"), st(root / "b")))
    with open(root / "b", "r+b") as f:
        f.write(b"SH")
    out.append(read(root / "a"))
    os.unlink(root / "a")
    out.append(st(root / "b"))
    (root / "d").mkdir()
    out.append(attempt(os.link, root / "d", root / "d2"))
    out.append(attempt(os.link, root / "b", root / "b"))
    out.append(attempt(os.link, root / "missing", root / "m2"))
    os.symlink("b", root / "s")
    os.link(root / "s", root / "s2", follow_symlinks=False)
    out.append((st(root / "s2"), os.readlink(root / "s2")))
    return out


def attributes(root: Path):
    out = []
    p = root / "f"
    p.write_bytes(b"data")
    for mode in (0o600, 0o4755, 0o2750, 0o1777, 0o000):
        os.chmod(p, mode)
        out.append(st(p))
    os.chown(p, 1234, 5678)
    out.append(st(p))
    os.chmod(p, 0o6755)
    os.chown(p, 1234, 99)  # chown clears set-id bits
    out.append(st(p))
    os.utime(p, ns=(1_000_000_123, 2_000_000_456))
    s = os.stat(p)
    out.append((s.st_atime_ns, s.st_mtime_ns))
    before = os.stat(p).st_ctime_ns
    time.sleep(0.01)
    os.utime(p)
    s = os.stat(p)
    out.append((s.st_mtime_ns > 2_000_000_456, s.st_ctime_ns > before))
    os.symlink("f", root / "s")
    os.utime(root / "s", ns=(5_000_000_000, 6_000_000_000), follow_symlinks=False)
    s = os.lstat(root / "s")
    out.append((s.st_atime_ns, s.st_mtime_ns, os.stat(p).st_mtime_ns == 6_000_000_000))
    os.chown(root / "s", 42, 43, follow_symlinks=False)
    out.append((st(root / "s"), st(p)))
    (root / "d").mkdir(mode=0o700)
    os.chmod(root / "d", 0o3775)
    out.append(st(root / "d"))
    # mtime/ctime move on writes and on directory changes.
    m0 = os.stat(root / "d").st_mtime_ns
    time.sleep(0.01)
    (root / "d" / "x").write_bytes(b"")
    out.append(os.stat(root / "d").st_mtime_ns > m0)
    return out


def readdir(root: Path):
    names = {f"file-{i:04d}" for i in range(600)} | {f"dir-{i}" for i in range(20)}
    for n in names:
        if n.startswith("dir"):
            (root / n).mkdir()
        else:
            (root / n).write_bytes(b"")
    with os.scandir(root) as it:
        listed = [(e.name, e.is_dir(follow_symlinks=False), e.is_file()) for e in it]
    return [sorted(listed), len(listed), st(root)]


def sync_ops(root: Path):
    out = []
    fd = os.open(root / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"x" * 10000)
    out.append((attempt(os.fsync, fd), attempt(os.fdatasync, fd)))
    os.close(fd)
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    out.append((attempt(os.fsync, dfd), attempt(os.fdatasync, dfd)))
    os.close(dfd)
    return out


def locks(root: Path):
    out = []
    p = root / "lock"
    p.write_bytes(b"")
    a = os.open(p, os.O_RDWR)
    b = os.open(p, os.O_RDWR)
    lk = lambda kind: __import__("struct").pack("hhqqi", kind, 0, 0, 0, 0)  # noqa: E731
    out.append(attempt(fcntl.fcntl, a, fcntl.F_OFD_SETLK, lk(fcntl.F_WRLCK)) is not None)
    out.append(attempt(fcntl.fcntl, b, fcntl.F_OFD_SETLK, lk(fcntl.F_WRLCK)))
    fcntl.fcntl(a, fcntl.F_OFD_SETLK, lk(fcntl.F_UNLCK))
    out.append(attempt(fcntl.fcntl, b, fcntl.F_OFD_SETLKW, lk(fcntl.F_WRLCK)) is not None)
    out.append(attempt(fcntl.flock, a, fcntl.LOCK_EX | fcntl.LOCK_NB))
    out.append(attempt(fcntl.lockf, a, fcntl.LOCK_EX | fcntl.LOCK_NB))
    os.close(a)
    os.close(b)
    return out


def mmaps(root: Path):
    out = []
    data = bytes(range(256)) * 4096 * 3
    (root / "m").write_bytes(data)
    with open(root / "m", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        out.append(m[:] == data)
        out.append(m[4096 * 5 : 4096 * 5 + 8])
    with open(root / "m", "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[0:4] = b"MMAP"
        m.flush()
    out.append(read(root / "m")[:6])
    return out


def xattrs(root: Path):
    out = []
    p = root / "f"
    p.write_bytes(b"")
    out.append(attempt(os.setxattr, p, "user.step", b"42"))
    out.append(attempt(os.getxattr, p, "user.step"))
    out.append(attempt(os.getxattr, p, "user.none"))
    out.append(sorted(os.listxattr(p)))
    out.append(attempt(os.removexattr, p, "user.step"))
    out.append(attempt(os.removexattr, p, "user.step"))
    out.append(attempt(os.setxattr, p, "bogus.ns", b"x"))
    os.symlink("f", root / "s")
    out.append(attempt(os.setxattr, root / "s", "user.x", b"1", follow_symlinks=False))
    out.append(attempt(os.getxattr, root / "s", "user.x", follow_symlinks=False))
    out.append(attempt(os.listxattr, root / "s", follow_symlinks=False))
    return out


def preallocate(root: Path):
    fd = os.open(root / "f", os.O_CREAT | os.O_RDWR, 0o644)
    os.posix_fallocate(fd, 0, 1 << 20)  # glibc falls back to writing where the volume lacks fallocate (pyfuse3)
    out = [os.fstat(fd).st_size, os.pread(fd, 4, 4096)]
    os.close(fd)
    return out


def checkpoint_flow(root: Path):
    """What a PyTorch DCP / Orbax save does, end to end."""
    tmp = root / "100.orbax-checkpoint-tmp"
    tmp.mkdir(exist_ok=True)
    for rank in range(4):
        with open(tmp / f"__{rank}_0.distcp", "wb") as f:
            f.write(os.urandom(1) * (300_000 + rank))
            f.flush()
            os.fsync(f.fileno())
    (tmp / ".metadata.tmp").write_bytes(b"meta")
    os.replace(tmp / ".metadata.tmp", tmp / ".metadata")
    dfd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
    os.close(dfd)
    os.rename(tmp, root / "100")
    listing = sorted((p.name, p.stat().st_size) for p in (root / "100").iterdir())
    shutil.rmtree(root / "100")
    return [listing, os.listdir(root)]


def writes_in_flight(root: Path):
    """Large writes seen at once from other descriptors, while the writer keeps its file open."""
    p = root / "f"
    data = bytes(range(256)) * (4 * MiB // 256)
    wo = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)  # direct I/O
    rw = os.open(p, os.O_RDWR)  # page cache
    out = []
    for off in range(0, 4 * MiB, MiB):
        os.pwrite(wo, data[off : off + MiB], off)
        out.append((st(p), os.pread(rw, 16, off + MiB - 16)))
    ro = os.open(p, os.O_RDONLY)
    out.append(os.pread(ro, 4 * MiB, 0) == data)
    os.pwrite(rw, b"x" * MiB, 3 * MiB + 5)
    out.append((fst(ro), os.pread(ro, 8, 4 * MiB - 3)))
    ap = os.open(p, os.O_WRONLY | os.O_APPEND)
    for _ in range(3):
        os.write(ap, b"y" * MiB)
        os.write(wo, b"z" * MiB)  # at wo's offset, then appended after it
    out.append((st(p), os.pread(ro, 4, 0), os.pread(ro, 4, 5 * MiB)))
    tr = os.open(p, os.O_WRONLY | os.O_TRUNC)  # after everything before it
    out.append(fst(ro))
    os.write(wo, b"w" * MiB)
    out.append((st(p), os.pread(ro, 4, 0)))
    for fd in (wo, rw, ro, ap, tr):
        os.close(fd)
    out.append(st(p))
    return out


SCENARIOS = [
    open_flags,
    holes_and_truncate,
    renames,
    rename_flags,
    removal,
    symlinks,
    hard_links,
    attributes,
    readdir,
    sync_ops,
    locks,
    mmaps,
    xattrs,
    preallocate,
    checkpoint_flow,
    writes_in_flight,
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_same_as_tmpfs(scenario, volume, ref_dir):
    expected = scenario(ref_dir)
    got = scenario(volume.mountpoint)
    assert got == expected


def test_readdir_offsets_stable_under_concurrent_change(volume):
    """Entries present throughout a listing appear exactly once, whatever changes meanwhile."""
    root = volume.mountpoint
    stable = {f"keep-{i:04d}" for i in range(1000)}
    for n in stable:
        (root / n).write_bytes(b"")
    for i in range(200):
        (root / f"gone-{i}").write_bytes(b"")
    seen = []
    with os.scandir(root) as it:
        for i, entry in enumerate(it):
            seen.append(entry.name)
            if i == 100:  # the kernel has fetched only the first batch by now
                for j in range(200):
                    os.unlink(root / f"gone-{j}")
                for j in range(300):
                    (root / f"new-{j}").write_bytes(b"")
    assert len(seen) == len(set(seen)), "an entry was reported twice"
    assert stable <= set(seen), "an entry present throughout was skipped"


def test_read_sees_earlier_write_after_reopen(volume):
    """Page cache kept for read-only opens never serves bytes older than the last write."""
    p = volume.mountpoint / "f"
    p.write_bytes(b"A" * 8192)
    assert read(p) == b"A" * 8192  # fills the page cache
    with open(p, "r+b") as f:
        f.write(b"B" * 4096)
    assert read(p) == b"B" * 4096 + b"A" * 4096
    with open(p, "wb") as f:  # write-only: direct I/O path
        f.write(b"C" * 100)
    assert read(p) == b"C" * 100


def test_statfs_reports_capacity(volumes):
    vol = volumes(capacity="256M")
    s = os.statvfs(vol.mountpoint)
    assert s.f_blocks * s.f_frsize == 256 << 20
    free0 = s.f_bavail * s.f_frsize
    (vol.mountpoint / "f").write_bytes(b"x" * (10 << 20))
    s = os.statvfs(vol.mountpoint)
    assert free0 - s.f_bavail * s.f_frsize == 10 << 20


def test_statx_reports_the_birth_time(volume, engine):
    """statx(2) asks for what stat(2) lacks: the birth time, which tmpfs keeps (pyfuse3 has no
    statx handler: there the kernel reports none)."""
    libc = ctypes.CDLL(None, use_errno=True)
    before = time.time_ns()
    (volume.mountpoint / "f").write_bytes(b"x")
    buf = ctypes.create_string_buffer(256)
    assert libc.statx(-100, bytes(volume.mountpoint / "f"), 0, 0xFFF, buf) == 0
    mask = struct.unpack_from("<I", buf)[0]
    if engine == "pyfuse3":
        assert not mask & 0x800
        return
    assert mask & 0xFFF == 0xFFF
    sec, nsec = struct.unpack_from("<qI", buf, 80)
    assert before // 10**9 - 1 <= sec and sec * 10**9 + nsec <= time.time_ns()
