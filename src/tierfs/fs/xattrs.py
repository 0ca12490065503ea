"""Extended attributes: tmpfs' own, on the backing inode.

The kernel checks the caller first (namespaces, permissions, sizes), as for tmpfs;
``/proc/self/fd/N`` of an ``O_PATH`` descriptor reaches the inode itself, a symlink
included. POSIX ACLs are stored only where the kernel enforces them on this mount
(``hooks.acl``): stored but not enforced, an ACL would only turn its mask into group bits.
"""

from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING

from tierfs.fs.caller import ACL_NAMES, acting_as, sys_admin

if TYPE_CHECKING:
    from tierfs.fs.hooks import Hooks
    from tierfs.fs.inodes import InodeTable
    from tierfs.fs.messages import Requester


class Xattrs:
    """The extended attributes of the inodes in ``inodes``."""

    def __init__(self, inodes: InodeTable, hooks: Hooks) -> None:
        self.inodes = inodes
        self.hooks = hooks

    def set(self, inode: int, name: bytes, value: bytes, ctx: Requester, flags: int) -> None:
        path = self.inodes[inode].proc_path
        if self._acl_name(name):
            with acting_as(ctx):  # tmpfs drops set-gid as the caller's setfacl would
                os.setxattr(path, name, value, flags)
            return
        os.setxattr(path, name, value, flags)

    def get(self, inode: int, name: bytes) -> bytes:
        # Asked at the first write of every new file (for security.capability): through the
        # open file when there is one, which spares the kernel a walk of /proc.
        self._acl_name(name)
        node = self.inodes[inode]
        return os.getxattr(node.open_fd if node.open_fd >= 0 else node.proc_path, name)

    def list(self, inode: int, ctx: Requester) -> list[bytes]:
        """The names tmpfs would list to the caller: ``trusted.*`` only to one with
        CAP_SYS_ADMIN (the daemon, as root, sees them all)."""
        names = [os.fsencode(n) for n in os.listxattr(self.inodes[inode].proc_path)]
        hidden = () if self.hooks.acl else ACL_NAMES
        if any(n.startswith(b"trusted.") for n in names) and not sys_admin(ctx.pid):
            hidden = (*hidden, *(n for n in names if n.startswith(b"trusted.")))
        return [n for n in names if n not in hidden]

    def remove(self, inode: int, name: bytes, ctx: Requester) -> None:
        path = self.inodes[inode].proc_path
        if self._acl_name(name):
            with acting_as(ctx):
                os.removexattr(path, name)
            return
        os.removexattr(path, name)

    def _acl_name(self, name: bytes) -> bool:
        """Whether ``name`` is a POSIX ACL; refused (EOPNOTSUPP, as by a file system without
        ACLs) unless the kernel enforces them on this mount."""
        if name not in ACL_NAMES:
            return False
        if not self.hooks.acl:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return True
