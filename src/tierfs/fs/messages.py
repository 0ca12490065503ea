"""The arguments of FUSE requests in the shapes the handlers take, and the kernel's replies
packed from the attributes they give.

Apart from the kernel session so that :class:`~tierfs.fs.operations.Operations` takes a
caller (:class:`Context`) or the attributes to change (:class:`SetattrFields`) from either
engine alike, and gives the kernel's ``struct fuse_attr`` (:func:`fuse_attr`) to the
session's own engine, whose directory listings fill a :class:`DirBuffer`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tierfs.fs import abi

_NS = 1_000_000_000
# Every change goes through the daemon, so the kernel may cache names and attributes (for
# this long); writes, renames and unlinks invalidate what they touch in the kernel itself.
ATTR_TIMEOUT = 1.0


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

    @classmethod
    def of(cls, fields: object) -> SetattrFields:
        """pyfuse3's fields (which know neither set-id drops nor "now")."""
        own = cls(0)
        for name in ("update_atime", "update_mtime", "update_mode", "update_uid", "update_gid", "update_size"):
            setattr(own, name, bool(getattr(fields, name)))
        return own


class DirBuffer:
    """A READDIRPLUS reply being filled by ``Operations.readdir``, up to the kernel's size;
    ``entry`` packs an entry's ``fuse_entry_out``."""

    __slots__ = ("size", "parts", "used", "entry")

    def __init__(self, size: int, entry: Callable[[int, os.stat_result], bytes]):
        self.size = size
        self.parts: list[bytes] = []
        self.used = 0
        self.entry = entry

    def add(self, name: bytes, ino: int, st: os.stat_result, next_id: int) -> bool:
        """Append one entry; False (and nothing appended) once the reply is full."""
        namelen = len(name)
        length = abi.ENTRY_OUT.size + abi.DIRENT.size + namelen
        padded = (length + 7) & ~7
        if self.used + padded > self.size:
            return False
        self.parts.append(self.entry(ino, st))
        self.parts.append(abi.DIRENT.pack(ino, next_id, namelen, stat.S_IFMT(st.st_mode) >> 12))
        self.parts.append(name + b"\0" * (padded - length))
        self.used += padded
        return True


def timeout(seconds: float) -> tuple[int, int]:
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


# ``struct fuse_attr``, field by field: ino size blocks atime mtime ctime atimensec
# mtimensec ctimensec mode nlink uid gid rdev blksize flags
FuseAttr = tuple[int, int, int, int, int, int, int, int, int, int, int, int, int, int, int, int]


def fuse_attr(ino: int, st: os.stat_result, nlink: int) -> FuseAttr:
    """``st`` as the kernel's ``struct fuse_attr`` of ``ino``, with the link count users see."""
    at, mt, ct = st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns
    return (
        ino,
        st.st_size,
        st.st_blocks,
        at // _NS,
        mt // _NS,
        ct // _NS,
        at % _NS,
        mt % _NS,
        ct % _NS,
        st.st_mode,
        nlink,
        st.st_uid,
        st.st_gid,
        st.st_rdev,
        st.st_blksize,
        0,
    )


def split_names(body: memoryview, count: int) -> list[bytes]:
    """``count`` NUL-terminated names at the start of ``body``."""
    return bytes(body).split(b"\0", count)[:count]
