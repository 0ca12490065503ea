"""Attributes of files and of the volume, and extended attributes.

Apart from the names and the data path because what the kernel checks permissions against
is decided here: the backing file's mode, owner and times, and its POSIX ACLs, which are
only stored where the kernel enforces them. The volume's size is the space account's, not
the backing tmpfs', when ``--capacity`` bounds it.
"""

from __future__ import annotations

import errno
import os
import stat

import pyfuse3

from tierfs.core import linux
from tierfs.fs.caller import acting_as
from tierfs.fs.volume import ACL_NAMES, Volume, drop_privs, errors_to_fuse
from tierfs.ramtier.space import PAGE


class Attributes(Volume):
    """Handlers of attributes, the volume's statistics and extended attributes."""

    def getattr_sync(self, inode: int, ctx=None) -> tuple[int, os.stat_result]:
        return inode, os.fstat(self.inodes[inode].fd)

    @errors_to_fuse
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
                drop_privs(node.proc_path)
            node.cache_valid = False
            self.space.update(os.fstat(node.fd))
        if fields.update_atime or fields.update_mtime:
            linux.utimens_fd(
                node.fd,
                attr.st_atime_ns if fields.update_atime else None,
                attr.st_mtime_ns if fields.update_mtime else None,
            )
        return self._attrs(inode, os.fstat(node.fd))

    @errors_to_fuse
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

    @errors_to_fuse
    async def setxattr(self, inode, name, value, ctx):
        path = self._xattr_path(inode, errno.EPERM)
        if self._acl_name(name):
            with acting_as(ctx):  # tmpfs drops set-gid as the caller's setfacl would
                os.setxattr(path, name, value)
            return
        os.setxattr(path, name, value)

    def getxattr_sync(self, inode: int, name: bytes, ctx=None) -> bytes:
        # Asked at the first write of every new file (for security.capability): through the
        # open file when there is one, which spares the kernel a walk of /proc.
        self._acl_name(name)
        node = self.inodes[inode]
        if node.open_fd >= 0:
            return os.getxattr(node.open_fd, name)
        return os.getxattr(self._xattr_path(inode, pyfuse3.ENOATTR), name)

    @errors_to_fuse
    async def listxattr(self, inode, ctx):
        node = self.inodes[inode]
        if node.kind == stat.S_IFLNK:
            return []
        names = [os.fsencode(n) for n in os.listxattr(node.proc_path)]
        return names if self.acl else [n for n in names if n not in ACL_NAMES]

    @errors_to_fuse
    async def removexattr(self, inode, name, ctx):
        path = self._xattr_path(inode, pyfuse3.ENOATTR)
        if self._acl_name(name):
            with acting_as(ctx):
                os.removexattr(path, name)
            return
        os.removexattr(path, name)
