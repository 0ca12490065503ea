"""The volume's handlers, for both engines: a thin passthrough onto the RAM tier's tree.

Every handler is a handful of ``*at()`` system calls relative to the ``O_PATH`` descriptors
in :class:`~tierfs.fs.inodes.InodeTable`; POSIX semantics (errno values, rename rules,
sticky directories, link counts, timestamps) are tmpfs' own. Permission checks are the
kernel's (``default_permissions``), made against the attributes returned here, which are
the backing file's, and against its POSIX ACLs where the engine negotiated them (``acl``).
The daemon runs as root; what it does on a caller's behalf beyond what the kernel checked
is done as the caller (:mod:`tierfs.fs.caller`): names are made by mknod, mkdir, symlink
and link with the caller's credentials, so tmpfs gives them their owner and group, and a
create that finds its name taken opens it only as the caller may. A plain create is an
exclusive create as root and a chown of the new descriptor, the one path hot enough to
matter, and as safe: nothing it touches was there before.

Handlers never await, with few exceptions: a file of a step still being restored
(``restoring``) makes a read wait for the chunks it covers, and anything that would change
the file wait for the whole file; ``copy_file_range`` copies in a thread, and ``lseek``
may first have the kernel write back mapped pages. Every other handler runs to completion
on the trio thread, so the table and the space account need no locks, and an operation
sees no other half-done. Writes are answered before their bytes are copied (``writes``, see
:mod:`tierfs.fs.writebehind`); every handler that looks at a file's data or attributes
first waits for that file's writes, which blocks briefly rather than awaiting.

Whole files may be served by kernel passthrough (``backing``, set by the engine when the
kernel grants it): the kernel then reads and writes the RAM-tier file itself, and this class
sees only the open, the close and metadata. A file still being restored, or one that
another open is reading through the daemon, keeps the daemon path, with direct I/O so the
kernel never caches an inode that may pass through later.

Two hooks tie the mount to the checkpoint machinery: ``events`` hears of the acts that may
commit a checkpoint (a file closed after writing, a rename), and ``snapshots`` keeps
committed steps frozen: their extra hard links are hidden from ``st_nlink``, and a
committed file is detached from its snapshot before anything changes it.

The handlers are grouped by concern, each group a mixin of :class:`~tierfs.fs.volume.Volume`,
which holds what they all share: names and directories (:mod:`tierfs.fs.names`), opening
files (:mod:`tierfs.fs.opening`), attributes (:mod:`tierfs.fs.attributes`), and here the data
path (reads, writes, closes) and the one class both engines see. The requests that tierfs'
own engine serves without a coroutine (those of creating and writing a file) have
synchronous handlers, written once; pyfuse3 awaits faces made of them (:func:`_face`). Every
other handler is a coroutine that both engines await.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, overload

import pyfuse3
import trio

from tierfs.core import linux
from tierfs.fs import recovery
from tierfs.fs.attributes import Attributes
from tierfs.fs.names import Names
from tierfs.fs.opening import Opening
from tierfs.fs.volume import ATTR_TIMEOUT, drop_privs, errors_to_fuse

if TYPE_CHECKING:
    from tierfs.fs.messages import Requester

log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_T = TypeVar("_T")
_R = TypeVar("_R")


@overload
def _face(
    sync: Callable[Concatenate[Operations, _P], _T],
) -> Callable[Concatenate[Operations, _P], Coroutine[Any, Any, _T]]: ...


@overload
def _face(
    sync: Callable[Concatenate[Operations, _P], _T], reply: Callable[[Operations, _T], _R]
) -> Callable[Concatenate[Operations, _P], Coroutine[Any, Any, _R]]: ...


def _face(
    sync: Callable[Concatenate[Operations, _P], _T], reply: Callable[[Operations, _T], object] | None = None
) -> Callable[Concatenate[Operations, _P], Coroutine[Any, Any, object]]:
    """pyfuse3's handler for the synchronous handler ``sync``, which takes the same
    arguments: its answer made into what pyfuse3 replies with (``reply``), its errors into
    the errno the kernel sees. ``sync`` is called by its name, so that a subclass's own
    handler is the one called."""
    name = sync.__name__

    async def face(self: Operations, *args: _P.args, **kwargs: _P.kwargs) -> object:
        handler: Callable[_P, _T] = getattr(self, name)
        answer = handler(*args, **kwargs)
        return answer if reply is None else reply(self, answer)

    face.__name__ = face.__qualname__ = name.removesuffix("_sync")
    return errors_to_fuse(face)


def _entry(ops: Operations, answer: tuple[int, os.stat_result]) -> pyfuse3.EntryAttributes:
    return ops._attrs(*answer)


def _opened(
    ops: Operations, answer: tuple[pyfuse3.FileInfo, int, os.stat_result]
) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
    fi, ino, st = answer
    return fi, ops._attrs(ino, st)


class Operations(Names, Opening, Attributes, pyfuse3.Operations):
    """The volume, as pyfuse3 and tierfs' own engine serve it."""

    supports_dot_lookup = False  # no NFS export: '.'/'..' never reach lookup()
    enable_writeback_cache = False
    attr_timeout = ATTR_TIMEOUT  # of names and attributes alike

    # pyfuse3's faces of the synchronous handlers (read's, which may wait for a restore
    # first, is written out with the data path).
    lookup = _face(Names.lookup_sync, _entry)
    getattr = _face(Attributes.getattr_sync, _entry)
    create = _face(Opening.create_sync, _opened)
    getxattr = _face(Attributes.getxattr_sync)

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:  # answered by no reply, even an error
        self.forget_sync(inode_list)

    # -- the data path ---------------------------------------------------------------

    @errors_to_fuse
    async def read(self, fh: int, off: int, size: int) -> memoryview:  # type: ignore[override]
        # (the ignore: pyfuse3 replies with any contiguous buffer, not only the bytes its types name)
        if not self.read_ready(fh):
            assert self.restoring is not None  # only a file being restored is not ready
            await self.restoring.wait_range(self._files[fh], off, size)
        return self.read_sync(fh, off, size)

    def read_ready(self, fh: int) -> bool:
        """Whether a read of ``fh`` can be answered without waiting for a restore."""
        return self.restoring is None or not self.restoring.pending(self._files[fh])

    def read_size(self, fh: int, off: int, size: int) -> int:
        """How many bytes a read of ``size`` at ``off`` gets, once the file's writes are in,
        for an engine that moves them itself (the file is not being restored)."""
        self.writes_done(self._files[fh])
        n = max(0, min(size, os.fstat(fh).st_size - off))
        self.counters["bytes_read"] += n
        return n

    def read_sync(self, fh: int, off: int, size: int) -> memoryview:
        """Read from the RAM tier, once the chunks of a file being restored are in.

        One buffer serves every read: the engine copies the reply to the kernel as soon as
        this returns, before any other handler can run, so it is never shared."""
        self.writes_done(self._files[fh])
        if size > len(self._read_buf):
            self._read_buf = memoryview(bytearray(size))
        n = os.preadv(fh, [self._read_buf[:size]], off)
        self.counters["bytes_read"] += n
        return self._read_buf[:n]

    @errors_to_fuse
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        ino = self._before_write(fh)
        if self.writes.running and self.space.fits(self.writes.queued_bytes + len(buf), fh):
            self.writes.submit(ino, fh, off, buf)
            n = len(buf)
        else:  # near full: apply it now, after the queued ones, so that ENOSPC is this write's
            self.writes_done(ino)
            self.space.check_write(fh, off, len(buf))
            n = os.pwrite(fh, buf, off)
            self.space.update(os.fstat(fh))
        self._wrote(fh, ino, n)
        return n

    def write_by(self, fh: int, off: int, size: int, apply: Callable[[], None], now: bool = False) -> None:
        """A write of ``size`` bytes at ``off`` that ``apply()`` makes and answers itself
        (tierfs' own engine, from the pipe its request was spliced into), queued for the
        write-behind workers, or made ``now``; when the RAM tier is near full, only after
        the queued ones and waited for (ENOSPC before anything is written). Raises only
        before ``apply`` is queued."""
        ino = self._before_write(fh)
        near_full = not self.space.fits(self.writes.queued_bytes + size, fh)
        if near_full:
            self.writes_done(ino)
            self.space.check_write(fh, off, size)
        self.writes.submit_job(ino, fh, size, apply, now)  # from here on, nothing may fail: apply answers
        if near_full:
            self.writes.wait(ino)
        self._wrote(fh, ino, size)

    def _before_write(self, fh: int) -> int:
        ino = self._files[fh]
        self._account_writes()
        self._raise_write_error(fh)
        if self._kill_privs:
            self._drop_privs(fh)
        return ino

    def _wrote(self, fh: int, ino: int, n: int) -> None:
        if fh in self._direct:  # the kernel's cached pages of the file may be stale now
            self.inodes[ino].cache_valid = False
        self.counters["bytes_written"] += n
        self.writing.wrote(n)

    def _drop_privs(self, fh: int) -> None:
        if fh in self._kill_privs:
            self._kill_privs.discard(fh)
            drop_privs(f"/proc/self/fd/{fh}")

    def _raise_write_error(self, fh: int) -> None:
        """Report a write of ``fh`` that failed after it was answered (as a failed writeback)."""
        error = self.writes.take_error(fh)
        if error is not None:
            self._failed_writes.add(fh)
            raise error

    @errors_to_fuse
    async def flush(self, fh: int) -> None:
        self.writes_done(self._files[fh])
        self._raise_write_error(fh)

    def release_sync(self, fh: int) -> None:
        self.release_writes(fh)
        self.release_handle(fh)

    release = _face(release_sync)

    def has_handle(self, fh: int) -> bool:
        return fh in self._files or fh in self._dirs

    def release_frees_space(self, fh: int) -> bool:
        """Whether releasing ``fh`` gives space back: the last open of an unlinked file.
        tmpfs frees it at close, so the kernel session does such a release at once."""
        node = self.inodes.get(self._files.get(fh, -1))
        return node is not None and node.orphaned and node.opens == 1

    def release_writes(self, fh: int) -> None:
        """The part of a release that others see, done in order with what follows it: the
        file's writes are in and accounted, it no longer counts as open for writing, and the
        commit rules hear that it was closed."""
        if fh not in self._writable:
            return
        self._writable.discard(fh)
        if fh in self._passthrough_writers:
            # The kernel wrote it itself, and never mixes that with daemon writes on one
            # inode: nothing can be queued for it. Account what it wrote now.
            self._passthrough_writers.discard(fh)
            st = os.fstat(fh)
            self.writing.unwatch(fh, st)
            self.space.update(st)
        else:
            self.writes_done(self._files[fh])
            if (error := self.writes.take_error(fh)) is not None:  # flush reported any but this
                log.warning("a write to %s failed after close: %s", self._relpath(fh) or "an unlinked file", error)
                self._failed_writes.add(fh)
            st = os.fstat(fh)
        if fh in self._failed_writes:
            self._failed_writes.discard(fh)
            log.warning(
                "%s lost a write after it was answered: its close does not count toward a commit",
                self._relpath(fh) or "an unlinked file",
            )
        elif self.events is not None and st.st_nlink > 0:
            path = self._relpath(fh)
            if path is not None:
                self.events.file_done(path)

    def release_handle(self, fh: int) -> None:
        """The rest of a release (after :meth:`release_writes`), which no request can tell
        from not done yet: the descriptor, the backing file and the inode's count of opens.
        The kernel session leaves it for a moment when nothing waits."""
        ino = self._files.pop(fh)
        if self.record is not None:
            self.record.closed(fh)
        self._kill_privs.discard(fh)
        self._unprivileged_writers.discard(fh)
        self._direct.discard(fh)
        if self.backing is not None:
            self.backing.detach(fh)
        os.close(fh)
        node = self.inodes.get(ino)
        if node is None:
            return
        node.opens -= 1
        if node.open_fd == fh:
            node.open_fd = -1
        if node.orphaned and node.opens == 0:
            self.space.drop(os.fstat(node.fd).st_ino)
            self.inodes.unpin(ino)
        self.inodes.forget(ino, 0)  # the kernel may have forgotten it while it was open

    def take_over(self, handles: list[recovery.Handle]) -> None:
        """Adopt the open handles of a daemon that is gone, each already reopened at its
        own descriptor number (:func:`tierfs.fs.recovery.reopen_handles`): the kernel
        goes on using them as they were."""
        for h in handles:
            node = self.inodes[h.ino]
            if h.is_dir:
                self._dirs[h.fh] = None
                continue
            self._opened(h.ino, node, h.fh, h.flags)
            if h.kind & recovery.PASSTHROUGH:
                assert self.backing is not None  # set from the same record's INIT (KernelSession.take_over)
                self.backing.adopt(h.ino, h.fh, h.backing_id)
                if h.flags & os.O_ACCMODE != os.O_RDONLY:
                    self.writing.watch(h.fh, os.fstat(h.fh))
                    self._passthrough_writers.add(h.fh)
            if h.kind & recovery.KILL_PRIVS:
                self._kill_privs.add(h.fh)
            if h.kind & recovery.DIRECT:
                self._direct.add(h.fh)
        for h in handles:  # released by the kernel (and answered) before the predecessor did it
            if h.kind & recovery.RELEASING and not h.is_dir:
                self.release_sync(h.fh)

    @errors_to_fuse
    async def fsync(self, fh: int, datasync: bool) -> None:
        self.writes_done(self._files[fh])
        self._raise_write_error(fh)
        (os.fdatasync if datasync else os.fsync)(fh)

    @errors_to_fuse
    async def fallocate(self, fh: int, mode: int, offset: int, length: int, ctx: Requester) -> None:
        """``fallocate(2)`` of an open file, applied to its backing file: tmpfs' own
        preallocation, ``KEEP_SIZE`` and punched holes (and its ``EOPNOTSUPP`` for the rest).

        Served by tierfs' own FUSE engine only (pyfuse3 has no such handler). It changes the file
        as a write does, so it follows the write's rules: the file's queued writes and its
        restore come first, a committed file is detached from its snapshots, what may be
        allocated must fit in ``--capacity`` (``ENOSPC`` before anything changes), and a
        caller other than root drops set-id bits, as tmpfs does. The kernel updates its own
        size for a size-changing call and drops its cached attributes and punched pages.
        """
        ino = self._files[fh]
        await self._settle(ino)
        self.writes_done(ino)
        self._raise_write_error(fh)
        node = self.inodes[ino]
        self._detach(node)
        if not mode & linux.FALLOC_FL_PUNCH_HOLE:  # may allocate what the range lacks
            self.space.check_write(fh, offset, length)
        linux.fallocate(fh, mode, offset, length)
        if ctx.uid != 0:
            self._kill_privs.discard(fh)
            drop_privs(f"/proc/self/fd/{fh}")
        node.cache_valid = False
        self.space.update(os.fstat(fh))
        self.writing.wrote(0 if mode & linux.FALLOC_FL_PUNCH_HOLE else length)  # allocating costs as writing does

    @errors_to_fuse
    async def copy_file_range(
        self, fh_in: int, off_in: int, fh_out: int, off_out: int, length: int, flags: int, ctx: Requester
    ) -> int:
        """``copy_file_range(2)`` between two open files of the volume, made by tmpfs on their
        backing files: one copy in the kernel, and tmpfs' checks (an append-only or immutable
        target, overlapping ranges). The target changes as by a write and follows a write's
        rules; the source's restore and queued writes come first."""
        if flags:
            raise pyfuse3.FUSEError(errno.EINVAL)  # none are defined
        ino_in = self._files[fh_in]
        await self._settle(ino_in)
        ino_out = self._files[fh_out]
        await self._settle(ino_out)
        self.writes_done(ino_in)
        self._before_write(fh_out)
        self.writes_done(ino_out)
        node = self.inodes[ino_out]
        self._detach(node)
        length = min(length, max(0, os.fstat(fh_in).st_size - off_in))  # what the source holds
        self.space.check_write(fh_out, off_out, length)
        # In a thread: a copy of gigabytes would hold every other request for its length.
        # The kernel holds the target's inode lock meanwhile, so no write of it comes between.
        n = await trio.to_thread.run_sync(os.copy_file_range, fh_in, fh_out, length, off_in, off_out)
        node.cache_valid = False
        self.space.update(os.fstat(fh_out))
        self._wrote(fh_out, ino_out, n)
        return n

    @errors_to_fuse
    async def lseek(self, fh: int, offset: int, whence: int) -> int:
        """``SEEK_DATA``/``SEEK_HOLE`` (the kernel answers the other kinds itself), answered
        by the backing file as tmpfs keeps it, once its writes and its restore are in.

        Pages written through a shared mapping of a file open for reading and writing on
        the daemon path sit in the kernel's page cache until written back, and the kernel
        does not write them back before asking: while such an open exists, the engine has
        the kernel write them back first (``write_back``). Without one, the answer is the
        one the kernel gives without a handler (the whole file is data), never a hole that
        holds bytes. (A write-only open cannot be mapped.)
        """
        ino = self._files[fh]
        await self._settle(ino)  # a placeholder's holes are chunks not fetched yet
        self.writes_done(ino)
        mappable = any(
            self._files[w] == ino and fcntl.fcntl(w, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
            for w in self._writable - self._passthrough_writers
        )
        if mappable and self.write_back is not None:
            await self.write_back(ino)
            self.writes_done(ino)
        elif mappable:
            size = os.fstat(fh).st_size
            if offset < 0 or whence not in (os.SEEK_DATA, os.SEEK_HOLE):
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            if offset >= size:
                raise OSError(errno.ENXIO, os.strerror(errno.ENXIO))
            return offset if whence == os.SEEK_DATA else size
        return os.lseek(fh, offset, whence)
