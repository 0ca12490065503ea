"""The volume's handlers as pyfuse3 calls them.

:class:`~tierfs.fs.operations.Operations` answers in the terms tierfs' own engine packs
itself (an entry as ``(ino, stat_result)``, a failure as OSError); pyfuse3 wants
``EntryAttributes``, a reply token for listings, and ``FUSEError`` for every failure. Each
face here is that translation and nothing else, so the handlers exist once.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, ParamSpec, TypeVar

import pyfuse3

from tierfs.fs.messages import ATTR_TIMEOUT, Requester, SetattrFields
from tierfs.fs.operations import Operations

log = logging.getLogger(__name__)

_NS = 1_000_000_000
_P = ParamSpec("_P")
_R = TypeVar("_R")


def errors_to_fuse(handler: Callable[_P, Awaitable[_R]]) -> Callable[_P, Coroutine[Any, Any, _R]]:
    """Turn OSError into the errno the kernel should see; a bug becomes EIO, not a dead mount."""

    @functools.wraps(handler)
    async def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return await handler(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except Exception:
            log.exception("internal error in %s", handler.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


class Pyfuse3Volume(pyfuse3.Operations):
    """``ops`` behind pyfuse3's interface."""

    supports_dot_lookup = False  # no NFS export: '.'/'..' never reach lookup()
    enable_writeback_cache = False

    def __init__(self, ops: Operations):
        super().__init__()
        self.ops = ops

    def _entry(self, ino: int, st: os.stat_result) -> pyfuse3.EntryAttributes:
        """The attributes the own engine would pack, as pyfuse3's object."""
        (_, size, blocks, at, mt, ct, atn, mtn, ctn, mode, nlink, uid, gid, rdev, blksize, _) = self.ops.fuse_attr(
            ino, st
        )
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.generation = 0
        a.entry_timeout = a.attr_timeout = ATTR_TIMEOUT
        a.st_mode, a.st_nlink, a.st_uid, a.st_gid, a.st_rdev = mode, nlink, uid, gid, rdev
        a.st_size, a.st_blksize, a.st_blocks = size, blksize, blocks
        a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns = at * _NS + atn, mt * _NS + mtn, ct * _NS + ctn
        return a

    # -- attributes ------------------------------------------------------------------------

    @errors_to_fuse
    async def getattr(self, inode: int, ctx: Requester) -> pyfuse3.EntryAttributes:
        return self._entry(*self.ops.getattr(inode, ctx))

    @errors_to_fuse
    async def setattr(
        self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields, fh: int | None, ctx: Requester
    ) -> pyfuse3.EntryAttributes:
        return self._entry(*await self.ops.setattr(inode, attr, SetattrFields.of(fields), fh, ctx))

    @errors_to_fuse
    async def statfs(self, ctx: Requester) -> pyfuse3.StatvfsData:
        return await self.ops.statfs(ctx)

    # -- names -----------------------------------------------------------------------------

    @errors_to_fuse
    async def lookup(self, parent_inode: int, name: bytes, ctx: Requester) -> pyfuse3.EntryAttributes:
        return self._entry(*self.ops.lookup(parent_inode, name, ctx))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:  # answered by no reply, even an error
        self.ops.forget(inode_list)

    @errors_to_fuse
    async def readlink(self, inode: int, ctx: Requester) -> bytes:
        return await self.ops.readlink(inode, ctx)

    @errors_to_fuse
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Requester
    ) -> pyfuse3.EntryAttributes:
        return self._entry(*await self.ops.mknod(parent_inode, name, mode, rdev, ctx))

    @errors_to_fuse
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Requester) -> pyfuse3.EntryAttributes:
        return self._entry(*await self.ops.mkdir(parent_inode, name, mode, ctx))

    @errors_to_fuse
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Requester) -> pyfuse3.EntryAttributes:
        return self._entry(*await self.ops.symlink(parent_inode, name, target, ctx))

    @errors_to_fuse
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Requester) -> pyfuse3.EntryAttributes:
        return self._entry(*await self.ops.link(inode, new_parent_inode, new_name, ctx))

    @errors_to_fuse
    async def unlink(self, parent_inode: int, name: bytes, ctx: Requester) -> None:
        await self.ops.unlink(parent_inode, name, ctx)

    @errors_to_fuse
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Requester) -> None:
        await self.ops.rmdir(parent_inode, name, ctx)

    @errors_to_fuse
    async def rename(
        self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes, flags: int, ctx: Requester
    ) -> None:
        await self.ops.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx)

    # -- directories -----------------------------------------------------------------------

    @errors_to_fuse
    async def opendir(self, inode: int, ctx: Requester) -> int:
        return await self.ops.opendir(inode, ctx)

    @errors_to_fuse
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        def add(name: bytes, ino: int, st: os.stat_result, next_id: int) -> bool:
            return bool(pyfuse3.readdir_reply(token, name, self._entry(ino, st), next_id))

        await self.ops.readdir(fh, start_id, add)

    @errors_to_fuse
    async def releasedir(self, fh: int) -> None:
        await self.ops.releasedir(fh)

    @errors_to_fuse
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        await self.ops.fsyncdir(fh, datasync)

    # -- files -----------------------------------------------------------------------------

    @errors_to_fuse
    async def open(self, inode: int, flags: int, ctx: Requester) -> pyfuse3.FileInfo:
        return await self.ops.open(inode, flags, ctx)

    @errors_to_fuse
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Requester
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        fi, ino, st = self.ops.create(parent_inode, name, mode, flags, ctx)
        return fi, self._entry(ino, st)

    @errors_to_fuse
    async def read(self, fh: int, off: int, size: int) -> memoryview:  # type: ignore[override]
        # (the ignore: pyfuse3 replies with any contiguous buffer, not only the bytes its types name)
        await self.ops.wait_for_read(fh, off, size)
        return self.ops.read(fh, off, size)

    @errors_to_fuse
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return self.ops.write(fh, off, buf)

    @errors_to_fuse
    async def flush(self, fh: int) -> None:
        self.ops.flush(fh)

    @errors_to_fuse
    async def release(self, fh: int) -> None:
        self.ops.release(fh)

    @errors_to_fuse
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.ops.fsync(fh, datasync)

    # -- extended attributes ---------------------------------------------------------------

    @errors_to_fuse
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Requester) -> None:
        await self.ops.setxattr(inode, name, value, ctx)

    @errors_to_fuse
    async def getxattr(self, inode: int, name: bytes, ctx: Requester) -> bytes:
        return self.ops.getxattr(inode, name, ctx)

    @errors_to_fuse
    async def listxattr(self, inode: int, ctx: Requester) -> list[bytes]:
        return await self.ops.listxattr(inode, ctx)

    @errors_to_fuse
    async def removexattr(self, inode: int, name: bytes, ctx: Requester) -> None:
        await self.ops.removexattr(inode, name, ctx)
