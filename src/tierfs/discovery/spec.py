"""The ``--peers`` grammar: address lists, brace patterns and DNS sources, read once with the options.

At thousands of nodes nobody writes every peer's address. ``--peers`` takes, comma-separated,
any mix of:

- ``HOST:PORT``, as always;
- brace ranges, expanded in place: ``trainer-{0..1023}-0.train:7420``, several per item
  (``slice-{0..3}-{0..63}``), zero-padded when a bound is (``node{000..999}``); at most
  :data:`MAX_PEERS` addresses in all;
- ``dns:NAME:PORT``: every A/AAAA address of NAME (a headless Service), at PORT;
- ``dns+srv:NAME``: every SRV record of NAME, its target's addresses at its port.

Either DNS form may end in ``@IP[:PORT]`` to ask that DNS server instead of the system's.

Patterns are expanded when the options are read (a bad one is a one-line error then);
names are resolved by the daemon, never while the options are read
(:class:`tierfs.discovery.directory.PeerDirectory`).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from itertools import product

from tierfs.core.errors import UserError
from tierfs.core.parse import parse_address

MAX_PEERS = 100_000  # addresses --peers may expand to: a survey asks every one of them

_RANGE = re.compile(r"\{([^{}]*)\}")
_BOUNDS = re.compile(r"^(\d{1,9})\.\.(\d{1,9})$")
_DNS_NAME = re.compile(
    r"^(?=.{1,253}\.?$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
    r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$"
)
_FORMS = "HOST:PORT, a pattern like node-{0..15}:7420, dns:NAME:PORT or dns+srv:NAME"


@dataclass(frozen=True)
class DnsSource:
    """A DNS name whose records are peers: ``srv`` records, or A/AAAA addresses at ``port``."""

    kind: str  # "dns" (A/AAAA) or "dns+srv"
    name: str
    port: int | None = None  # "dns" only: SRV records carry their own
    server: tuple[str, int] | None = None  # None: the system's resolver

    def __str__(self) -> str:
        text = f"{self.kind}:{self.name}" + (f":{self.port}" if self.port is not None else "")
        if self.server is not None:
            host, port = self.server
            text += f"@[{host}]:{port}" if ":" in host else f"@{host}:{port}"
        return text

    async def resolve(self) -> list[tuple[str, int]]:
        """The peers this name gives now (no deadline here: the caller sets it)."""
        # dnspython takes ~70 ms to import: only a node given a DNS name pays it, not every start.
        from tierfs.discovery import dns  # noqa: PLC0415

        if self.kind == "dns+srv":
            return await dns.services(self.name, self.server)
        port = self.port
        assert port is not None  # a "dns" source always names its port (see _parse_source)
        return [(ip, port) for ip in await dns.addresses(self.name, self.server)]


@dataclass(frozen=True)
class PeerSpec:
    """What ``--peers`` says: fixed addresses (patterns expanded) and DNS names to resolve."""

    addresses: tuple[tuple[str, int], ...] = ()
    sources: tuple[DnsSource, ...] = ()


def parse_peers(text: str, what: str = "--peers") -> PeerSpec:
    """Parse a ``--peers`` value; every mistake is a one-line UserError naming the item."""
    items = [item.strip() for item in _split(str(text), what) if item.strip()]
    total = sum(_count(item, what) for item in items)
    if total > MAX_PEERS:
        size = f"{total:,}" if total < 10 * MAX_PEERS else f"over {10 * MAX_PEERS:,}"
        raise UserError(
            f"{what} expands to {size} addresses, more than the {MAX_PEERS:,} allowed: "
            "narrow the ranges, or use dns+srv:NAME"
        )
    addresses: list[tuple[str, int]] = []
    sources: list[DnsSource] = []
    for item in items:
        lowered = item.lower()
        if lowered.startswith(("dns:", "dns+srv:")):
            sources.append(_parse_source(item, what))
        else:
            addresses += [_address(text, item, what) for text in expand(item, what)]
    return PeerSpec(tuple(dict.fromkeys(addresses)), tuple(dict.fromkeys(sources)))


def _split(text: str, what: str) -> list[str]:
    """Split at commas outside braces; a comma inside braces is a list, which is not supported."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth < 0:
                raise UserError(f"invalid {what}: a '}}' without its '{{' in {text[:120]!r}")
        elif c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
        elif c == "," and depth:
            raise UserError(
                f"invalid {what}: braces hold a numeric range like {{0..15}}, not a list "
                f"({text[max(0, i - 40) : i + 40]!r}); write the items out, comma-separated"
            )
    if depth:
        raise UserError(f"invalid {what}: a '{{' without its '}}' in {text[:120]!r}")
    return items + [text[start:]]


