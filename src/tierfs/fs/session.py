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
(the handlers of ``_now`` in :mod:`tierfs.fs.requests`, which decodes every request and
packs its reply, call the Operations' handlers that are not coroutines). A request whose
handler may await (an open, truncate or read of a file still being restored) makes its
worker hand the device to another one and await it, so it never holds up the others. Each
worker has its own request buffer; a reply is written before the worker awaits anything
again, so a handler may reply from a shared buffer.

Two things keep the caller of a file's create from waiting on the daemon. A release (the
kernel does not wait for its answer) is done once nothing is queued, so the next open's
lookups are answered first, and always before any other request that could tell, and
before the worker lets another task run (:mod:`tierfs.fs.releases`). And where the next request typically follows
within a millisecond, the worker polls the device for it instead of sleeping, and asks the
kernel to keep idle CPUs awake meanwhile, so that its answers wake their callers at once
(:mod:`tierfs.fs.poller`); both only where the CPU is idle anyway.

Open files of the kernel's choice of I/O mode are tracked by
:class:`~tierfs.fs.backing.BackingFiles`: the kernel insists that every passthrough open of
an inode use the same backing file, and that no open of an inode in passthrough use the
page cache.

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
import logging
import os
import select
import stat
import time
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING

import pyfuse3
import trio

from tierfs.core import linux
from tierfs.core.meters import RequestTimes
from tierfs.fs import abi, replay, splicing
from tierfs.fs.backing import BackingFiles
from tierfs.fs.messages import Context
from tierfs.fs.poller import Poller, WakeLatency
from tierfs.fs.recovery import SessionState
from tierfs.fs.releases import BEFORE_RELEASE_HANDLES, BEFORE_RELEASES, Releases
from tierfs.fs.requests import LATER, Reply
from tierfs.fs.splicing import Pipe, PipePool

if TYPE_CHECKING:
    from tierfs.fs.operations import Operations
    from tierfs.fs.recovery import InitRecord

log = logging.getLogger(__name__)

MAX_WRITE = 1 << 20  # 1 MiB requests, as libfuse negotiates on this kernel
BUFFER_SIZE = MAX_WRITE + 2 * 4096  # the kernel refuses reads into anything smaller
MAX_WORKERS = 32
YIELD_EVERY = 16  # requests a worker serves back to back before it lets other tasks run

MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4


class Unmounted(Exception):
    """The kernel ended the connection (unmounted or aborted)."""


