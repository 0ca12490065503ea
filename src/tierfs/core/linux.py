"""Linux system calls the standard library does not expose (through libc via ctypes)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os

# The interpreter's own symbols, libc's among them: ctypes.util.find_library would run
# ldconfig in a subprocess at every command's start for the same answer.
_libc = ctypes.CDLL(None, use_errno=True)

AT_FDCWD = -100
AT_SYMLINK_NOFOLLOW = 0x100
AT_EMPTY_PATH = 0x1000
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
RENAME_WHITEOUT = 4
UTIME_NOW = (1 << 30) - 1
UTIME_OMIT = (1 << 30) - 2
MNT_DETACH = 2


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _check(ret: int, *names: object) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), *names[:1])
    return ret


def renameat2(olddirfd: int, old: bytes, newdirfd: int, new: bytes, flags: int = 0) -> None:
    _check(_libc.renameat2(olddirfd, old, newdirfd, new, ctypes.c_uint(flags)), old)


FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """``fallocate(2)`` with its flags (``os.posix_fallocate`` knows only mode 0)."""
    _check(_libc.fallocate(fd, mode, offset, length))


# Inode flags (``lsattr``/``chattr``), by ioctl on an open descriptor.
FS_IOC_GETFLAGS = 0x80086601
FS_IOC_SETFLAGS = 0x40086602
FS_IOC_FSGETXATTR = 0x801C581F
FS_IOC_FSSETXATTR = 0x401C5820
FS_IMMUTABLE_FL = 0x10
FS_APPEND_FL = 0x20
FS_XFLAG_IMMUTABLE = 0x8
FS_XFLAG_APPEND = 0x10


def get_flags(fd: int) -> int:
    buf = bytearray(8)
    fcntl.ioctl(fd, FS_IOC_GETFLAGS, buf)
    return int.from_bytes(buf[:4], "little")


def set_flags(fd: int, flags: int) -> None:
    fcntl.ioctl(fd, FS_IOC_SETFLAGS, bytearray(flags.to_bytes(8, "little")))


STATX_BTIME = 0x800
_STATX_SIZE = 256


def birth_time(fd: int) -> int | None:
    """The birth time (ns) of the file an ``O_PATH`` descriptor refers to, if its file system keeps one."""
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    _check(_libc.statx(fd, b"", AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW, STATX_BTIME, buf))
    if not int.from_bytes(buf.raw[:4], "little") & STATX_BTIME:
        return None
    sec, nsec = int.from_bytes(buf.raw[80:88], "little", signed=True), int.from_bytes(buf.raw[88:92], "little")
    return sec * 1_000_000_000 + nsec


NOW = object()  # a time of utimens_fd: the current one, set as "now" (UTIME_NOW), not as a chosen time


def utimens_fd(fd: int, atime_ns: int | object | None, mtime_ns: int | object | None) -> None:
    """Set times on the file an ``O_PATH`` descriptor refers to (symlinks included); None keeps a time."""

    def ts(ns: int | object | None) -> _Timespec:
        if ns is None or ns is NOW:
            return _Timespec(0, UTIME_OMIT if ns is None else UTIME_NOW)
        if not isinstance(ns, int):  # what ctypes would refuse below anyway
            raise TypeError(f"a time in ns, None or NOW, not {ns!r}")
        return _Timespec(*divmod(ns, 1_000_000_000))

    times = (_Timespec * 2)(ts(atime_ns), ts(mtime_ns))
    _check(_libc.utimensat(fd, b"", times, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW))


def chown_fd(fd: int, uid: int, gid: int) -> None:
    """``fchownat(fd, "", ...)``: works on ``O_PATH`` descriptors, symlinks included."""
    _check(_libc.fchownat(fd, b"", uid, gid, AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW))


CLONE_NEWCGROUP = 0x02000000


def setns(fd: int, nstype: int) -> None:
    """``setns(2)``: join the namespace ``fd`` refers to (``os.setns`` from Python 3.12)."""
    _check(_libc.setns(fd, nstype))


MAX_HANDLE_SZ = 128


class _FileHandle(ctypes.Structure):
    _fields_ = [
        ("handle_bytes", ctypes.c_uint),
        ("handle_type", ctypes.c_int),
        ("f_handle", ctypes.c_ubyte * MAX_HANDLE_SZ),
    ]


_handle_out = _FileHandle()  # name_to_handle's, reused: it runs for every inode the kernel is given
_mount_id_out = ctypes.c_int()
_handle_out_ref, _mount_id_ref = ctypes.byref(_handle_out), ctypes.byref(_mount_id_out)
_handle_out_bytes = (ctypes.c_char * ctypes.sizeof(_FileHandle)).from_buffer(_handle_out)


def name_to_handle(fd: int) -> bytes:
    """A handle that reopens the inode ``fd`` refers to, whatever its names become
    (``name_to_handle_at(fd, "", AT_EMPTY_PATH)``): its type (4 bytes) and the handle.
    Not thread-safe: the daemon's handlers call it from the trio thread only."""
    _handle_out.handle_bytes = MAX_HANDLE_SZ
    _check(_libc.name_to_handle_at(fd, b"", _handle_out_ref, _mount_id_ref, AT_EMPTY_PATH))
    return _handle_out_bytes.raw[4 : 8 + _handle_out.handle_bytes]


