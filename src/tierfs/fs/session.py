"""A FUSE session of our own: ``/dev/fuse`` spoken directly, with kernel passthrough.

pyfuse3 (on libfuse 3.14) can neither negotiate ``FUSE_PASSTHROUGH`` at INIT nor hand the
kernel a backing file on open, and passthrough is what lets reads, writes, splice and
mmap of a whole file go from the caller straight to its RAM-tier file with no daemon round
trip: tmpfs speed for the bulk of every checkpoint. So this module mounts the volume
itself (``mount(2)`` with ``fd=``), answers INIT, and serves requests by calling the very
same :class:`~tierfs.fs.operations.Operations` handlers pyfuse3 calls, with arguments of
the same shape. File-system semantics stay in that one class; this is only the engine.

Requests are served by trio tasks. One worker at a time reads the device, and serves what
it reads right there, as long as the handler cannot wait: most requests, and all those of
creating and writing a file, whose cost is mostly the daemon's Python, so they go without
a coroutine, pyfuse3's objects, or a pass through trio's scheduler while more are queued
(the handlers in ``_now`` call Operations' synchronous ``*_sync`` methods). A request whose
handler may await (an open, truncate or read of a file still being restored) makes its
worker hand the device to another one and await it, so it never holds up the others. Each
worker has its own request buffer; a reply is written before the worker awaits anything
again, so a handler may reply from a shared buffer.

Two things keep the caller of a file's create from waiting on the daemon. A release (the
kernel does not wait for its answer) is done once nothing is queued, so the next open's
lookups are answered first, and always before any other request that could tell, and
before the worker lets another task run. And where the next request typically follows
within a millisecond, the worker polls the device for it instead of sleeping, and asks the
kernel to keep idle CPUs awake meanwhile, so that its answers wake their callers at once
(:mod:`tierfs.fs.poller`); both only where the CPU is idle anyway.

Open files of the kernel's choice of I/O mode are tracked by :class:`BackingFiles`: the
kernel insists that every passthrough open of an inode use the same backing file, and that
no open of an inode in passthrough use the page cache.

Without passthrough (a kernel before 6.9, or ``--data-path daemon``) every byte crosses the
daemon, and the session moves them without Python touching them: each request is read
through a pipe (:mod:`tierfs.fs.splicing`), a write's bytes stay there and are spliced into
the RAM-tier file, by this worker when no other request waits (one writer: no hand-over to
wait for), else by a write-behind thread (several writers: their copies run side by side),
which answers once they are in. Reads are answered from the file as they come; the
kernel's page cache keeps what it read or what was written through it between opens, as
long as nothing bypassed it (:class:`~tierfs.fs.operations.Operations`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import select
import stat
import time
from collections.abc import Awaitable
from dataclasses import dataclass

import pyfuse3
import trio

from tierfs.core import linux
from tierfs.fs import abi, splicing
from tierfs.fs.poller import Poller, WakeLatency
from tierfs.fs.splicing import Pipe, PipePool

log = logging.getLogger(__name__)

MAX_WRITE = 1 << 20  # 1 MiB requests, as libfuse negotiates on this kernel
BUFFER_SIZE = MAX_WRITE + 2 * 4096  # the kernel refuses reads into anything smaller
MAX_WORKERS = 32
MAX_BACKGROUND = 64
YIELD_EVERY = 16  # requests a worker serves back to back before it lets other tasks run
_WANT = (abi.ASYNC_READ | abi.ATOMIC_O_TRUNC | abi.BIG_WRITES
         | abi.DO_READDIRPLUS | abi.ASYNC_DIO | abi.PARALLEL_DIROPS | abi.MAX_PAGES
         | abi.INIT_EXT | abi.DIRECT_IO_ALLOW_MMAP | abi.HANDLE_KILLPRIV_V2)
# HANDLE_KILLPRIV_V2 lets the kernel mark inodes without set-id bits or capabilities as
# such (SB_NOSEC); without it every passthrough write first asks the daemon for the
# file's security.capability. In exchange the daemon drops set-id bits itself: files
# that have them stay on the daemon path for their non-root writers (Operations).
_ACL = abi.POSIX_ACL | abi.DONT_MASK
# POSIX_ACL makes the kernel enforce the ACLs it reads as system.posix_acl_* xattrs, as
# tmpfs does; a new object's mode then comes from the parent's default ACL if it has one,
# else from the umask, which only the daemon can tell apart: DONT_MASK leaves the umask to
# it (Operations). One without the other is not tmpfs' behaviour: both or neither.

MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
# A file's close is followed at once by the next open's path walk and create, which should
# not wait for the release's bookkeeping. Requests that cannot tell whether a release before
# them was handled yet (nothing they do or return depends on it) are served before it. A
# create needs only the part of a release that others see (Operations.release_writes: the
# commit rules hear of the close before anything new appears), not the rest
# (Operations.release_handle). Any other request comes after the whole release, as the
# kernel sent them.
_BEFORE_RELEASES = frozenset({abi.LOOKUP, abi.GETATTR, abi.GETXATTR, abi.FORGET, abi.BATCH_FORGET, abi.RELEASE})
_BEFORE_RELEASE_HANDLES = frozenset({*_BEFORE_RELEASES, abi.CREATE})


_LATER = object()  # a handler of ``_now`` that must wait after all: serve it as a coroutine


class Unmounted(Exception):
    """The kernel ended the connection (unmounted or aborted)."""


@dataclass(slots=True)
class Context:
    """The caller of a request (pyfuse3.RequestContext's fields)."""

    uid: int
    gid: int
    pid: int
    umask: int = 0


class SetattrFields:
    """Which attributes a SETATTR changes (pyfuse3.SetattrFields' fields)."""

    __slots__ = ("update_atime", "update_mtime", "update_ctime", "update_mode",
                 "update_uid", "update_gid", "update_size", "kill_suidgid")

    def __init__(self, valid: int):
        self.update_atime = bool(valid & (abi.FATTR_ATIME | abi.FATTR_ATIME_NOW))
        self.update_mtime = bool(valid & (abi.FATTR_MTIME | abi.FATTR_MTIME_NOW))
        self.update_ctime = False
        self.update_mode = bool(valid & abi.FATTR_MODE)
        self.update_uid = bool(valid & abi.FATTR_UID)
        self.update_gid = bool(valid & abi.FATTR_GID)
        self.update_size = bool(valid & abi.FATTR_SIZE)
        self.kill_suidgid = bool(valid & abi.FATTR_KILL_SUIDGID)  # a truncate by a caller without CAP_FSETID


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
        self.parts.append(_entry(attr))
        self.parts.append(abi.DIRENT.pack(attr.st_ino, next_id, namelen, stat.S_IFMT(attr.st_mode) >> 12))
        self.parts.append(name + b"\0" * (padded - length))
        self.used += padded
        return True


class BackingFiles:
    """Backing files registered with the kernel for passthrough, one per open inode.

    The kernel ties an inode in passthrough to one backing file until its last such open
    is released, and refuses another one meanwhile; so an inode's id is shared by all its
    passthrough opens and closed with the last of them.
    """

    def __init__(self, dev_fd: int):
        self._dev_fd = dev_fd
        self._inodes: dict[int, list[int]] = {}  # ino -> [backing id, passthrough opens]
        self._handles: dict[int, int] = {}  # fh -> ino
        self.failed: OSError | None = None  # the kernel refused to register a file

    def opens(self, ino: int) -> int:
        entry = self._inodes.get(ino)
        return entry[1] if entry else 0

    def attach(self, ino: int, fh: int) -> bool:
        """Serve ``fh`` (a descriptor of ``ino``'s backing file) by passthrough, if the kernel lets us."""
        entry = self._inodes.get(ino)
        if entry is None:
            arg = bytearray(abi.BACKING_MAP.pack(fh, 0, 0))
            try:
                backing_id = fcntl.ioctl(self._dev_fd, abi.DEV_IOC_BACKING_OPEN, arg, True)
            except OSError as e:
                if self.failed is None:
                    log.warning("the kernel refused a passthrough backing file (%s): files are served "
                                "by the daemon from now on", e.strerror or e)
                self.failed = e
                return False
            entry = self._inodes[ino] = [backing_id, 0]
        entry[1] += 1
        self._handles[fh] = ino
        return True

    def backing_id(self, fh: int) -> int | None:
        ino = self._handles.get(fh)
        return None if ino is None else self._inodes[ino][0]

    def detach(self, fh: int) -> None:
        """``fh`` was released: the inode's last passthrough open closes its backing id."""
        ino = self._handles.pop(fh, None)
        if ino is None:
            return
        entry = self._inodes[ino]
        entry[1] -= 1
        if entry[1] == 0:
            del self._inodes[ino]
            try:
                fcntl.ioctl(self._dev_fd, abi.DEV_IOC_BACKING_CLOSE, abi.BACKING_ID.pack(entry[0]))
            except OSError as e:  # the connection is gone: nothing to close
                log.debug("closing backing id %d: %s", entry[0], e)

    def __len__(self) -> int:
        return len(self._handles)


def _ts(seconds: float) -> tuple[int, int]:
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


def _attr_fields(a: pyfuse3.EntryAttributes) -> tuple:
    at, mt, ct = a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns
    return (a.st_ino, a.st_size, a.st_blocks, at // 1_000_000_000, mt // 1_000_000_000, ct // 1_000_000_000,
            at % 1_000_000_000, mt % 1_000_000_000, ct % 1_000_000_000,
            a.st_mode, a.st_nlink, a.st_uid, a.st_gid, a.st_rdev, a.st_blksize, 0)


def _entry(a: pyfuse3.EntryAttributes) -> bytes:
    entry_s, entry_ns = _ts(a.entry_timeout)
    attr_s, attr_ns = _ts(a.attr_timeout)
    return abi.ENTRY_OUT.pack(a.st_ino, a.generation, entry_s, attr_s, entry_ns, attr_ns, *_attr_fields(a))


def _attr(a: pyfuse3.EntryAttributes) -> bytes:
    attr_s, attr_ns = _ts(a.attr_timeout)
    return abi.ATTR_OUT.pack(attr_s, attr_ns, 0, *_attr_fields(a))


def _names(body: memoryview, count: int) -> list[bytes]:
    """``count`` NUL-terminated names at the start of ``body``."""
    return bytes(body).split(b"\0", count)[:count]


class KernelSession:
    """One mounted volume served over ``/dev/fuse``; the engine behind the passthrough data path.

    ``mount`` → ``run`` (until unmounted or :meth:`terminate`) → ``close``, the same life
    cycle as pyfuse3's ``init``/``main``/``close``.
    """

    name = "tierfs"

    def __init__(self, ops, want_passthrough: bool = True, wake_cpus: bool = True, writers: int = 1):
        self.ops = ops
        self.want_passthrough = want_passthrough
        # Without passthrough every byte written crosses the daemon: requests are read
        # through a pipe and writes spliced into their files by ``writers`` threads.
        self._pipes: PipePool | None = None
        self._pipe: Pipe | None = None  # the pipe the next request is read through
        if not want_passthrough:
            try:
                pipes = PipePool()
                self._pipe, self._pipes = pipes.take(), pipes
            except OSError as e:
                log.warning("writes are read into the daemon, not spliced: a pipe for them: %s", e.strerror or e)
        self.max_write = MAX_WRITE if self._pipes is None else min(MAX_WRITE, self._pipes.max_write)
        self._data_pipe: Pipe | None = None  # holding the bytes of the write read last
        self._dev_poll = select.poll()  # whether more requests are queued
        ops.writes.threads = writers if self._pipes is not None else 1  # unspliced writes: answered first
        self.fd: int | None = None
        self.mountpoint: str | None = None
        self.backing: BackingFiles | None = None  # set once INIT granted passthrough
        self.refused: str | None = None  # why passthrough is off, if it was wanted
        self._cancel: trio.CancelScope | None = None
        self._read_lock = trio.Lock()
        self._released: list[int] = []  # handles released, nothing done about them yet
        self._closing: list[int] = []  # handles released, their release_handle still to do
        self._last_opcode = 0
        self._poller = Poller()  # whether to poll for the next request rather than sleep
        self._wake = WakeLatency(wake_cpus)  # idle CPUs kept awake while a burst lasts
        if self._wake.state not in ("on", "off"):
            log.info("idle CPUs will not be kept awake during bursts of requests: %s", self._wake.state)
        self._workers = 0
        self._idle = 0
        valid = _ts(ops.attr_timeout)
        self._entry_valid = (0, valid[0], valid[0], valid[1], valid[1])  # generation, entry and attr timeouts
        self._attr_valid = (valid[0], valid[1], 0)
        # Handlers that never wait, served where the request was read: no coroutine, no
        # pyfuse3 objects. These are the requests of creating and writing a file, where
        # the daemon's Python is most of each request's cost.
        self._now = {
            abi.LOOKUP: self._lookup, abi.FORGET: self._forget, abi.BATCH_FORGET: self._batch_forget,
            abi.GETATTR: self._getattr, abi.CREATE: self._create, abi.RELEASE: self._release,
            abi.GETXATTR: self._getxattr, abi.READ: self._read_now,
        }
        self._handlers = {
            abi.SETATTR: self._setattr, abi.READLINK: self._readlink,
            abi.SYMLINK: self._symlink, abi.MKNOD: self._mknod, abi.MKDIR: self._mkdir,
            abi.UNLINK: self._unlink, abi.RMDIR: self._rmdir, abi.RENAME: self._rename,
            abi.RENAME2: self._rename2, abi.LINK: self._link, abi.OPEN: self._open,
            abi.READ: self._read, abi.WRITE: self._write,
            abi.FLUSH: self._flush, abi.FSYNC: self._fsync,
            abi.FALLOCATE: self._fallocate, abi.LSEEK: self._lseek,
            abi.OPENDIR: self._opendir, abi.READDIRPLUS: self._readdirplus,
            abi.RELEASEDIR: self._releasedir, abi.FSYNCDIR: self._fsyncdir, abi.STATFS: self._statfs,
            abi.SETXATTR: self._setxattr,
            abi.LISTXATTR: self._listxattr, abi.REMOVEXATTR: self._removexattr,
            abi.INIT: self._init, abi.INTERRUPT: self._interrupt, abi.DESTROY: self._destroy,
        }

    @property
    def wake_cpus(self) -> str:
        return self._wake.state

    @property
    def data_path(self) -> str:
        return "passthrough" if self.backing is not None and self.backing.failed is None else "daemon"

    @property
    def transfer(self) -> str:
        """How the bytes of files served by the daemon move, in a few words (for status)."""
        if self.backing is not None:
            return "others by direct I/O"
        if self._pipes is None:
            return "writes copied by 1 thread"
        return f"writes spliced by {self.ops.writes.threads} threads"

    # -- life cycle ------------------------------------------------------------------------

    def mount(self, mountpoint: str, fsname: str, read_only: bool = False) -> None:
        """Mount a FUSE file system served by this session (needs CAP_SYS_ADMIN)."""
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        options = (f"fd={fd},rootmode={stat.S_IFDIR:o},user_id=0,group_id=0,"
                   "allow_other,default_permissions")
        flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0)
        try:
            linux.mount(fsname, mountpoint, "fuse.tierfs", flags, options)
        except OSError:
            os.close(fd)
            raise
        self.fd, self.mountpoint = fd, mountpoint
        self._dev_poll.register(fd, select.POLLIN)

    async def run(self) -> None:
        """Serve requests until the kernel ends the connection or :meth:`terminate` is called."""
        with trio.CancelScope() as self._cancel:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._workers = 1
                nursery.start_soon(self._worker)

    def terminate(self) -> None:
        if self._cancel is not None:
            self._cancel.cancel()

    def close(self, unmount: bool) -> None:
        """Let go of the mount: unmount it first if asked (it may be gone already)."""
        if unmount and self.mountpoint is not None:
            try:
                linux.umount(self.mountpoint, linux.MNT_DETACH)
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.ENOENT):
                    log.warning("could not unmount %s: %s", self.mountpoint, e)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self._pipes is not None:
            if self._pipe is not None:
                self._pipes.discard(self._pipe)
                self._pipe = None
            self._pipes.close()
        self._poller.close()
        self._wake.close()

    # -- the request loop ----------------------------------------------------------------

    async def _worker(self) -> None:
        buf = bytearray(BUFFER_SIZE)
        view = memoryview(buf)
        while True:
            self._idle += 1
            try:
                await self._read_lock.acquire()  # one task reads the device at a time
            finally:
                self._idle -= 1
            try:
                waiting = await self._serve_until_waiting(buf, view)
            finally:
                self._read_lock.release()
            if self._idle == 0 and self._workers < MAX_WORKERS:
                self._workers += 1  # keep one worker reading while this one awaits
                self._nursery.start_soon(self._worker)
            await waiting

    async def _serve_until_waiting(self, buf: bytearray, view: memoryview) -> Awaitable[None]:
        """Read requests and serve them, as long as they need no waiting; return the first
        one that does, to be awaited by this worker once another one reads the device.

        A request already queued is taken at once, with no pass through trio's scheduler
        (which costs as much as a handler), but every ``YIELD_EVERY`` requests the other
        tasks get their turn. With nothing queued, releases read so far are done first
        (the space of an unlinked file comes back at once, as on tmpfs), then the next
        request is polled for where the poller expects it soon; releases are always done
        before this worker lets any other task run: no task ever sees one half done.
        """
        served = 0
        follow_up = True  # the last answer may be followed at once (no idle moment since)
        while True:
            try:
                n = self._receive(buf)
            except BlockingIOError:
                if self._finish_releases():  # the first idle moment; then read again
                    continue
                n = None
                if follow_up and (window := self._poller.idle(self._last_opcode)):
                    self._wake.hold()
                    n = self._poller.poll(self._receive, buf, window)
                follow_up = False
                if n is None:
                    self._wake.release()
                    served = 0
                    await trio.lowlevel.wait_readable(self.fd)
                    continue
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.EINTR):  # interrupted before we read it
                    continue
                self._finish_releases()
                if e.errno == errno.ENODEV:  # unmounted
                    self.terminate()
                    await trio.sleep_forever()
                raise
            if not follow_up:
                self._poller.arrived()
            follow_up = True
            waiting = self._serve(view[:n])
            if waiting is not None:
                return waiting
            served += 1
            if served == YIELD_EVERY:
                served = 0
                self._finish_releases()
                await trio.lowlevel.checkpoint()

    def _receive(self, buf: bytearray) -> int:
        """Read the next request into ``buf``: its length (BlockingIOError if none is queued)."""
        if self._pipes is None:
            return os.readv(self.fd, [buf])
        if self._pipe is None:
            self._pipe = self._pipes.take()
        n, holds_data = splicing.receive(self.fd, self._pipe, buf)
        if holds_data:  # the write's bytes go with their pipe
            self._data_pipe, self._pipe = self._pipe, None
        return n

    def _settle_releases(self) -> None:
        """Do the part of the releases read so far that others see (Operations.release_writes)."""
        released, self._released = self._released, []
        for fh in released:
            self._releasing(self.ops.release_writes, fh)
            self._closing.append(fh)

    def _finish_releases(self) -> bool:
        """Do all of the releases read so far; whether there were any."""
        if not self._released and not self._closing:
            return False
        self._settle_releases()
        closing, self._closing = self._closing, []
        for fh in closing:
            self._releasing(self.ops.release_handle, fh)
        return True

    @staticmethod
    def _releasing(step, fh: int) -> None:
        try:
            step(fh)
        except Exception as e:  # the kernel ignores a release's result: say it here
            log.warning("releasing file handle %d failed: %s", fh, e, exc_info=not isinstance(e, OSError))

    def _serve(self, req: memoryview):
        """Serve one request at once, or return what to await to serve it (a handler that may wait)."""
        _, opcode, unique, nodeid, uid, gid, pid, extlen, _ = abi.IN_HEADER.unpack_from(req)
        body = req[abi.IN_HEADER.size:len(req) - extlen * 8]
        if (self._released or self._closing) and opcode not in _BEFORE_RELEASES:
            if opcode in _BEFORE_RELEASE_HANDLES:
                self._settle_releases()
            else:
                self._finish_releases()
        self._last_opcode = opcode
        if self._data_pipe is not None:
            self._write_spliced(unique, body)
            return None
        if opcode == abi.READ and self._pipes is not None and self._read_spliced(unique, body):
            return None
        handler = self._now.get(opcode)
        if handler is not None:
            try:
                reply = handler(nodeid, body, Context(uid, gid, pid))
            except Exception as e:
                self._fail(opcode, unique, e)
                return None
            if reply is not _LATER:
                if reply is not None:
                    self._reply(unique, reply)
                return None
        return self._dispatch(opcode, unique, nodeid, body, Context(uid, gid, pid))

    async def _dispatch(self, opcode: int, unique: int, nodeid: int, body: memoryview, ctx: Context) -> None:
        handler = self._handlers.get(opcode)
        if handler is None:
            self._reply_error(unique, errno.ENOSYS)
            return
        try:
            reply = await handler(nodeid, body, ctx)
        except trio.Cancelled:
            raise
        except Exception as e:
            self._fail(opcode, unique, e)
            return
        if reply is not None:
            self._reply(unique, reply)

    def _fail(self, opcode: int, unique: int, e: Exception) -> None:
        """Answer a request whose handler raised: its errno, or EIO for a bug (logged)."""
        if isinstance(e, pyfuse3.FUSEError):
            self._reply_error(unique, e.errno)
        elif isinstance(e, OSError):
            self._reply_error(unique, e.errno or errno.EIO)
        else:
            log.error("internal error serving FUSE opcode %d", opcode, exc_info=e)
            self._reply_error(unique, errno.EIO)

    def _write_spliced(self, unique: int, body: memoryview) -> None:
        """A write whose bytes wait in ``_data_pipe``: moved into the file and answered by a
        write-behind worker while more requests wait to be read (several writers: their
        copies run side by side), else here, at once (one writer: no hand-over to wait for)."""
        pipe, self._data_pipe = self._data_pipe, None
        fh, offset, size, *_ = abi.WRITE_IN.unpack_from(body)

        def apply() -> None:
            try:
                n = splicing.write_out(pipe, fh, offset, size)
            except BaseException as e:
                self._pipes.discard(pipe)
                self._reply_error(unique, getattr(e, "errno", None) or errno.EIO)
                if not isinstance(e, OSError):
                    raise
                return
            (self._pipes.give if n == size else self._pipes.discard)(pipe)
            self._reply(unique, [abi.WRITE_OUT.pack(n, 0)])

        try:
            self.ops.write_by(fh, offset, size, apply, now=not self._dev_poll.poll(0))
        except Exception as e:  # refused before apply was queued
            self._pipes.discard(pipe)
            self._fail(abi.WRITE, unique, e)

    def _read_spliced(self, unique: int, body: memoryview) -> bool:
        """Answer a read by splicing the file's pages through the pipe into ``/dev/fuse``:
        one copy, by the kernel, into the reader's pages. False: not done (a file being
        restored, or one that changed under the splice), for the ordinary handler."""
        fh, offset, size, *_ = abi.READ_IN.unpack_from(body)
        try:
            n = self.ops.read_size(fh, offset, size) if self.ops.read_ready(fh) else 0
        except Exception:  # the ordinary handler answers with the error
            return False
        if n == 0:
            return False
        try:
            done = splicing.read_out(self._pipe, fh, offset, n, self.fd,
                                     abi.OUT_HEADER.pack(abi.OUT_HEADER.size + n, 0, unique))
        except OSError as e:
            log.debug("could not splice a read (answered by a copy instead): %s", e)
            done = False
        if not done:  # the pipe may hold part of it
            self._pipes.discard(self._pipe)
            self._pipe = self._pipes.take()
        return done

    def _reply(self, unique: int, parts: list) -> None:
        length = abi.OUT_HEADER.size + sum(len(p) for p in parts)
        self._send([abi.OUT_HEADER.pack(length, 0, unique), *parts])

    def _reply_error(self, unique: int, err: int) -> None:
        self._send([abi.OUT_HEADER.pack(abi.OUT_HEADER.size, -err, unique)])

    def _send(self, parts: list) -> None:
        try:
            os.writev(self.fd, parts)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENODEV):  # interrupted meanwhile, or unmounted
                log.warning("could not answer the kernel: %s", e)

    # -- handshake -----------------------------------------------------------------------

    async def _init(self, nodeid, body, ctx):
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
        self.ops.acl = bool(granted & abi.POSIX_ACL)
        if granted & abi.PASSTHROUGH:
            self.backing = BackingFiles(self.fd)
        elif self.want_passthrough:
            self.refused = f"the kernel does not offer FUSE passthrough (protocol {major}.{minor})"
            log.warning("%s: files are served by the daemon", self.refused)
        self.ops.backing = self.backing
        reply = abi.INIT_OUT.pack(
            abi.KERNEL_MAJOR, min(minor, abi.KERNEL_MINOR), max_readahead,
            granted & 0xFFFFFFFF, MAX_BACKGROUND, MAX_BACKGROUND * 3 // 4, self.max_write, 1,
            self.max_write // 4096, 0, granted >> 32, 1 if self.backing is not None else 0,
        )
        return [reply]

    async def _interrupt(self, nodeid, body, ctx):
        return None  # handlers run to completion; the kernel retries nothing

    async def _destroy(self, nodeid, body, ctx):
        return []

    # -- names ---------------------------------------------------------------------------

    def _entry_now(self, ino: int, st: os.stat_result) -> bytes:
        return abi.ENTRY_OUT.pack(ino, *self._entry_valid, *self.ops.fuse_attr(ino, st))

    def _lookup(self, nodeid, body, ctx):
        return [self._entry_now(*self.ops.lookup_sync(nodeid, bytes(body[:-1])))]

    def _forget(self, nodeid, body, ctx):
        self.ops.forget_sync([(nodeid, abi.FORGET_IN.unpack_from(body)[0])])

    def _batch_forget(self, nodeid, body, ctx):
        count, _ = abi.BATCH_FORGET_IN.unpack_from(body)
        self.ops.forget_sync(abi.FORGET_ONE.iter_unpack(body[abi.BATCH_FORGET_IN.size:][:count * abi.FORGET_ONE.size]))

    def _getattr(self, nodeid, body, ctx):
        st = self.ops.getattr_sync(nodeid)
        return [abi.ATTR_OUT.pack(*self._attr_valid, *self.ops.fuse_attr(nodeid, st))]

    async def _setattr(self, nodeid, body, ctx):
        (valid, _, fh, size, _, atime, mtime, _, atimensec, mtimensec, _, mode, _, uid, gid, _
         ) = abi.SETATTR_IN.unpack_from(body)
        attr = pyfuse3.EntryAttributes()
        now = time.time_ns()
        attr.st_mode, attr.st_uid, attr.st_gid, attr.st_size = mode, uid, gid, size
        attr.st_atime_ns = now if valid & abi.FATTR_ATIME_NOW else atime * 1_000_000_000 + atimensec
        attr.st_mtime_ns = now if valid & abi.FATTR_MTIME_NOW else mtime * 1_000_000_000 + mtimensec
        handle = fh if valid & abi.FATTR_FH else None
        return [_attr(await self.ops.setattr(nodeid, attr, SetattrFields(valid), handle, ctx))]

    async def _readlink(self, nodeid, body, ctx):
        return [await self.ops.readlink(nodeid, ctx)]

    async def _symlink(self, nodeid, body, ctx):
        name, target = _names(body, 2)
        return [_entry(await self.ops.symlink(nodeid, name, target, ctx))]

    async def _mknod(self, nodeid, body, ctx):
        mode, rdev, ctx.umask, _ = abi.MKNOD_IN.unpack_from(body)
        name = bytes(body[abi.MKNOD_IN.size:-1])
        return [_entry(await self.ops.mknod(nodeid, name, mode, rdev, ctx))]

    async def _mkdir(self, nodeid, body, ctx):
        mode, ctx.umask = abi.MKDIR_IN.unpack_from(body)
        name = bytes(body[abi.MKDIR_IN.size:-1])
        return [_entry(await self.ops.mkdir(nodeid, name, mode, ctx))]

    async def _unlink(self, nodeid, body, ctx):
        await self.ops.unlink(nodeid, bytes(body[:-1]), ctx)
        return []

    async def _rmdir(self, nodeid, body, ctx):
        await self.ops.rmdir(nodeid, bytes(body[:-1]), ctx)
        return []

    async def _rename(self, nodeid, body, ctx):
        (newdir,) = abi.RENAME_IN.unpack_from(body)
        old, new = _names(body[abi.RENAME_IN.size:], 2)
        await self.ops.rename(nodeid, old, newdir, new, 0, ctx)
        return []

    async def _rename2(self, nodeid, body, ctx):
        newdir, flags, _ = abi.RENAME2_IN.unpack_from(body)
        old, new = _names(body[abi.RENAME2_IN.size:], 2)
        await self.ops.rename(nodeid, old, newdir, new, flags, ctx)
        return []

    async def _link(self, nodeid, body, ctx):
        (old,) = abi.LINK_IN.unpack_from(body)
        name = bytes(body[abi.LINK_IN.size:-1])
        return [_entry(await self.ops.link(old, nodeid, name, ctx))]

    # -- files -----------------------------------------------------------------------------

    def _open_out(self, fi: pyfuse3.FileInfo) -> bytes:
        backing_id = self.backing.backing_id(fi.fh) if self.backing is not None else None
        if backing_id is not None:  # no FLUSH at close: the kernel wrote the bytes itself
            return abi.OPEN_OUT.pack(fi.fh, abi.FOPEN_PASSTHROUGH | abi.FOPEN_NOFLUSH, backing_id)
        flags = (abi.FOPEN_DIRECT_IO if fi.direct_io else 0) | (abi.FOPEN_KEEP_CACHE if fi.keep_cache else 0)
        return abi.OPEN_OUT.pack(fi.fh, flags, 0)

    async def _open(self, nodeid, body, ctx):
        flags, _ = abi.OPEN_IN.unpack_from(body)
        return [self._open_out(await self.ops.open(nodeid, flags, ctx))]

    def _create(self, nodeid, body, ctx):
        flags, mode, ctx.umask, _ = abi.CREATE_IN.unpack_from(body)
        name = bytes(body[abi.CREATE_IN.size:-1])
        fi, ino, st = self.ops.create_sync(nodeid, name, mode, flags, ctx)
        return [self._entry_now(ino, st), self._open_out(fi)]

    def _read_now(self, nodeid, body, ctx):
        fh, offset, size, *_ = abi.READ_IN.unpack_from(body)
        if not self.ops.read_ready(fh):
            return _LATER  # waits for chunks of a file being restored
        return [self.ops.read_sync(fh, offset, size)]

    async def _read(self, nodeid, body, ctx):
        fh, offset, size, *_ = abi.READ_IN.unpack_from(body)
        return [await self.ops.read(fh, offset, size)]

    async def _write(self, nodeid, body, ctx):
        fh, offset, size, *_ = abi.WRITE_IN.unpack_from(body)
        # A copy: the write may be applied after this worker reads its next request.
        data = bytes(body[abi.WRITE_IN.size:abi.WRITE_IN.size + size])
        return [abi.WRITE_OUT.pack(await self.ops.write(fh, offset, data), 0)]

    async def _flush(self, nodeid, body, ctx):
        await self.ops.flush(abi.FLUSH_IN.unpack_from(body)[0])
        return []

    def _release(self, nodeid, body, ctx):
        fh = abi.RELEASE_IN.unpack_from(body)[0]
        self._released.append(fh)  # done by _settle/_finish_releases
        if self.ops.release_frees_space(fh):  # before anything queued behind it may need the space
            self._finish_releases()
        return []

    async def _fsync(self, nodeid, body, ctx):
        fh, flags, _ = abi.FSYNC_IN.unpack_from(body)
        await self.ops.fsync(fh, bool(flags & abi.FSYNC_FDATASYNC))
        return []

    async def _fallocate(self, nodeid, body, ctx):
        fh, offset, length, mode, _ = abi.FALLOCATE_IN.unpack_from(body)
        await self.ops.fallocate(fh, mode, offset, length, ctx)
        return []

    async def _lseek(self, nodeid, body, ctx):
        fh, offset, whence, _ = abi.LSEEK_IN.unpack_from(body)
        return [abi.LSEEK_OUT.pack(await self.ops.lseek(fh, offset, whence))]

    # -- directories -----------------------------------------------------------------------

    async def _opendir(self, nodeid, body, ctx):
        fh = await self.ops.opendir(nodeid, ctx)
        return [abi.OPEN_OUT.pack(fh, 0, 0)]

    async def _readdirplus(self, nodeid, body, ctx):
        fh, offset, size, *_ = abi.READ_IN.unpack_from(body)
        token = DirBuffer(size)
        await self.ops.readdir(fh, offset, token)
        return token.parts

    async def _releasedir(self, nodeid, body, ctx):
        await self.ops.releasedir(abi.RELEASE_IN.unpack_from(body)[0])
        return []

    async def _fsyncdir(self, nodeid, body, ctx):
        fh, flags, _ = abi.FSYNC_IN.unpack_from(body)
        await self.ops.fsyncdir(fh, bool(flags & abi.FSYNC_FDATASYNC))
        return []

    async def _statfs(self, nodeid, body, ctx):
        s = await self.ops.statfs(ctx)
        return [abi.STATFS_OUT.pack(s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree,
                                    s.f_bsize, s.f_namemax, s.f_frsize)]

    # -- extended attributes ---------------------------------------------------------------

    async def _setxattr(self, nodeid, body, ctx):
        size, _ = abi.SETXATTR_IN.unpack_from(body)
        rest = body[abi.SETXATTR_IN.size:]
        end = bytes(rest).index(b"\0")
        await self.ops.setxattr(nodeid, bytes(rest[:end]), bytes(rest[end + 1:end + 1 + size]), ctx)
        return []

    def _getxattr(self, nodeid, body, ctx):
        size, _ = abi.GETXATTR_IN.unpack_from(body)
        return self._sized(self.ops.getxattr_sync(nodeid, bytes(body[abi.GETXATTR_IN.size:-1])), size)

    async def _listxattr(self, nodeid, body, ctx):
        size, _ = abi.GETXATTR_IN.unpack_from(body)
        names = await self.ops.listxattr(nodeid, ctx)
        return self._sized(b"".join(n + b"\0" for n in names), size)

    @staticmethod
    def _sized(value: bytes, size: int) -> list:
        if size == 0:
            return [abi.GETXATTR_OUT.pack(len(value), 0)]
        if len(value) > size:
            raise pyfuse3.FUSEError(errno.ERANGE)
        return [value]

    async def _removexattr(self, nodeid, body, ctx):
        await self.ops.removexattr(nodeid, bytes(body[:-1]), ctx)
        return []
