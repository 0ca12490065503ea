"""What a successor daemon needs to take over a live FUSE connection, kept on the RAM tier.

The kernel's FUSE connection outlives the daemon as long as one descriptor of
``/dev/fuse`` stays open (the keeper, :mod:`tierfs.daemon.keeper`, holds one). What the
kernel knows of the dead daemon does not go away with it: node ids it looked up, file
handles it was given, passthrough backing ids, and requests it sent but never saw
answered. A successor must honour all of them, so the daemon writes down, as it goes,
what it told the kernel, in four files of a root-only directory beside the rank's home
(tmpfs, so they survive the process and cost no disk):

- ``init.json``: what INIT negotiated (written once per connection);
- ``nodes``: an append-only log of ``(node id, file handle)``: every inode the kernel was
  given, reopened with ``open_by_handle_at`` when a successor first meets its node id
  (compacted to the nodes the kernel still holds as it grows);
- ``handles``: a table, mapped into memory and indexed by file handle (the daemon's
  descriptor number), of the open handles: inode, open flags, backing id;
- ``requests``: a journal of the requests that must not run twice (a ``mkdir`` run again
  fails with ``EEXIST``): each is marked begun before it runs and its reply stored once it
  is known, so a request the kernel sends again (``FUSE_NOTIFY_RESEND``) gets the answer
  it would have had.

Writes into the mapped files are plain stores (no system call); only a new inode costs a
``name_to_handle_at`` and an append.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from tierfs.core import linux
from tierfs.core.atomic import private_dir, read_small, write_atomically

log = logging.getLogger(__name__)

_NODE = struct.Struct("<QH")  # node id, handle length; then the handle
_HANDLE = struct.Struct("<QiiI4x")  # inode, open flags, backing id, kind|bits
_HEADER = struct.Struct("<Q")  # highest file handle ever recorded + 1 (entry 0: fd 0 is never a handle)
MAX_HANDLES = 1 << 20  # file handles are descriptors: the daemon's RLIMIT_NOFILE (tierfs.daemon.host)
_SLOTS = 4096  # requests journaled at once; each is answered long before this many follow it
_SLOT = struct.Struct("<QIIQ")  # unique, state, reply length, begun at (ns)
SLOT_SIZE = 256
MAX_REPLY = SLOT_SIZE - _SLOT.size
BEGUN, DONE = 1, 2
FILE, DIRECTORY = 1, 2  # kinds of handle
PASSTHROUGH, DIRECT, KILL_PRIVS, RELEASING = 1 << 8, 1 << 9, 1 << 10, 1 << 11  # bits beside the kind
COMPACT_AT = 1 << 20  # rewrite the node log past this size, if most of it is forgotten nodes
MAX_INIT = 1 << 12
HANDLES_STEP = 1 << 16  # the handle table is allocated in steps of this many bytes
# The clock tmpfs stamps ctimes from (or a finer one): a name made after a request began
# has a ctime no older than the request's start read from it.
CLOCK_REALTIME_COARSE = getattr(time, "CLOCK_REALTIME_COARSE", 5)


@dataclass(frozen=True)
class Handle:
    fh: int
    ino: int
    flags: int
    backing_id: int
    kind: int  # FILE or DIRECTORY, with the bits above

    @property
    def is_dir(self) -> bool:
        return self.kind & 0xFF == DIRECTORY


class InitRecord(TypedDict):
    """What INIT negotiated (``init.json``), for a successor to serve on as it left the connection."""

    minor: int
    offered: int  # the kernel's flags, both words
    granted: int
    max_write: int
    acl: bool
    passthrough: bool


@dataclass
class Taken:
    """A connection's state as a successor finds it: what INIT negotiated and the open handles."""

    init: InitRecord
    handles: list[Handle] = field(default_factory=list)


