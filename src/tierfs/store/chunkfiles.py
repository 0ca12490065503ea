"""Chunk files whose bytes were checked against their names, and the checks remembered.

Which chunks the store holds, for which manifests and for how long is the store's
business; whether a file range *is* chunk ``h`` is a question about bytes alone, answered
the same way for a replica, for a copy of this node's own step and for a chunk arriving
from the network. Keeping it here keeps the rule in one place: bytes are served only from
the descriptor that was hashed, and a check is trusted again only while the file's identity
(device, inode, size, mtime and ctime, and the range) is unchanged, so a reader cannot make
this node hash 64 MiB per request.
"""

from __future__ import annotations

import errno
import os
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import xxhash

from tierfs.core.chunks import hash_range
from tierfs.core.linux import pwrite_all
from tierfs.peers.wire import PIECE, NoSpace, PeerError

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing's own from Python 3.13

VERIFIED_CACHE = 65536  # file ranges remembered as verified: 256 GiB of 4 MiB chunks, ~10 MB of memory

_HASH_RE = re.compile(r"[0-9a-f]{32}")

Location = tuple[str, int, int]  # (path, offset, length) of a chunk's bytes
# A file range as it is now: (device, inode, size, mtime_ns, ctime_ns, offset, length).
_Identity = tuple[int, int, int, int, int, int, int]


class LocalChunks(Protocol):
    """This node's own committed chunks, which a replica may copy instead of receiving."""

    def find(self, h: str) -> Location | None:
        """Where chunk ``h`` lies in one of this node's frozen steps, or ``None``."""


class HashMismatch(PeerError):
    def __init__(self, message: str = "hash mismatch"):
        super().__init__(message)


class NotFound(PeerError):
    def __init__(self, message: str = "not found"):
        super().__init__(message)


class Corrupt(PeerError):
    def __init__(self, message: str = "corrupt"):
        super().__init__(message)


def is_hash(value: object) -> TypeIs[str]:
    return isinstance(value, str) and _HASH_RE.fullmatch(value) is not None


def create_private(tmp: Path) -> int:
    """A new file at ``tmp`` only root can read; its descriptor.

    Its pages are taken as the body is written, not reserved first: a full tmpfs (or an
    unbounded account on a shared ramdisk) is found by the write that has no room, as
    :class:`NoSpace`, and the body is still read to its end, so the sender hears "no space"
    on a connection that stays in step. Reserving with ``fallocate`` first cost a second
    pass over the pages for every chunk received.
    """
    return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)


