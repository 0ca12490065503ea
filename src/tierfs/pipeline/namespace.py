"""A step's namespace: placeholder files in its snapshot, hard-linked into the job's volume.

Putting a step's files into the volume is needed beyond a restore that fetches bytes: a
step already whole on this node is linked back in, and a step that must not stay is set
aside. Each of these reaches into the job's tree, which the job controls: every path there
is walked from the tree's descriptor without following links (:mod:`tierfs.ramtier.beneath`),
so a symbolic link the job made stops the move, never redirects root's hand to what it
leads to. That rule lives here, once, for every caller.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

from tierfs.core.atomic import private_dir
from tierfs.core.manifest import Entry, Manifest, restorable_mode
from tierfs.ramtier import RankDir, beneath

log = logging.getLogger(__name__)


def create_placeholders(snap: Path, manifest: Manifest) -> None:
    """Build ``snap`` as the step's tree: every entry with its final name and attributes, files all hole."""
    os.mkdir(snap, 0o700)
    tree = str(snap)  # plain strings: pathlib costs more than the syscalls here
    for e in manifest.entries:
        path = os.path.join(tree, e.path)
        if e.kind == "dir":
            os.mkdir(path, 0o700)  # its own mode once its children are in (_apply_attrs)
        elif e.kind == "symlink":
            os.symlink(cast(str, e.target), path)  # never None: a checked manifest's symlinks have one
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, e.size)
            finally:
                os.close(fd)
    for e in reversed(manifest.entries):  # children first: directory mtimes stick
        _apply_attrs(os.path.join(tree, e.path), e)


def _apply_attrs(path: str, e: Entry) -> None:
    os.chown(path, e.uid, e.gid, follow_symlinks=False)
    if e.kind != "symlink":
        os.chmod(path, restorable_mode(e))
    os.utime(path, ns=(e.mtime_ns, e.mtime_ns), follow_symlinks=False)


def set_aside(rank: RankDir, rel: str, why: str) -> None:
    """Move ``rel`` out of the volume into ``<rank dir>/aside/``, where nothing is lost.

    ``rel`` is the job's path: it is reached from the tree's descriptor without following
    links (:mod:`tierfs.ramtier.beneath`). If the job made a directory above it a symbolic
    link, ``rel`` is not in the volume and nothing moves: root never moves what the link
    leads to (another job's data, say).
    """
    with _tree_fd(rank) as tree_fd:
        try:
            with beneath.parent_of(tree_fd, rel) as (src_fd, name):
                try:
                    os.lstat(name, dir_fd=src_fd)
                except FileNotFoundError:
                    return
                aside = rank.path / "aside" / f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}" / rel
                dst_fd = os.open(private_dir(aside.parent), _DIR_FLAGS)
                try:
                    os.rename(name, aside.name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
                finally:
                    os.close(dst_fd)
        except beneath.NotBeneath as e:
            log.warning("left %s where it is (%s): %s", rel, why, e)
            return
    log.warning("moved %s out of the volume to %s: %s", rel, aside, why)


def link_into_tree(rank: RankDir, snap: Path, root: str, why: str, *, keep: bool = False) -> None:
    """Put the snapshot's ``snap/root`` into the volume at ``root``.

    A directory above ``root`` that is not a real directory (a file, or a symbolic link
    the job made) is set aside and recreated from the snapshot, so the step lands in the
    job's tree and nowhere else; so is whatever is at ``root`` itself, unless ``keep``
    (then an existing ``root`` stays as the job left it).
    """
    parts = root.split("/")
    for depth in range(1, len(parts) + 1):
        rel = "/".join(parts[:depth])
        with _tree_fd(rank) as tree_fd:
            try:
                st = beneath.lstat(tree_fd, rel)
            except FileNotFoundError:
                st = None
        if depth < len(parts):
            if st is None or not stat.S_ISDIR(st.st_mode):
                set_aside(rank, rel, why)
                link_copy(snap, rank, rel, recurse=False)
        elif st is None or not keep:
            set_aside(rank, rel, why)
            link_copy(snap, rank, rel)


def link_copy(snap: Path, rank: RankDir, rel: str, recurse: bool = True) -> None:
    """Recreate ``snap/rel`` at ``rel`` in the volume: directories as new ones with the
    same attributes, everything else as hard links (no byte copied).

    ``snap`` is the daemon's own snapshot; the volume's side is the job's, so it is reached
    from the tree's descriptor and every directory made is entered by its descriptor:
    a symbolic link the job puts in the way stops the copy (NotBeneath), never redirects it.
    """
    with _tree_fd(rank) as tree_fd, beneath.parent_of(tree_fd, rel) as (dst_fd, name):
        _link_copy_at(os.path.join(snap, rel), dst_fd, name, recurse)


def _link_copy_at(src: str, dir_fd: int, name: str, recurse: bool) -> None:
    st = os.lstat(src)
    if not stat.S_ISDIR(st.st_mode):
        os.link(src, name, dst_dir_fd=dir_fd, follow_symlinks=False)
        return
    os.mkdir(name, 0o700, dir_fd=dir_fd)  # nobody else's until its attributes are set
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise beneath.NotBeneath(e.errno, f"{name} was replaced while it was being restored") from None
        raise
    try:
        if recurse:
            with os.scandir(src) as it:
                for entry in it:
                    _link_copy_at(entry.path, fd, entry.name, True)
        os.fchown(fd, st.st_uid, st.st_gid)
        os.fchmod(fd, stat.S_IMODE(st.st_mode))
        os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
    finally:
        os.close(fd)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@contextmanager
def _tree_fd(rank: RankDir) -> Iterator[int]:
    """A descriptor of the rank's tree, the root every path of the job's is walked from."""
    fd = os.open(rank.tree, _DIR_FLAGS)
    try:
        yield fd
    finally:
        os.close(fd)
