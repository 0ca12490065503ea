"""Releases answered at once and done later, so that a file's close does not hold up the
next file's create.

A file's close is followed at once by the next open's path walk and create, which should
not wait for the release's bookkeeping, and the kernel does not wait for a release's answer.
So the kernel session (:mod:`tierfs.fs.session`) answers a RELEASE at once and does it once
nothing is queued, and always before any request that could tell: requests that cannot tell
whether a release before them was handled yet (nothing they do or return depends on it) are
served before it (:data:`BEFORE_RELEASES`). A create needs only the part of a release that
others see (Operations.release_writes: the commit rules hear of the close before anything
new appears), not the rest (Operations.release_handle), so it comes before that rest
(:data:`BEFORE_RELEASE_HANDLES`). Any other request comes after the whole release, as the
kernel sent them.

Apart from the serving loop because this is a rule of order of its own, with its own state:
the loop only asks, at each request, whether a release waits (it looks at ``_released``
and ``_closing`` itself, which costs no call), and which part of it to do now.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from tierfs.fs import abi
from tierfs.fs.requests import Requests

if TYPE_CHECKING:
    from tierfs.fs.operations import Operations

log = logging.getLogger("tierfs.fs.session")  # the kernel session's lines

BEFORE_RELEASES = frozenset({abi.LOOKUP, abi.GETATTR, abi.GETXATTR, abi.FORGET, abi.BATCH_FORGET, abi.RELEASE})
BEFORE_RELEASE_HANDLES = frozenset({*BEFORE_RELEASES, abi.CREATE})


class Releases(Requests):
    """The kernel session's releases: answered at once, done in two parts later."""

    def __init__(self, ops: Operations):
        super().__init__(ops)
        self._released: list[int] = []  # handles released, nothing done about them yet
        self._closing: list[int] = []  # handles released, their release_handle still to do

    def _settle_releases(self) -> None:
        """Do the part of the releases read so far that others see (Operations.release_writes)."""
        released, self._released = self._released, []
        for fh in released:
            self._releasing(self.ops.release_writes, fh)
            self._closing.append(fh)

    def _finish_releases(self) -> bool:
        """Do all of the releases read so far; whether there were any."""
        if not self._released and not self._closing:
            return False
        self._settle_releases()
        closing, self._closing = self._closing, []
        for fh in closing:
            self._releasing(self.ops.release_handle, fh)
        return True

    @staticmethod
    def _releasing(step: Callable[[int], None], fh: int) -> None:
        try:
            step(fh)
        except Exception as e:  # the kernel ignores a release's result: say it here
            log.warning("releasing file handle %d failed: %s", fh, e, exc_info=not isinstance(e, OSError))

    def _release(self, unique: int, body: memoryview) -> None:
        """RELEASE, answered at once but done later (:meth:`_settle_releases`,
        :meth:`_finish_releases`); the record marks it, so that a successor finishes it if
        this daemon dies first (the kernel, answered, does not send it again)."""
        fh = abi.RELEASE_IN.unpack_from(body)[0]
        known = fh in self.ops.handles  # not: sent again, done before a predecessor died
        if known:
            if self.record is not None:
                self.record.releasing(fh)
            self._released.append(fh)  # done by _settle/_finish_releases
        self._reply(unique, [])
        if known and self.ops.opener.frees_space(fh):  # before anything queued behind it may need the space
            self._finish_releases()