class ChunkWriter:
    """One chunk being received: a temp file, its running hash, the space it reserved.

    Use as a context manager: leaving it without :meth:`commit` removes the temp file and
    returns the reservation, whatever happened (hash mismatch, timeout, cancellation).
    ``fd`` is ``None`` when the chunk is already held: the body is then only hashed, so a
    duplicate costs no RAM and a sender with bad bytes still hears about it. ``install``
    takes the verified bytes (``fd`` and ``tmp``, both ``None`` for a chunk already held);
    ``release`` returns the reservation, once, however the writer ends.
    """

    def __init__(
        self,
        h: str,
        length: int,
        fd: int | None,
        tmp: Path | None,
        *,
        install: Callable[[str, int | None, Path | None], None],
        release: Callable[[], None],
    ):
        self.h, self.length, self.fd = h, length, fd
        self.hasher = xxhash.xxh3_128()
        self._tmp, self._install, self._release = tmp, install, release
        self._open = True

    def commit(self) -> None:
        """Check the hash of what was received and move it into place."""
        if self.hasher.hexdigest() != self.h:
            raise HashMismatch()
        self._install(self.h, self.fd, self._tmp)
        self._close(remove=False)

    def write(self, piece: memoryview, at: int) -> None:
        """Bytes ``at`` onwards of the body, in order: hashed, and written unless the chunk is held."""
        self.hasher.update(piece)
        if self.fd is not None:
            with _no_space():
                pwrite_all(self.fd, piece, at)

    def fill_from(self, path: str, offset: int) -> str | None:
        """Copy the chunk's bytes from ``path`` at ``offset`` and hash them: what is wrong with that range, or None.

        The copy is made in the kernel where it can be; it is hashed from this writer's own
        file, so what is committed is what was checked.
        """
        fd = self.fd
        if fd is None:  # the writer of a chunk held already only hashes what it is sent
            raise RuntimeError(f"chunk {self.h} is held already: there is no file to copy it into")
        try:
            src = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:  # the step it was in was retained away meanwhile
            return f"is gone ({e.strerror})"
        try:
            with _no_space():
                copy_range(src, offset, fd, self.length)
        finally:
            os.close(src)
        hasher = hash_range(fd, 0, self.length)
        if hasher is None or hasher.hexdigest() != self.h:
            return "does not match its name"
        self.hasher = hasher
        return None

    def abort(self) -> None:
        self._close(remove=True)

    def _close(self, *, remove: bool) -> None:
        if not self._open:
            return
        self._open = False
        self._release()
        if self.fd is not None:
            os.close(self.fd)
            if remove:
                discard_file(self._tmp)

    def __enter__(self) -> ChunkWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class ChunkSource:
    """An open, just-verified chunk: serve ``length`` bytes of ``fd`` from ``offset``.

    Serving from the descriptor that was hashed means a rename or a GC between the check
    and the send cannot swap in other bytes.
    """

    def __init__(self, fd: int, offset: int, length: int):
        self.fd, self.offset, self.length = fd, offset, length

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> ChunkSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class VerifiedRanges:
    """File ranges whose bytes hashed to a chunk's name, the newest ``capacity`` of them."""

    def __init__(self, capacity: int = VERIFIED_CACHE):
        self.capacity = capacity
        self._hashes: OrderedDict[_Identity, str] = OrderedDict()  # file identity + range -> its hash

    def open(self, path: str, offset: int, length: int | None, h: str) -> ChunkSource | str:
        """Open a chunk's bytes, hashing them unless this very file range was verified before.

        The open source, or why the bytes are not chunk ``h``. The identity is taken from
        the open descriptor, which is also what is served: a rename or a GC between the
        check and the send cannot swap in other bytes.
        """
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return "file is gone"
        try:
            st = os.fstat(fd)
            if length is None:
                length = st.st_size - offset
            key = _identity(st, offset, length)
            if self._hashes.get(key) == h:
                self._hashes.move_to_end(key)
                return ChunkSource(fd, offset, length)
            hasher = hash_range(fd, offset, length)
        except BaseException:
            os.close(fd)
            raise
        if hasher is None or hasher.hexdigest() != h:
            os.close(fd)
            return "short read" if hasher is None else f"hashes to {hasher.hexdigest()}"
        self._remember(key, h)
        return ChunkSource(fd, offset, length)

    def remember(self, st: os.stat_result, offset: int, length: int, h: str) -> None:
        """Range ``offset``+``length`` of the file ``st`` describes (stat it after its last rename) is chunk ``h``."""
        self._remember(_identity(st, offset, length), h)

    def _remember(self, key: _Identity, h: str) -> None:
        self._hashes[key] = h
        self._hashes.move_to_end(key)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)


def _identity(st: os.stat_result, offset: int, length: int) -> _Identity:
    """A file range as it is now: any write to the file changes its mtime and ctime.

    tmpfs gives a fine-grained ctime to a file whose times were just looked at, so a change
    right after a check still shows. A new file that reuses the inode gets a new ctime.
    """
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, offset, length


def copy_range(src: int, offset: int, dst: int, length: int) -> None:
    """Copy in the kernel (``copy_file_range``), or with pread/pwrite where that is refused."""
    done = 0
    try:
        while done < length:
            n = os.copy_file_range(src, dst, length - done, offset + done, done)
            if n == 0:
                return  # short source: the hash check reports it
            done += n
        return
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    while done < length:
        piece = os.pread(src, min(PIECE, length - done), offset + done)
        if not piece:
            return
        os.pwrite(dst, piece, done)
        done += len(piece)


@contextmanager
def _no_space() -> Iterator[None]:
    """A write that found the RAM tier full is :class:`NoSpace`."""
    try:
        yield
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise NoSpace() from None
        raise


def write_private(tmp: Path, data: bytes) -> os.stat_result:
    """A new file at ``tmp`` only root can read, holding ``data``: its stat once written.

    Nothing is left at ``tmp`` if the write fails (a full RAM tier, a cancellation).
    """
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        discard_file(tmp)
        raise
    os.close(fd)
    return st


def discard_file(path: Path | None) -> None:
    """Unlink ``path``; one already gone (or no path at all) is what was wanted."""
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def mtime(path: Path) -> float:
    """When the file was last written; 0 (long ago) if it is gone meanwhile."""
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def scan(path: Path) -> Iterable[os.DirEntry[str]]:
    with os.scandir(path) as it:
        return list(it)


def mkdir_private(path: Path) -> None:
    """A directory of a store's, root-only from its creation: the daemon's umask is 0."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
