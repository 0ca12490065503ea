"""Where a job's peers are now: the fixed addresses of ``--peers`` and what its DNS sources last gave.

DNS sources (:mod:`tierfs.discovery.spec`) are resolved by :class:`PeerDirectory`, at start
and again every ``--survey-interval``, each lookup under a deadline, on trio, so the FUSE
loop never waits for DNS. A source that fails keeps its last answer and costs one log
line; nodes that come up late appear at the next lookup. A brace pattern's host names are
resolved when the daemon connects, as for any ``HOST:PORT``.
"""

from __future__ import annotations

import logging

import trio

from tierfs.discovery.spec import DnsSource, PeerSpec

log = logging.getLogger(__name__)

RESOLVE_TIMEOUT = 5.0  # seconds one DNS source may take
RETRY_EMPTY = 2.0  # seconds between lookups while DNS has given no peer at all
MISSING_NAMED = 3  # unanswering peers named in one warning; the rest are counted


class PeerDirectory:
    """The peers of a job as known now: the fixed addresses, and what each DNS source last gave."""

    def __init__(self, spec: PeerSpec, timeout: float = RESOLVE_TIMEOUT):
        self.spec = spec
        self.timeout = timeout
        self._answers: dict[DnsSource, list[tuple[str, int]]] = {}
        self._errors: dict[DnsSource, str] = {}  # the last error logged, so it is logged once

    @property
    def dynamic(self) -> bool:
        return bool(self.spec.sources)

    def addresses(self) -> list[tuple[str, int]]:
        found = list(self.spec.addresses)
        for source in self.spec.sources:
            found += self._answers.get(source, [])
        return list(dict.fromkeys(found))

    async def resolve(self) -> list[tuple[str, int]]:
        """Look every DNS source up again (concurrently, each under the deadline); the addresses now."""
        async with trio.open_nursery() as nursery:
            for source in self.spec.sources:
                nursery.start_soon(self._resolve, source)
        return self.addresses()

    async def _resolve(self, source: DnsSource) -> None:
        from tierfs.discovery.dns import DnsError  # noqa: PLC0415 (loaded by source.resolve anyway: see there)

        error = None
        try:
            with trio.fail_after(self.timeout):
                found = await source.resolve()
        except trio.TooSlowError:
            error = f"no answer within {self.timeout:g}s"
        except DnsError as e:
            error = str(e)
        except OSError as e:  # the network, not the answer: e.g. no route to the DNS server
            error = e.strerror or str(e)
        except Exception as e:  # noqa: BLE001 (answers from the network: a surprise costs a line, not the daemon)
            error = f"{type(e).__name__}: {e}"
        if error is not None:
            if self._errors.get(source) != error:
                kept = len(self._answers.get(source, []))
                log.warning(
                    "peer discovery: %s failed (%s); %s",
                    source,
                    error,
                    f"keeping its {kept} peer(s) from before" if kept else "retrying",
                )
                self._errors[source] = error
            return
        if self._errors.pop(source, None) is not None:
            log.info("peer discovery: %s answers again", source)
        before = self._answers.get(source)
        self._answers[source] = found
        if before != found:
            log.info("peer discovery: %s gives %d peer(s)%s", source, len(found), _changes(before or [], found))


def _changes(before: list[tuple[str, int]], after: list[tuple[str, int]]) -> str:
    added = [a for a in after if a not in set(before)]
    gone = [a for a in before if a not in set(after)]
    words = []
    for sign, which in (("+", added), ("-", gone)):
        if which:
            names = ", ".join(f"{h}:{p}" for h, p in which[:MISSING_NAMED])
            more = f" and {len(which) - MISSING_NAMED} more" if len(which) > MISSING_NAMED else ""
            words.append(f"{sign}{names}{more}")
    return f" ({'; '.join(words)})" if words else ""


def unanswered(names: list[str]) -> list[str]:
    """Warnings about peers that do not answer: one per peer for a few, one line for many."""
    if len(names) <= MISSING_NAMED:
        return [f"peer {name} does not answer yet; replication uses the others and retries it" for name in names]
    return [
        f"{len(names)} peers do not answer yet ({', '.join(names[:MISSING_NAMED])} and "
        f"{len(names) - MISSING_NAMED} more); replication uses the others and retries them"
    ]
