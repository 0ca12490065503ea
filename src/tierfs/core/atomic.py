"""The daemon's own small files and directories: written whole, private, checked when read.

A file is written beside its final name, then renamed over it: a reader, or a restart
after a crash, sees the old content or the new, never half of either. It gets ``mode``
from its creation on (``0600`` unless the caller says otherwise), so a secret is never
readable by others, even for a moment. The daemon runs with umask 0 (the FUSE layer
needs it for the exact modes of the job's files), so every mode here is explicit.

The daemon's state (``mtc.json``, ``state.json``, ``daemon.lock``...) steers what a later
start deletes and serves. Whoever can replace it runs that start's cleanup, so it lives in
root-only directories, and every read checks again what it opens: not a symbolic link,
owned by the daemon's user, writable by nobody else, no larger than its reader expects.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

from tierfs.core.errors import UserError

log = logging.getLogger(__name__)

STATE_LIMIT = 16 << 20  # no state file of the daemon's comes near this


class UnsafeFile(UserError):
    """A file or directory failed its check: the message says which, why and what to do."""


def temporary_name(path: Path) -> Path:
    """Where ``path``'s next content is written first (``tmp`` in it: never a commit)."""
    return path.with_name(f".tmp.{path.name}")


def write_atomically(path: Path, text: str | bytes, mode: int = 0o600, owner: tuple[int, int] | None = None) -> None:
    """Replace ``path`` with ``text`` (or bytes); the file has ``mode`` (and ``owner``, uid
    and gid) from before its first byte and its final name."""
    tmp = temporary_name(path)
    tmp.unlink(missing_ok=True)  # a crash's leftover would keep its own mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with open(fd, "wb" if isinstance(text, bytes) else "w") as f:
        if owner is not None:
            os.fchown(fd, *owner)
        f.write(text)
    os.replace(tmp, path)


def read_small(path: Path, limit: int, *, private: bool = False, dir_fd: int | None = None) -> bytes:
    """The content of the regular file ``path``, at most ``limit`` bytes, read without trust.

    Never follows a symbolic link at ``path`` and never blocks on a fifo. With ``private``
    the file must also be the daemon's own (see :func:`check_private`). Raises
    ``FileNotFoundError`` if it is missing, :class:`UnsafeFile` if it fails a check.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFile(f"{path} is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{path} is not a regular file")
        if private:
            check_private(st, path)
        if st.st_size > limit:
            raise UnsafeFile(f"{path} is larger than {limit} bytes")
        data = b""
        while len(data) <= limit:
            chunk = os.read(fd, limit + 1 - len(data))
            if not chunk:
                break
            data += chunk
        if len(data) > limit:  # it grew while being read
            raise UnsafeFile(f"{path} is larger than {limit} bytes")
        return data
    finally:
        os.close(fd)


def read_state(path: Path, limit: int = STATE_LIMIT) -> bytes:
    """A state file of the daemon's own; refuses (UnsafeFile, with what to do) one it did not write."""
    try:
        return read_small(path, limit, private=True)
    except UnsafeFile as e:
        raise UnsafeFile(f"{e}: tierfs did not write it; check it and remove it, then start again") from None


def check_private(st: os.stat_result, path: os.PathLike[str] | str, *, shared_ok: bool = False) -> None:
    """Raise UnsafeFile unless ``st`` is owned by the daemon's user and writable by nobody else.

    ``shared_ok`` accepts a sticky directory that anyone may write to (like ``/dev/shm``):
    others can add entries there but not replace the daemon's.
    """
    if st.st_uid != os.geteuid():
        raise UnsafeFile(f"{path} belongs to uid {st.st_uid}, not to uid {os.geteuid()} that runs tierfs")
    wide = stat.S_IMODE(st.st_mode) & 0o022
    if wide and not (shared_ok and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        who = {0o020: "its group", 0o002: "every user"}.get(wide, "its group and every user")
        raise UnsafeFile(f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})")


def private_dir(path: Path, *, own: bool = True, mode: int = 0o700) -> Path:
    """Create ``path`` (and missing parents) with ``mode``, or check the directory already there.

    It must be a real directory (not a symbolic link), owned by the daemon's user and
    writable by nobody else. ``own`` marks a directory tierfs made itself: one that an
    earlier version created too widely (umask 0) is set to ``mode`` with a warning;
    any other (``own=False``: the ramdisk or runtime directory an operator chose) is only
    checked, and a sticky, world-writable one is accepted. Raises UnsafeFile if the check fails.
    """
    missing: list[Path] = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, mode)
        except FileExistsError:
            pass  # made meanwhile: checked below like any other
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeFile(
                f"{path} is not a directory but a {'symbolic link' if os.path.islink(path) else 'file'}: "
                "remove it, tierfs makes its own"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if own and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
            log.warning("%s had mode %04o: narrowed to %04o", path, stat.S_IMODE(st.st_mode), mode)
            os.fchmod(fd, mode)
            st = os.fstat(fd)
        try:
            check_private(st, path, shared_ok=not own)
        except UnsafeFile as e:
            raise UnsafeFile(
                f"{e}: {'remove it, tierfs makes its own' if own else 'give it to root and chmod go-w it'}"
            ) from None
    finally:
        os.close(fd)
    return path