def _ranges(item: str, what: str) -> list[tuple[int, int, int]]:
    """The item's ranges as (first, last, width); width > 0 pads with zeros."""
    out = []
    for body in _RANGE.findall(item):
        m = _BOUNDS.match(body)
        if not m:
            raise UserError(
                f"invalid range {{{body[:40]}}} in {what} item {item[:120]!r}: use whole numbers, "
                "e.g. {0..15} or {000..999}"
            )
        a, b = m.group(1), m.group(2)
        if int(a) > int(b):
            raise UserError(
                f"invalid range {{{body}}} in {what} item {item[:120]!r}: it counts down; write {{{b}..{a}}}"
            )
        padded = (len(a) > 1 and a[0] == "0") or (len(b) > 1 and b[0] == "0")
        out.append((int(a), int(b), max(len(a), len(b)) if padded else 0))
    return out


def _count(item: str, what: str) -> int:
    if item.lower().startswith(("dns:", "dns+srv:")):
        return 0
    n = 1
    for first, last, _ in _ranges(item, what):
        n = min(n * (last - first + 1), 10 * MAX_PEERS)  # the product of many ranges stays small
    return n


def expand(item: str, what: str = "--peers") -> list[str]:
    """Every string a brace pattern stands for, in order: ``n{1..2}-{0..1}`` -> n1-0, n1-1, n2-0, n2-1."""
    ranges = _ranges(item, what)
    if not ranges:
        return [item]
    parts = _RANGE.split(item)[::2]  # the text between the ranges
    choices = [[str(i).zfill(width) for i in range(first, last + 1)] for first, last, width in ranges]
    out = []
    for picked in product(*choices):
        text = parts[0]
        for value, part in zip(picked, parts[1:], strict=True):  # a range between every two texts
            text += value + part
        out.append(text)
    return out


def _address(text: str, item: str, what: str) -> tuple[str, int]:
    if "{" in text or "}" in text:
        raise UserError(f"invalid {what} item {item[:120]!r}: unbalanced braces")
    try:
        return parse_address(text, what)
    except UserError:
        gives = "" if text == item else f" (which gives {text[:120]!r})"
        raise UserError(f"invalid {what} item {item[:120]!r}{gives}: use {_FORMS}") from None


def _parse_source(item: str, what: str) -> DnsSource:
    kind, _, rest = item.partition(":")
    kind = kind.lower()
    body, at, server_text = rest.partition("@")
    server = _dns_server(server_text, item, what) if at else None
    if kind == "dns":
        name, sep, port = body.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise UserError(
                f"invalid {what} item {item[:120]!r}: dns: needs a port, e.g. dns:train.default.svc.cluster.local:7420"
            )
    else:
        name, port = body, None
    if not _DNS_NAME.match(name):
        raise UserError(f"invalid {what} item {item[:120]!r}: {name[:80]!r} is not a DNS name")
    return DnsSource(kind, name.lower(), int(port) if port is not None else None, server)


def _dns_server(text: str, item: str, what: str) -> tuple[str, int]:
    """``IP`` or ``IP:PORT`` (IPv6 as ``[::1]:53``): a DNS server is named by address, not by name."""
    host, port = text, "53"
    if text.startswith("["):
        host, _, tail = text[1:].partition("]")
        port = tail[1:] if tail.startswith(":") else ("53" if not tail else "x")
    elif text.count(":") == 1:
        host, port = text.split(":")
    try:
        ip = str(ipaddress.ip_address(host))
    except ValueError:
        ip = None
    if ip is None or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(
            f"invalid {what} item {item[:120]!r}: after '@' give the DNS server's IP[:PORT], "
            "e.g. @10.96.0.10 or @10.96.0.10:53"
        )
    return ip, int(port)