class KernelSession(Releases):
    """One mounted volume served over ``/dev/fuse``: tierfs' own engine, with passthrough or without.

    ``mount`` → ``run`` (until unmounted or :meth:`terminate`) → ``close``, the same life
    cycle as pyfuse3's ``init``/``main``/``close``.
    """

    name = "tierfs"

    def __init__(self, ops: Operations, want_passthrough: bool = True, wake_cpus: bool = True, writers: int = 1):
        super().__init__(ops)
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
        ops.hooks.write_back_pages = self.write_back
        self.fd = -1  # /dev/fuse, once mounted
        self.mountpoint: str | None = None
        self.backing: BackingFiles | None = None  # set once INIT granted passthrough
        self.refused: str | None = None  # why passthrough is off, if it was wanted
        self._cancel: trio.CancelScope | None = None
        self._read_lock = trio.Lock()
        self._last_opcode = 0
        self._poller = Poller()  # whether to poll for the next request rather than sleep
        self._wake = WakeLatency(wake_cpus)  # idle CPUs kept awake while a burst lasts
        if self._wake.state not in ("on", "off"):
            log.info("idle CPUs will not be kept awake during bursts of requests: %s", self._wake.state)
        self._workers = 0
        self._idle = 0
        self.record: SessionState | None = None  # what a successor needs, kept as we go
        self.times = RequestTimes()  # every request's time in the daemon, for tierfs_fuse_request_*
        self._journaled: set[int] = set()  # requests whose replies the record keeps
        self._resend = False  # ask the kernel for the requests a predecessor left unanswered

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

    def mount(self, mountpoint: str, fsname: str, read_only: bool = False, fd: int | None = None) -> None:
        """Mount a FUSE file system served by this session (needs CAP_SYS_ADMIN), on the
        ``/dev/fuse`` descriptor ``fd`` if given (one the keeper holds too)."""
        if fd is None:
            fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
        else:
            os.set_blocking(fd, False)
        options = f"fd={fd},rootmode={stat.S_IFDIR:o},user_id=0,group_id=0,allow_other,default_permissions"
        flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0)
        try:
            linux.mount(fsname, mountpoint, "fuse.tierfs", flags, options)
        except OSError:
            os.close(fd)
            raise
        self.fd, self.mountpoint = fd, mountpoint
        self._dev_poll.register(fd, select.POLLIN)

    def take_over(self, fd: int, mountpoint: str, init: InitRecord) -> None:
        """Serve the live connection ``fd`` of a daemon that is gone, as its INIT left it
        (``init``, from its record); the handles it gave out are the Operations' to adopt."""
        os.set_blocking(fd, False)
        self.fd, self.mountpoint = fd, mountpoint
        self._dev_poll.register(fd, select.POLLIN)
        self.max_write = init["max_write"]
        if self._pipes is not None and self._pipes.max_write < self.max_write:
            self._pipes.close()  # the kernel sends writes as large as first agreed
            self._pipes = self._pipe = None
            self.ops.writes.threads = 1
        self.ops.hooks.acl = init["acl"]
        if init["passthrough"]:
            self.backing = self.ops.hooks.backing = BackingFiles(fd)
        self._resend = bool(init["offered"] & abi.HAS_RESEND)
        if not self._resend:
            log.warning(
                "this kernel cannot send again the requests the last daemon left unanswered "
                "(FUSE_NOTIFY_RESEND, Linux 6.9): their callers wait until interrupted"
            )

    async def run(self) -> None:
        """Serve requests until the kernel ends the connection or :meth:`terminate` is called."""
        if self._resend:
            self._resend = False
            self._send([abi.OUT_HEADER.pack(abi.OUT_HEADER.size, abi.NOTIFY_RESEND, 0)])
        with trio.CancelScope() as self._cancel:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._workers = 1
                nursery.start_soon(self._worker)

    async def write_back(self, ino: int) -> None:
        """Have the kernel write back its dirty pages of ``ino`` (from shared mappings),
        dropping what it caches of it. The notification returns once those writes are
        answered, which other workers do meanwhile: it is made from a thread."""
        message = abi.OUT_HEADER.pack(abi.OUT_HEADER.size + abi.NOTIFY_INVAL_INODE_OUT.size, abi.NOTIFY_INVAL_INODE, 0)
        try:
            await trio.to_thread.run_sync(os.write, self.fd, message + abi.NOTIFY_INVAL_INODE_OUT.pack(ino, 0, 0))
        except FileNotFoundError:
            pass  # the kernel has forgotten the inode: it caches nothing of it

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
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
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

    def _serve(self, req: memoryview) -> Awaitable[None] | None:
        """Serve one request at once, or return what to await to serve it (a handler that may wait);
        either way its time is counted (:class:`~tierfs.core.meters.RequestTimes`)."""
        started = time.perf_counter_ns()
        header = abi.IN_HEADER.unpack_from(req)
        opcode = header[1]
        waiting = self._serve_now(req, header)
        if waiting is None:
            self.times.record(opcode, time.perf_counter_ns() - started)
            return None
        return self.times.timed(waiting, opcode, started)

    def _serve_now(self, req: memoryview, header: tuple[int, ...]) -> Awaitable[None] | None:
        _, opcode, unique, nodeid, uid, gid, pid, extlen, _ = header
        body = req[abi.IN_HEADER.size : len(req) - extlen * 8]
        if (self._released or self._closing) and opcode not in BEFORE_RELEASES:
            if opcode in BEFORE_RELEASE_HANDLES:
                self._settle_releases()
            else:
                self._finish_releases()
        self._last_opcode = opcode
        if (data_pipe := self._data_pipe) is not None:
            self._write_spliced(unique, body, data_pipe)
            return None
        # _pipe: what a session that splices requests read this one through (no other has one)
        if opcode == abi.READ and (pipe := self._pipe) is not None and self._read_spliced(unique, body, pipe):
            return None
        if opcode == abi.RELEASE:
            self._release(unique, body)
            return None
        if self.record is not None and opcode in replay.JOURNALED:
            # Sent again: the reply a predecessor kept, or when it began the request (None: never).
            kept = self.record.recall(unique) if unique & abi.UNIQUE_RESEND else None
            if kept is not None:
                if isinstance(kept, bytes):
                    self._send(replay.with_unique(kept, unique))
                    return None
                self._journaled.add(unique)  # keeps when it first began
                return self._again(opcode, unique, nodeid, body, Context(uid, gid, pid), kept)
            self._journaled.add(unique)
            self.record.begin(unique)
        handler = self._now.get(opcode)
        if handler is not None:
            try:
                reply = handler(nodeid, body, Context(uid, gid, pid))
            except Exception as e:  # noqa: BLE001 (a handler's error is its request's answer; _fail logs a bug)
                self._fail(opcode, unique, e)
                return None
            if reply is not LATER:
                if reply is not None:
                    self._reply(unique, reply)
                return None
        return self._dispatch(opcode, unique, nodeid, body, Context(uid, gid, pid))

    async def _dispatch(self, opcode: int, unique: int, nodeid: int, body: memoryview, ctx: Context) -> None:
        handler = self._later.get(opcode)
        if handler is None:
            self._reply_error(unique, errno.ENOSYS)
            return
        try:
            reply = await handler(nodeid, body, ctx)
        except trio.Cancelled:
            raise
        except Exception as e:  # noqa: BLE001 (a handler's error is its request's answer; _fail logs a bug)
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

    def _write_spliced(self, unique: int, body: memoryview, pipe: Pipe) -> None:
        """A write whose bytes wait in ``pipe`` (``_data_pipe``): moved into the file and answered by a
        write-behind worker while more requests wait to be read (several writers: their
        copies run side by side), else here, at once (one writer: no hand-over to wait for)."""
        self._data_pipe = None
        pipes = self._pipes
        assert pipes is not None  # the pipe is the pool's: only a spliced request holds data
        fh, offset, size, *_ = abi.WRITE_IN.unpack_from(body)

        def apply() -> None:
            try:
                n = splicing.write_out(pipe, fh, offset, size)
            except BaseException as e:
                pipes.discard(pipe)
                self._reply_error(unique, getattr(e, "errno", None) or errno.EIO)
                if not isinstance(e, OSError):
                    raise
                return
            (pipes.give if n == size else pipes.discard)(pipe)
            self._reply(unique, [abi.WRITE_OUT.pack(n, 0)])

        try:
            self.ops.write_by(fh, offset, size, apply, now=not self._dev_poll.poll(0))
        except Exception as e:  # noqa: BLE001 (refused before apply was queued: the request's answer)
            pipes.discard(pipe)
            self._fail(abi.WRITE, unique, e)

    def _read_spliced(self, unique: int, body: memoryview, pipe: Pipe) -> bool:
        """Answer a read by splicing the file's pages through ``pipe`` (``_pipe``, which it
        was read through) into ``/dev/fuse``: one copy, by the kernel, into the reader's
        pages. False: not done (a file being restored, or one that changed under the
        splice), for the ordinary handler."""
        fh, offset, size, *_ = abi.READ_IN.unpack_from(body)
        try:
            n = self.ops.read_size(fh, offset, size) if self.ops.read_ready(fh) else 0
        except Exception:  # noqa: BLE001 (the ordinary handler answers with the error)
            return False
        if n == 0:
            return False
        try:
            done = splicing.read_out(
                pipe, fh, offset, n, self.fd, abi.OUT_HEADER.pack(abi.OUT_HEADER.size + n, 0, unique)
            )
        except OSError as e:
            log.debug("could not splice a read (answered by a copy instead): %s", e)
            done = False
        if not done:  # the pipe may hold part of it
            pipes = self._pipes
            assert pipes is not None  # the pipe is the pool's
            pipes.discard(pipe)
            self._pipe = pipes.take()
        return done

    def _reply(self, unique: int, parts: Reply) -> None:
        length = abi.OUT_HEADER.size + sum(len(p) for p in parts)
        message = [abi.OUT_HEADER.pack(length, 0, unique), *parts]
        if unique in self._journaled:
            self._journaled.discard(unique)
            assert self.record is not None  # only journaled with a record
            self.record.done(unique, b"".join(message))
        self._send(message)

    def _reply_error(self, unique: int, err: int) -> None:
        header = abi.OUT_HEADER.pack(abi.OUT_HEADER.size, -err, unique)
        if unique in self._journaled:
            self._journaled.discard(unique)
            assert self.record is not None  # only journaled with a record
            self.record.done(unique, header)
        self._send([header])

    def _send(self, parts: Sequence[bytes | memoryview]) -> None:
        try:
            os.writev(self.fd, parts)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENODEV):  # interrupted meanwhile, or unmounted
                log.warning("could not answer the kernel: %s", e)
