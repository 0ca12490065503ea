"""Moving a write's bytes from ``/dev/fuse`` into its RAM-tier file without reading them.

On the daemon data path every byte written crosses the daemon. Read into the daemon's
memory and written out again, each byte is copied twice; spliced (``splice(2)``) from the
device into a pipe and from the pipe into the file, it is copied once, by the kernel, and
the daemon's Python only sees the request's header. The pipe holds references to the
request's pages until the bytes are in the file, so the answer to the kernel (which frees
or reuses those pages) is sent only after that, by whoever moved them: a write-behind
worker (:mod:`tierfs.fs.writebehind`), so the request loop reads on meanwhile.
"""

from __future__ import annotations

import errno
import fcntl
import os

from tierfs.fs import abi

# A request spliced into a pipe takes one slot per page its bytes touch (one more than
# their size in pages when they do not start on a page, as a direct write's buffer may
# not) plus one for its header; the kernel fails a request that does not fit. Pipes of
# 2 MiB hold the largest request, 1 MiB; without CAP_SYS_RESOURCE no pipe may pass
# /proc/sys/fs/pipe-max-size (1 MiB by default), and the session then asks the kernel for
# writes of two pages less than its pipes hold.
PIPE_SIZE = 2 << 20
PIPE_MAX_SIZE = "/proc/sys/fs/pipe-max-size"
MIN_PIPE_SIZE = 128 << 10  # smaller pipes would cost more requests than splicing saves
PAGE = 4096
HEAD = abi.IN_HEADER.size + abi.WRITE_IN.size  # what the daemon reads of a write


def pipe_size() -> int:
    """The largest pipe this process may make, up to ``PIPE_SIZE``; OSError if below ``MIN_PIPE_SIZE``."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        try:
            return fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        except PermissionError:
            with open(PIPE_MAX_SIZE) as f:
                limit = int(f.read(32))
        if limit < MIN_PIPE_SIZE:
            raise OSError(errno.EPERM, f"pipes are limited to {limit} bytes ({PIPE_MAX_SIZE})")
        return fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, limit)
    finally:
        os.close(r)
        os.close(w)


class Pipe:
    __slots__ = ("r", "w")

    def __init__(self, size: int) -> None:
        self.r, self.w = os.pipe2(os.O_CLOEXEC)
        try:
            fcntl.fcntl(self.w, fcntl.F_SETPIPE_SZ, size)
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


class PipePool:
    """Empty pipes for requests to be spliced into, one per request in flight."""

    def __init__(self) -> None:
        self.size = pipe_size()
        self.max_write = self.size - 2 * PAGE  # the largest write whose request surely fits
        self._free: list[Pipe] = []

    def take(self) -> Pipe:
        try:
            return self._free.pop()  # list.pop and append are atomic: workers give back
        except IndexError:
            return Pipe(self.size)

    def give(self, pipe: Pipe) -> None:
        """An emptied pipe, for the next request."""
        self._free.append(pipe)

    def discard(self, pipe: Pipe) -> None:
        """A pipe that may still hold bytes of a request that failed."""
        pipe.close()

    def close(self) -> None:
        while self._free:
            self.discard(self._free.pop())


def receive(dev_fd: int, pipe: Pipe, buf: bytearray) -> tuple[int, bool]:
    """Read the next request through ``pipe``: its length in ``buf``, and whether its bytes
    to write are still in the pipe (a WRITE's; ``buf`` then holds only its first ``HEAD``).

    Raises BlockingIOError when no request is queued, as a read would.
    """
    n = os.splice(dev_fd, pipe.w, len(buf))
    view = memoryview(buf)
    got = os.readv(pipe.r, [view[: min(n, HEAD)]])
    if n > got and abi.IN_HEADER.unpack_from(buf)[1] == abi.WRITE:
        return got, True
    while got < n:
        got += os.readv(pipe.r, [view[got:n]])
    return n, False


def read_out(pipe: Pipe, fd: int, offset: int, size: int, dev_fd: int, header: bytes) -> bool:
    """Answer a read with ``size`` bytes of ``fd`` at ``offset``: ``header`` and the file's
    pages into ``pipe``, then all of it into ``dev_fd``. True once answered (or dropped by the
    kernel meanwhile); False, or an OSError, if nothing was sent (the file held fewer bytes,
    or could not be read): the pipe may then hold part of it."""
    os.write(pipe.w, header)
    moved = 0
    while moved < size:
        n = os.splice(fd, pipe.w, size - moved, offset_src=offset + moved)
        if n == 0:
            return False
        moved += n
    try:
        os.splice(pipe.r, dev_fd, len(header) + size)
    except FileNotFoundError:  # the reader was interrupted: nobody to answer
        pass
    return True


def write_out(pipe: Pipe, fd: int, offset: int, size: int) -> int:
    """Move ``size`` bytes from ``pipe`` into ``fd`` at ``offset``; how many moved before
    an error (raised only when none did)."""
    done = 0
    while done < size:
        try:
            n = os.splice(pipe.r, fd, size - done, offset_dst=offset + done)
        except OSError as e:
            if e.errno == errno.EINVAL and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
                return done + _append(pipe, fd, size - done)
            if done:
                return done
            raise
        if n == 0:
            if done:
                return done
            raise OSError(errno.EIO, "the request's bytes are missing from its pipe")
        done += n
    return done


def _append(pipe: Pipe, fd: int, size: int) -> int:
    """Copy ``size`` bytes from ``pipe`` to the end of ``fd``: an append-only file (chattr +a)
    is open with O_APPEND, which splice refuses. Its writes are at its end anyway."""
    data = bytearray()
    while len(data) < size:
        chunk = os.read(pipe.r, size - len(data))
        if not chunk:
            raise OSError(errno.EIO, "the request's bytes are missing from its pipe")
        data += chunk
    return os.write(fd, data)
