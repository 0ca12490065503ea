"""Opening files and letting them go: the create that gives a new file to its caller, the
choice, at every open, of how the kernel will read and write it, and the last close that
frees an unlinked file.

A part of its own because an open decides what the data path is: kernel passthrough
for a whole file when the engine has it and nothing forbids it, else the daemon, with
direct I/O or the page cache according to the kind of open. A create is also the one place
a file is made as root and handed to its caller after, the hot path of every checkpoint.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING

import pyfuse3

from tierfs.core import linux
from tierfs.fs import recovery
from tierfs.fs.caller import Caller, acting_as, creation_mode, drop_privs, has_privs
from tierfs.fs.inodes import O_PATH_FLAGS, Inode, InodeTable

if TYPE_CHECKING:
    from tierfs.fs.handles import Handles
    from tierfs.fs.hooks import Hooks
    from tierfs.fs.messages import Requester
    from tierfs.fs.writing import Writing
    from tierfs.ramtier.space import SpaceAccount

# Flags that the kernel has already acted on, or that the backing open must not see.
# O_APPEND among them: the kernel gives every write its offset (for an O_APPEND open, the
# end of the file as it knows it), and writes mapped pages back through any handle open
# for writing; a backing descriptor opened O_APPEND would move all of those to its end.
_STRIP_OPEN_FLAGS = os.O_CREAT | os.O_EXCL | os.O_NOCTTY | os.O_NOFOLLOW | os.O_DIRECT | os.O_APPEND


class Opener:
    """Opens backing files for the kernel's opens, and records each in the handle table."""

    def __init__(
        self,
        inodes: InodeTable,
        handles: Handles,
        space: SpaceAccount,
        writing: Writing,
        hooks: Hooks,
        writes_done: Callable[[], None],
    ) -> None:
        self.inodes = inodes
        self.handles = handles
        self.space = space
        self.writing = writing
        self.hooks = hooks
        self.writes_done = writes_done  # every queued write in: an O_TRUNC of a raced create comes after them
        self.counters = {"opens": 0, "passthrough_opens": 0}

    def open(self, inode: int, flags: int, ctx: Requester, kill_privs: bool | None) -> pyfuse3.FileInfo:
        """Open ``inode`` (whose writes and restore are in, when it is opened for writing).
        ``kill_privs``: the kernel says the truncate of an ``O_TRUNC`` open drops set-id
        bits (its caller lacks CAP_FSETID); pyfuse3 does not pass it on, so there a caller
        other than root does."""
        node = self.inodes[inode]
        try:
            fd = os.open(node.proc_path, (flags & ~_STRIP_OPEN_FLAGS) | os.O_CLOEXEC)
        except PermissionError:
            if not flags & os.O_APPEND:
                raise
            # Append-only (chattr +a): tmpfs opens it for writing only with O_APPEND, which
            # then costs nothing: the kernel writes such an open at the end anyway.
            fd = os.open(node.proc_path, (flags & ~_STRIP_OPEN_FLAGS) | os.O_APPEND | os.O_CLOEXEC)
        if flags & os.O_TRUNC and (ctx.uid != 0 if kill_privs is None else kill_privs):
            drop_privs(f"/proc/self/fd/{fd}")  # as tmpfs' truncate does (the daemon truncated as root)
        return self._open_backing(inode, node, fd, flags, ctx)

    def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Requester, resumed: int | None
    ) -> tuple[pyfuse3.FileInfo, int, os.stat_result]:
        """Create ``name``, or open it if another creator made it after the kernel's lookup.

        The common case, a name still free, is an exclusive create as root and a chown of
        the new descriptor (no name is looked at twice). A name that turned out to be taken
        is opened with the caller's credentials (:func:`~tierfs.fs.caller.acting_as`), so
        tmpfs makes the checks the kernel would have made on it, once every queued write
        is in.

        ``resumed``: the request was begun at that time (ns) by a daemon that died before
        answering it; a regular file made since is taken as this request's own, and given
        to the caller if the daemon died before it could be."""
        parent = self.inodes[parent_inode]
        bflags = (flags & ~_STRIP_OPEN_FLAGS) | os.O_CLOEXEC
        mode = stat.S_IMODE(creation_mode(parent, mode, ctx))
        try:
            fd = os.open(name, bflags | os.O_CREAT | os.O_EXCL, mode, dir_fd=parent.fd)
            created = True
        except FileExistsError:
            ours: os.stat_result | None = None  # a regular file this request's first run made
            if resumed is not None:
                st = _lstat_at(parent.fd, name)
                if st is not None and stat.S_ISREG(st.st_mode) and st.st_ctime_ns >= resumed:
                    ours = st
            if ours is not None and ours.st_uid == 0 and ctx.uid != 0:  # made as root, never chowned
                fd, created = os.open(name, bflags | os.O_NOFOLLOW, dir_fd=parent.fd), True
            elif flags & os.O_EXCL and ours is None:
                raise
            else:
                self.writes_done()
                fd, created = self._open_raced(parent, name, bflags, mode, ctx), False
        try:
            if created:
                self._give_to_caller(fd, parent, ctx)
            ino, st = self.inodes.adopt(*self._path_fd(fd, parent, name))
        except OSError:
            os.close(fd)
            raise
        fi = self._open_backing(ino, self.inodes[ino], fd, flags, ctx, st)
        return fi, ino, st

    def tmpfile(
        self, parent_inode: int, mode: int, flags: int, ctx: Requester
    ) -> tuple[pyfuse3.FileInfo, int, os.stat_result]:
        """An unnamed file in ``parent_inode`` (``O_TMPFILE``), the caller's as a create's is.

        Always linkable on the backing side: whether the caller may give it a name
        (``O_EXCL`` forbids it) is the kernel's to enforce on its own inode."""
        parent = self.inodes[parent_inode]
        mode = stat.S_IMODE(creation_mode(parent, mode, ctx))
        fd = os.open(".", (flags & ~_STRIP_OPEN_FLAGS) | os.O_TMPFILE | os.O_CLOEXEC, mode, dir_fd=parent.fd)
        try:
            self._give_to_caller(fd, parent, ctx)
            ino, st = self.inodes.adopt(os.open(f"/proc/self/fd/{fd}", O_PATH_FLAGS & ~os.O_NOFOLLOW))
        except OSError:
            os.close(fd)
            raise
        node = self.inodes[ino]
        node.orphaned = True  # its space goes at its last close, unless it is linked meanwhile
        return self._open_backing(ino, node, fd, flags, ctx, st), ino, st

    def adopt(self, h: recovery.Handle) -> None:
        """Take on a handle a dead predecessor opened (reopened at its own descriptor number)."""
        if h.is_dir:
            self.handles.add_dir(h.fh)
            return
        self._opened(h.ino, self.inodes[h.ino], h.fh, h.flags)
        if h.kind & recovery.PASSTHROUGH:
            assert self.hooks.backing is not None  # set from the same record's INIT (KernelSession.take_over)
            self.hooks.backing.adopt(h.ino, h.fh, h.backing_id)
            if h.flags & os.O_ACCMODE != os.O_RDONLY:
                self.writing.watch(h.fh, os.fstat(h.fh))
                self.handles.passthrough_writers.add(h.fh)
        if h.kind & recovery.KILL_PRIVS:
            self.handles.kill_privs.add(h.fh)
        if h.kind & recovery.DIRECT:
            self.handles.direct.add(h.fh)

    def frees_space(self, fh: int) -> bool:
        """Whether releasing ``fh`` gives space back: the last open of an unlinked file.
        tmpfs frees it at close, so the kernel session does such a release at once."""
        node = self.inodes.get(self.handles.files.get(fh, -1))
        return node is not None and node.orphaned and node.opens == 1

    def release(self, fh: int) -> None:
        """Let go of ``fh`` (its writes released): the descriptor, the backing file, and the
        inode's count of opens, whose last frees an orphaned file's space."""
        ino = self.handles.remove_file(fh)
        if self.hooks.backing is not None:
            self.hooks.backing.detach(fh)
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

    def _open_raced(self, parent: Inode, name: bytes, bflags: int, mode: int, ctx: Requester) -> int:
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
            st = None if isinstance(e, Caller) else _lstat_at(parent.fd, name)
            if st is not None and not stat.S_ISREG(st.st_mode):
                raise pyfuse3.FUSEError(errno.ESTALE) from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise pyfuse3.FUSEError(errno.ESTALE)
        return fd

    def _give_to_caller(self, fd: int, parent: Inode, ctx: Requester) -> None:
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

    def _passes_through(self, ino: int, node: Inode, fd: int, privileged: bool) -> int | None:
        """Whether the kernel may serve this open from the backing file itself: the backing
        id it does so with, or None.

        Not a file with set-id bits (``privileged``): a write by anyone but root drops them,
        and only the daemon sees the writes it serves. Unless the inode is passed through
        already: the kernel then fails (EIO) any open of it that is not."""
        backing = self.hooks.backing
        if backing is None or backing.failed is not None or node.kind != stat.S_IFREG:
            return None
        if self.hooks.pending(ino):
            return None  # its reads must wait for chunks
        if node.opens - 1 > backing.opens(ino):
            return None  # an earlier open is served by the daemon: the kernel allows no mix
        if privileged and not backing.opens(ino):
            return None
        return backing.attach(ino, fd)

    def _open_backing(
        self, ino: int, node: Inode, fd: int, flags: int, ctx: Requester, st: os.stat_result | None = None
    ) -> pyfuse3.FileInfo:
        """Register an open backing descriptor and choose how the kernel reads and writes it.

        Passthrough when the engine and the file allow it. Otherwise, through the daemon:
        write-only opens use direct I/O (no copy into the page cache, 1 MiB requests);
        read-only opens keep the page cache between opens unless the file changed since;
        read-write opens use the page cache (so shared mmap works), dropping stale pages.
        Under a passthrough engine every daemon open is direct I/O, since the kernel refuses
        passthrough for an inode it caches. ``st``: the file's status, if taken since the open.
        """
        self.counters["opens"] += 1
        fi = pyfuse3.FileInfo(fh=fd)
        accmode = flags & os.O_ACCMODE
        if flags & os.O_TRUNC:
            node.cache_valid = False
            st = st or os.fstat(fd)
            self.space.update(st)
        privileged = has_privs((st or os.fstat(fd)).st_mode)
        drops_privs = accmode != os.O_RDONLY and ctx.uid != 0 and privileged
        if accmode != os.O_RDONLY and ctx.uid != 0:
            self.handles.unprivileged_writers.add(fd)
        self._opened(ino, node, fd, flags)
        backing_id = self._passes_through(ino, node, fd, privileged)
        if backing_id is not None:
            if drops_privs:  # made set-id while passed through: dropped at the open, not the first write
                drop_privs(f"/proc/self/fd/{fd}")
            self.counters["passthrough_opens"] += 1
            if accmode != os.O_RDONLY:
                self.writing.watch(fd, st or os.fstat(fd))
                self.handles.passthrough_writers.add(fd)
            self.handles.recorded(fd, ino, flags, recovery.FILE | recovery.PASSTHROUGH, backing_id)
            return fi
        bits = 0
        if drops_privs:
            # A write by anyone but root drops set-id bits; the kernel does it only for
            # page-cache writes, so direct writes do it here, as tmpfs would.
            self.handles.kill_privs.add(fd)
            bits |= recovery.KILL_PRIVS
        if accmode == os.O_WRONLY or flags & os.O_DIRECT or self.hooks.backing is not None:
            fi.direct_io = True
            self.handles.direct.add(fd)
            bits |= recovery.DIRECT
        else:
            fi.keep_cache = node.cache_valid
            node.cache_valid = True
        if self.handles.record is not None:
            self.handles.recorded(fd, ino, flags, recovery.FILE | bits)
        return fi

    def _opened(self, ino: int, node: Inode, fd: int, flags: int) -> None:
        node.opens += 1
        node.open_fd = fd
        self.handles.files[fd] = ino
        if flags & os.O_ACCMODE != os.O_RDONLY:
            self.handles.writable.add(fd)


def _lstat_at(dirfd: int, name: bytes) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
