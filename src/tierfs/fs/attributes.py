"""Attributes of files and of the volume, and extended attributes.

Apart from the names and the data path because what the kernel checks permissions against
is decided here: the backing file's mode, owner and times, and its POSIX ACLs, which are
only stored where the kernel enforces them. The volume's size is the space account's, not
the backing tmpfs', when ``--capacity`` bounds it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from typing import TYPE_CHECKING

import pyfuse3

from tierfs.core import linux
from tierfs.fs.caller import acting_as, sys_admin
from tierfs.fs.volume import ACL_NAMES, Volume, drop_privs, errors_to_fuse, has_privs
from tierfs.ramtier.space import PAGE

if TYPE_CHECKING:
    from tierfs.fs.messages import Requester, SetattrFields

_FLAG_IOCTLS = {linux.FS_IOC_GETFLAGS, linux.FS_IOC_SETFLAGS, linux.FS_IOC_FSGETXATTR, linux.FS_IOC_FSSETXATTR}
# The setters, and the flags among theirs that freeze an inode (the first word of each argument).
_FLAG_SETTERS = {
    linux.FS_IOC_SETFLAGS: linux.FS_IMMUTABLE_FL | linux.FS_APPEND_FL,
    linux.FS_IOC_FSSETXATTR: linux.FS_XFLAG_IMMUTABLE | linux.FS_XFLAG_APPEND,
}


class Attributes(Volume):
    """Handlers of attributes, the volume's statistics and extended attributes."""

    def getattr_sync(self, inode: int, ctx: Requester | None = None) -> tuple[int, os.stat_result]:
        return inode, os.fstat(self.inodes[inode].fd)

    def birth_time(self, inode: int) -> int | None:
        return linux.birth_time(self.inodes[inode].fd)

    @errors_to_fuse
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields | SetattrFields,
        fh: int | None,
        ctx: Requester,
    ) -> pyfuse3.EntryAttributes:
        await self._settle(inode)
        self.writes_done(inode)
        node = self.inodes[inode]
        self._detach(node)
        if fields.update_mode and node.kind != stat.S_IFLNK:
            os.chmod(node.proc_path, stat.S_IMODE(attr.st_mode))
            if has_privs(attr.st_mode):
                self.privileged(inode)
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
                drop_privs(node.proc_path)
            node.cache_valid = False
            self.space.update(os.fstat(node.fd))
        if fields.update_atime or fields.update_mtime:
            # "now" stays "now" (UTIME_NOW), which tmpfs allows on an append-only file; pyfuse3
            # passes only the time
            atime = linux.NOW if getattr(fields, "atime_now", False) else attr.st_atime_ns
            mtime = linux.NOW if getattr(fields, "mtime_now", False) else attr.st_mtime_ns
            linux.utimens_fd(node.fd, atime if fields.update_atime else None, mtime if fields.update_mtime else None)
        return self._attrs(inode, os.fstat(node.fd))

    @errors_to_fuse
    async def statfs(self, ctx: Requester) -> pyfuse3.StatvfsData:
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

    # -- extended attributes: tmpfs' own, on the backing inode ---------------------------
    # The kernel checks the caller first (namespaces, permissions, sizes), as for tmpfs;
    # /proc/self/fd/N of an O_PATH descriptor reaches the inode itself, a symlink included.

    def _acl_name(self, name: bytes) -> bool:
        """Whether ``name`` is a POSIX ACL; refused (EOPNOTSUPP, as by a file system without
        ACLs) unless the kernel enforces them on this mount: stored but not enforced, an
        ACL would only turn its mask into group bits."""
        if name not in ACL_NAMES:
            return False
        if not self.acl:
            raise pyfuse3.FUSEError(errno.EOPNOTSUPP)
        return True

    @errors_to_fuse
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Requester, flags: int = 0) -> None:
        """``flags``: XATTR_CREATE and XATTR_REPLACE, which pyfuse3 checks itself and does not pass."""
        path = self.inodes[inode].proc_path
        if self._acl_name(name):
            with acting_as(ctx):  # tmpfs drops set-gid as the caller's setfacl would
                os.setxattr(path, name, value, flags)
            return
        os.setxattr(path, name, value, flags)

    def getxattr_sync(self, inode: int, name: bytes, ctx: Requester | None = None) -> bytes:
        # Asked at the first write of every new file (for security.capability): through the
        # open file when there is one, which spares the kernel a walk of /proc.
        self._acl_name(name)
        node = self.inodes[inode]
        return os.getxattr(node.open_fd if node.open_fd >= 0 else node.proc_path, name)

    @errors_to_fuse
    async def listxattr(self, inode: int, ctx: Requester) -> list[bytes]:
        """The names tmpfs would list to the caller: ``trusted.*`` only to one with
        CAP_SYS_ADMIN (the daemon, as root, sees them all)."""
        names = [os.fsencode(n) for n in os.listxattr(self.inodes[inode].proc_path)]
        hidden = () if self.acl else ACL_NAMES
        if any(n.startswith(b"trusted.") for n in names) and not sys_admin(ctx.pid):
            hidden = (*hidden, *(n for n in names if n.startswith(b"trusted.")))
        return [n for n in names if n not in hidden]

    @errors_to_fuse
    async def removexattr(self, inode: int, name: bytes, ctx: Requester) -> None:
        path = self.inodes[inode].proc_path
        if self._acl_name(name):
            with acting_as(ctx):
                os.removexattr(path, name)
            return
        os.removexattr(path, name)

    # -- inode flags (lsattr, chattr) ------------------------------------------------------

    @errors_to_fuse
    async def ioctl(self, inode: int, fh: int, cmd: int, data: bytes, out_size: int) -> bytes:
        """Inode flags, on the backing file as tmpfs keeps them; no other ioctl is a file
        system's (ENOTTY, as tmpfs answers). The kernel already checked the caller: owner
        or CAP_FOWNER to change flags, CAP_LINUX_IMMUTABLE to change append-only or immutable.

        Before a file becomes immutable or append-only, its queued writes go in, and a
        committed file is detached from its snapshots: tmpfs would refuse to unlink the
        snapshot's name of a frozen inode when the step is dropped."""
        if cmd not in _FLAG_IOCTLS:
            raise pyfuse3.FUSEError(errno.ENOTTY)
        if cmd in _FLAG_SETTERS:
            await self._settle(inode)
            self.writes_done(inode)
            word = int.from_bytes(data[:4], "little")
            if word & _FLAG_SETTERS[cmd]:
                self._detach(self.inodes[inode])
        buf = bytearray(data.ljust(max(out_size, 8), b"\0"))
        fcntl.ioctl(fh, cmd, buf)
        return bytes(buf[:out_size])
