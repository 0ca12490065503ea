"""Requests a dead daemon read but never answered, sent again by the kernel to its successor.

``FUSE_NOTIFY_RESEND`` queues every such request again. Most are safe to run twice (a
read, a write at an offset, a getattr); these are not: run again after the first run did
its work, a ``mkdir`` fails with ``EEXIST``, an ``unlink`` or a ``rename`` with
``ENOENT``, a ``create`` or ``open`` hands out a second descriptor. So each of them is
journaled (:class:`~tierfs.fs.recovery.SessionState`): marked begun before it runs, its
reply kept once known. A request sent again whose reply was kept gets that reply; one that
had begun but has no reply is run again, and the error a first run would cause is read as
the sign that it did run: the name now exists and changed since the request began
(``EEXIST``), or is gone (``ENOENT``, ``ENODATA``). A create run again opens the file its
first run made (:meth:`~tierfs.fs.opening.Opener.create`).
"""

from __future__ import annotations

import errno

from tierfs.fs import abi

JOURNALED = frozenset(
    {
        abi.MKNOD,
        abi.MKDIR,
        abi.SYMLINK,
        abi.LINK,
        abi.UNLINK,
        abi.RMDIR,
        abi.RENAME,
        abi.RENAME2,
        abi.CREATE,
        abi.OPEN,
        abi.OPENDIR,
        abi.SETXATTR,
        abi.REMOVEXATTR,
    }
)
_MADE_ALREADY = {
    abi.MKNOD: abi.MKNOD_IN.size,
    abi.MKDIR: abi.MKDIR_IN.size,
    abi.LINK: abi.LINK_IN.size,
    abi.SYMLINK: 0,
}  # where the new name starts in the request
_GONE_ALREADY = {
    abi.UNLINK: errno.ENOENT,
    abi.RMDIR: errno.ENOENT,
    abi.RENAME: errno.ENOENT,
    abi.RENAME2: errno.ENOENT,
    abi.REMOVEXATTR: errno.ENODATA,
    abi.SETXATTR: errno.EEXIST,
}


def with_unique(reply: bytes, unique: int) -> list[bytes]:
    """A kept reply, addressed to the request as the kernel sent it again."""
    length, error, _ = abi.OUT_HEADER.unpack_from(reply)
    return [abi.OUT_HEADER.pack(length, error, unique), reply[abi.OUT_HEADER.size :]]


def made_name(opcode: int, body: memoryview) -> bytes | None:
    """The name a creating request makes in its directory (the request's node)."""
    start = _MADE_ALREADY.get(opcode)
    if start is None:
        return None
    return bytes(body[start:]).split(b"\0", 1)[0]


def done_already(opcode: int, err: int | None) -> bool:
    """Whether ``err`` from running a removing request again means the first run did it."""
    return _GONE_ALREADY.get(opcode) == err
