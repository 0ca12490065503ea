"""A seeded random client: the same system calls on two trees, every result recorded.

``differential.py run ROOT SEED COUNT [--without FEATURE ...]`` makes COUNT calls chosen by
SEED under ROOT (creates, writes, truncates, fallocates, renames with every flag, links,
symlinks, fifos, O_TMPFILE, copy_file_range, seeks for data and holes, chmod and chown,
extended attributes in every namespace with every flag and buffer size, inode flags by
ioctl) and prints one JSON list: each call's description and its result or errno. The
sequence depends on SEED alone, never on results, so two runs on two trees make the same
calls and their lists compare item by item. ``tree ROOT`` prints everything a tree holds
that must agree (types, modes, owners, sizes, link counts, contents, symlink targets, every
extended attribute, inode flags); ``unfreeze ROOT`` clears the immutable and append-only
flags a run left, so that the tree can be deleted.

Standard library only: the system python3 runs it as any user.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import random
import stat
import struct
import sys

libc = ctypes.CDLL(None, use_errno=True)

# -- system calls Python does not offer with every argument ------------------------------

FS_IOC_GETFLAGS, FS_IOC_SETFLAGS = 0x80086601, 0x40086602
FS_IOC_FSGETXATTR, FS_IOC_FSSETXATTR = 0x801C581F, 0x401C5820
FS_IOC_GETVERSION = 0x80087601
FSXATTR = struct.Struct("<IIIII8x")  # xflags extsize nextents projid cowextsize pad
IMMUTABLE, APPEND, NODUMP, NOATIME = 0x10, 0x20, 0x40, 0x80
XFLAG_IMMUTABLE, XFLAG_APPEND, XFLAG_NODUMP, XFLAG_NOATIME = 0x8, 0x10, 0x80, 0x40
RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT = 1, 2, 4
KEEP_SIZE, PUNCH_HOLE, COLLAPSE_RANGE, ZERO_RANGE, INSERT_RANGE = 0x01, 0x02, 0x08, 0x10, 0x20
O_TMPFILE = getattr(os, "O_TMPFILE", 0o20200000)
XATTR_CREATE, XATTR_REPLACE = 1, 2
AT_SYMLINK_NOFOLLOW, AT_SYMLINK_FOLLOW, AT_EMPTY_PATH = 0x100, 0x400, 0x1000
STATX_ATTR_IMMUTABLE, STATX_ATTR_APPEND = 0x10, 0x20

for _name in ("setxattr", "lsetxattr"):
    getattr(libc, _name).argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
libc.fsetxattr.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
for _name in ("getxattr", "lgetxattr"):
    getattr(libc, _name).argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    getattr(libc, _name).restype = ctypes.c_ssize_t
libc.fgetxattr.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
libc.fgetxattr.restype = ctypes.c_ssize_t
for _name in ("listxattr", "llistxattr"):
    getattr(libc, _name).argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    getattr(libc, _name).restype = ctypes.c_ssize_t
libc.flistxattr.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
libc.flistxattr.restype = ctypes.c_ssize_t
for _name in ("removexattr", "lremovexattr"):
    getattr(libc, _name).argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.fremovexattr.argtypes = [ctypes.c_int, ctypes.c_char_p]
libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
libc.statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]


def _check(ret: int) -> int:
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return ret


def xattr_set(target, name: bytes, value: bytes, flags: int, follow: bool) -> None:
    if isinstance(target, int):
        _check(libc.fsetxattr(target, name, value, len(value), flags))
    else:
        _check((libc.setxattr if follow else libc.lsetxattr)(os.fsencode(target), name, value, len(value), flags))


def xattr_get(target, name: bytes, size: int, follow: bool = False):
    """getxattr with a buffer of exactly ``size`` bytes: the value, or its length if 0."""
    buf = ctypes.create_string_buffer(max(size, 1))
    if isinstance(target, int):
        n = _check(libc.fgetxattr(target, name, buf, size))
    else:
        n = _check((libc.getxattr if follow else libc.lgetxattr)(os.fsencode(target), name, buf, size))
    return n if size == 0 else buf.raw[:n]


def xattr_list(target, size: int, follow: bool = False):
    """listxattr with a buffer of exactly ``size`` bytes: the sorted names, or the length if 0."""
    buf = ctypes.create_string_buffer(max(size, 1))
    if isinstance(target, int):
        n = _check(libc.flistxattr(target, buf, size))
    else:
        n = _check((libc.listxattr if follow else libc.llistxattr)(os.fsencode(target), buf, size))
    return n if size == 0 else sorted(os.fsdecode(name) for name in buf.raw[:n].split(b"\0")[:-1])


def xattr_remove(target, name: bytes, follow: bool) -> None:
    if isinstance(target, int):
        _check(libc.fremovexattr(target, name))
    else:
        _check((libc.removexattr if follow else libc.lremovexattr)(os.fsencode(target), name))


def rename2(old: str, new: str, flags: int) -> None:
    _check(libc.renameat2(-100, os.fsencode(old), -100, os.fsencode(new), flags))


def link_fd(fd: int, path: str) -> None:
    """Give the open file ``fd`` the name ``path`` (an O_TMPFILE file too): linkat of its
    /proc link, followed (os.link would make link(2) of the /proc link itself)."""
    _check(libc.linkat(-100, f"/proc/self/fd/{fd}".encode(), -100, os.fsencode(path), AT_SYMLINK_FOLLOW))


def fallocate(fd: int, mode: int, off: int, n: int) -> None:
    _check(libc.fallocate(fd, mode, off, n))


def get_flags(fd: int) -> int:
    buf = bytearray(8)
    fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf)
    return struct.unpack_from("<i", buf)[0]


def statx_mask(path: str) -> str:
    """Which of the basic fields and the birth time a statx of ``path`` fills."""
    buf = ctypes.create_string_buffer(256)
    _check(libc.statx(-100, os.fsencode(path), AT_SYMLINK_NOFOLLOW, 0xFFF, buf))
    return hex(struct.unpack_from("<I", buf)[0] & 0xFFF)


def statx_attributes(dirfd: int, path: str, follow: bool = False) -> int:
    """``stx_attributes`` of ``path`` (the descriptor itself if empty), 0 if none."""
    buf = ctypes.create_string_buffer(256)
    flags = (0 if follow else AT_SYMLINK_NOFOLLOW) | (AT_EMPTY_PATH if not path else 0)
    if libc.statx(dirfd, os.fsencode(path), flags, 0, buf) != 0:
        return 0
    return struct.unpack_from("<Q", buf, 8)[0]


def set_flags(fd: int, flags: int) -> None:
    fcntl.ioctl(fd, FS_IOC_SETFLAGS, bytearray(struct.pack("<q", flags)))


def get_fsxattr(fd: int) -> list:
    buf = bytearray(FSXATTR.size)
    fcntl.ioctl(fd, FS_IOC_FSGETXATTR, buf)
    return list(FSXATTR.unpack(buf))


def set_fsxattr(fd: int, xflags: int) -> None:
    fcntl.ioctl(fd, FS_IOC_FSSETXATTR, bytearray(FSXATTR.pack(xflags, 0, 0, 0, 0)))


def get_version(fd: int) -> int:
    buf = bytearray(8)
    fcntl.ioctl(fd, FS_IOC_GETVERSION, buf)
    return 0  # its value is the file system's own: only whether it answers compares


def acl(*entries: tuple[int, int, int]) -> bytes:
    """A ``system.posix_acl_*`` value: version 2, then (tag, perm, id) entries."""
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


# -- what the calls are made of ----------------------------------------------------------

DIRS = ["", "d", "e", "d/s"]
DIR_WEIGHTS = [6, 3, 2, 1]
NAMES = ["f", "g", "h", "d", "e", "s", "l", "p"]
MODES = [0o644, 0o600, 0o755, 0o777, 0o000, 0o444, 0o4755, 0o2775, 0o1777, 0o2644]
UIDS = [0, 1000, 1001, 65534, -1]
SIZES = [0, 1, 10, 4095, 4096, 5000, 70000, 1 << 20]
OFFSETS = [0, 1, 100, 4095, 4096, 8192, 100000, 1 << 20, 3 << 20]
TARGETS = ["f", "../f", "d", "nowhere", "s/l", "d/s/f"]
LONG_SUFFIX = "n" * 250
XATTR_NAMES = [
    b"user.a",
    b"user.a",
    b"user.b",
    b"user.b",
    b"user.a.b",
    b"trusted.t",
    b"security.s",
    b"user." + LONG_SUFFIX.encode(),
    b"user." + LONG_SUFFIX.encode() + b"x",
    b"user.",
    b"trusted.t",
    b"trusted.overlay.x",
    b"security.s",
    b"security.capability",
    b"system.posix_acl_access",
    b"system.posix_acl_default",
    b"system.other",
    b"noprefix",
    b"os2.a",
]
ACLS = [
    acl((1, 7, 0xFFFFFFFF), (4, 5, 0xFFFFFFFF), (0x20, 4, 0xFFFFFFFF)),  # the mode as an ACL
    acl((1, 6, 0xFFFFFFFF), (2, 6, 1000), (4, 4, 0xFFFFFFFF), (0x10, 6, 0xFFFFFFFF), (0x20, 0, 0xFFFFFFFF)),
    acl((1, 7, 0xFFFFFFFF), (4, 7, 0xFFFFFFFF), (8, 7, 2000), (0x10, 5, 0xFFFFFFFF), (0x20, 1, 0xFFFFFFFF)),
    b"\x02\0\0\0garbage!",
]
CAPS = [struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0), b"\x01\x02"]  # v2 cap_net_bind_service; junk
FLAG_SETS = [0, IMMUTABLE, APPEND, NODUMP, NOATIME, NODUMP | NOATIME, APPEND | NODUMP, 0x4, 0x8, 0x80000]
XFLAG_SETS = [0, XFLAG_IMMUTABLE, XFLAG_APPEND, XFLAG_NODUMP | XFLAG_NOATIME, 0x1]
FEATURES = ("fallocate", "seek_holes", "acl", "ioctl", "tmpfile", "setxattr_flags", "statx")


class Client:
    """Makes the calls of one seed under one root, and records what each returned."""

    def __init__(self, root: str, seed: int, without: set[str]):
        self.root = os.path.join(root, "w")  # a level down: a symlink to ../f stays in the tree
        self.rng = random.Random(seed)
        self.without = without
        self.slots: dict[int, int] = {}
        self.log: list[list] = []
        self.named: list[str] = []  # the paths and slots the current call names
        self.named_slots: list[int] = []
        ops = [
            (self.open, 12),
            (self.close, 5),
            (self.write, 10),
            (self.read, 5),
            (self.truncate, 3),
            (self.mkdir, 4),
            (self.rmdir, 2),
            (self.unlink, 3),
            (self.symlink, 2),
            (self.readlink, 1),
            (self.link, 2),
            (self.rename, 5),
            (self.mkfifo, 1),
            (self.chmod, 3),
            (self.chown, 2),
            (self.utime, 1),
            (self.stat, 4),
            (self.listdir, 2),
            (self.access, 1),
            (self.umask, 1),
            (self.copy_range, 2),
            (self.sendfile, 1),
            (self.seek, 3),
            (self.sync, 1),
            (self.setxattr, 10),
            (self.getxattr, 6),
            (self.listxattr, 4),
            (self.removexattr, 4),
        ]
        if "fallocate" not in without:
            ops.append((self.fallocate, 3))
        if "ioctl" not in without:
            ops.append((self.ioctl, 6))
        if "tmpfile" not in without:
            ops += [(self.tmpfile, 1), (self.link_fd, 1)]
        if "statx" not in without:
            ops.append((self.statx, 1))
        self.ops = [op for op, weight in ops for _ in range(weight)]

    # -- choices -------------------------------------------------------------------------

    def path(self) -> str:
        p = os.path.join(self.rng.choices(DIRS, DIR_WEIGHTS)[0], self.rng.choice(NAMES))
        self.named.append(p)
        return p

    def full(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def slot(self) -> int:
        """A slot for a new descriptor (closing the one it held)."""
        return self.rng.randrange(6)

    def open_slot(self) -> int:
        """A slot to use: mostly one that holds a descriptor. The choice depends on what
        earlier calls opened, which is the same on both trees until a result differs."""
        held = sorted(self.slots)
        s = self.rng.choice(held) if held and self.rng.random() < 0.9 else self.rng.randrange(6)
        self.named_slots.append(s)
        return s

    def data(self) -> bytes:
        n = self.rng.choice(SIZES)
        return self.rng.randbytes(min(n, 64)) * (n // 64 + 1) if n else b""

    # -- the run -------------------------------------------------------------------------

    def run(self, count: int) -> list[list]:
        for i, d in enumerate(("", "d", "e", "d/s")):  # somewhere to start from (EEXIST later)
            self.call(i - 4, lambda: (f"mkdir {d}", lambda: os.mkdir(self.full(d), 0o1777)))
        for i in range(count):
            op = self.rng.choice(self.ops)
            self.call(i, op)
        for s in sorted(self.slots):
            os.close(self.slots.pop(s))
        return self.log

    def call(self, i: int, op) -> None:
        """Choose the call's arguments, make it, and record its description and outcome.

        A call refused with EPERM is marked ``frozen`` if an inode it names is immutable or
        append-only: that is where the kernel checks its own flags before anything else
        (tests.fuse.test_differential)."""
        self.named, self.named_slots = [], []
        desc, fn = op()
        try:
            result = fn()
        except OSError as e:
            result = errno.errorcode.get(e.errno, str(e.errno))
            if e.errno == errno.EPERM and self.frozen():
                result = [result, "frozen"]
        self.log.append([i, desc, result, self.after()])

    def after(self) -> list:
        """What the call left of the paths and descriptors it names: a state that parts
        from the other tree's shows at the call that made it so, not only at the end."""
        seen = []
        for p in self.named:
            for look in (
                lambda: summary(os.stat(self.full(p), follow_symlinks=False)),
                lambda: summary(os.stat(self.full(p))),
                lambda: xattr_list(self.full(p), 65536),
            ):
                try:
                    seen.append(look())
                except OSError as e:
                    seen.append(errno.errorcode.get(e.errno, str(e.errno)))
        seen += [fst(self.slots[s]) if s in self.slots else None for s in self.named_slots]
        return seen

    def frozen(self) -> bool:
        """Whether a path or open slot the current call names (or a path's directory) is
        immutable or append-only, as statx reports it. Only tmpfs reports it there (FUSE
        passes no statx attributes), which is the side the comparison asks."""
        targets = [(self.slots[s], "", False) for s in self.named_slots if s in self.slots]
        for p in self.named:
            targets += [
                (-100, self.full(p), False),
                (-100, self.full(p), True),
                (-100, self.full(os.path.dirname(p)), True),
            ]
        return any(
            statx_attributes(fd, path, follow) & (STATX_ATTR_IMMUTABLE | STATX_ATTR_APPEND)
            for fd, path, follow in targets
        )

    def on_slot(self, s: int, fn):
        def run():
            if s not in self.slots:
                return "no-slot"
            return fn(self.slots[s])

        return run

    # -- the operations: each returns (description, the call) ----------------------------

    def open(self):
        p, s = self.path(), self.slot()
        acc = self.rng.choice([os.O_RDONLY, os.O_WRONLY, os.O_RDWR])
        extra = [
            f
            for f, p in (
                (os.O_CREAT, 0.6),
                (os.O_EXCL, 0.15),
                (os.O_TRUNC, 0.15),
                (os.O_APPEND, 0.2),
                (os.O_NOFOLLOW, 0.1),
                (os.O_DIRECTORY, 0.1),
                (os.O_NOATIME, 0.1),
            )
            if self.rng.random() < p
        ]
        flags = acc | os.O_NONBLOCK | sum(extra)  # O_NONBLOCK: a fifo never blocks the run
        mode = self.rng.choice(MODES)

        def run():
            fd = os.open(self.full(p), flags, mode)
            self._put(s, fd)
            return ["fd", fst(fd)]

        return f"open {p} {flags:#o} {mode:#o} -> {s}", run

    def tmpfile(self):
        d, s = self.rng.choice(DIRS), self.slot()
        self.named.append(d)
        acc = self.rng.choice([os.O_WRONLY, os.O_RDWR])
        excl = self.rng.choice([0, os.O_EXCL])
        mode = self.rng.choice(MODES)

        def run():
            fd = os.open(self.full(d), O_TMPFILE | acc | excl, mode)
            self._put(s, fd)
            return ["fd", fst(fd)]

        return f"tmpfile {d or '.'} {acc | excl:#o} {mode:#o} -> {s}", run

    def link_fd(self):
        s, p = self.open_slot(), self.path()

        def link(fd):
            link_fd(fd, self.full(p))

        return f"linkat fd {s} {p}", self.on_slot(s, link)

    def _put(self, s: int, fd: int) -> None:
        if s in self.slots:
            os.close(self.slots[s])
        self.slots[s] = fd

    def close(self):
        s = self.open_slot()

        def run():
            if s not in self.slots:
                return "no-slot"
            os.close(self.slots.pop(s))

        return f"close {s}", run

    def write(self):
        s, data, off = self.open_slot(), self.data(), self.rng.choice(OFFSETS)
        if self.rng.random() < 0.5:
            return f"write {s} {len(data)}", self.on_slot(s, lambda fd: os.write(fd, data))
        return f"pwrite {s} {len(data)}@{off}", self.on_slot(s, lambda fd: os.pwrite(fd, data, off))

    def read(self):
        s, n, off = self.open_slot(), self.rng.choice(SIZES), self.rng.choice(OFFSETS)
        return f"pread {s} {n}@{off}", self.on_slot(s, lambda fd: digest(os.pread(fd, n, off)))

    def truncate(self):
        size = self.rng.choice(OFFSETS + [7, 12345])
        if self.rng.random() < 0.5:
            s = self.open_slot()
            return f"ftruncate {s} {size}", self.on_slot(s, lambda fd: os.ftruncate(fd, size))
        p = self.path()
        return f"truncate {p} {size}", lambda: os.truncate(self.full(p), size)

    def fallocate(self):
        s = self.open_slot()
        mode = self.rng.choice(
            [
                0,
                KEEP_SIZE,
                PUNCH_HOLE | KEEP_SIZE,
                ZERO_RANGE,
                ZERO_RANGE | KEEP_SIZE,
                COLLAPSE_RANGE,
                INSERT_RANGE,
                PUNCH_HOLE,
            ]
        )
        off, n = self.rng.choice(OFFSETS), self.rng.choice([1, 4096, 8192, 65536, 1 << 20])
        return f"fallocate {s} {mode:#x} {n}@{off}", self.on_slot(s, lambda fd: fallocate(fd, mode, off, n))

    def seek(self):
        s, off = self.open_slot(), self.rng.choice(OFFSETS)
        whences = [os.SEEK_SET, os.SEEK_CUR, os.SEEK_END]
        if "seek_holes" not in self.without:
            whences += [os.SEEK_DATA, os.SEEK_HOLE, os.SEEK_DATA, os.SEEK_HOLE]
        whence = self.rng.choice(whences)

        def seek(fd):
            if whence != os.SEEK_SET and whence != os.SEEK_CUR and stat.S_ISDIR(os.fstat(fd).st_mode):
                return "directory"  # FUSE seeks directories as files: tmpfs knows only SET and CUR there
            return os.lseek(fd, off, whence)

        return f"lseek {s} {off} {whence}", self.on_slot(s, seek)

    def sync(self):
        s, fn = self.open_slot(), self.rng.choice([os.fsync, os.fdatasync])
        return f"{fn.__name__} {s}", self.on_slot(s, fn)

    def copy_range(self):
        src, dst, n = self.open_slot(), self.open_slot(), self.rng.choice(SIZES)
        src_off, dst_off = self.rng.choice(OFFSETS), self.rng.choice(OFFSETS)

        def run():
            if src not in self.slots or dst not in self.slots:
                return "no-slot"
            return os.copy_file_range(self.slots[src], self.slots[dst], n, src_off, dst_off)

        return f"copy_file_range {src}@{src_off} {dst}@{dst_off} {n}", run

    def sendfile(self):
        src, dst, n, off = self.open_slot(), self.open_slot(), self.rng.choice(SIZES), self.rng.choice(OFFSETS)

        def run():
            if src not in self.slots or dst not in self.slots:
                return "no-slot"
            if src == dst:  # within one file, overlapping: what it leaves depends on how it is cut up
                return "one file: left out"
            return os.sendfile(self.slots[dst], self.slots[src], off, n)

        return f"sendfile {src}@{off} {dst} {n}", run

    def mkdir(self):
        p, mode = self.path(), self.rng.choice(MODES)
        return f"mkdir {p} {mode:#o}", lambda: os.mkdir(self.full(p), mode)

    def rmdir(self):
        p = self.path()
        return f"rmdir {p}", lambda: os.rmdir(self.full(p))

    def unlink(self):
        p = self.path()
        return f"unlink {p}", lambda: os.unlink(self.full(p))

    def symlink(self):
        target, p = self.rng.choice(TARGETS), self.path()
        return f"symlink {target} {p}", lambda: os.symlink(target, self.full(p))

    def readlink(self):
        p = self.path()
        return f"readlink {p}", lambda: os.readlink(self.full(p))

    def link(self):
        a, b = self.path(), self.path()
        return f"link {a} {b}", lambda: os.link(self.full(a), self.full(b), follow_symlinks=False)

    def rename(self):
        a, b = self.path(), self.path()
        flags = self.rng.choice([0, 0, RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT, 3])
        return f"rename {a} {b} {flags}", lambda: rename2(self.full(a), self.full(b), flags)

    def mkfifo(self):
        p, mode = self.path(), self.rng.choice(MODES)
        return f"mkfifo {p} {mode:#o}", lambda: os.mkfifo(self.full(p), mode)

    def chmod(self):
        p, mode = self.path(), self.rng.choice(MODES)

        def run():
            if mode & stat.S_ISUID or mode & stat.S_ISGID and mode & stat.S_IXGRP:
                if os.getuid() != 0 and self.writing(self.full(p)):
                    # a write passed through to tmpfs would not drop them (docs/architecture.md)
                    return "set-id bits for a file this user has open for writing: left out"
            return os.chmod(self.full(p), mode)

        return f"chmod {p} {mode:#o}", run

    def writing(self, path: str) -> bool:
        """Whether an open slot writes the file ``path`` names."""
        try:
            st = os.stat(path)
        except OSError:
            return False
        return any(
            fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
            and (os.fstat(fd).st_ino, os.fstat(fd).st_dev) == (st.st_ino, st.st_dev)
            for fd in self.slots.values()
        )

    def chown(self):
        p, uid, gid = self.path(), self.rng.choice(UIDS), self.rng.choice(UIDS + [2000])
        if uid == gid == -1:  # the kernel asks FUSE for it as for a write's dropping of set-id bits
            gid = 2000  # (docs/architecture.md): a difference of the protocol, left out
        follow = self.rng.random() < 0.5
        return f"chown {p} {uid} {gid} {follow}", lambda: os.chown(self.full(p), uid, gid, follow_symlinks=follow)

    def utime(self):
        p = self.path()
        times = self.rng.choice([None, (1, 2)])
        return f"utime {p} {times}", lambda: os.utime(self.full(p), times)

    def stat(self):
        p, follow = self.path(), self.rng.random() < 0.5
        return f"stat {p} {follow}", lambda: summary(os.stat(self.full(p), follow_symlinks=follow))

    def statx(self):
        p = self.path()
        return f"statx {p}", lambda: statx_mask(self.full(p))

    def listdir(self):
        d = self.rng.choice(DIRS)
        return f"listdir {d}", lambda: sorted(os.listdir(self.full(d)))

    def access(self):
        p, mode = self.path(), self.rng.choice([os.R_OK, os.W_OK, os.X_OK, os.R_OK | os.W_OK])
        return f"access {p} {mode}", lambda: _check(libc.faccessat(-100, os.fsencode(self.full(p)), mode, 0))

    def umask(self):
        mask = self.rng.choice([0o022, 0o077, 0o002, 0o000, 0o027])
        return f"umask {mask:#o}", lambda: os.umask(mask) and None

    # -- extended attributes and inode flags ---------------------------------------------

    def xattr_target(self):
        """A path (followed or not) or an open slot: ``(description, resolve, follow)``."""
        if self.rng.random() < 0.25:
            s = self.open_slot()
            return f"fd {s}", lambda: self.slots.get(s), True
        p, follow = self.path(), self.rng.random() < 0.3
        return f"{p} {follow}", lambda: self.full(p), follow

    def xattr_name(self) -> bytes:
        names = XATTR_NAMES if "acl" not in self.without else [n for n in XATTR_NAMES if b"posix_acl" not in n]
        return self.rng.choice(names)

    def xattr_value(self, name: bytes) -> bytes:
        if b"posix_acl" in name and self.rng.random() < 0.8:
            return self.rng.choice(ACLS)
        if name == b"security.capability" and self.rng.random() < 0.8:
            return self.rng.choice(CAPS)
        n = self.rng.choice([0, 1, 1, 100, 100, 4000, 65536, 65537])
        return self.rng.randbytes(min(n, 97)) * (n // 97 + 1) if n else b""

    def with_target(self, describe: str, fn):
        desc, resolve, follow = self.xattr_target()

        def run():
            target = resolve()
            return "no-slot" if target is None else fn(target, follow)

        return f"{describe} {desc}", run

    def setxattr(self):
        name = self.xattr_name()
        value = self.xattr_value(name)
        flags = self.rng.choice([0, 0, 0, XATTR_CREATE, XATTR_CREATE, XATTR_REPLACE, XATTR_REPLACE, 3, 4])
        if "setxattr_flags" in self.without:  # checked by reading the attribute first (pyfuse3):
            if flags == 3:  # not both at once,
                flags = XATTR_REPLACE
            if name == b"security.capability" and flags == XATTR_CREATE:  # nor one it cannot read back
                flags = 0
        return self.with_target(
            f"setxattr {name!r} {len(value)} {flags}", lambda t, follow: xattr_set(t, name, value, flags, follow)
        )

    def getxattr(self):
        name, size = self.xattr_name(), self.rng.choice([0, 1, 16, 256, 65536])
        return self.with_target(
            f"getxattr {name!r} {size}", lambda t, follow: value_of(xattr_get(t, name, size, follow))
        )

    def listxattr(self):
        size = self.rng.choice([0, 1, 7, 64, 65536])
        return self.with_target(f"listxattr {size}", lambda t, follow: xattr_list(t, size, follow))

    def removexattr(self):
        name = self.xattr_name()
        return self.with_target(f"removexattr {name!r}", lambda t, follow: xattr_remove(t, name, follow))

    def ioctl(self):
        s = self.open_slot()
        kind = self.rng.choice(
            ["getflags", "getflags", "setflags", "setflags", "fsgetxattr", "fssetxattr", "getversion"]
        )
        if kind == "setflags":
            flags = self.rng.choice(FLAG_SETS)
            return f"ioctl {s} SETFLAGS {flags:#x}", self.on_slot(s, lambda fd: set_flags(fd, flags))
        if kind == "fssetxattr":
            xflags = self.rng.choice(XFLAG_SETS)
            return f"ioctl {s} FSSETXATTR {xflags:#x}", self.on_slot(s, lambda fd: set_fsxattr(fd, xflags))
        fn = {"getflags": get_flags, "fsgetxattr": get_fsxattr, "getversion": get_version}[kind]
        return f"ioctl {s} {kind.upper()}", self.on_slot(s, fn)


# -- what a call's result is recorded as ------------------------------------------------------


def digest(data: bytes) -> list:
    return [len(data), hashlib.blake2b(data, digest_size=8).hexdigest()]


def value_of(v):
    return v if isinstance(v, int) else digest(v)


def summary(st: os.stat_result) -> list:
    """What must agree of a status: not inode numbers, devices or times."""
    return [
        stat.filemode(st.st_mode),
        st.st_nlink,
        st.st_uid,
        st.st_gid,
        st.st_size if not stat.S_ISDIR(st.st_mode) else None,
        st.st_blocks if stat.S_ISREG(st.st_mode) else None,
    ]


def fst(fd: int) -> list:
    return summary(os.fstat(fd))


# -- the tree --------------------------------------------------------------------------------


def tree(root: str, flags: bool = True) -> dict:
    """Every path under ``root`` with what must agree of it (inode flags only if ``flags``)."""
    out = {}
    for d, dirs, files, dir_fd in os.fwalk(root):
        for name in sorted(dirs + files):
            rel = os.path.relpath(os.path.join(d, name), root)
            st = os.lstat(name, dir_fd=dir_fd)
            entry = {"stat": summary(st), "xattrs": {}}
            full = os.path.join(d, name)
            for xname in xattr_list(full, 65536):
                try:
                    entry["xattrs"][xname] = digest(xattr_get(full, os.fsencode(xname), 65536))
                except OSError as e:  # security.capability that the kernel cannot present
                    entry["xattrs"][xname] = errno.errorcode.get(e.errno, str(e.errno))
            if stat.S_ISLNK(st.st_mode):
                entry["target"] = os.readlink(name, dir_fd=dir_fd)
            elif stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
                try:
                    if flags:
                        entry["flags"] = get_flags(fd)
                        entry["fsxattr"] = get_fsxattr(fd)[0]
                    if stat.S_ISREG(st.st_mode):
                        entry["data"] = digest(os.pread(fd, st.st_size + 1, 0))
                finally:
                    os.close(fd)
            out[rel] = entry
    return out


def unfreeze(root: str) -> None:
    """Clear immutable and append-only flags under ``root`` (as root), so it can be deleted."""
    for _, dirs, files, dir_fd in os.fwalk(root, topdown=False):
        for name in dirs + files:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
            except OSError:
                continue
            try:
                flags = get_flags(fd)
                if flags & (IMMUTABLE | APPEND):
                    set_flags(fd, flags & ~(IMMUTABLE | APPEND))
            except OSError:
                pass
            finally:
                os.close(fd)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["run", "tree", "unfreeze"])
    parser.add_argument("root")
    parser.add_argument("seed", type=int, nargs="?", default=0)
    parser.add_argument("count", type=int, nargs="?", default=0)
    parser.add_argument(
        "--without",
        nargs="*",
        default=[],
        choices=FEATURES,
        help="leave out calls the file system under test has no handler for",
    )
    args = parser.parse_args(argv)
    if args.command == "run":
        os.umask(0o022)
        print(json.dumps(Client(args.root, args.seed, set(args.without)).run(args.count)))
    elif args.command == "tree":
        print(json.dumps(tree(args.root, flags="ioctl" not in args.without), sort_keys=True))
    else:
        unfreeze(args.root)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
