"""Where a restore gets a chunk from: the tiers that hold the step, cheapest first.

The tiers come as values (:mod:`tierfs.tiers`), already in the order to try: this node's
RAM, then the disk, the peers holding the step (closest first), GCS. Every tier verifies
what it gives (:meth:`~tierfs.tiers.base.Tier.get_chunk`), whichever it is. A tier that is
one of several holders of the same data (a peer) and fails (down, too slow, wrong bytes)
is not asked again during this restore; the chunk goes to the next tier.

Which tier a chunk is read from is one small function, :func:`sources_for`; when twins
restore a step from GCS together, :class:`tierfs.pipeline.coordinating.PlannedSources` makes a
per-chunk choice instead (one twin reads each chunk from GCS, the others from it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tierfs.core.errors import UserError
from tierfs.tiers.base import NotHeld, Tier, TierError, first_line, rotate_equals

log = logging.getLogger(__name__)


def sources_for(tiers: Sequence[Tier], h: str, prefer: int) -> list[Tier]:
    """The tiers to ask for chunk ``h``, in order: ``tiers`` with equals rotated by ``prefer``.

    Restore workers pass different ``prefer`` values, so the peers holding a step serve
    them in parallel, each worker starting at another peer.
    """
    return rotate_equals(tiers, prefer)


class ChunkSources:
    """The tiers one restore draws from, in the order to try them; what each gave."""

    def __init__(self, tiers: Sequence[Tier] = ()):
        self.tiers = list(tiers)
        self.alive: list[Tier] = list(tiers)
        self.bytes_from: dict[str, int] = {}  # tier name -> bytes it gave

    def batch(self) -> tuple[int, int]:
        """Bytes and chunks a restore may ask for together (:meth:`fetch_many_into`): (0, 1) for one at a time."""
        return next(((t.batch_bytes, t.batch_chunks) for t in self.alive if t.batch_bytes), (0, 1))

    async def fetch_into(self, h: str, length: int, fd: int, offset: int, prefer: int = 0) -> None:
        """Chunk ``h`` (``length`` bytes), verified, into ``fd`` at ``offset``.

        ``prefer`` rotates which of equal tiers goes first. Raises UserError (one line naming
        the chunk) when no tier can give it; the range may then hold anything, and must not
        be served.
        """
        errors: list[str] = []
        for tier in sources_for(self.alive, h, prefer):
            if tier not in self.alive:
                continue  # set aside by a concurrent fetch
            try:
                await tier.get_chunk_into(h, length, fd, offset)
            except Exception as e:  # noqa: BLE001 (a tier's trouble, or a bug in one, must not end the restore)
                if isinstance(e, NotHeld) and not tier.skip_after_failure:
                    log.debug("chunk %s: %s", h, e)
                    errors.append(first_line(e))
                else:
                    errors.append(f"{tier.name}: {first_line(e)}")
                    self._failed(tier, f"chunk {h}", e)
                continue
            self.bytes_from[tier.name] = self.bytes_from.get(tier.name, 0) + length
            return
        raise UserError(f"chunk {h} is on no reachable tier: {'; '.join(errors) or 'no tier holds it'}")

    async def fetch_many_into(
        self, chunks: list[tuple[str, int, int, int]], prefer: int = 0
    ) -> list[tuple[str, int, int, int]]:
        """Chunks ``(h, length, fd, offset)``, verified, into place, many per request where a tier allows it.

        Tiers are tried in the order :meth:`fetch_into` tries them. One that takes batches
        (a peer) is asked for all the chunks still wanted at once; one before it that does
        not (this node's RAM, the disk) keeps those it holds for :meth:`fetch_into`, which
        asks it first; at one after it (GCS) the batch ends. Returns the chunks still to
        fetch, one by one with :meth:`fetch_into`; their ranges may hold anything meanwhile.
        """
        wanted, single, batched = list(chunks), [], False
        for tier in sources_for(self.alive, chunks[0][0], prefer):
            if not wanted or (batched and not tier.batch_bytes):
                break
            if tier not in self.alive:
                continue  # set aside by a concurrent fetch
            try:
                if tier.batch_bytes:
                    batched = True
                    came = await tier.get_chunks_into(wanted)
                    if gave := sum(length for (_, length, _, _), ok in zip(wanted, came, strict=True) if ok):
                        self.bytes_from[tier.name] = self.bytes_from.get(tier.name, 0) + gave
                else:
                    came = await tier.has_chunks([h for h, _, _, _ in wanted])
                    single += [c for c, held in zip(wanted, came, strict=True) if held]
            except Exception as e:  # noqa: BLE001 (as in fetch_into: the chunks go on to the next tier)
                self._failed(tier, f"{len(wanted)} chunks from {wanted[0][0]}", e)
                continue
            wanted = [c for c, ok in zip(wanted, came, strict=True) if not ok]
        return single + wanted

    def _failed(self, tier: Tier, what: str, e: Exception) -> None:
        """A tier failed to give ``what``: one of several holders is not asked again during this restore."""
        if not isinstance(e, TierError):
            log.error("%s from %s: unexpected %s", what, tier.name, type(e).__name__, exc_info=True)
        if tier.skip_after_failure:
            if tier in self.alive:  # down or untrustworthy: not asked again in this restore
                self.alive.remove(tier)
            log.warning("%s from %s failed (%s); it is not asked again in this restore", what, tier.name, e)
        else:
            log.warning("%s from %s failed (%s); trying the next tier", what, tier.name, e)

    def order(self, hashes: list[str]) -> list[str]:
        """The order in which a restore's workers fetch ``hashes`` (a plan may change it)."""
        return hashes

    def arrived(self, h: str) -> None:
        """Chunk ``h`` is written where this node's peer service can read it (a plan tells its twins)."""

    async def aclose(self) -> None:
        for tier in self.tiers:
            await tier.aclose()