class SessionState:
    """The record of one connection, written by its daemon and read by the next one."""

    _handles: mmap.mmap  # the table of open handles, mapped by _open
    _requests: mmap.mmap  # the journal of requests, mapped by _open

    def __init__(self, directory: Path, tree: Path):
        self.dir = directory
        self.tree = tree
        self._tree_fd = -1  # the tree's root, a descriptor on its tmpfs for open_by_handle_at
        self._nodes: dict[int, bytes] = {}  # node id -> file handle, for the nodes the kernel holds
        self._log_fd = -1
        self._log_size = 0
        self._handles_fd = -1  # kept to allocate more of the table as handles grow
        self._allocated = 0  # bytes of the table allocated: a store beyond would fault in a page
        self._maps: list[mmap.mmap] = []  # every file mapped, for close
        self._high = 1

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        """A new connection: nothing the kernel knows yet."""
        private_dir(self.dir)
        for name in ("init.json", "nodes", "handles", "requests"):
            try:
                os.unlink(self.dir / name)
            except FileNotFoundError:
                pass
        self._open()

    def take_over(self) -> Taken:
        """The connection of a daemon that is gone: its negotiation, its nodes and handles."""
        private_dir(self.dir)  # root's alone, as its predecessor made it (UnsafeFile otherwise)
        init: InitRecord = json.loads(read_small(self.dir / "init.json", MAX_INIT, private=True))
        self._open()
        self._load_nodes()
        self._high = _HEADER.unpack_from(self._handles, 0)[0] or 1
        handles = []
        for fh in range(1, min(self._high, MAX_HANDLES)):
            ino, flags, backing_id, kind = _HANDLE.unpack_from(self._handles, fh * _HANDLE.size)
            if kind:
                handles.append(Handle(fh, ino, flags, backing_id, kind))
        return Taken(init, handles)

    def _open(self) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self._tree_fd = os.open(self.tree, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._log_fd = os.open(self.dir / "nodes", flags | os.O_APPEND, 0o600)
        self._log_size = os.fstat(self._log_fd).st_size
        self._requests, fd = self._map("requests", _SLOTS * SLOT_SIZE)
        os.close(fd)
        self._handles, self._handles_fd = self._map("handles", MAX_HANDLES * _HANDLE.size, HANDLES_STEP)
        self._allocated = HANDLES_STEP

    def _map(self, name: str, size: int, allocate: int | None = None) -> tuple[mmap.mmap, int]:
        """The file ``name`` of ``size`` bytes mapped, its first ``allocate`` bytes (all by
        default) allocated: a store into a page of a full tmpfs that was never allocated
        kills the process with SIGBUS, where ``fallocate`` fails with ENOSPC."""
        fd = os.open(self.dir / name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # sparse beyond what is allocated
            os.posix_fallocate(fd, 0, size if allocate is None else allocate)
            mapped = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._maps.append(mapped)
        return mapped, fd

    def close(self) -> None:
        for m in self._maps:
            m.close()
        self._maps.clear()
        for fd in (self._log_fd, self._tree_fd, self._handles_fd):
            if fd >= 0:
                os.close(fd)
        self._log_fd = self._tree_fd = self._handles_fd = -1

    def move_above(self, limit: int) -> None:
        """Move the record's own descriptors to numbers from ``limit`` on."""
        self._log_fd, self._tree_fd, self._handles_fd = (
            _move(fd, limit) for fd in (self._log_fd, self._tree_fd, self._handles_fd)
        )

    # -- INIT ---------------------------------------------------------------------------------

    def save_init(self, init: InitRecord) -> None:
        write_atomically(self.dir / "init.json", json.dumps(init), 0o600)

    # -- nodes --------------------------------------------------------------------------------

    def node_added(self, ino: int, fd: int) -> None:
        """The kernel was given node ``ino``, the inode of the O_PATH descriptor ``fd``."""
        handle = linux.name_to_handle(fd)
        if self._nodes.get(ino) == handle:
            return
        self._nodes[ino] = handle
        self._append(ino, handle)

    def node_gone(self, ino: int) -> None:
        """The kernel forgot node ``ino``."""
        self._nodes.pop(ino, None)

    def reopen_handle(self, h: Handle) -> int:
        """A new descriptor of the file or directory handle ``h`` (at any number)."""
        flags = (os.O_RDONLY | os.O_DIRECTORY if h.is_dir else h.flags & ~_STRIP_ON_REOPEN) | os.O_CLOEXEC
        if h.ino == 1:  # the tree's root, which no node record names
            return os.open(self.tree, flags | os.O_NOFOLLOW)
        handle = self._nodes.get(h.ino)
        if handle is None:
            raise OSError(errno.ESTALE, "no record of the node")
        try:
            return linux.open_by_handle(self._tree_fd, handle, flags | os.O_NOFOLLOW)
        except PermissionError:
            if not h.flags & os.O_APPEND:
                raise  # an append-only file (chattr +a) opens for writing only so, as in Opener.open
            return linux.open_by_handle(self._tree_fd, handle, flags | os.O_NOFOLLOW | os.O_APPEND)

    def reopen(self, ino: int) -> int | None:
        """An O_PATH descriptor of node ``ino``'s inode, or None if it is unknown or gone."""
        handle = self._nodes.get(ino)
        if handle is None:
            return None
        try:
            return linux.open_by_handle(self._tree_fd, handle, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None

    def _append(self, ino: int, handle: bytes) -> None:
        record = _NODE.pack(ino, len(handle)) + handle
        os.write(self._log_fd, record)
        self._log_size += len(record)
        if self._log_size > COMPACT_AT and self._log_size > 4 * len(self._nodes) * len(record):
            self._compact()

    def _compact(self) -> None:
        """Rewrite the log with only the nodes the kernel still holds."""
        records = b"".join(_NODE.pack(ino, len(h)) + h for ino, h in self._nodes.items())
        write_atomically(self.dir / "nodes", records, 0o600)
        os.close(self._log_fd)
        self._log_fd = os.open(self.dir / "nodes", os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._log_size = len(records)

    def _load_nodes(self) -> None:
        data = os.pread(self._log_fd, self._log_size, 0)
        at = 0
        while at + _NODE.size <= len(data):
            ino, n = _NODE.unpack_from(data, at)
            if n > 4 + linux.MAX_HANDLE_SZ or at + _NODE.size + n > len(data):
                break  # a record cut short by the daemon's death
            self._nodes[ino] = data[at + _NODE.size : at + _NODE.size + n]
            at += _NODE.size + n
        if at != len(data):
            log.warning("the node log of the connection ended in a partial record: %d bytes ignored", len(data) - at)
        self._compact()

    # -- open handles ---------------------------------------------------------------------------

    def opened(self, fh: int, ino: int, flags: int, kind: int, backing_id: int = 0) -> None:
        """Record an open handle; OSError (ENOSPC) if the table cannot grow to hold it."""
        if not 0 < fh < MAX_HANDLES:
            return  # beyond the table: a successor will not know it (RLIMIT_NOFILE keeps fds below)
        if (fh + 1) * _HANDLE.size > self._allocated:
            size = min(MAX_HANDLES * _HANDLE.size, -(-(fh + 1) * _HANDLE.size // HANDLES_STEP) * HANDLES_STEP)
            os.posix_fallocate(self._handles_fd, 0, size)
            self._allocated = size
        _HANDLE.pack_into(self._handles, fh * _HANDLE.size, ino, flags, backing_id, kind)
        if fh >= self._high:
            self._high = fh + 1
            _HEADER.pack_into(self._handles, 0, self._high)

    def releasing(self, fh: int) -> None:
        """The kernel released ``fh`` (and was answered); the release is still to be done."""
        if 0 < fh < min(self._high, MAX_HANDLES):
            at = fh * _HANDLE.size
            ino, flags, backing_id, kind = _HANDLE.unpack_from(self._handles, at)
            if kind:
                _HANDLE.pack_into(self._handles, at, ino, flags, backing_id, kind | RELEASING)

    def closed(self, fh: int) -> None:
        if 0 < fh < MAX_HANDLES:
            _HANDLE.pack_into(self._handles, fh * _HANDLE.size, 0, 0, 0, 0)

    # -- requests that must not run twice ----------------------------------------------------------

    @staticmethod
    def _slot(unique: int) -> int:
        return ((unique & ~_RESEND_BITS) >> 1) % _SLOTS * SLOT_SIZE

    def begin(self, unique: int) -> None:
        _SLOT.pack_into(
            self._requests,
            self._slot(unique),
            unique & ~_RESEND_BITS,
            BEGUN,
            0,
            time.clock_gettime_ns(CLOCK_REALTIME_COARSE),
        )

    def done(self, unique: int, reply: bytes) -> None:
        """Keep ``reply`` (the whole message, header first) as the answer to ``unique``."""
        at = self._slot(unique)
        if len(reply) > MAX_REPLY:
            return  # stays "begun": a resend is judged by what it finds
        self._requests[at + _SLOT.size : at + _SLOT.size + len(reply)] = reply
        _SLOT.pack_into(self._requests, at, unique & ~_RESEND_BITS, DONE, len(reply), 0)

    def recall(self, unique: int) -> bytes | int | None:
        """What became of request ``unique`` before the daemon died: its reply if it was
        answered, when it began (ns) if it began only, or None if it never began."""
        at = self._slot(unique)
        key, state, length, began = _SLOT.unpack_from(self._requests, at)
        if key != unique & ~_RESEND_BITS:
            return None
        if state == DONE:
            return bytes(self._requests[at + _SLOT.size : at + _SLOT.size + length])
        return began if state == BEGUN else None


_RESEND_BITS = 1 << 63  # fs.abi.UNIQUE_RESEND
_STRIP_ON_REOPEN = os.O_CREAT | os.O_EXCL | os.O_TRUNC | os.O_NOCTTY | os.O_APPEND | os.O_DIRECT


def reopen_handles(state: SessionState, taken: Taken, keep: dict[str, int]) -> dict[str, int]:
    """Open every handle of ``taken`` again at its own descriptor number, so the file
    handles the kernel holds mean the same files in this process.

    Runs first in a successor, before it opens anything else: the numbers are reserved,
    then each file is opened by its handle and moved onto its number. Descriptors this
    process inherited (``keep``, by name) that sit on such a number are moved away first;
    returns their numbers now. A handle whose inode is gone (ESTALE) is dropped, and the
    kernel's next request on it gets EBADF.
    """
    wanted = {h.fh for h in taken.handles}
    if not wanted:
        return dict(keep)
    state.move_above(max(wanted) + 1)
    moved = {name: _move(fd, max(wanted) + 1) if fd in wanted else fd for name, fd in keep.items()}
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    for fh in wanted - {null}:
        try:
            fcntl.fcntl(fh, fcntl.F_GETFD)
        except OSError:
            os.dup2(null, fh, inheritable=False)
            continue
        raise OSError(errno.EBUSY, f"descriptor {fh} of a handle is in use in the successor")
    kept = []
    try:
        for h in taken.handles:
            try:
                fd = state.reopen_handle(h)
            except OSError as e:
                log.warning("a file handle of the last daemon cannot be reopened (%s): dropped", e.strerror or e)
                state.closed(h.fh)
                if h.fh != null:
                    os.close(h.fh)
                continue
            os.dup2(fd, h.fh, inheritable=False)
            os.close(fd)
            kept.append(h)
    finally:
        if null not in {h.fh for h in kept}:
            os.close(null)
    taken.handles[:] = kept
    return moved


def _move(fd: int, limit: int) -> int:
    if fd < 0:
        return fd
    new = fcntl.fcntl(fd, fcntl.F_DUPFD if os.get_inheritable(fd) else fcntl.F_DUPFD_CLOEXEC, limit)
    os.close(fd)
    return new
