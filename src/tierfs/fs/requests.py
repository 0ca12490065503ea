"""Each FUSE request decoded into the :class:`~tierfs.fs.operations.Operations` call it asks
for, and that call's answer packed as the kernel's reply.

Apart from the serving loop (:mod:`tierfs.fs.session`), which needs to know of a request
only whether it can be served where it was read (a handler of ``_now``) or must be awaited
(one of ``_later``); what each request means is written here, one handler per opcode, and
so is the handshake that decides which of the kernel's features the session uses.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Final, Literal

import pyfuse3
import trio

from tierfs.fs import abi, replay
from tierfs.fs.backing import BackingFiles
from tierfs.fs.messages import ATTR_TIMEOUT, Context, DirBuffer, SetattrFields, split_names, timeout

if TYPE_CHECKING:
    from tierfs.fs.operations import Operations
    from tierfs.fs.recovery import SessionState

log = logging.getLogger(__name__)

MAX_BACKGROUND = 64
_WANT = (
    abi.ASYNC_READ
    | abi.ATOMIC_O_TRUNC
    | abi.BIG_WRITES
    | abi.DO_READDIRPLUS
    | abi.ASYNC_DIO
    | abi.PARALLEL_DIROPS
    | abi.MAX_PAGES
    | abi.INIT_EXT
    | abi.DIRECT_IO_ALLOW_MMAP
    | abi.HANDLE_KILLPRIV_V2
)
# HANDLE_KILLPRIV_V2 lets the kernel mark inodes without set-id bits or capabilities as
# such (SB_NOSEC); without it every passthrough write first asks the daemon for the
# file's security.capability. In exchange the daemon drops set-id bits itself: files
# that have them stay on the daemon path for their non-root writers (Operations).
_ACL = abi.POSIX_ACL | abi.DONT_MASK
# POSIX_ACL makes the kernel enforce the ACLs it reads as system.posix_acl_* xattrs, as
# tmpfs does; a new object's mode then comes from the parent's default ACL if it has one,
# else from the umask, which only the daemon can tell apart: DONT_MASK leaves the umask to
# it (Operations). One without the other is not tmpfs' behaviour: both or neither.


class _Later(enum.Enum):
    """The type of :data:`LATER`, a value of its own, which no reply can be mistaken for."""

    LATER = "later"


LATER: Final = _Later.LATER  # a handler of ``_now`` that must wait after all: serve it as a coroutine

Reply = Sequence[bytes | memoryview]  # the parts of a reply, after its header
# Handlers, by opcode: ``(nodeid, body, ctx)`` to the reply (None: no reply at all).
NowHandler = Callable[[int, memoryview, Context], Reply | None | Literal[_Later.LATER]]
LaterHandler = Callable[[int, memoryview, Context], Awaitable[Reply | None]]


class Requests:
    """The kernel session's handlers, by opcode: ``(nodeid, body, ctx)`` to the parts of the
    reply (None: no reply). A release is the serving loop's to schedule (its ``_release``).

    The serving loop's own, used here: ``_reply(unique, parts)`` and ``_fail(opcode, unique, e)``."""

    # Kept by the kernel session.
    fd: int  # /dev/fuse (-1 until mounted)
    want_passthrough: bool
    max_write: int
    backing: BackingFiles | None
    refused: str | None
    record: SessionState | None

    if TYPE_CHECKING:  # the serving loop's own (KernelSession)

        def _reply(self, unique: int, parts: Reply) -> None: ...

        def _fail(self, opcode: int, unique: int, e: Exception) -> None: ...

    def __init__(self, ops: Operations):
        self.ops = ops
        valid = timeout(ATTR_TIMEOUT)
        self._entry_valid = (0, valid[0], valid[0], valid[1], valid[1])  # generation, entry and attr timeouts
        self._attr_valid = (valid[0], valid[1], 0)
        # Handlers that never wait, served where the request was read: no coroutine, no
        # pyfuse3 objects. These are the requests of creating and writing a file, where
        # the daemon's Python is most of each request's cost.
        self._now: dict[int, NowHandler] = {
            abi.LOOKUP: self._lookup,
            abi.FORGET: self._forget,
            abi.BATCH_FORGET: self._batch_forget,
            abi.GETATTR: self._getattr,
            abi.STATX: self._statx,
            abi.CREATE: self._create,
            abi.GETXATTR: self._getxattr,
            abi.READ: self._read_now,
        }
        self._later: dict[int, LaterHandler] = {
            abi.SETATTR: self._setattr,
            abi.READLINK: self._readlink,
            abi.SYMLINK: self._symlink,
            abi.MKNOD: self._mknod,
            abi.MKDIR: self._mkdir,
            abi.UNLINK: self._unlink,
            abi.RMDIR: self._rmdir,
            abi.RENAME: self._rename,
            abi.RENAME2: self._rename2,
            abi.LINK: self._link,
            abi.OPEN: self._open,
            abi.READ: self._read,
            abi.WRITE: self._write,
            abi.FLUSH: self._flush,
            abi.FSYNC: self._fsync,
            abi.FALLOCATE: self._fallocate,
            abi.LSEEK: self._lseek,
            abi.COPY_FILE_RANGE: self._copy_file_range,
            abi.COPY_FILE_RANGE_64: self._copy_file_range_64,
            abi.OPENDIR: self._opendir,
            abi.READDIRPLUS: self._readdirplus,
            abi.RELEASEDIR: self._releasedir,
            abi.FSYNCDIR: self._fsyncdir,
            abi.STATFS: self._statfs,
            abi.SETXATTR: self._setxattr,
            abi.LISTXATTR: self._listxattr,
            abi.REMOVEXATTR: self._removexattr,
            abi.IOCTL: self._ioctl,
            abi.TMPFILE: self._tmpfile,
            abi.INIT: self._init,
            abi.INTERRUPT: self._interrupt,
            abi.DESTROY: self._destroy,
        }

    # -- the handshake -----------------------------------------------------------------------

    async def _init(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        major, minor, max_readahead, flags, flags2 = abi.INIT_IN.unpack_from(body)
        if major != abi.KERNEL_MAJOR or minor < 31:
            log.error("kernel FUSE protocol %d.%d is too old for this engine", major, minor)
            raise pyfuse3.FUSEError(errno.EPROTO)
        offered = flags | (flags2 << 32 if flags & abi.INIT_EXT else 0)
        want = _WANT | (abi.PASSTHROUGH if self.want_passthrough else 0)
        if self.want_passthrough or not offered & abi.DIRECT_IO_ALLOW_MMAP:
            # Drop cached pages whenever a file's mtime changed. Every change goes through
            # the kernel, and since Linux 6.6 (DIRECT_IO_ALLOW_MMAP) it drops what a direct
            # write makes stale itself; before, only this catches it in the other opens. On
            # the daemon path it would also drop what a write just put in the page cache.
            want |= abi.AUTO_INVAL_DATA
        if offered & _ACL == _ACL:
            want |= _ACL
        granted = offered & want
        self.ops.hooks.acl = bool(granted & abi.POSIX_ACL)
        if granted & abi.PASSTHROUGH:
            self.backing = BackingFiles(self.fd)
        elif self.want_passthrough:
            self.refused = f"the kernel does not offer FUSE passthrough (protocol {major}.{minor})"
            log.warning("%s: files are served by the daemon", self.refused)
        self.ops.hooks.backing = self.backing
        if self.record is not None:  # a successor serves on as this handshake left the connection
            self.record.save_init(
                {
                    "minor": minor,
                    "offered": offered,
                    "granted": granted,
                    "max_write": self.max_write,
                    "acl": self.ops.hooks.acl,
                    "passthrough": self.backing is not None,
                }
            )
        reply = abi.INIT_OUT.pack(
            abi.KERNEL_MAJOR,
            min(minor, abi.KERNEL_MINOR),
            max_readahead,
            granted & 0xFFFFFFFF,
            MAX_BACKGROUND,
            MAX_BACKGROUND * 3 // 4,
            self.max_write,
            1,
            self.max_write // 4096,
            0,
            granted >> 32,
            1 if self.backing is not None else 0,
        )
        return [reply]

    async def _interrupt(self, nodeid: int, body: memoryview, ctx: Context) -> None:
        return None  # handlers run to completion; the kernel retries nothing

    async def _destroy(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        return []

    async def _again(self, opcode: int, unique: int, nodeid: int, body: memoryview, ctx: Context, began: int) -> None:
        """A journaled request sent again, begun by a daemon that died before it answered:
        run again, the errors of a first run that did its work read as success (:mod:`tierfs.fs.replay`)."""
        reply: Reply | None
        try:
            if opcode == abi.CREATE:
                reply = self._create(nodeid, body, ctx, resumed=began)
            else:
                reply = await self._later[opcode](nodeid, body, ctx)
        except trio.Cancelled:
            raise
        except Exception as e:  # noqa: BLE001 (a handler's error is its request's answer; _fail logs a bug)
            err = getattr(e, "errno", None)
            name = replay.made_name(opcode, body)
            if replay.done_already(opcode, err):
                reply = []
            elif err == errno.EEXIST and name is not None:
                ino, st = self.ops.lookup(nodeid, name)
                if st.st_ctime_ns < began:  # it was there before: the first run failed too
                    self.ops.forget([(ino, 1)])
                    self._fail(opcode, unique, e)
                    return
                reply = [self._entry_now(ino, st)]
            else:
                self._fail(opcode, unique, e)
                return
        if reply is not None:
            self._reply(unique, reply)

    # -- names ---------------------------------------------------------------------------

    def _entry_now(self, ino: int, st: os.stat_result) -> bytes:
        return abi.ENTRY_OUT.pack(ino, *self._entry_valid, *self.ops.fuse_attr(ino, st))

    def _lookup(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        return [self._entry_now(*self.ops.lookup(nodeid, bytes(body[:-1])))]

    def _forget(self, nodeid: int, body: memoryview, ctx: Context) -> None:
        self.ops.forget([(nodeid, abi.FORGET_IN.unpack_from(body)[0])])

    def _batch_forget(self, nodeid: int, body: memoryview, ctx: Context) -> None:
        count, _ = abi.BATCH_FORGET_IN.unpack_from(body)
        self.ops.forget(abi.FORGET_ONE.iter_unpack(body[abi.BATCH_FORGET_IN.size :][: count * abi.FORGET_ONE.size]))

    def _getattr(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        return [abi.ATTR_OUT.pack(*self._attr_valid, *self.ops.fuse_attr(*self.ops.getattr(nodeid)))]

    def _statx(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        """GETATTR's answer with the birth time, which only statx(2) asks for."""
        ino, st = self.ops.getattr(nodeid)
        (_, size, blocks, at, mt, ct, atn, mtn, ctn, mode, nlink, uid, gid, rdev, blksize, _) = self.ops.fuse_attr(
            ino, st
        )
        born = self.ops.birth_time(nodeid)
        mask = abi.STATX_BASIC_STATS | (abi.STATX_BTIME if born is not None else 0)
        bt, btn = divmod(born or 0, 1_000_000_000)
        return [
            abi.STATX_OUT.pack(
                self._attr_valid[0],
                self._attr_valid[1],
                0,
                mask,
                blksize,
                0,
                nlink,
                uid,
                gid,
                mode,
                ino,
                size,
                blocks,
                0,
                at,
                atn,
                bt,
                btn,
                ct,
                ctn,
                mt,
                mtn,
                os.major(rdev),
                os.minor(rdev),
                0,
                0,
            )
        ]

    async def _setattr(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        (valid, _, fh, size, _, atime, mtime, _, atimensec, mtimensec, _, mode, _, uid, gid, _) = (
            abi.SETATTR_IN.unpack_from(body)
        )
        attr = pyfuse3.EntryAttributes()
        now = time.time_ns()
        attr.st_mode, attr.st_uid, attr.st_gid, attr.st_size = mode, uid, gid, size
        attr.st_atime_ns = now if valid & abi.FATTR_ATIME_NOW else atime * 1_000_000_000 + atimensec
        attr.st_mtime_ns = now if valid & abi.FATTR_MTIME_NOW else mtime * 1_000_000_000 + mtimensec
        handle = fh if valid & abi.FATTR_FH else None
        ino, st = await self.ops.setattr(nodeid, attr, SetattrFields(valid), handle, ctx)
        return [abi.ATTR_OUT.pack(*self._attr_valid, *self.ops.fuse_attr(ino, st))]

    async def _readlink(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        return [await self.ops.readlink(nodeid, ctx)]

    async def _symlink(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        name, target = split_names(body, 2)
        return [self._entry_now(*await self.ops.symlink(nodeid, name, target, ctx))]

    async def _mknod(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        mode, rdev, ctx.umask, _ = abi.MKNOD_IN.unpack_from(body)
        name = bytes(body[abi.MKNOD_IN.size : -1])
        return [self._entry_now(*await self.ops.mknod(nodeid, name, mode, rdev, ctx))]

    async def _mkdir(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        mode, ctx.umask = abi.MKDIR_IN.unpack_from(body)
        name = bytes(body[abi.MKDIR_IN.size : -1])
        return [self._entry_now(*await self.ops.mkdir(nodeid, name, mode, ctx))]

    async def _unlink(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        await self.ops.unlink(nodeid, bytes(body[:-1]), ctx)
        return []

    async def _rmdir(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        await self.ops.rmdir(nodeid, bytes(body[:-1]), ctx)
        return []

    async def _rename(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        (newdir,) = abi.RENAME_IN.unpack_from(body)
        old, new = split_names(body[abi.RENAME_IN.size :], 2)
        await self.ops.rename(nodeid, old, newdir, new, 0, ctx)
        return []

    async def _rename2(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        newdir, flags, _ = abi.RENAME2_IN.unpack_from(body)
        old, new = split_names(body[abi.RENAME2_IN.size :], 2)
        await self.ops.rename(nodeid, old, newdir, new, flags, ctx)
        return []

    async def _link(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        (old,) = abi.LINK_IN.unpack_from(body)
        name = bytes(body[abi.LINK_IN.size : -1])
        return [self._entry_now(*await self.ops.link(old, nodeid, name, ctx))]

    # -- files -----------------------------------------------------------------------------

    def _open_out(self, fi: pyfuse3.FileInfo) -> bytes:
        backing_id = self.backing.backing_id(fi.fh) if self.backing is not None else None
        if backing_id is not None:  # no FLUSH at close: the kernel wrote the bytes itself
            return abi.OPEN_OUT.pack(fi.fh, abi.FOPEN_PASSTHROUGH | abi.FOPEN_NOFLUSH, backing_id)
        flags = (abi.FOPEN_DIRECT_IO if fi.direct_io else 0) | (abi.FOPEN_KEEP_CACHE if fi.keep_cache else 0)
        return abi.OPEN_OUT.pack(fi.fh, flags, 0)

    async def _open(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        flags, open_flags = abi.OPEN_IN.unpack_from(body)
        kill = bool(open_flags & abi.OPEN_KILL_SUIDGID)
        return [self._open_out(await self.ops.open(nodeid, flags, ctx, kill_privs=kill))]

    def _create(self, nodeid: int, body: memoryview, ctx: Context, resumed: int | None = None) -> Reply:
        flags, mode, ctx.umask, _ = abi.CREATE_IN.unpack_from(body)
        name = bytes(body[abi.CREATE_IN.size : -1])
        fi, ino, st = self.ops.create(nodeid, name, mode, flags, ctx, resumed)
        return [self._entry_now(ino, st), self._open_out(fi)]

    async def _tmpfile(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        flags, mode, ctx.umask, _ = abi.CREATE_IN.unpack_from(body)
        fi, ino, st = await self.ops.tmpfile(nodeid, mode, flags, ctx)
        return [self._entry_now(ino, st), self._open_out(fi)]

    def _read_now(self, nodeid: int, body: memoryview, ctx: Context) -> Reply | Literal[_Later.LATER]:
        fh, offset, size, *_ = abi.READ_IN.unpack_from(body)
        if not self.ops.read_ready(fh):
            return LATER  # waits for chunks of a file being restored
        return [self.ops.read(fh, offset, size)]

    async def _read(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        fh, offset, size, *_ = abi.READ_IN.unpack_from(body)
        await self.ops.wait_for_read(fh, offset, size)
        return [self.ops.read(fh, offset, size)]

    async def _write(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        fh, offset, size, *_ = abi.WRITE_IN.unpack_from(body)
        # A copy: the write may be applied after this worker reads its next request.
        data = bytes(body[abi.WRITE_IN.size : abi.WRITE_IN.size + size])
        return [abi.WRITE_OUT.pack(self.ops.write(fh, offset, data), 0)]

    async def _flush(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        self.ops.flush(abi.FLUSH_IN.unpack_from(body)[0])
        return []

    async def _fsync(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        fh, flags, _ = abi.FSYNC_IN.unpack_from(body)
        await self.ops.fsync(fh, bool(flags & abi.FSYNC_FDATASYNC))
        return []

    async def _fallocate(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        fh, offset, length, mode, _ = abi.FALLOCATE_IN.unpack_from(body)
        await self.ops.fallocate(fh, mode, offset, length, ctx)
        return []

    async def _lseek(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        fh, offset, whence, _ = abi.LSEEK_IN.unpack_from(body)
        return [abi.LSEEK_OUT.pack(await self.ops.lseek(fh, offset, whence))]

    async def _copy_file_range(self, nodeid: int, body: memoryview, ctx: Context, limit: int = 0xFFFFFFFF) -> Reply:
        """``limit``: the most its answer can say (32 bits, before COPY_FILE_RANGE_64)."""
        fh_in, off_in, _, fh_out, off_out, length, flags = abi.COPY_FILE_RANGE_IN.unpack_from(body)
        n = await self.ops.copy_file_range(fh_in, off_in, fh_out, off_out, min(length, limit), flags, ctx)
        return [abi.WRITE_OUT.pack(n, 0) if limit == 0xFFFFFFFF else abi.COPY_FILE_RANGE_64_OUT.pack(n)]

    async def _copy_file_range_64(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        return await self._copy_file_range(nodeid, body, ctx, limit=1 << 63)

    # -- directories -----------------------------------------------------------------------

    async def _opendir(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        fh = await self.ops.opendir(nodeid, ctx)
        return [abi.OPEN_OUT.pack(fh, 0, 0)]

    async def _readdirplus(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        fh, offset, size, *_ = abi.READ_IN.unpack_from(body)
        token = DirBuffer(size, self._entry_now)
        await self.ops.readdir(fh, offset, token.add)
        return token.parts

    async def _releasedir(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        await self.ops.releasedir(abi.RELEASE_IN.unpack_from(body)[0])
        return []

    async def _fsyncdir(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        fh, flags, _ = abi.FSYNC_IN.unpack_from(body)
        await self.ops.fsyncdir(fh, bool(flags & abi.FSYNC_FDATASYNC))
        return []

    async def _statfs(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        s = await self.ops.statfs(ctx)
        return [
            abi.STATFS_OUT.pack(
                s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree, s.f_bsize, s.f_namemax, s.f_frsize
            )
        ]

    # -- extended attributes ---------------------------------------------------------------

    async def _setxattr(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        size, flags = abi.SETXATTR_IN.unpack_from(body)
        rest = body[abi.SETXATTR_IN.size :]
        end = bytes(rest).index(b"\0")
        await self.ops.setxattr(nodeid, bytes(rest[:end]), bytes(rest[end + 1 : end + 1 + size]), ctx, flags)
        return []

    def _getxattr(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        size, _ = abi.GETXATTR_IN.unpack_from(body)
        return self._sized(self.ops.getxattr(nodeid, bytes(body[abi.GETXATTR_IN.size : -1])), size)

    async def _listxattr(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        size, _ = abi.GETXATTR_IN.unpack_from(body)
        names = await self.ops.listxattr(nodeid, ctx)
        return self._sized(b"".join(n + b"\0" for n in names), size)

    @staticmethod
    def _sized(value: bytes, size: int) -> Reply:
        if size == 0:
            return [abi.GETXATTR_OUT.pack(len(value), 0)]
        if len(value) > size:
            raise pyfuse3.FUSEError(errno.ERANGE)
        return [value]

    async def _removexattr(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        await self.ops.removexattr(nodeid, bytes(body[:-1]), ctx)
        return []

    async def _ioctl(self, nodeid: int, body: memoryview, ctx: Context) -> Reply:
        fh, _, cmd, _, in_size, out_size = abi.IOCTL_IN.unpack_from(body)
        data = bytes(body[abi.IOCTL_IN.size : abi.IOCTL_IN.size + in_size])
        return [abi.IOCTL_OUT.pack(0, 0, 0, 0), await self.ops.ioctl(nodeid, fh, cmd, data, out_size)]
