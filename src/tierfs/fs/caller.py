"""The credentials of the FUSE request's caller: file-system calls made with them, and the
rules of set-id bits, umask and default ACLs that the daemon, as root, applies on its behalf.

The daemon runs as root, and root passes every permission check tmpfs makes. A name the
kernel looked up as missing may exist by the time the daemon creates it: the kernel's
directory lock keeps other callers of this mount out of that window, but not a restore,
the daemon's own work or a second mount of the tree. Opening or chowning what is found
there as root would hand the caller a file it may not open, or give it someone else's.
So the calls that create a name, or open one that turned out to exist, are made with the
caller's fsuid, fsgid and supplementary groups: tmpfs itself then checks them (modes,
ACLs, sticky directories, ``protected_regular``) and gives the new object its owner and
group atomically, as it would for the caller directly.

fsuid, fsgid and the supplementary groups are per-thread credentials in Linux, but glibc's
``setgroups`` (and ``os.setgroups``) changes every thread of the process; so the raw
system calls are used, on the calling thread only, and root's credentials are restored
before anything else runs on it (the handlers calling :func:`acting_as` never await
inside it). Changing the fsuid away from 0 also drops the file-system capabilities
(``CAP_DAC_OVERRIDE``, ``CAP_FOWNER``, ``CAP_FSETID``...) of this thread until it is set
back, which is exactly what the check needs.

The request names the caller's fsuid, fsgid and thread id, not its supplementary groups:
those are read from ``/proc/<tid>/status``, and used only if that thread still has the
fsuid and fsgid of the request. A caller the daemon cannot see (pid 0: another pid
namespace) acts with no supplementary groups, the smaller set of rights.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from tierfs.core import linux
from tierfs.core.linux import _libc

if TYPE_CHECKING:
    from tierfs.fs.inodes import Inode
    from tierfs.fs.messages import Requester

log = logging.getLogger(__name__)

# (setgroups, setfsuid, setfsgid) system call numbers
_SYSCALLS = {"x86_64": (116, 122, 123), "aarch64": (159, 151, 152)}
SYS_SETGROUPS, SYS_SETFSUID, SYS_SETFSGID = _SYSCALLS.get(platform.machine(), (116, 122, 123))
NGROUPS_MAX = 65536
STATUS_MAX = 1 << 20  # /proc/<pid>/status with NGROUPS_MAX groups of 10 digits stays below
_GidArray = ctypes.c_uint * NGROUPS_MAX
_CAP_SYS_ADMIN = 21
ACL_ACCESS, ACL_DEFAULT = b"system.posix_acl_access", b"system.posix_acl_default"
ACL_NAMES = (ACL_ACCESS, ACL_DEFAULT)


class Caller(OSError):
    """The caller's credentials cannot be taken on (it exited, or changed them meanwhile)."""


def _status(pid: int) -> dict[bytes, list[bytes]]:
    """The fields of ``/proc/<pid>/status``, read without following a link and at most
    :data:`STATUS_MAX` bytes; a thread that is gone raises ``ESRCH``."""
    try:
        fd = os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):
        raise Caller(errno.ESRCH, f"the caller (pid {pid}) has exited") from None
    try:
        text = b""
        while len(text) < STATUS_MAX and (chunk := os.read(fd, STATUS_MAX - len(text))):
            text += chunk
    except ProcessLookupError:
        raise Caller(errno.ESRCH, f"the caller (pid {pid}) has exited") from None
    finally:
        os.close(fd)
    fields = {}
    for line in text.split(b"\n"):
        key, _, value = line.partition(b":")
        fields[key] = value.split()
    return fields


def sys_admin(pid: int) -> bool:
    """Whether thread ``pid`` has CAP_SYS_ADMIN in the daemon's user namespace, which is
    what tmpfs asks before it lists ``trusted.*`` names. One the daemon cannot see has not."""
    if pid <= 0:
        return False
    try:
        caps = int(_status(pid).get(b"CapEff", [b"0"])[0], 16)
        same_userns = os.stat(f"/proc/{pid}/ns/user").st_ino == os.stat("/proc/self/ns/user").st_ino
    except (OSError, ValueError):
        return False
    return same_userns and bool(caps & (1 << _CAP_SYS_ADMIN))


def supplementary_groups(pid: int, uid: int, gid: int) -> list[int]:
    """The supplementary groups of thread ``pid``, which must have fsuid ``uid`` and fsgid ``gid``.

    A thread that is gone raises ``ESRCH``, one whose credentials are not the request's ``EACCES``.
    """
    if pid <= 0:
        return []
    fields = _status(pid)
    try:
        fsuid, fsgid = int(fields[b"Uid"][3]), int(fields[b"Gid"][3])
        groups = [int(g) for g in fields[b"Groups"][:NGROUPS_MAX]]
    except (KeyError, IndexError, ValueError):
        raise Caller(errno.EACCES, f"cannot read the groups of the caller (pid {pid})") from None
    if (fsuid, fsgid) != (uid, gid):
        raise Caller(errno.EACCES, f"the caller (pid {pid}) changed its credentials meanwhile")
    return groups


def _syscall(number: int, *args: object) -> int:
    result: int = _libc.syscall(ctypes.c_long(number), *args)  # syscall(2) returns a C int (ctypes' default restype)
    return result


def _set_groups(groups: list[int]) -> None:
    array = _GidArray(*groups) if groups else None
    if _syscall(SYS_SETGROUPS, ctypes.c_size_t(len(groups)), array) < 0:
        err = ctypes.get_errno()
        raise Caller(err, f"cannot take on the caller's groups: {os.strerror(err)}")


def _set_fs_ids(uid: int, gid: int) -> None:
    """setfsgid then setfsuid; neither reports failure, so each is asked back (-1 changes nothing)."""
    _syscall(SYS_SETFSGID, ctypes.c_uint(gid))
    _syscall(SYS_SETFSUID, ctypes.c_uint(uid))
    if (
        _syscall(SYS_SETFSUID, ctypes.c_uint(0xFFFFFFFF)) != uid
        or _syscall(SYS_SETFSGID, ctypes.c_uint(0xFFFFFFFF)) != gid
    ):
        raise Caller(errno.EPERM, "cannot take on the caller's fsuid and fsgid (the daemon is not root)")


_OWN = (os.geteuid(), os.getegid(), os.getgroups())


def _restore() -> None:
    uid, gid, groups = _OWN
    try:
        _set_fs_ids(uid, gid)
        _set_groups(groups)
    except OSError as e:  # this thread would go on serving with the caller's rights
        log.critical("could not take back the daemon's own credentials (%s): stopping", e)
        os._exit(70)


@contextmanager
def acting_as(ctx: Requester) -> Iterator[None]:
    """File-system calls inside are made as ``ctx.uid``/``ctx.gid`` (and the groups of
    ``ctx.pid``) on this thread, which must not run anything else until it ends."""
    groups = supplementary_groups(ctx.pid, ctx.uid, ctx.gid) if ctx.uid != 0 else _OWN[2]
    try:
        _set_groups(groups)
        _set_fs_ids(ctx.uid, ctx.gid)
        yield
    finally:
        _restore()


def creation_mode(parent: Inode, mode: int, ctx: Requester) -> int:
    """``mode`` as the caller's umask leaves it, unless ``parent`` has a default ACL, which
    then decides instead (tmpfs applies it; the daemon's own umask is 0).

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
