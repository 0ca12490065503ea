"""The volume's handlers, for both engines: a thin passthrough onto the RAM tier's tree.

Every handler is a handful of ``*at()`` system calls relative to the ``O_PATH`` descriptors
of the inode table; POSIX semantics are tmpfs' own. Permission checks are the kernel's
(``default_permissions``, and POSIX ACLs where the engine negotiated them), made against
the backing file's attributes; what the daemon, as root, does beyond them on a caller's
behalf is done with the caller's credentials (:mod:`tierfs.fs.caller`).

The state lives in named parts: the inodes the kernel knows (:mod:`~tierfs.fs.inodes`), the
open handles (:mod:`~tierfs.fs.handles`), the writes answered before they are applied
(:mod:`~tierfs.fs.writeback`), opening and closing backing files (:mod:`~tierfs.fs.opening`),
the tree's links, paths and space (:mod:`~tierfs.fs.tree`), extended attributes
(:mod:`~tierfs.fs.xattrs`), and what the engine and the daemon plug in later
(:mod:`~tierfs.fs.hooks`). The handlers only put them together.

One calling convention serves both engines: a handler that never waits is a plain method,
one that may wait (for a restore, a thread, the kernel's write-back) a coroutine, and each
answers in the engines' common terms, ``(ino, stat_result)`` for an entry and OSError for a
failure. tierfs' own engine packs those itself (:mod:`tierfs.fs.requests`); pyfuse3 gets
them through :mod:`tierfs.fs.pyfuse3_faces`. Handlers run to completion on the trio thread,
so the parts need no locks; every handler that looks at a file's data or attributes first
waits for that file's queued writes, which blocks briefly rather than awaiting.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from collections.abc import Callable, Iterable

import pyfuse3
import trio

from tierfs.core import linux
from tierfs.fs import recovery
from tierfs.fs.caller import acting_as, creation_mode, drop_privs, has_privs
from tierfs.fs.handles import Handles
from tierfs.fs.hooks import Events, Hooks
from tierfs.fs.inodes import Inode, InodeTable
from tierfs.fs.messages import FuseAttr, Requester, SetattrFields, fuse_attr
from tierfs.fs.opening import Opener
from tierfs.fs.tree import Tree
from tierfs.fs.writeback import WriteBack
from tierfs.fs.writebehind import WriteBehind
from tierfs.fs.writing import Writing
from tierfs.fs.xattrs import Xattrs
from tierfs.ramtier.snapshots import Snapshots
from tierfs.ramtier.space import SpaceAccount

log = logging.getLogger(__name__)

Entry = tuple[int, os.stat_result]  # a FUSE inode number and its backing file's status
DirEntryAdder = Callable[[bytes, int, os.stat_result, int], bool]  # name, ino, st, next offset: False once full


class Operations:
    """The volume, as both engines serve it."""

    def __init__(
        self,
        tree: str | os.PathLike[str],
        space: SpaceAccount,
        snapshots: Snapshots | None = None,
        events: Events | None = None,
    ):
        self.inodes = InodeTable(tree)
        self.handles = Handles()
        self.space = space
        self.hooks = Hooks(events=events)
        self.tree = Tree(tree, self.inodes, space, snapshots)
        self.writes = WriteBehind()  # applies writes only while its workers run (``with``)
        self.writing = Writing()  # what background work gives way to
        self.write_back = WriteBack(self.writes, space, self.inodes, self.handles, self.writing)
        self.opener = Opener(self.inodes, self.handles, space, self.writing, self.hooks, self.write_back.done)
        self.xattrs = Xattrs(self.inodes, self.hooks)
        self._read_buf = memoryview(bytearray(1 << 20))
        self._bytes_read = 0

    def keep_record(self, record: recovery.SessionState) -> None:
        """Write every node and handle given to the kernel into ``record``, for a successor."""
        self.inodes.record = self.handles.record = record

    @property
    def counters(self) -> dict[str, int]:
        return {"bytes_written": self.write_back.bytes_written, "bytes_read": self._bytes_read, **self.opener.counters}

    @property
    def last_write(self) -> float:
        """time.monotonic() when the job was last writing in bulk (:mod:`tierfs.fs.writing`)."""
        return self.writing.last

    # -- attributes as the kernel gets them ------------------------------------------------

    def fuse_attr(self, ino: int, st: os.stat_result) -> FuseAttr:
        """``ino``'s attributes as the kernel gets them: ``st`` brought up to date, with the
        link count users see (without the snapshots').

        The kernel believes the size it is given: an older one truncates its view of the
        file (its cached pages, and where its next ``O_APPEND`` write goes). ``st`` was taken
        by the caller, and a worker may have applied the last queued write since, so any
        write to ``ino`` answered since the last wait for it means the status is taken
        again, after them."""
        if self.writes.unsettled(ino):
            self.writes_done(ino)
            st = os.fstat(self.inodes[ino].fd)
        return fuse_attr(ino, st, self.tree.nlink(st))

    def getattr(self, inode: int, ctx: Requester | None = None) -> Entry:
        return inode, os.fstat(self.inodes[inode].fd)

    def birth_time(self, inode: int) -> int | None:
        return linux.birth_time(self.inodes[inode].fd)

    async def setattr(
        self, inode: int, attr: pyfuse3.EntryAttributes, fields: SetattrFields, fh: int | None, ctx: Requester
    ) -> Entry:
        node = await self._before_change(inode)
        if fields.update_mode and node.kind != stat.S_IFLNK:
            os.chmod(node.proc_path, stat.S_IMODE(attr.st_mode))
            if has_privs(attr.st_mode):
                self.handles.privileged(inode)
        if fields.update_uid or fields.update_gid:
            uid = attr.st_uid if fields.update_uid else -1
            gid = attr.st_gid if fields.update_gid else -1
            linux.chown_fd(node.fd, uid, gid)
        if fields.update_size:
            if fh is not None:
                os.ftruncate(fh, attr.st_size)
            else:
                os.truncate(node.proc_path, attr.st_size)
            if fields.kill_suidgid:
                drop_privs(node.proc_path)
            node.cache_valid = False
            self.space.update(os.fstat(node.fd))
        if fields.update_atime or fields.update_mtime:
            # "now" stays "now" (UTIME_NOW), which tmpfs allows on an append-only file
            atime = linux.NOW if fields.atime_now else attr.st_atime_ns
            mtime = linux.NOW if fields.mtime_now else attr.st_mtime_ns
            linux.utimens_fd(node.fd, atime if fields.update_atime else None, mtime if fields.update_mtime else None)
        return inode, os.fstat(node.fd)

    async def statfs(self, ctx: Requester) -> pyfuse3.StatvfsData:
        self.writes_done()
        return self.tree.statvfs()

    # -- names -----------------------------------------------------------------------------

    def lookup(self, parent_inode: int, name: bytes, ctx: Requester | None = None) -> Entry:
        return self.inodes.lookup(self.inodes[parent_inode].fd, name)

    def forget(self, inode_list: Iterable[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            self.inodes.forget(ino, n)

    async def readlink(self, inode: int, ctx: Requester) -> bytes:
        return os.readlink(b"", dir_fd=self.inodes[inode].fd)

    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Requester) -> Entry:
        parent = self.inodes[parent_inode]
        mode = creation_mode(parent, mode, ctx)
        with acting_as(ctx):
            os.mknod(name, mode, rdev, dir_fd=parent.fd)
        return self.inodes.lookup(parent.fd, name)

    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Requester) -> Entry:
        parent = self.inodes[parent_inode]
        mode = creation_mode(parent, mode, ctx)
        with acting_as(ctx):
            os.mkdir(name, stat.S_IMODE(mode), dir_fd=parent.fd)
        return self.inodes.lookup(parent.fd, name)

    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Requester) -> Entry:
        parent = self.inodes[parent_inode]
        with acting_as(ctx):
            os.symlink(target, name, dir_fd=parent.fd)
        return self.inodes.lookup(parent.fd, name)

    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Requester) -> Entry:
        node, parent = self.inodes[inode], self.inodes[new_parent_inode]
        with acting_as(ctx):  # protected_hardlinks is the caller's to pass
            os.link(node.proc_path, new_name, dst_dir_fd=parent.fd, follow_symlinks=True)
        node.orphaned = False  # an O_TMPFILE file given a name
        return self.inodes.lookup(parent.fd, new_name)

    async def unlink(self, parent_inode: int, name: bytes, ctx: Requester) -> None:
        parent = self.inodes[parent_inode]
        st = os.stat(name, dir_fd=parent.fd, follow_symlinks=False)
        os.unlink(name, dir_fd=parent.fd)
        self.tree.link_removed(st)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: Requester) -> None:
        os.rmdir(name, dir_fd=self.inodes[parent_inode].fd)

    async def rename(
        self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes, flags: int, ctx: Requester
    ) -> None:
        """A rename may commit a step: its bytes must all be there first, and the commit
        rules hear of what moved into place."""
        self.writes_done()
        old, new = self.inodes[parent_inode_old], self.inodes[parent_inode_new]
        replaced = None
        if not flags & (linux.RENAME_NOREPLACE | linux.RENAME_EXCHANGE):
            try:
                replaced = os.stat(name_new, dir_fd=new.fd, follow_symlinks=False)
            except FileNotFoundError:
                pass
        if flags & linux.RENAME_WHITEOUT:  # the whiteout left behind is the caller's, as on tmpfs
            with acting_as(ctx):
                linux.renameat2(old.fd, name_old, new.fd, name_new, flags)
        elif flags:
            linux.renameat2(old.fd, name_old, new.fd, name_new, flags)
        else:
            os.rename(name_old, name_new, src_dir_fd=old.fd, dst_dir_fd=new.fd)
        moved = os.stat(name_new, dir_fd=new.fd, follow_symlinks=False)
        if replaced is not None and moved.st_ino != replaced.st_ino:
            self.tree.link_removed(replaced)
        events = self.hooks.events
        if events is not None and not flags & linux.RENAME_EXCHANGE:
            path = self.tree.relpath(new.fd, name_new)
            if path is not None and stat.S_ISDIR(moved.st_mode):
                events.dir_renamed(path)
            elif path is not None and stat.S_ISREG(moved.st_mode):
                events.file_done(path)

    # -- directories -----------------------------------------------------------------------

    async def opendir(self, inode: int, ctx: Requester) -> int:
        fd = os.open(self.inodes[inode].proc_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.handles.add_dir(fd, inode, os.O_RDONLY | os.O_DIRECTORY, recovery.DIRECTORY)
        return fd

    async def readdir(self, fh: int, start_id: int, add: DirEntryAdder) -> None:
        """Offsets index a listing taken when the walk starts, so entries created or removed
        meanwhile are never reported twice or skipped. Each entry counts as a lookup."""
        names = self.handles.dirs[fh]
        if names is None or start_id == 0:
            names = self.handles.dirs[fh] = [os.fsencode(n) for n in os.listdir(fh)]
        for i in range(start_id, len(names)):
            try:
                ino, st = self.inodes.lookup(fh, names[i])
            except FileNotFoundError:
                continue  # removed since the listing
            if not add(names[i], ino, st, i + 1):
                self.inodes.forget(ino, 1, undo=True)
                break

    async def releasedir(self, fh: int) -> None:
        if self.handles.remove_dir(fh):  # else sent again, done before a predecessor died
            os.close(fh)

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        os.fsync(fh)

    # -- opening and closing ---------------------------------------------------------------

    async def open(self, inode: int, flags: int, ctx: Requester, kill_privs: bool | None = None) -> pyfuse3.FileInfo:
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            await self._before_change(inode)
        return self.opener.open(inode, flags, ctx, kill_privs)

    def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Requester, resumed: int | None = None
    ) -> tuple[pyfuse3.FileInfo, int, os.stat_result]:
        return self.opener.create(parent_inode, name, mode, flags, ctx, resumed)

    async def tmpfile(
        self, parent_inode: int, mode: int, flags: int, ctx: Requester
    ) -> tuple[pyfuse3.FileInfo, int, os.stat_result]:
        return self.opener.tmpfile(parent_inode, mode, flags, ctx)

    def take_over(self, handles: list[recovery.Handle]) -> None:
        """Adopt the open handles of a daemon that is gone, each already reopened at its
        own descriptor number (:func:`tierfs.fs.recovery.reopen_handles`): the kernel
        goes on using them as they were."""
        for h in handles:
            self.opener.adopt(h)
        for h in handles:  # released by the kernel (and answered) before the predecessor did it
            if h.kind & recovery.RELEASING and not h.is_dir:
                self.release(h.fh)

    def release(self, fh: int) -> None:
        self.release_writes(fh)
        self.release_handle(fh)

    def release_writes(self, fh: int) -> None:
        """The part of a release that others see, done in order with what follows it: the
        file's writes are in and accounted, it no longer counts as open for writing, and the
        commit rules hear that it was closed."""
        handles = self.handles
        if fh not in handles.writable:
            return
        handles.writable.discard(fh)
        if fh in handles.passthrough_writers:
            # The kernel wrote it itself, and never mixes that with daemon writes on one
            # inode: nothing can be queued for it. Account what it wrote now.
            handles.passthrough_writers.discard(fh)
            st = os.fstat(fh)
            self.writing.unwatch(fh, st)
            self.space.update(st)
        else:
            self.writes_done(handles.ino(fh))
            if (error := self.writes.take_error(fh)) is not None:  # flush reported any but this
                log.warning("a write to %s failed after close: %s", self.tree.relpath(fh) or "an unlinked file", error)
                handles.failed_writes.add(fh)
            st = os.fstat(fh)
        if fh in handles.failed_writes:
            handles.failed_writes.discard(fh)
            log.warning(
                "%s lost a write after it was answered: its close does not count toward a commit",
                self.tree.relpath(fh) or "an unlinked file",
            )
        elif self.hooks.events is not None and st.st_nlink > 0:
            path = self.tree.relpath(fh)
            if path is not None:
                self.hooks.events.file_done(path)

    def release_handle(self, fh: int) -> None:
        """The rest of a release (after :meth:`release_writes`), which no request can tell
        from not done yet: the kernel session leaves it for a moment when nothing waits."""
        self.opener.release(fh)

    # -- the data path ---------------------------------------------------------------------

    def read_ready(self, fh: int) -> bool:
        """Whether a read of ``fh`` can be answered without waiting for a restore."""
        return not self.hooks.pending(self.handles.ino(fh))

    async def wait_for_read(self, fh: int, off: int, size: int) -> None:
        """Until the chunks a read covers are in, for a file still being restored."""
        if not self.read_ready(fh):
            assert self.hooks.restoring is not None  # only a file being restored is not ready
            await self.hooks.restoring.wait_range(self.handles.ino(fh), off, size)

    def read(self, fh: int, off: int, size: int) -> memoryview:
        """Read from the RAM tier (once :meth:`read_ready`).

        One buffer serves every read: the engine copies the reply to the kernel as soon as
        this returns, before any other handler can run, so it is never shared."""
        self.writes_done(self.handles.ino(fh))
        if size > len(self._read_buf):
            self._read_buf = memoryview(bytearray(size))
        n = os.preadv(fh, [self._read_buf[:size]], off)
        self._bytes_read += n
        return self._read_buf[:n]

    def read_size(self, fh: int, off: int, size: int) -> int:
        """How many bytes a read of ``size`` at ``off`` gets, once the file's writes are in,
        for an engine that moves them itself (the file is not being restored)."""
        self.writes_done(self.handles.ino(fh))
        n = max(0, min(size, os.fstat(fh).st_size - off))
        self._bytes_read += n
        return n

    def write(self, fh: int, off: int, buf: bytes) -> int:
        return self.write_back.write(fh, off, buf)

    def write_by(self, fh: int, off: int, size: int, apply: Callable[[], None], now: bool = False) -> None:
        """A write that ``apply()`` makes and answers itself (tierfs' own engine, from the
        pipe its request was spliced into): :meth:`~tierfs.fs.writeback.WriteBack.write_by`."""
        self.write_back.write_by(fh, off, size, apply, now)

    def flush(self, fh: int) -> None:
        self.writes_done(self.handles.ino(fh))
        self.write_back.raise_error(fh)

    async def fsync(self, fh: int, datasync: bool) -> None:
        self.flush(fh)
        (os.fdatasync if datasync else os.fsync)(fh)

    async def fallocate(self, fh: int, mode: int, offset: int, length: int, ctx: Requester) -> None:
        """``fallocate(2)`` on the backing file: tmpfs' own preallocation, ``KEEP_SIZE`` and
        punched holes (and its ``EOPNOTSUPP`` for the rest), following a write's rules:
        what may be allocated must fit in ``--capacity`` (``ENOSPC`` before anything
        changes), and a caller other than root drops set-id bits, as tmpfs does. (tierfs'
        own engine only: pyfuse3 has no such handler.)"""
        node = await self._before_change(self.handles.ino(fh))
        self.write_back.raise_error(fh)
        if not mode & linux.FALLOC_FL_PUNCH_HOLE:  # may allocate what the range lacks
            self.space.check_write(fh, offset, length)
        linux.fallocate(fh, mode, offset, length)
        if ctx.uid != 0:
            self.handles.kill_privs.discard(fh)
            drop_privs(f"/proc/self/fd/{fh}")
        node.cache_valid = False
        self.space.update(os.fstat(fh))
        self.writing.wrote(0 if mode & linux.FALLOC_FL_PUNCH_HOLE else length)  # allocating costs as writing does

    async def copy_file_range(
        self, fh_in: int, off_in: int, fh_out: int, off_out: int, length: int, flags: int, ctx: Requester
    ) -> int:
        """``copy_file_range(2)`` made by tmpfs on the backing files: one copy in the kernel,
        and tmpfs' checks (an append-only or immutable target, overlapping ranges). The
        target follows a write's rules; the source's restore and queued writes come first."""
        if flags:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))  # none are defined
        ino_in = self.handles.ino(fh_in)
        await self._settle(ino_in)
        self.writes_done(ino_in)
        ino_out = self.write_back.before(fh_out)
        node = await self._before_change(ino_out)
        length = min(length, max(0, os.fstat(fh_in).st_size - off_in))  # what the source holds
        self.space.check_write(fh_out, off_out, length)
        # In a thread: a copy of gigabytes would hold every other request for its length.
        # The kernel holds the target's inode lock meanwhile, so no write of it comes between.
        n = await trio.to_thread.run_sync(os.copy_file_range, fh_in, fh_out, length, off_in, off_out)
        node.cache_valid = False
        self.space.update(os.fstat(fh_out))
        self.write_back.wrote(fh_out, ino_out, n)
        return n

    async def lseek(self, fh: int, offset: int, whence: int) -> int:
        """``SEEK_DATA``/``SEEK_HOLE`` (the kernel answers the other kinds itself), answered
        by the backing file once its writes and its restore are in.

        Pages written through a shared mapping of a file open for reading and writing on
        the daemon path sit in the kernel's page cache until written back, and the kernel
        does not write them back before asking: while such an open exists, the engine has
        the kernel write them back first (``write_back_pages``). Without one, the answer is the
        one the kernel gives without a handler (the whole file is data), never a hole that
        holds bytes. (A write-only open cannot be mapped.)"""
        ino = self.handles.ino(fh)
        await self._settle(ino)  # a placeholder's holes are chunks not fetched yet
        self.writes_done(ino)
        mappable = any(
            fcntl.fcntl(w, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR for w in self.handles.writers_through_daemon(ino)
        )
        if mappable and self.hooks.write_back_pages is not None:
            await self.hooks.write_back_pages(ino)
            self.writes_done(ino)
        elif mappable:
            return linux.seek_all_data(os.fstat(fh).st_size, offset, whence)
        return os.lseek(fh, offset, whence)

    # -- extended attributes and inode flags ----------------------------------------------

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Requester, flags: int = 0) -> None:
        """``flags``: XATTR_CREATE and XATTR_REPLACE, which pyfuse3 checks itself and does not pass."""
        self.xattrs.set(inode, name, value, ctx, flags)

    def getxattr(self, inode: int, name: bytes, ctx: Requester | None = None) -> bytes:
        return self.xattrs.get(inode, name)

    async def listxattr(self, inode: int, ctx: Requester) -> list[bytes]:
        return self.xattrs.list(inode, ctx)

    async def removexattr(self, inode: int, name: bytes, ctx: Requester) -> None:
        self.xattrs.remove(inode, name, ctx)

    async def ioctl(self, inode: int, fh: int, cmd: int, data: bytes, out_size: int) -> bytes:
        """Inode flags (lsattr, chattr); no other ioctl is a file system's (ENOTTY, as tmpfs
        answers). The kernel already checked the caller. Before a file becomes immutable or
        append-only, a committed file is detached from its snapshots: tmpfs would refuse
        to unlink the snapshot's name of a frozen inode when the step is dropped."""
        if cmd not in linux.FLAG_IOCTLS:
            raise OSError(errno.ENOTTY, os.strerror(errno.ENOTTY))
        if cmd in linux.FLAG_SETTERS:
            await self._settle(inode)
            self.writes_done(inode)
            if linux.freezes(cmd, data):
                self.tree.detach(self.inodes[inode])
        buf = bytearray(data.ljust(max(out_size, 8), b"\0"))
        fcntl.ioctl(fh, cmd, buf)
        return bytes(buf[:out_size])

    # -- rules every change follows --------------------------------------------------------

    async def _settle(self, ino: int) -> None:
        """Before a file of a step being restored changes, let its restore finish."""
        if self.hooks.pending(ino):
            assert self.hooks.restoring is not None
            await self.hooks.restoring.wait_file(ino)

    async def _before_change(self, ino: int) -> Inode:
        """Before ``ino`` changes: its restore is complete, its queued writes are in, and a
        committed file has been detached from its snapshots."""
        await self._settle(ino)
        self.writes_done(ino)
        node = self.inodes[ino]
        self.tree.detach(node)
        return node

    def writes_done(self, ino: int | None = None) -> None:
        """Wait until the writes to ``ino`` (or to every file) are in the RAM tier, and account them."""
        self.write_back.done(ino)

    def writing_inodes(self) -> set[int]:
        """Backing inode numbers of the files open for writing now."""
        return {os.fstat(fh).st_ino for fh in self.handles.writable}

    def close(self) -> None:
        """Close every descriptor still held (after the kernel let go of the mount)."""
        self.handles.close_all()
        self.tree.close()
        self.inodes.close_all()