def open_by_handle(mount_fd: int, handle: bytes, flags: int) -> int:
    """``open_by_handle_at``: the inode of a handle from :func:`name_to_handle` on the file
    system of ``mount_fd`` (needs CAP_DAC_READ_SEARCH); ESTALE once the inode is gone."""
    body = handle[4:]
    if len(body) > MAX_HANDLE_SZ:
        raise OSError(22, "file handle too long")
    h = _FileHandle(len(body), int.from_bytes(handle[:4], "little", signed=True))
    ctypes.memmove(h.f_handle, body, len(body))
    return _check(_libc.open_by_handle_at(mount_fd, ctypes.byref(h), flags))


def umount(path: str, flags: int = 0) -> None:
    _check(_libc.umount2(os.fsencode(path), flags), path)


MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096


def bind_mount(source: str, target: str, read_only: bool = False) -> None:
    """Bind ``source`` onto ``target`` as ``nosuid,nodev`` (and ``ro`` if asked), as pods get it.

    The volume's files are created by pods: without ``nosuid`` a setuid binary one pod
    writes runs with its owner's rights in another pod, without ``nodev`` a device node
    opens the host's device. ``noexec`` is not added (a pod may run what it wrote anyway,
    from its own writable layers) but is kept when ``source`` has it.

    A bind ignores flags (``mount(2)``), so a second call sets them: ``MS_REMOUNT|MS_BIND``
    replaces the mount's flags whole, hence every flag is given again, including those the
    kernel locks from the source in a user namespace (``ro``, ``noexec``). If that call
    fails the bind is undone: the target is never left with weaker flags.
    """
    flags = MS_NOSUID | MS_NODEV
    source_flags = os.statvfs(source).f_flag
    if read_only or source_flags & os.ST_RDONLY:
        flags |= MS_RDONLY
    if source_flags & os.ST_NOEXEC:
        flags |= MS_NOEXEC
    _check(_libc.mount(os.fsencode(source), os.fsencode(target), None, MS_BIND, None), target)
    try:
        _check(_libc.mount(None, os.fsencode(target), None, MS_REMOUNT | MS_BIND | flags, None), target)
    except OSError:
        umount(target, MNT_DETACH)
        raise


TMPFS_MAGIC = 0x01021994


def fs_magic(path: str | os.PathLike[str]) -> int:
    """``statfs(2).f_type`` of the filesystem holding ``path``."""
    buf = ctypes.create_string_buffer(128)  # struct statfs; f_type is its first long
    _check(_libc.statfs(os.fsencode(path), buf), path)
    return int.from_bytes(buf.raw[: ctypes.sizeof(ctypes.c_long)], "little")


M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def keep_heap_memory(threshold: int = 16 << 20, trim: int = 1 << 30) -> None:
    """Make malloc reuse freed request buffers instead of handing them back to the kernel.

    A FUSE write the daemon copies (pyfuse3's, or one not spliced) arrives as a fresh
    1 MiB bytes object. With glibc's defaults such blocks are often mmap()ed or trimmed on
    free, so each request faults in new zeroed pages; on a VM whose balloon reclaims idle
    memory that costs 3-4x the copy itself.
    """
    _libc.mallopt(M_MMAP_THRESHOLD, threshold)
    _libc.mallopt(M_TRIM_THRESHOLD, trim)


def mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    _check(
        _libc.mount(os.fsencode(source), os.fsencode(target), fstype.encode(), ctypes.c_ulong(flags), data.encode()),
        target,
    )


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """All of ``data`` at ``offset``: ``pwrite`` may write less than asked (a signal, a pipe)."""
    with memoryview(data) as view:
        while view:
            n = os.pwrite(fd, view, offset)
            view, offset = view[n:], offset + n


FLAG_IOCTLS = {FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IOC_FSGETXATTR, FS_IOC_FSSETXATTR}  # lsattr's and chattr's
# The setters, and the flags among theirs that freeze an inode (the first word of each argument).
FLAG_SETTERS = {
    FS_IOC_SETFLAGS: FS_IMMUTABLE_FL | FS_APPEND_FL,
    FS_IOC_FSSETXATTR: FS_XFLAG_IMMUTABLE | FS_XFLAG_APPEND,
}


def freezes(cmd: int, arg: bytes) -> bool:
    """Whether the inode-flag setter ``cmd`` with ``arg`` makes an inode immutable or append-only."""
    return bool(int.from_bytes(arg[:4], "little") & FLAG_SETTERS.get(cmd, 0))


def seek_all_data(size: int, offset: int, whence: int) -> int:
    """``SEEK_DATA``/``SEEK_HOLE`` in a file of ``size`` bytes taken as data throughout: the
    kernel's answer for a file system without holes."""
    if offset < 0 or whence not in (os.SEEK_DATA, os.SEEK_HOLE):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
    if offset >= size:
        raise OSError(errno.ENXIO, os.strerror(errno.ENXIO))
    return offset if whence == os.SEEK_DATA else size
