"""Paths in the job's tree, resolved by the daemon without following the job's symlinks.

The daemon runs as root; the job owns the directories of its tree. A path string such as
``ckpt/100`` that was true when a step committed may, by the time the daemon acts on it,
run through a symbolic link the job put in place of ``ckpt`` -- to another job's RAM tier,
or anywhere else root can write. So every delete, rename and copy of a path in the tree
walks it from a directory descriptor the daemon trusts, one component at a time, each
opened with ``O_NOFOLLOW | O_DIRECTORY``, and acts on the last component relative to its
parent's descriptor. A component that is a symbolic link stops the walk (ELOOP); ``..``
and absolute paths are refused before any system call. The job can still rename its
directories while the daemon works: the daemon then acts on whatever directory it holds,
which is always one of the job's own.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotBeneath(OSError):
    """The path leaves its root or runs through a symbolic link; the message names the component."""

    def __str__(self) -> str:
        return str(self.strerror)


def parts(rel: str) -> list[str]:
    """The components of ``rel``, a relative path without ``.``, ``..`` or empty parts."""
    names = rel.rstrip("/").split("/")
    if rel.startswith("/") or any(n in ("", ".", "..") or "\0" in n for n in names):
        raise NotBeneath(errno.EINVAL, f"{rel!r} is not a plain relative path")
    return names


def open_dir(root_fd: int, rel: str) -> int:
    """A new descriptor of directory ``rel`` beneath ``root_fd`` (``""``: the root itself)."""
    fd = os.dup(root_fd)
    if rel.strip("/") == "":
        return fd
    for i, name in enumerate(names := parts(rel)):
        try:
            new = os.open(name, _DIR_FLAGS, dir_fd=fd)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                where = "/".join(names[: i + 1])
                raise NotBeneath(
                    e.errno, f"{where} is not a directory (a symbolic link or a file): {rel} is not followed through it"
                ) from None
            raise
        os.close(fd)
        fd = new
    return fd


@contextmanager
def parent_of(root_fd: int, rel: str) -> Iterator[tuple[int, str]]:
    """``(descriptor of rel's parent directory, rel's last component)``; closes the descriptor."""
    names = parts(rel)
    fd = open_dir(root_fd, "/".join(names[:-1]))
    try:
        yield fd, names[-1]
    finally:
        os.close(fd)


def lstat(root_fd: int, rel: str) -> os.stat_result:
    """``lstat`` of ``rel`` beneath ``root_fd``; no component is followed if it is a link."""
    with parent_of(root_fd, rel) as (fd, name):
        return os.lstat(name, dir_fd=fd)


def remove(root_fd: int, rel: str) -> bool:
    """Delete ``rel`` beneath ``root_fd`` and, if it is a directory, everything in it.

    A symbolic link is removed itself, never followed. Returns False if ``rel`` did not
    exist; raises :class:`NotBeneath` if a component above it is not a real directory.
    """
    with parent_of(root_fd, rel) as (fd, name):
        try:
            st = os.lstat(name, dir_fd=fd)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(st.st_mode):
            # Descends by descriptors and refuses a directory swapped for a link meanwhile.
            shutil.rmtree(name, dir_fd=fd)
        else:
            os.unlink(name, dir_fd=fd)
        return True


def rename(root_fd: int, old: str, new: str) -> None:
    """Rename ``old`` to ``new``, both beneath ``root_fd``; neither path is followed through a link."""
    with parent_of(root_fd, old) as (src, a), parent_of(root_fd, new) as (dst, b):
        os.rename(a, b, src_dir_fd=src, dst_dir_fd=dst)
