"""pyfuse3 Operations: a thin passthrough onto the RAM tier's tree.

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

Handlers never await, with one exception: a file of a step still being restored
(``restoring``) makes a read wait for the chunks it covers, and anything that would change
the file wait for the whole file. Every other handler runs to completion on the trio
thread, so the table and the space account need no locks, and an operation sees no other
half-done. Writes are answered before their bytes are copied (``writes``, see
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
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import stat
import time
from typing import Callable, Protocol

import pyfuse3

from tierfs.core import linux
from tierfs.fs.caller import Caller, acting_as
from tierfs.fs.inodes import O_PATH_FLAGS, Inode, InodeTable
from tierfs.fs.messages import DirBuffer
from tierfs.fs.backing import BackingFiles
from tierfs.fs.writebehind import WriteBehind
from tierfs.ramtier.snapshots import Snapshots
from tierfs.ramtier.space import PAGE, SpaceAccount

log = logging.getLogger(__name__)

# Every change goes through this daemon, so the kernel may cache names and attributes;
# writes, renames and unlinks invalidate what they touch in the kernel itself.
ATTR_TIMEOUT = 1.0
_NS = 1_000_000_000
ACL_ACCESS, ACL_DEFAULT = b"system.posix_acl_access", b"system.posix_acl_default"
ACL_NAMES = (ACL_ACCESS, ACL_DEFAULT)
# Flags that the kernel has already acted on, or that the backing open must not see.
# O_APPEND among them: the kernel gives every write its offset (for an O_APPEND open, the
# end of the file as it knows it), and writes mapped pages back through any handle open
# for writing; a backing descriptor opened O_APPEND would move all of those to its end.
_STRIP_OPEN_FLAGS = os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_NOFOLLOW | os.O_DIRECT | os.O_APPEND


def _errors_to_fuse(handler: Callable) -> Callable:
    """Turn OSError into the errno the kernel should see; a bug becomes EIO, not a dead mount."""

    @functools.wraps(handler)
    async def wrapper(*args, **kwargs):
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


class Events(Protocol):
    """What the checkpoint machinery hears from the mount (paths relative to its root)."""

    def file_done(self, path: str) -> None: ...  # closed after writing, or renamed into place

    def dir_renamed(self, path: str) -> None: ...


class Restoring(Protocol):
    """Files whose bytes are still arriving from another tier (by FUSE inode number)."""

    def pending(self, ino: int) -> bool: ...

    async def wait_range(self, ino: int, offset: int, size: int) -> None: ...  # OSError(EIO) if unobtainable

    async def wait_file(self, ino: int) -> None: ...


def _has_privs(mode: int) -> bool:
    """Set-uid, or set-gid with group execute (set-gid alone means mandatory locking)."""
    return bool(mode & stat.S_ISUID or (mode & stat.S_ISGID and mode & stat.S_IXGRP))


def _drop_privs(path: str) -> None:
    """Clear what a write by an unprivileged user clears (the daemon writes as root, which keeps them)."""
    mode = os.stat(path).st_mode
    if _has_privs(mode):
        os.chmod(path, stat.S_IMODE(mode) & ~stat.S_ISUID & ~(stat.S_ISGID if mode & stat.S_IXGRP else 0))


def _readdir_reply(token, name: bytes, attrs: pyfuse3.EntryAttributes, next_id: int) -> bool:
    if isinstance(token, DirBuffer):
        return token.add(name, attrs, next_id)
    return pyfuse3.readdir_reply(token, name, attrs, next_id)


class Operations(pyfuse3.Operations):
    supports_dot_lookup = False  # no NFS export: '.'/'..' never reach lookup()
    enable_writeback_cache = False
    attr_timeout = ATTR_TIMEOUT  # of names and attributes alike

    def __init__(self, tree: str | os.PathLike, space: SpaceAccount,
                 snapshots: Snapshots | None = None, events: Events | None = None):
        super().__init__()
        self.inodes = InodeTable(tree)
        self.space = space
        self.snapshots = snapshots
        self.events = events
        self.restoring: Restoring | None = None
        self.backing: BackingFiles | None = None  # kernel passthrough, when the engine has it
        self.acl = False  # the kernel enforces POSIX ACLs (and leaves the umask to us): set by the engine
        self.writes = WriteBehind()  # applies writes only while its worker runs (``with``)
        self._tree_prefix = os.fsencode(os.path.abspath(tree)) + b"/"
        self._proc_fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._files: dict[int, int] = {}  # fh (the backing fd) -> inode
        self._writable: set[int] = set()  # fhs open for writing
        self._dirs: dict[int, list[bytes] | None] = {}  # fh -> readdir snapshot
        self._kill_privs: set[int] = set()  # fhs whose first write must drop set-id bits
        self._failed_writes: set[int] = set()  # fhs with a write that failed after its answer
        self._direct: set[int] = set()  # fhs open with direct I/O: their writes bypass the page cache
        self._read_buf = memoryview(bytearray(1 << 20))
        self._passthrough_writers: set[int] = set()  # fhs open for writing by passthrough
        self.counters = {"bytes_written": 0, "bytes_read": 0, "opens": 0, "passthrough_opens": 0}
        self._last_write = 0.0

    @property
    def last_write(self) -> float:
        """time.monotonic() of the latest write (now, while a passthrough writer is open):
        background work yields to writers."""
        return time.monotonic() if self._passthrough_writers else self._last_write

    # -- helpers ---------------------------------------------------------------------

    def _current(self, ino: int, st: os.stat_result) -> tuple[os.stat_result, int]:
        """``st`` brought up to date, and the link count users see (without the snapshots' links).

        The kernel believes the size it is given: an older one truncates its view of the
        file (its cached pages, and where its next ``O_APPEND`` write goes). ``st`` was taken
        by the caller, and the worker may have applied the last queued write since, so
        whether it was queued then is not whether it is queued now: any write to ``ino``
        answered since the last wait for it means the status is taken again, after them.
        """
        if self.writes.unsettled(ino):
            self.writes_done(ino)
            st = os.fstat(self.inodes[ino].fd)
        return st, st.st_nlink - (self.snapshots.pins(st.st_ino) if self.snapshots else 0)

    def fuse_attr(self, ino: int, st: os.stat_result) -> tuple:
        """``ino``'s attributes in the order of the kernel's ``struct fuse_attr``, for the
        kernel session to pack as they are (pyfuse3 gets the same as :meth:`_attrs`)."""
        st, nlink = self._current(ino, st)
        at, mt, ct = st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns
        return (ino, st.st_size, st.st_blocks, at // _NS, mt // _NS, ct // _NS, at % _NS, mt % _NS, ct % _NS,
                st.st_mode, nlink, st.st_uid, st.st_gid, st.st_rdev, st.st_blksize, 0)

    def _attrs(self, ino: int, st: os.stat_result) -> pyfuse3.EntryAttributes:
        st, nlink = self._current(ino, st)
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.generation = 0
        a.entry_timeout = ATTR_TIMEOUT
        a.attr_timeout = ATTR_TIMEOUT
        a.st_mode = st.st_mode
        a.st_nlink = nlink
        a.st_uid = st.st_uid
        a.st_gid = st.st_gid
        a.st_rdev = st.st_rdev
        a.st_size = st.st_size
        a.st_blksize = st.st_blksize
        a.st_blocks = st.st_blocks
        a.st_atime_ns = st.st_atime_ns
        a.st_mtime_ns = st.st_mtime_ns
        a.st_ctime_ns = st.st_ctime_ns
        return a

    def _give_to_caller(self, fd: int, parent: Inode, ctx: pyfuse3.RequestContext) -> None:
        """Make the file just created as root, open as ``fd``, the caller's, as tmpfs would
        have: the descriptor itself is changed, never a name someone could swap meanwhile."""
        setgid_parent = os.fstat(parent.fd).st_mode & stat.S_ISGID
        gid = -1 if setgid_parent else ctx.gid  # setgid dirs impose their group
        if ctx.uid != 0 or gid not in (-1, 0):
            mode = os.fstat(fd).st_mode  # as created: a default ACL of the parent may have shaped it
            linux.chown_fd(fd, ctx.uid, gid)
            # chown() clears set-id bits; the kernel already decided the caller may keep them.
            if mode & (stat.S_ISUID | stat.S_ISGID):
                os.fchmod(fd, stat.S_IMODE(mode))

    def _creation_mode(self, parent: Inode, mode: int, ctx) -> int:
        """``mode`` as the caller's umask leaves it, unless ``parent`` has a default ACL,
        which then decides instead (tmpfs applies it; the daemon's own umask is 0).

        With POSIX ACLs the kernel leaves the umask to the daemon (``FUSE_DONT_MASK``);
        otherwise the mode arrives masked already and nothing is left to do."""
        umask = getattr(ctx, "umask", 0)
        if not mode & umask & 0o777:
            return mode
        try:
            os.getxattr(parent.proc_path, ACL_DEFAULT)
        except OSError as e:
            if e.errno not in (errno.ENODATA, errno.EOPNOTSUPP):
                raise
            return mode & ~umask
        return mode

    def _new_entry(self, parent: Inode, name: bytes) -> pyfuse3.EntryAttributes:
        """Adopt a name just created in ``parent`` (already the caller's)."""
        return self._attrs(*self.inodes.lookup(parent.fd, name))

    def link_removed(self, st: os.stat_result) -> None:
        """A link of ``st`` (a name in the tree or a snapshot) is gone: if it was the last, its space is free (at last close)."""
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            return
        ino = self.inodes.fuse_ino(st)
        node = self.inodes.get(ino)
        if node is not None and node.opens:
            node.orphaned = True
            return
        self.space.drop(st.st_ino)
        # Nothing can reach the inode any more but our pin, which the kernel would release
        # only with its FORGET, some requests later: let tmpfs free it now.
        self.inodes.unpin(ino)

    def _relpath(self, fd: int, name: bytes = b"") -> str | None:
        """The tree-relative path of ``fd`` (joined with ``name``), as the commit rules see it."""
        path = os.readlink(b"%d" % fd, dir_fd=self._proc_fds)
        if name:
            path = path + b"/" + name
        if not path.startswith(self._tree_prefix) or path.endswith(b" (deleted)"):
            return None  # the root itself, or unlinked meanwhile
        return os.fsdecode(path[len(self._tree_prefix):])

    def _detach(self, node: Inode) -> None:
        """Before a committed file changes, give its snapshots a copy of their own."""
        if self.snapshots is None or node.kind != stat.S_IFREG:
            return
        st = os.fstat(node.fd)
        if not self.snapshots.pins(st.st_ino):
            return
        self.space.check_growth(st.st_blocks * 512)
        copy = self.snapshots.detach(st.st_ino, node.proc_path)
        if copy is not None:
            self.space.update(copy)

    async def _settle(self, ino: int) -> None:
        """Before a file of a step being restored changes, let its restore finish."""
        if self.restoring is not None and self.restoring.pending(ino):
            await self.restoring.wait_file(ino)

    def writes_done(self, ino: int | None = None) -> None:
        """Wait until the writes to ``ino`` (or to every file) are in the RAM tier, and account them."""
        self.writes.wait(ino)
        self._account_writes()

    def _account_writes(self) -> None:
        for fd in self.writes.finished():
            self.space.update(os.fstat(fd))
        for fd in self._passthrough_writers:  # the kernel writes these without telling us
            self.space.update(os.fstat(fd))

    def _raise_write_error(self, fh: int) -> None:
        """Report a write of ``fh`` that failed after it was answered (as a failed writeback)."""
        error = self.writes.take_error(fh)
        if error is not None:
            self._failed_writes.add(fh)
            raise error

    def writing_inodes(self) -> set[int]:
        """Backing inode numbers of the files open for writing now."""
        return {os.fstat(fh).st_ino for fh in self._writable}

    def _lstat_at(self, dirfd: int, name: bytes) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def _passes_through(self, ino: int, node: Inode, fd: int, writer_drops_privs: bool) -> bool:
        """Whether the kernel may serve this open from the backing file itself."""
        backing = self.backing
        if backing is None or backing.failed is not None or node.kind != stat.S_IFREG:
            return False
        if self.restoring is not None and self.restoring.pending(ino):
            return False  # its reads must wait for chunks
        if writer_drops_privs:
            return False  # its first write must drop set-id bits, which only the daemon sees
        if node.opens - 1 > backing.opens(ino):
            return False  # an earlier open is served by the daemon: the kernel allows no mix
        return backing.attach(ino, fd)

    def _open_backing(self, ino: int, node: Inode, fd: int, flags: int, ctx,
                      st: os.stat_result | None = None) -> pyfuse3.FileInfo:
        """Register an open backing descriptor and choose how the kernel reads and writes it.

        Passthrough when the engine and the file allow it. Otherwise, through the daemon:
        write-only opens use direct I/O (no copy into the page cache, 1 MiB requests);
        read-only opens keep the page cache between opens unless the file changed since;
        read-write opens use the page cache (so shared mmap works), dropping stale pages.
        Under a passthrough engine every daemon open is direct I/O, since the kernel refuses
        passthrough for an inode it caches. ``st``: the file's status, if taken since the open.
        """
        node.opens += 1
        node.open_fd = fd
        self._files[fd] = ino
        self.counters["opens"] += 1
        fi = pyfuse3.FileInfo(fh=fd)
        accmode = flags & os.O_ACCMODE
        if accmode != os.O_RDONLY:
            self._writable.add(fd)
        if flags & os.O_TRUNC:
            node.cache_valid = False
            st = st or os.fstat(fd)
            self.space.update(st)
        drops_privs = accmode != os.O_RDONLY and ctx.uid != 0 and _has_privs((st or os.fstat(fd)).st_mode)
        if self._passes_through(ino, node, fd, drops_privs):
            self.counters["passthrough_opens"] += 1
            if accmode != os.O_RDONLY:
                self._passthrough_writers.add(fd)
            return fi
        if drops_privs:
            # A write by anyone but root drops set-id bits; the kernel does it only for
            # page-cache writes, so direct writes do it here, as tmpfs would.
            self._kill_privs.add(fd)
        if accmode == os.O_WRONLY or flags & os.O_DIRECT or self.backing is not None:
            fi.direct_io = True
            self._direct.add(fd)
        else:
            fi.keep_cache = node.cache_valid
            node.cache_valid = True
        return fi

    # -- names -----------------------------------------------------------------------

    def lookup_sync(self, parent_inode: int, name: bytes) -> tuple[int, os.stat_result]:
        return self.inodes.lookup(self.inodes[parent_inode].fd, name)

    @_errors_to_fuse
    async def lookup(self, parent_inode, name, ctx=None):
        return self._attrs(*self.lookup_sync(parent_inode, name))

    def forget_sync(self, inode_list) -> None:
        for ino, n in inode_list:
            self.inodes.forget(ino, n)

    async def forget(self, inode_list):
        self.forget_sync(inode_list)

    def getattr_sync(self, inode: int) -> os.stat_result:
        return os.fstat(self.inodes[inode].fd)

    @_errors_to_fuse
    async def getattr(self, inode, ctx=None):
        return self._attrs(inode, self.getattr_sync(inode))

    @_errors_to_fuse
    async def setattr(self, inode, attr, fields, fh, ctx):
        await self._settle(inode)
        self.writes_done(inode)
        node = self.inodes[inode]
        self._detach(node)
        if fields.update_mode and node.kind != stat.S_IFLNK:
            os.chmod(node.proc_path, stat.S_IMODE(attr.st_mode))
        if fields.update_uid or fields.update_gid:
            uid = attr.st_uid if fields.update_uid else -1
            gid = attr.st_gid if fields.update_gid else -1
            linux.chown_fd(node.fd, uid, gid)
        if fields.update_size:
            if fh is not None:
                os.ftruncate(fh, attr.st_size)
            else:
                os.truncate(node.proc_path, attr.st_size)
            if getattr(fields, "kill_suidgid", False):
                _drop_privs(node.proc_path)
            node.cache_valid = False
            self.space.update(os.fstat(node.fd))
        if fields.update_atime or fields.update_mtime:
            linux.utimens_fd(
                node.fd,
                attr.st_atime_ns if fields.update_atime else None,
                attr.st_mtime_ns if fields.update_mtime else None,
            )
        return self._attrs(inode, os.fstat(node.fd))

    @_errors_to_fuse
    async def readlink(self, inode, ctx):
        return os.readlink(b"", dir_fd=self.inodes[inode].fd)

    @_errors_to_fuse
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        parent = self.inodes[parent_inode]
        mode = self._creation_mode(parent, mode, ctx)
        with acting_as(ctx):
            os.mknod(name, mode, rdev, dir_fd=parent.fd)
        return self._new_entry(parent, name)

    @_errors_to_fuse
    async def mkdir(self, parent_inode, name, mode, ctx):
        parent = self.inodes[parent_inode]
        mode = self._creation_mode(parent, mode, ctx)
        with acting_as(ctx):
            os.mkdir(name, stat.S_IMODE(mode), dir_fd=parent.fd)
        return self._new_entry(parent, name)

    @_errors_to_fuse
    async def symlink(self, parent_inode, name, target, ctx):
        parent = self.inodes[parent_inode]
        with acting_as(ctx):
            os.symlink(target, name, dir_fd=parent.fd)
        return self._new_entry(parent, name)

    @_errors_to_fuse
    async def link(self, inode, new_parent_inode, new_name, ctx):
        node, parent = self.inodes[inode], self.inodes[new_parent_inode]
        with acting_as(ctx):  # protected_hardlinks is the caller's to pass
            os.link(node.proc_path, new_name, dst_dir_fd=parent.fd, follow_symlinks=True)
        return self._new_entry(parent, new_name)

    @_errors_to_fuse
    async def unlink(self, parent_inode, name, ctx):
        parent = self.inodes[parent_inode]
        st = os.stat(name, dir_fd=parent.fd, follow_symlinks=False)
        os.unlink(name, dir_fd=parent.fd)
        self.link_removed(st)

    @_errors_to_fuse
    async def rmdir(self, parent_inode, name, ctx):
        os.rmdir(name, dir_fd=self.inodes[parent_inode].fd)

    @_errors_to_fuse
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        self.writes_done()  # a rename may commit a step: its bytes must all be there
        old, new = self.inodes[parent_inode_old], self.inodes[parent_inode_new]
        replaced = None
        if not flags & (linux.RENAME_NOREPLACE | linux.RENAME_EXCHANGE):
            replaced = self._lstat_at(new.fd, name_new)
        if flags:
            linux.renameat2(old.fd, name_old, new.fd, name_new, flags)
        else:
            os.rename(name_old, name_new, src_dir_fd=old.fd, dst_dir_fd=new.fd)
        moved = os.stat(name_new, dir_fd=new.fd, follow_symlinks=False)
        if replaced is not None and moved.st_ino != replaced.st_ino:
            self.link_removed(replaced)
        if self.events is not None and not flags & linux.RENAME_EXCHANGE:
            path = self._relpath(new.fd, name_new)
            if path is not None:
                if stat.S_ISDIR(moved.st_mode):
                    self.events.dir_renamed(path)
                elif stat.S_ISREG(moved.st_mode):
                    self.events.file_done(path)

    # -- files -----------------------------------------------------------------------

    @_errors_to_fuse
    async def open(self, inode, flags, ctx):
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            await self._settle(inode)
            self.writes_done(inode)
            self._detach(self.inodes[inode])
        node = self.inodes[inode]
        fd = os.open(node.proc_path, (flags & ~_STRIP_OPEN_FLAGS) | os.O_CLOEXEC)
        return self._open_backing(inode, node, fd, flags, ctx)

    def create_sync(self, parent_inode: int, name: bytes, mode: int, flags: int,
                    ctx) -> tuple[pyfuse3.FileInfo, int, os.stat_result]:
        """Create ``name``, or open it if another creator made it after the kernel's lookup.

        The common case, a name still free, is an exclusive create as root and a chown of
        the new descriptor (no name is looked at twice). A name that turned out to be taken
        is opened with the caller's credentials (:func:`~tierfs.fs.caller.acting_as`), so
        tmpfs makes the checks the kernel would have made on it."""
        parent = self.inodes[parent_inode]
        bflags = (flags & ~_STRIP_OPEN_FLAGS) | os.O_CLOEXEC
        mode = stat.S_IMODE(self._creation_mode(parent, mode, ctx))
        try:
            fd = os.open(name, bflags | os.O_CREAT | os.O_EXCL, mode, dir_fd=parent.fd)
            created = True
        except FileExistsError:
            if flags & os.O_EXCL:
                raise
            self.writes_done()  # O_TRUNC must come after writes still queued for it
            fd = self._open_raced(parent, name, bflags, mode, ctx)
            created = False
        try:
            if created:
                self._give_to_caller(fd, parent, ctx)
            ino, st = self.inodes.adopt(*self._path_fd(fd, parent, name))
        except OSError:
            os.close(fd)
            raise
        fi = self._open_backing(ino, self.inodes[ino], fd, flags, ctx, st)
        return fi, ino, st

    @staticmethod
    def _path_fd(fd: int, parent: Inode, name: bytes) -> tuple[int, os.stat_result]:
        """An O_PATH descriptor of the file open as ``fd`` (just opened as ``name`` in
        ``parent``), and the file's status.

        The name is opened again, which is cheaper than reopening ``fd`` through /proc,
        but only kept if it still is that file.
        """
        st = os.fstat(fd)
        path_fd = os.open(name, O_PATH_FLAGS, dir_fd=parent.fd)
        try:
            again = os.fstat(path_fd)
        except OSError:
            os.close(path_fd)
            raise
        if (again.st_ino, again.st_dev) != (st.st_ino, st.st_dev):
            os.close(path_fd)
            path_fd = os.open(f"/proc/self/fd/{fd}", os.O_PATH | os.O_CLOEXEC)
        return path_fd, st

    @_errors_to_fuse
    async def create(self, parent_inode, name, mode, flags, ctx):
        fi, ino, st = self.create_sync(parent_inode, name, mode, flags, ctx)
        return fi, self._attrs(ino, st)

    def _open_raced(self, parent: Inode, name: bytes, bflags: int, mode: int, ctx) -> int:
        """Open a name another creator made between the kernel's lookup and our create.

        As the caller, with ``O_CREAT``: tmpfs checks its permissions (``protected_regular``
        included) and, if the name is gone again, creates it for the caller. Only a regular
        file is opened, never through a symlink: anything else makes the kernel look the
        name up again (ESTALE) and resolve it as the caller would.
        """
        try:
            with acting_as(ctx):
                fd = os.open(name, bflags | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, mode, dir_fd=parent.fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise pyfuse3.FUSEError(errno.ESTALE) from None
            st = None if isinstance(e, Caller) else self._lstat_at(parent.fd, name)
            if st is not None and not stat.S_ISREG(st.st_mode):
                raise pyfuse3.FUSEError(errno.ESTALE) from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise pyfuse3.FUSEError(errno.ESTALE)
        return fd

    @_errors_to_fuse
    async def read(self, fh, off, size):
        if not self.read_ready(fh):
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

    @_errors_to_fuse
    async def write(self, fh, off, buf):
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
        self._last_write = time.monotonic()

    def _drop_privs(self, fh: int) -> None:
        if fh in self._kill_privs:
            self._kill_privs.discard(fh)
            _drop_privs(f"/proc/self/fd/{fh}")

    @_errors_to_fuse
    async def flush(self, fh):
        self.writes_done(self._files[fh])
        self._raise_write_error(fh)

    @_errors_to_fuse
    async def release(self, fh):
        self.release_sync(fh)

    def release_sync(self, fh: int) -> None:
        self.release_writes(fh)
        self.release_handle(fh)

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
            self._last_write = time.monotonic()
            st = os.fstat(fh)
            self.space.update(st)
        else:
            self.writes_done(self._files[fh])
            if (error := self.writes.take_error(fh)) is not None:  # flush reported any but this
                log.warning("a write to %s failed after close: %s", self._relpath(fh) or "an unlinked file", error)
                self._failed_writes.add(fh)
            st = os.fstat(fh)
        if fh in self._failed_writes:
            self._failed_writes.discard(fh)
            log.warning("%s lost a write after it was answered: its close does not count toward a commit",
                        self._relpath(fh) or "an unlinked file")
        elif self.events is not None and st.st_nlink > 0:
            path = self._relpath(fh)
            if path is not None:
                self.events.file_done(path)

    def release_handle(self, fh: int) -> None:
        """The rest of a release (after :meth:`release_writes`), which no request can tell
        from not done yet: the descriptor, the backing file and the inode's count of opens.
        The kernel session leaves it for a moment when nothing waits."""
        ino = self._files.pop(fh)
        self._kill_privs.discard(fh)
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

    @_errors_to_fuse
    async def fsync(self, fh, datasync):
        self.writes_done(self._files[fh])
        self._raise_write_error(fh)
        (os.fdatasync if datasync else os.fsync)(fh)

    @_errors_to_fuse
    async def fallocate(self, fh: int, mode: int, offset: int, length: int, ctx) -> None:
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
            _drop_privs(f"/proc/self/fd/{fh}")
        node.cache_valid = False
        self.space.update(os.fstat(fh))
        self._last_write = time.monotonic()

    @_errors_to_fuse
    async def lseek(self, fh: int, offset: int, whence: int) -> int:
        """``SEEK_DATA``/``SEEK_HOLE`` (the kernel answers the other kinds itself), answered
        by the backing file as tmpfs keeps it, once its writes and its restore are in.

        Pages written through a shared mapping of a file open for reading and writing on
        the daemon path sit in the kernel's page cache until written back, and the kernel
        does not write them back before asking: while such an open exists the answer is
        the one the kernel gives without a handler (the whole file is data), never a hole
        that holds bytes. (A write-only open cannot be mapped.)
        """
        ino = self._files[fh]
        await self._settle(ino)  # a placeholder's holes are chunks not fetched yet
        self.writes_done(ino)
        if any(self._files[w] == ino and fcntl.fcntl(w, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
               for w in self._writable - self._passthrough_writers):
            size = os.fstat(fh).st_size
            if offset < 0 or whence not in (os.SEEK_DATA, os.SEEK_HOLE):
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            if offset >= size:
                raise OSError(errno.ENXIO, os.strerror(errno.ENXIO))
            return offset if whence == os.SEEK_DATA else size
        return os.lseek(fh, offset, whence)

    # -- directories -----------------------------------------------------------------

    @_errors_to_fuse
    async def opendir(self, inode, ctx):
        fd = os.open(self.inodes[inode].proc_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._dirs[fd] = None
        return fd

    @_errors_to_fuse
    async def readdir(self, fh, start_id, token):
        # Offsets index a snapshot taken when the listing starts, so entries created or
        # removed meanwhile are never reported twice or skipped.
        names = self._dirs[fh]
        if names is None or start_id == 0:
            names = self._dirs[fh] = [os.fsencode(n) for n in os.listdir(fh)]
        for i in range(start_id, len(names)):
            try:
                ino, st = self.inodes.lookup(fh, names[i])
            except FileNotFoundError:
                continue  # removed since the snapshot
            if not _readdir_reply(token, names[i], self._attrs(ino, st), i + 1):
                self.inodes.forget(ino, 1)
                break

    @_errors_to_fuse
    async def releasedir(self, fh):
        del self._dirs[fh]
        os.close(fh)

    @_errors_to_fuse
    async def fsyncdir(self, fh, datasync):
        os.fsync(fh)

    @_errors_to_fuse
    async def statfs(self, ctx):
        self.writes_done()
        backing = os.statvfs(self.inodes[pyfuse3.ROOT_INODE].proc_path)
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = PAGE
        if self.space.bounded:
            s.f_blocks = self.space.capacity // PAGE
            s.f_bfree = s.f_bavail = max(0, self.space.capacity - self.space.used) // PAGE
        else:
            scale = backing.f_frsize / PAGE
            s.f_blocks = int(backing.f_blocks * scale)
            s.f_bfree = int(backing.f_bfree * scale)
            s.f_bavail = int(backing.f_bavail * scale)
        s.f_files, s.f_ffree, s.f_favail = backing.f_files, backing.f_ffree, backing.f_favail
        s.f_namemax = backing.f_namemax
        return s

    # -- extended attributes (tmpfs keeps user.* and POSIX ACLs; symlinks take none) ------

    def _xattr_path(self, inode: int, missing: int) -> str:
        node = self.inodes[inode]
        if node.kind == stat.S_IFLNK:
            raise pyfuse3.FUSEError(missing)
        return node.proc_path

    def _acl_name(self, name: bytes) -> bool:
        """Whether ``name`` is a POSIX ACL; refused (EOPNOTSUPP, as by a file system without
        ACLs) unless the kernel enforces them on this mount: stored but not enforced, an
        ACL would only turn its mask into group bits."""
        if name not in ACL_NAMES:
            return False
        if not self.acl:
            raise pyfuse3.FUSEError(errno.EOPNOTSUPP)
        return True

    @_errors_to_fuse
    async def setxattr(self, inode, name, value, ctx):
        path = self._xattr_path(inode, errno.EPERM)
        if self._acl_name(name):
            with acting_as(ctx):  # tmpfs drops set-gid as the caller's setfacl would
                os.setxattr(path, name, value)
            return
        os.setxattr(path, name, value)

    def getxattr_sync(self, inode: int, name: bytes) -> bytes:
        # Asked at the first write of every new file (for security.capability): through the
        # open file when there is one, which spares the kernel a walk of /proc.
        self._acl_name(name)
        node = self.inodes[inode]
        if node.open_fd >= 0:
            return os.getxattr(node.open_fd, name)
        return os.getxattr(self._xattr_path(inode, pyfuse3.ENOATTR), name)

    @_errors_to_fuse
    async def getxattr(self, inode, name, ctx):
        return self.getxattr_sync(inode, name)

    @_errors_to_fuse
    async def listxattr(self, inode, ctx):
        node = self.inodes[inode]
        if node.kind == stat.S_IFLNK:
            return []
        names = [os.fsencode(n) for n in os.listxattr(node.proc_path)]
        return names if self.acl else [n for n in names if n not in ACL_NAMES]

    @_errors_to_fuse
    async def removexattr(self, inode, name, ctx):
        path = self._xattr_path(inode, pyfuse3.ENOATTR)
        if self._acl_name(name):
            with acting_as(ctx):
                os.removexattr(path, name)
            return
        os.removexattr(path, name)

    def close(self) -> None:
        """Close every descriptor still held (after the kernel let go of the mount)."""
        for fd in list(self._files) + list(self._dirs):
            os.close(fd)
        if self._proc_fds >= 0:
            os.close(self._proc_fds)
            self._proc_fds = -1
        self._files.clear()
        self._dirs.clear()
        self.inodes.close_all()
