"""The namespace: looking names up, making and removing them, renaming, and listing directories.

Kept apart from the file handlers because names follow rules of their own: a new name is
made with the caller's credentials (so tmpfs gives it its owner and group, and checks
sticky directories and ``protected_hardlinks`` as for the caller), a removed or replaced
name may free the space of its file, and a rename may commit a checkpoint step.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable

import pyfuse3

from tierfs.core import linux
from tierfs.fs import recovery
from tierfs.fs.caller import acting_as
from tierfs.fs.inodes import Inode
from tierfs.fs.messages import DirBuffer, Requester
from tierfs.fs.volume import Volume, errors_to_fuse


def _readdir_reply(
    token: DirBuffer | pyfuse3.ReaddirToken, name: bytes, attrs: pyfuse3.EntryAttributes, next_id: int
) -> bool:
    if isinstance(token, DirBuffer):
        return token.add(name, attrs, next_id)
    return pyfuse3.readdir_reply(token, name, attrs, next_id)


class Names(Volume):
    """Handlers of names and directories."""

    def lookup_sync(self, parent_inode: int, name: bytes, ctx: Requester | None = None) -> tuple[int, os.stat_result]:
        return self.inodes.lookup(self.inodes[parent_inode].fd, name)

    def forget_sync(self, inode_list: Iterable[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            self.inodes.forget(ino, n)

    def _new_entry(self, parent: Inode, name: bytes) -> pyfuse3.EntryAttributes:
        """Adopt a name just created in ``parent`` (already the caller's)."""
        return self._attrs(*self.inodes.lookup(parent.fd, name))

    @errors_to_fuse
    async def readlink(self, inode: int, ctx: Requester) -> bytes:
        return os.readlink(b"", dir_fd=self.inodes[inode].fd)

    @errors_to_fuse
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Requester
    ) -> pyfuse3.EntryAttributes:
        parent = self.inodes[parent_inode]
        mode = self._creation_mode(parent, mode, ctx)
        with acting_as(ctx):
            os.mknod(name, mode, rdev, dir_fd=parent.fd)
        return self._new_entry(parent, name)

    @errors_to_fuse
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Requester) -> pyfuse3.EntryAttributes:
        parent = self.inodes[parent_inode]
        mode = self._creation_mode(parent, mode, ctx)
        with acting_as(ctx):
            os.mkdir(name, stat.S_IMODE(mode), dir_fd=parent.fd)
        return self._new_entry(parent, name)

    @errors_to_fuse
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Requester) -> pyfuse3.EntryAttributes:
        parent = self.inodes[parent_inode]
        with acting_as(ctx):
            os.symlink(target, name, dir_fd=parent.fd)
        return self._new_entry(parent, name)

    @errors_to_fuse
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Requester) -> pyfuse3.EntryAttributes:
        node, parent = self.inodes[inode], self.inodes[new_parent_inode]
        with acting_as(ctx):  # protected_hardlinks is the caller's to pass
            os.link(node.proc_path, new_name, dst_dir_fd=parent.fd, follow_symlinks=True)
        node.orphaned = False  # an O_TMPFILE file given a name
        return self._new_entry(parent, new_name)

    @errors_to_fuse
    async def unlink(self, parent_inode: int, name: bytes, ctx: Requester) -> None:
        parent = self.inodes[parent_inode]
        st = os.stat(name, dir_fd=parent.fd, follow_symlinks=False)
        os.unlink(name, dir_fd=parent.fd)
        self.link_removed(st)

    @errors_to_fuse
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Requester) -> None:
        os.rmdir(name, dir_fd=self.inodes[parent_inode].fd)

    @errors_to_fuse
    async def rename(
        self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes, flags: int, ctx: Requester
    ) -> None:
        self.writes_done()  # a rename may commit a step: its bytes must all be there
        old, new = self.inodes[parent_inode_old], self.inodes[parent_inode_new]
        replaced = None
        if not flags & (linux.RENAME_NOREPLACE | linux.RENAME_EXCHANGE):
            replaced = self._lstat_at(new.fd, name_new)
        if flags & linux.RENAME_WHITEOUT:  # the whiteout left behind is the caller's, as on tmpfs
            with acting_as(ctx):
                linux.renameat2(old.fd, name_old, new.fd, name_new, flags)
        elif flags:
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

    # -- directories -----------------------------------------------------------------

    @errors_to_fuse
    async def opendir(self, inode: int, ctx: Requester) -> int:
        fd = os.open(self.inodes[inode].proc_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._dirs[fd] = None
        if self.record is not None:
            self.recorded(self.record, fd, inode, os.O_RDONLY | os.O_DIRECTORY, recovery.DIRECTORY)
        return fd

    @errors_to_fuse
    async def readdir(self, fh: int, start_id: int, token: DirBuffer | pyfuse3.ReaddirToken) -> None:
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
                self.inodes.forget(ino, 1, undo=True)
                break

    @errors_to_fuse
    async def releasedir(self, fh: int) -> None:
        if self._dirs.pop(fh, False) is False:
            return  # sent again, done before a predecessor died
        if self.record is not None:
            self.record.closed(fh)
        os.close(fh)

    @errors_to_fuse
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        os.fsync(fh)
