"""What is plugged into the volume after it is built, and the interfaces it is plugged with.

The volume's handlers are written before the kernel is asked anything: whether it grants
passthrough and POSIX ACLs is learnt at the session's INIT, and whether a step is being
restored only once the daemon has chosen one. Each of those is set here, on one object the
parts that need it share, rather than on the parts themselves.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tierfs.fs.backing import BackingFiles


class Events(Protocol):
    """What the checkpoint machinery hears from the mount (paths relative to its root)."""

    def file_done(self, path: str) -> None: ...  # closed after writing, or renamed into place

    def dir_renamed(self, path: str) -> None: ...


class Restoring(Protocol):
    """Files whose bytes are still arriving from another tier (by FUSE inode number)."""

    def pending(self, ino: int) -> bool: ...

    async def wait_range(self, ino: int, offset: int, size: int) -> None: ...  # OSError(EIO) if unobtainable

    async def wait_file(self, ino: int) -> None: ...


@dataclass(slots=True)
class Hooks:
    """Set by the daemon (``events``, ``restoring``) and by the engine (the rest)."""

    events: Events | None = None
    restoring: Restoring | None = None
    backing: BackingFiles | None = None  # kernel passthrough, when the engine has it
    acl: bool = False  # the kernel enforces POSIX ACLs (and leaves the umask to the daemon)
    write_back_pages: Callable[[int], Awaitable[None]] | None = None  # the kernel's dirty pages of an inode

    def pending(self, ino: int) -> bool:
        """Whether ``ino`` is a file whose restore is not complete yet."""
        return self.restoring is not None and self.restoring.pending(ino)
