"""The arguments of FUSE requests in the shapes the handlers take, and the kernel's replies
packed from the attributes they give.

Apart from the kernel session so that :class:`~tierfs.fs.operations.Operations` can fill a
directory listing of the session's own engine (:class:`DirBuffer`) as it fills pyfuse3's,
and take a caller (:class:`Context`) or the attributes to change (:class:`SetattrFields`)
from either engine alike.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from typing import Protocol

import pyfuse3

from tierfs.fs import abi


@dataclass(slots=True)
class Context:
    """The caller of a request (pyfuse3.RequestContext's fields)."""

    uid: int
    gid: int
    pid: int
    umask: int = 0


class Requester(Protocol):
    """The caller of a request as the handlers take it from either engine: pyfuse3's
    ``RequestContext`` or :class:`Context`."""

    @property
    def uid(self) -> int: ...

    @property
    def gid(self) -> int: ...

    @property
    def pid(self) -> int: ...

    @property
    def umask(self) -> int: ...


class SetattrFields:
    """Which attributes a SETATTR changes (pyfuse3.SetattrFields' fields)."""

    __slots__ = (
        "update_atime",
        "update_mtime",
        "update_ctime",
        "update_mode",
        "update_uid",
        "update_gid",
        "update_size",
        "kill_suidgid",
        "atime_now",
        "mtime_now",
    )

    def __init__(self, valid: int):
        self.update_atime = bool(valid & (abi.FATTR_ATIME | abi.FATTR_ATIME_NOW))
        self.update_mtime = bool(valid & (abi.FATTR_MTIME | abi.FATTR_MTIME_NOW))
        self.update_ctime = False
        self.update_mode = bool(valid & abi.FATTR_MODE)
        self.update_uid = bool(valid & abi.FATTR_UID)
        self.update_gid = bool(valid & abi.FATTR_GID)
        self.update_size = bool(valid & abi.FATTR_SIZE)
        self.kill_suidgid = bool(valid & abi.FATTR_KILL_SUIDGID)  # a truncate by a caller without CAP_FSETID
        # "now", not a time the caller chose (allowed on an append-only file)
        self.atime_now = bool(valid & abi.FATTR_ATIME_NOW)
        self.mtime_now = bool(valid & abi.FATTR_MTIME_NOW)


class DirBuffer:
    """A READDIRPLUS reply being filled by ``Operations.readdir``, up to the kernel's size."""

    __slots__ = ("size", "parts", "used")

    def __init__(self, size: int):
        self.size = size
        self.parts: list[bytes] = []
        self.used = 0

    def add(self, name: bytes, attr: pyfuse3.EntryAttributes, next_id: int) -> bool:
        """Append one entry; False (and nothing appended) once the reply is full."""
        namelen = len(name)
        length = abi.ENTRY_OUT.size + abi.DIRENT.size + namelen
        padded = (length + 7) & ~7
        if self.used + padded > self.size:
            return False
        self.parts.append(entry_out(attr))
        self.parts.append(abi.DIRENT.pack(attr.st_ino, next_id, namelen, stat.S_IFMT(attr.st_mode) >> 12))
        self.parts.append(name + b"\0" * (padded - length))
        self.used += padded
        return True


def timeout(seconds: float) -> tuple[int, int]:
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


# ``struct fuse_attr``, field by field: ino size blocks atime mtime ctime atimensec
# mtimensec ctimensec mode nlink uid gid rdev blksize flags
FuseAttr = tuple[int, int, int, int, int, int, int, int, int, int, int, int, int, int, int, int]


def attr_fields(a: pyfuse3.EntryAttributes) -> FuseAttr:
    at, mt, ct = a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns
    return (
        a.st_ino,
        a.st_size,
        a.st_blocks,
        at // 1_000_000_000,
        mt // 1_000_000_000,
        ct // 1_000_000_000,
        at % 1_000_000_000,
        mt % 1_000_000_000,
        ct % 1_000_000_000,
        a.st_mode,
        a.st_nlink,
        a.st_uid,
        a.st_gid,
        a.st_rdev,
        a.st_blksize,
        0,
    )


def entry_out(a: pyfuse3.EntryAttributes) -> bytes:
    entry_s, entry_ns = timeout(a.entry_timeout)
    attr_s, attr_ns = timeout(a.attr_timeout)
    return abi.ENTRY_OUT.pack(a.st_ino, a.generation, entry_s, attr_s, entry_ns, attr_ns, *attr_fields(a))


def attr_out(a: pyfuse3.EntryAttributes) -> bytes:
    attr_s, attr_ns = timeout(a.attr_timeout)
    return abi.ATTR_OUT.pack(attr_s, attr_ns, 0, *attr_fields(a))


def split_names(body: memoryview, count: int) -> list[bytes]:
    """``count`` NUL-terminated names at the start of ``body``."""
    return bytes(body).split(b"\0", count)[:count]
