"""Committed steps, frozen by hard links so the job can go on changing its files.

    <rank dir>/steps/<step>/tree/...      the step's committed paths, relative to the volume root
    <rank dir>/steps/<step>/state.json    roots, commit time, backup progress (tierfs.ramtier.steps)
    <rank dir>/steps/<step>/manifest.json the manifest built from tree/

A snapshot costs one hard link per file on tmpfs: no byte is copied when a checkpoint
commits. The job may then delete or rename committed files freely (the links keep the
bytes). Only changing a committed file's data or attributes needs a copy, and the copy is
given to the *snapshot* (``detach``), so the job's inode, its FUSE inode number and its page
cache stay what they were; readers of a snapshot recheck the path's inode after reading to
notice a detach that raced with them.

Files still open for writing when their step commits are copied instead of linked, since
a write through an earlier descriptor could otherwise land in the snapshot. Every copy
keeps the file's holes (:func:`tierfs.core.holes.copy_data`): the job sets a file's size for
free, and a copy of its holes would fill the RAM with zeros.

The committed path is the job's: it is walked from the tree's descriptor without following
symbolic links (:mod:`tierfs.ramtier.beneath`), so a link the job put in its place can
never make the daemon freeze, and later back up, files from outside the job's tree.
``steps/`` is root-only (0700): the job reaches its snapshots through the mount alone.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from tierfs.core import linux
from tierfs.core.atomic import UnsafeFile, private_dir
from tierfs.core.errors import UserError
from tierfs.core.holes import copy_data
from tierfs.core.manifest import Manifest
from tierfs.ramtier import beneath

log = logging.getLogger(__name__)


class Snapshots:
    def __init__(
        self,
        rank_path: Path,
        tree: Path,
        on_unlinked: Callable[[os.stat_result], None],
        on_copied: Callable[[os.stat_result], None] = lambda st: None,
    ):
        self.root = rank_path / "steps"
        self.tree = tree
        self._on_unlinked = on_unlinked  # a link of this inode is gone (space accounting)
        self._on_copied = on_copied  # a new inode holds a copy (space accounting)
        self._pins: dict[int, list[str]] = {}  # backing st_ino -> snapshot paths linking it
        self._serial = 0
        self.detaches = 0  # readers of a snapshot compare it before and after reading

    # -- state -------------------------------------------------------------------------

    def load(self) -> None:
        """Rebuild the pin table after a restart; remove what a crash left half-built.

        Raises UserError if ``steps/`` or a step in it is not the daemon's own: what is
        there decides what this start serves, replicates and deletes.
        """
        try:
            private_dir(self.root)
            self._pins.clear()
            for entry in os.scandir(self.root):
                if entry.name.startswith("."):
                    shutil.rmtree(entry.path, ignore_errors=True)
                elif entry.name.isdigit():
                    private_dir(Path(entry.path))
                    self._walk_pins(self.step_tree(int(entry.name)), self._pin)
        except UnsafeFile as e:
            raise UserError(f"unsafe ramdisk: {e}") from None

    def steps(self) -> list[int]:
        return sorted(int(e.name) for e in os.scandir(self.root) if e.name.isdigit())

    def step_dir(self, step: int) -> Path:
        return self.root / str(step)

    def step_tree(self, step: int) -> Path:
        return self.root / str(step) / "tree"

    def chunk_locations(self, manifest: Manifest) -> dict[str, tuple[str, int, int]]:
        """Where each distinct chunk of a committed step lives in its snapshot: (path, offset, length)."""
        snap = self.step_tree(manifest.step)
        return {h: (str(snap / path), offset, length) for h, (path, offset, length) in manifest.chunk_places().items()}

    def pins(self, ino: int) -> int:
        """How many snapshot links ``ino`` has (subtracted from the link count users see)."""
        paths = self._pins.get(ino)
        return len(paths) if paths else 0

    def pin_step(self, step: int) -> None:
        """Pin every file of a step built outside :meth:`freeze` (a restore's placeholders)."""

        def pin_once(ino: int, path: str, st: os.stat_result) -> None:
            if path not in self._pins.get(ino, ()):
                self._pin(ino, path, st)

        self._walk_pins(self.step_tree(step), pin_once)

    # -- freezing ------------------------------------------------------------------------

    def freeze(self, step: int, root: str, writing: set[int]) -> float | None:
        """Add ``root`` (a path under the tree) to ``step``'s snapshot, replacing an older copy.

        Returns when ``root`` was made (its birth time, or 0.0 where the file system keeps
        none): the job has been writing the step since. Returns None if ``root`` no longer
        exists; raises :class:`beneath.NotBeneath` if it
        is not a plain path or runs through a symbolic link. ``writing`` holds the inodes
        open for writing, which are copied rather than linked.
        """
        tree_fd = os.open(self.tree, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            with beneath.parent_of(tree_fd, root) as (parent_fd, name):
                if not _lexists(name, parent_fd):
                    return None
                born = _born(name, parent_fd)
                snap = self.step_tree(step)
                for d in (self.step_dir(step), snap):
                    if not os.path.isdir(d):
                        os.mkdir(d, 0o700)
                self._serial += 1
                staging = self.root / f".staging-{os.getpid()}-{self._serial}"
                frozen: list[tuple[int, str]] = []  # (inode, path under the root) of each file
                try:
                    self._copy_tree(parent_fd, name, staging, "", writing, frozen)
                    dst = snap / root
                    self._make_parents(tree_fd, root, snap)
                    if os.path.lexists(dst):
                        self._remove(dst)
                    os.rename(staging, dst)
                except BaseException:
                    self._remove(staging)
                    raise
        except FileNotFoundError:
            return None  # an ancestor went away
        finally:
            os.close(tree_fd)
        for ino, rel in frozen:
            self._pins.setdefault(ino, []).append(os.path.join(dst, rel) if rel else str(dst))
        return born

    def _copy_tree(
        self, dir_fd: int, name: str, dst: Path, rel: str, writing: set[int], frozen: list[tuple[int, str]]
    ) -> None:
        """Recreate ``name`` in ``dir_fd`` at ``dst``: directories copied, files linked."""
        st = os.lstat(name, dir_fd=dir_fd)
        if stat.S_ISDIR(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                st = os.fstat(fd)  # the directory held, whatever the name means meanwhile
                os.mkdir(dst, 0o700)
                with os.scandir(fd) as it:
                    for entry in it:
                        child = f"{rel}/{entry.name}" if rel else entry.name
                        self._copy_tree(fd, entry.name, dst / entry.name, child, writing, frozen)
            finally:
                os.close(fd)
            _copy_attrs(st, dst)
        elif stat.S_ISREG(st.st_mode) and st.st_ino in writing:
            self._freeze_copy(dir_fd, name, dst, rel, frozen)
        elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            try:
                os.link(name, dst, src_dir_fd=dir_fd, follow_symlinks=False)  # the entry itself, never a target
            except PermissionError:  # immutable or append-only (chattr): tmpfs gives it no second name
                if not stat.S_ISREG(st.st_mode):
                    raise
                self._freeze_copy(dir_fd, name, dst, rel, frozen)
                return
            linked = os.lstat(dst)
            if stat.S_ISREG(linked.st_mode):
                frozen.append((linked.st_ino, rel))
        # fifos, sockets and devices are not checkpoint data

    def _freeze_copy(self, dir_fd: int, name: str, dst: Path, rel: str, frozen: list[tuple[int, str]]) -> None:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            copy = self._copy_file(fd, dst)
        finally:
            os.close(fd)
        self._on_copied(copy)
        frozen.append((copy.st_ino, rel))

    def _make_parents(self, tree_fd: int, root: str, snap: Path) -> None:
        """Create the root's ancestors in the snapshot with the live tree's attributes."""
        parts = root.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            rel = "/".join(parts[:i])
            if not (snap / rel).is_dir():
                os.mkdir(snap / rel, 0o700)
                _copy_attrs(beneath.lstat(tree_fd, rel), snap / rel)

    def _copy_file(self, src_fd: int, dst: Path) -> os.stat_result:
        """Copy the open regular file ``src_fd`` to a new file ``dst`` with its attributes."""
        st = os.fstat(src_fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{dst.name} is not a regular file")
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            copy_data(src_fd, out, st.st_size)  # holes stay holes: a sparse file's copy costs what it holds
            st = os.fstat(src_fd)
        finally:
            os.close(out)
        _copy_attrs(st, dst)
        return os.lstat(dst)

    # -- copy on write -------------------------------------------------------------------

    def detach(self, ino: int, live_path: str) -> os.stat_result | None:
        """Give the snapshots of ``ino`` their own copy before the job changes it.

        ``live_path`` opens the inode (a /proc/self/fd path). Returns the copy's stat for
        space accounting, or None if ``ino`` is not in any snapshot.
        """
        paths = self._pins.pop(ino, None)
        if not paths:
            return None
        self._serial += 1
        tmp = self.root / f".cow-{os.getpid()}-{self._serial}"
        try:
            fd = os.open(live_path, os.O_RDONLY | os.O_CLOEXEC)  # a /proc/self/fd link: followed on purpose
            try:
                copy = self._copy_file(fd, tmp)
            finally:
                os.close(fd)
            for p in paths:
                os.link(tmp, p + ".cow")
                os.rename(p + ".cow", p)
        except BaseException:
            self._pins[ino] = paths
            for p in paths:
                _unlink_quietly(p + ".cow")
            raise
        finally:
            _unlink_quietly(tmp)
        self._pins[copy.st_ino] = paths
        self.detaches += 1
        return os.lstat(paths[0])

    # -- dropping -----------------------------------------------------------------------

    def drop(self, step: int) -> Path | None:
        """Forget a step at once; returns a directory for the caller to delete at leisure.

        Freeing a big step's pages takes a while (a quarter second per GiB here), so the
        step is only renamed aside and accounted as free here, on the trio thread; the
        deletion itself belongs in a worker thread. ``load`` removes leftovers after a crash.
        """
        d = self.step_dir(step)
        if not d.exists():
            return None
        self._serial += 1
        trash = self.root / f".trash-{os.getpid()}-{self._serial}"
        self._remove(d, trash)
        return trash

    def _remove(self, path: Path, trash: Path | None = None) -> None:
        """Unpin and account everything under ``path``; delete it, or move it to ``trash``."""
        if not os.path.lexists(path):
            return
        gone: list[os.stat_result] = []

        def unpin(ino: int, p: str, st: os.stat_result) -> None:
            paths = self._pins.get(ino)
            if paths and p in paths:
                paths.remove(p)
                if not paths:
                    del self._pins[ino]
            gone.append(st)

        self._walk_pins(path, unpin)
        if trash is not None:
            os.rename(path, trash)
        elif os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        for st in gone:
            self._on_unlinked(st)

    def _pin(self, ino: int, path: str, st: os.stat_result) -> None:
        self._pins.setdefault(ino, []).append(path)

    @staticmethod
    def _walk_pins(top: Path, visit: Callable[[int, str, os.stat_result], None]) -> None:
        """Call ``visit`` for every regular file under ``top`` (or ``top`` itself)."""
        if os.path.isdir(top) and not os.path.islink(top):
            for d, _, files, dir_fd in os.fwalk(top):  # by descriptors: never through a link
                for f in files:
                    st = os.lstat(f, dir_fd=dir_fd)
                    if stat.S_ISREG(st.st_mode):
                        visit(st.st_ino, os.path.join(d, f), st)
        elif os.path.lexists(top):
            st = os.lstat(top)
            if stat.S_ISREG(st.st_mode):
                visit(st.st_ino, str(top), st)


def _copy_attrs(st: os.stat_result, dst: Path) -> None:
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _lexists(name: str, dir_fd: int) -> bool:
    try:
        os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def _born(name: str, dir_fd: int) -> float:
    """When ``name`` in ``dir_fd`` was made (seconds), or 0.0 if its file system does not say."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        ns = linux.birth_time(fd)
    except OSError:
        ns = None
    finally:
        os.close(fd)
    return ns / 1e9 if ns is not None else 0.0


def _unlink_quietly(path: Path | str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
