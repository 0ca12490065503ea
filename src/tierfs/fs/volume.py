"""What every handler of the volume shares: the inode table, the space account, the open
handles, and the rules that keep them true whichever handler runs.

The handlers are grouped by concern in mixins of :class:`Volume` (names, opening files,
attributes, the data path); each concern needs the same few rules: that attributes handed
to the kernel are taken after the file's answered writes, that a committed file is detached
from its snapshots before it changes, that a file still being restored is complete first,
and that the space of a file goes when its last link and its last open do. They live here,
once, for all of them.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, Protocol, TypeVar

import pyfuse3

from tierfs.core import linux
from tierfs.fs.backing import BackingFiles
from tierfs.fs.inodes import Inode, InodeTable
from tierfs.fs.messages import FuseAttr, Requester
from tierfs.fs.recovery import SessionState
from tierfs.fs.writebehind import WriteBehind
from tierfs.fs.writing import Writing
from tierfs.ramtier.snapshots import Snapshots
from tierfs.ramtier.space import SpaceAccount

log = logging.getLogger(__name__)

# Every change goes through this daemon, so the kernel may cache names and attributes;
# writes, renames and unlinks invalidate what they touch in the kernel itself.
ATTR_TIMEOUT = 1.0
_NS = 1_000_000_000
ACL_ACCESS, ACL_DEFAULT = b"system.posix_acl_access", b"system.posix_acl_default"
ACL_NAMES = (ACL_ACCESS, ACL_DEFAULT)

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


class Events(Protocol):
    """What the checkpoint machinery hears from the mount (paths relative to its root)."""

    def file_done(self, path: str) -> None: ...  # closed after writing, or renamed into place

    def dir_renamed(self, path: str) -> None: ...


class Restoring(Protocol):
    """Files whose bytes are still arriving from another tier (by FUSE inode number)."""

    def pending(self, ino: int) -> bool: ...

    async def wait_range(self, ino: int, offset: int, size: int) -> None: ...  # OSError(EIO) if unobtainable

    async def wait_file(self, ino: int) -> None: ...


def has_privs(mode: int) -> bool:
    """Set-uid, or set-gid with group execute (set-gid alone means mandatory locking)."""
    return bool(mode & stat.S_ISUID or (mode & stat.S_ISGID and mode & stat.S_IXGRP))


def drop_privs(path: str) -> None:
    """Clear what a write by an unprivileged user clears (the daemon writes as root, which keeps them).

    tmpfs clears them on an append-only file too (its check of the flag comes before), where
    a chmod is refused: the flag is lifted for the chmod and put back."""
    mode = os.stat(path).st_mode
    if not has_privs(mode):
        return
    dropped = stat.S_IMODE(mode) & ~stat.S_ISUID & ~(stat.S_ISGID if mode & stat.S_IXGRP else 0)
    try:
        os.chmod(path, dropped)
    except PermissionError:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            flags = linux.get_flags(fd)
            if not flags & linux.FS_APPEND_FL:
                raise
            linux.set_flags(fd, flags & ~linux.FS_APPEND_FL)
            try:
                os.fchmod(fd, dropped)
            finally:
                linux.set_flags(fd, flags)
        finally:
            os.close(fd)


class Volume:
    """The RAM tier's tree as the handlers see it, and what they keep of the kernel's opens."""

    def __init__(
        self,
        tree: str | os.PathLike[str],
        space: SpaceAccount,
        snapshots: Snapshots | None = None,
        events: Events | None = None,
    ):
        super().__init__()
        self.inodes = InodeTable(tree)
        self.space = space
        self.snapshots = snapshots
        self.events = events
        self.restoring: Restoring | None = None
        self.backing: BackingFiles | None = None  # kernel passthrough, when the engine has it
        self.record: SessionState | None = None  # what a successor needs: set by the own engine
        self.acl = False  # the kernel enforces POSIX ACLs (and leaves the umask to us): set by the engine
        self.write_back: Callable[[int], Awaitable[None]] | None = None  # the kernel's dirty pages of an inode
        self.writes = WriteBehind()  # applies writes only while its worker runs (``with``)
        self._tree_prefix = os.fsencode(os.path.abspath(tree)) + b"/"
        self._proc_fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._files: dict[int, int] = {}  # fh (the backing fd) -> inode
        self._writable: set[int] = set()  # fhs open for writing
        self._dirs: dict[int, list[bytes] | None] = {}  # fh -> readdir snapshot
        self._kill_privs: set[int] = set()  # fhs whose first write must drop set-id bits
        self._unprivileged_writers: set[int] = set()  # fhs open for writing by callers other than root
        self._failed_writes: set[int] = set()  # fhs with a write that failed after its answer
        self._direct: set[int] = set()  # fhs open with direct I/O: their writes bypass the page cache
        self._read_buf = memoryview(bytearray(1 << 20))
        self._passthrough_writers: set[int] = set()  # fhs open for writing by passthrough
        self.counters = {"bytes_written": 0, "bytes_read": 0, "opens": 0, "passthrough_opens": 0}
        self.writing = Writing()  # what background work gives way to

    @property
    def last_write(self) -> float:
        """time.monotonic() when the job was last writing in bulk: background work gives way
        to it (:mod:`tierfs.fs.writing`)."""
        return self.writing.last

    # -- attributes as the kernel gets them ------------------------------------------------

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

    def fuse_attr(self, ino: int, st: os.stat_result) -> FuseAttr:
        """``ino``'s attributes in the order of the kernel's ``struct fuse_attr``, for the
        kernel session to pack as they are (pyfuse3 gets the same as :meth:`_attrs`)."""
        st, nlink = self._current(ino, st)
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

    # -- rules every change follows --------------------------------------------------------

    def _creation_mode(self, parent: Inode, mode: int, ctx: Requester) -> int:
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

    def privileged(self, ino: int) -> None:
        """``ino`` was just given set-id bits: the next write of each handle a caller other
        than root has open for writing on the daemon path drops them, as on tmpfs. (One that
        is passed through writes beside the daemon: its writes keep them.)"""
        for fh in self._unprivileged_writers:
            if self._files[fh] == ino and fh not in self._passthrough_writers:
                self._kill_privs.add(fh)

    @staticmethod
    def recorded(record: SessionState, fh: int, ino: int, flags: int, kind: int, backing_id: int = 0) -> None:
        """Write an open handle into the ``record`` for a successor; the open serves on if it cannot be."""
        try:
            record.opened(fh, ino, flags, kind, backing_id)
        except OSError as e:
            log.warning("a successor will not know file handle %d (its record cannot grow: %s)", fh, e.strerror or e)

    def link_removed(self, st: os.stat_result) -> None:
        """A link of ``st`` (a name in the tree or a snapshot) is gone: if it was the last, its
        space is free (at last close)."""
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
        return os.fsdecode(path[len(self._tree_prefix) :])

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

    def writing_inodes(self) -> set[int]:
        """Backing inode numbers of the files open for writing now."""
        return {os.fstat(fh).st_ino for fh in self._writable}

    def _lstat_at(self, dirfd: int, name: bytes) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return None

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
