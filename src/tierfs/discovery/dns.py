"""A small DNS client for peer discovery: A, AAAA and SRV lookups, on trio, with deadlines.

Why not only the system resolver: ``getaddrinfo`` has no SRV lookups, and it cannot be told
to ask one given server (which a test, or an operator debugging discovery, needs). Queries
go over UDP with EDNS0 (4096-byte answers) and again over TCP when the answer comes back
truncated, as a headless Service of a thousand pods makes it.

Answers come from the network: every length, offset and compression pointer is checked
before use, and anything malformed is a :class:`DnsError`, never another exception.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket
import struct
from dataclasses import dataclass

import trio

A, AAAA, SRV, CNAME, OPT = 1, 28, 33, 5, 41
NOERROR, NXDOMAIN = 0, 3
RCODES = {1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED"}
UDP_PAYLOAD = 4096  # what EDNS0 tells the server this client takes over UDP
MAX_MESSAGE = 65535  # a DNS message never exceeds this (TCP's two-byte length)
MAX_RECORDS = 100_000  # records of one answer this client reads (a full TCP message holds fewer)
MAX_POINTERS = 64  # compression jumps in one name (real names need a handful)
TARGET_LOOKUPS = 32  # SRV targets without glue records looked up at once
UDP_RETRY = 1.0  # seconds before a UDP query is sent again
RESOLV_CONF = "/etc/resolv.conf"
MAX_RESOLV_CONF = 64 << 10
_HEADER = struct.Struct("!HHHHHH")
_RR = struct.Struct("!HHIH")


class DnsError(Exception):
    """A lookup failed: no answer in time, a server error, or a malformed message."""


@dataclass(frozen=True)
class Srv:
    priority: int
    weight: int
    port: int
    target: str


@dataclass
class Answer:
    rcode: int
    truncated: bool
    records: list  # (type, owner, value): an address string, a Srv, or a CNAME target
    additional: list  # the same, from the additional section (SRV targets' addresses)


# -- messages ------------------------------------------------------------------------------


def encode_name(name: str) -> bytes:
    """``a.b.c`` (or ``a.b.c.``) as DNS labels; a bad name is a DnsError naming it."""
    labels = name.rstrip(".").split(".") if name.rstrip(".") else []
    out = bytearray()
    for label in labels:
        raw = label.encode("ascii", "replace")
        if not 0 < len(raw) < 64:
            raise DnsError(f"invalid DNS name {name!r}: every label has 1 to 63 characters")
        out += bytes([len(raw)]) + raw
    out += b"\0"
    if len(out) > 255:
        raise DnsError(f"invalid DNS name {name[:80]!r}...: longer than 255 bytes")
    return bytes(out)


def build_query(qid: int, name: str, qtype: int) -> bytes:
    """One recursive question, with an EDNS0 record offering UDP_PAYLOAD-byte answers."""
    header = _HEADER.pack(qid, 0x0100, 1, 0, 0, 1)  # RD; one question, one additional (OPT)
    question = encode_name(name) + struct.pack("!HH", qtype, 1)
    opt = b"\0" + struct.pack("!HHIH", OPT, UDP_PAYLOAD, 0, 0)
    return header + question + opt


def _read_name(data: bytes, offset: int) -> tuple[str, int]:
    """The name at ``offset`` and the offset just after it (where the record goes on)."""
    labels: list[str] = []
    end = None
    jumps = 0
    total = 0
    while True:
        if offset >= len(data):
            raise DnsError("malformed answer: a name runs past the end")
        length = data[offset]
        if length & 0xC0 == 0xC0:
            if offset + 1 >= len(data):
                raise DnsError("malformed answer: a cut compression pointer")
            target = ((length & 0x3F) << 8) | data[offset + 1]
            if end is None:
                end = offset + 2
            jumps += 1
            if jumps > MAX_POINTERS or target >= offset:  # only backwards: no loops
                raise DnsError("malformed answer: a compression pointer loops")
            offset = target
            continue
        if length & 0xC0:
            raise DnsError("malformed answer: an unknown label type")
        offset += 1
        if length == 0:
            break
        if offset + length > len(data):
            raise DnsError("malformed answer: a label runs past the end")
        total += length + 1
        if total > 255:
            raise DnsError("malformed answer: a name longer than 255 bytes")
        labels.append(data[offset:offset + length].decode("ascii", "replace"))
        offset += length
    return ".".join(labels), (end if end is not None else offset)


def parse_response(data: bytes, qid: int) -> Answer:
    """The answer to query ``qid``: its rcode, truncation, and the records this client uses."""
    if len(data) < _HEADER.size:
        raise DnsError("malformed answer: shorter than a DNS header")
    rid, flags, qd, an, ns, ar = _HEADER.unpack_from(data)
    if rid != qid:
        raise DnsError("answer to another query")
    if not flags & 0x8000:
        raise DnsError("malformed answer: not a response")
    offset = _HEADER.size
    for _ in range(qd):
        _, offset = _read_name(data, offset)
        offset += 4
    sections: list[list] = [[], [], []]
    if an + ns + ar > MAX_RECORDS:
        raise DnsError(f"answer of {an + ns + ar} records: at most {MAX_RECORDS}")
    for section, count in ((0, an), (1, ns), (2, ar)):
        for _ in range(count):
            owner, offset = _read_name(data, offset)
            if offset + _RR.size > len(data):
                raise DnsError("malformed answer: a record runs past the end")
            rtype, _klass, _ttl, length = _RR.unpack_from(data, offset)
            offset += _RR.size
            if offset + length > len(data):
                raise DnsError("malformed answer: record data runs past the end")
            value = _record_value(data, offset, rtype, length)
            if value is not None:
                sections[section].append((rtype, owner.lower(), value))
            offset += length
    return Answer(flags & 0x000F, bool(flags & 0x0200), sections[0], sections[2])


def _record_value(data: bytes, offset: int, rtype: int, length: int):
    if rtype == A:
        if length != 4:
            raise DnsError("malformed answer: an A record that is not 4 bytes")
        return str(ipaddress.IPv4Address(data[offset:offset + 4]))
    if rtype == AAAA:
        if length != 16:
            raise DnsError("malformed answer: an AAAA record that is not 16 bytes")
        return str(ipaddress.IPv6Address(data[offset:offset + 16]))
    if rtype == SRV:
        if length < 7:
            raise DnsError("malformed answer: a SRV record shorter than 7 bytes")
        priority, weight, port = struct.unpack_from("!HHH", data, offset)
        target, end = _read_name(data, offset + 6)
        if end > offset + length:
            raise DnsError("malformed answer: a SRV target runs past its record")
        return Srv(priority, weight, port, target.lower())
    if rtype == CNAME:
        return _read_name(data, offset)[0].lower()
    return None


# -- transport -----------------------------------------------------------------------------


async def _udp(server: tuple[str, int], query: bytes, qid: int) -> Answer:
    family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
    with trio.socket.socket(family, socket.SOCK_DGRAM) as sock:
        await sock.connect(server)  # the kernel then drops datagrams from anyone else
        while True:
            await sock.send(query)
            with trio.move_on_after(UDP_RETRY):
                while True:
                    try:
                        data = await sock.recv(MAX_MESSAGE)
                    except ConnectionRefusedError:
                        raise DnsError(f"DNS server {_name(server)} refused the connection (nothing listens)") from None
                    try:
                        return parse_response(data, qid)
                    except DnsError as e:
                        if str(e) != "answer to another query":
                            raise
                        # a stray or late answer to an earlier query: wait for ours


async def _tcp(server: tuple[str, int], query: bytes, qid: int) -> Answer:
    try:
        stream = await trio.open_tcp_stream(*server)
    except OSError as e:
        raise DnsError(f"cannot reach DNS server {_name(server)} over TCP: {e.strerror or e}") from None
    async with stream:
        await stream.send_all(struct.pack("!H", len(query)) + query)
        head = await _receive(stream, 2)
        return parse_response(await _receive(stream, struct.unpack("!H", head)[0]), qid)


async def _receive(stream: trio.SocketStream, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        piece = await stream.receive_some(n - len(data))
        if not piece:
            raise DnsError("the DNS server closed the TCP connection mid-answer")
        data += piece
    return bytes(data)


async def query(server: tuple[str, int], name: str, qtype: int) -> Answer:
    """Ask ``server`` once (UDP, then TCP if truncated); the caller sets the deadline."""
    qid = secrets.randbelow(1 << 16)
    message = build_query(qid, name, qtype)
    try:
        answer = await _udp(server, message, qid)
        if answer.truncated:
            answer = await _tcp(server, message, qid)
    except OSError as e:
        raise DnsError(f"DNS server {_name(server)}: {e.strerror or e}") from None
    if answer.rcode not in (NOERROR, NXDOMAIN):
        raise DnsError(f"DNS server {_name(server)} answered {RCODES.get(answer.rcode, answer.rcode)} for {name}")
    return answer


# -- lookups -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvConf:
    nameservers: tuple[tuple[str, int], ...]
    search: tuple[str, ...] = ()
    ndots: int = 1


def resolv_conf(path: str = RESOLV_CONF) -> ResolvConf:
    """The system's DNS servers and search domains (what a pod's /etc/resolv.conf says)."""
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_RESOLV_CONF).decode("utf-8", "replace")
    except OSError:
        text = ""
    servers, search, ndots = [], [], 1
    for line in text.splitlines():
        words = line.split("#")[0].split(";")[0].split()
        if len(words) >= 2 and words[0] == "nameserver":
            try:
                servers.append((str(ipaddress.ip_address(words[1].split("%")[0])), 53))
            except ValueError:
                continue
        elif words and words[0] in ("search", "domain"):
            search = words[1:]
        elif words and words[0] == "options":
            for opt in words[1:]:
                if opt.startswith("ndots:") and opt[6:].isdigit():
                    ndots = min(int(opt[6:]), 15)
    return ResolvConf(tuple(servers[:3]) or (("127.0.0.1", 53),), tuple(search[:6]), ndots)


def candidates(name: str, conf: ResolvConf) -> list[str]:
    """The names to try for ``name``, in the order a stub resolver tries them."""
    if name.endswith("."):
        return [name]
    searched = [f"{name}.{domain}" for domain in conf.search]
    return [name, *searched] if name.count(".") >= conf.ndots else [*searched, name]


async def lookup(name: str, qtype: int, server: tuple[str, int] | None = None) -> tuple[list, list]:
    """Records of ``qtype`` for ``name`` (answer section, additional section); empty if none exist.

    ``server``: ask that one; None: the system's name servers and search domains. The
    caller bounds the time (``trio.fail_after``).
    """
    if server is not None:
        answer = await query(server, name, qtype)
        return [r for r in answer.records if r[0] == qtype], answer.additional
    conf = resolv_conf()
    error: DnsError | None = None
    for candidate in candidates(name, conf):
        for ns in conf.nameservers:
            try:
                answer = await query(ns, candidate, qtype)
            except DnsError as e:
                error = e
                continue
            found = [r for r in answer.records if r[0] == qtype]
            if found:
                return found, answer.additional
            break  # this server knows the name has none: try the next candidate name
    if error is not None:
        raise error
    return [], []


async def addresses(name: str, server: tuple[str, int] | None = None) -> list[str]:
    """Every A and AAAA address of ``name``: from ``server``, or the system resolver (/etc/hosts too)."""
    if server is None:
        try:
            infos = await trio.socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                return []
            raise DnsError(f"cannot resolve {name}: {e.strerror or e}") from None
        return _unique(info[4][0] for info in infos)
    found: list[str] = []
    for qtype in (A, AAAA):
        records, _ = await lookup(name, qtype, server)
        found += [value for _, _, value in records]
    return _unique(found)


async def services(name: str, server: tuple[str, int] | None = None) -> list[tuple[str, int]]:
    """The (address, port) of every SRV target of ``name``; targets resolved as ``addresses``."""
    records, additional = await lookup(name, SRV, server)
    glue: dict[str, list[str]] = {}
    for rtype, owner, value in additional:
        if rtype in (A, AAAA):
            glue.setdefault(owner.rstrip("."), []).append(value)
    ordered = [srv for _, _, srv in sorted(records, key=lambda r: (r[2].priority, r[2].target, r[2].port))
               if srv.target not in ("", ".")]  # "." means "no such service here"
    wanted = {srv.target.rstrip(".") for srv in ordered} - glue.keys()
    limiter = trio.CapacityLimiter(TARGET_LOOKUPS)

    async def resolve(target: str) -> None:
        async with limiter:
            glue[target] = await addresses(target, server)

    async with trio.open_nursery() as nursery:
        for target in sorted(wanted):
            nursery.start_soon(resolve, target)
    return _unique((ip, srv.port) for srv in ordered for ip in glue.get(srv.target.rstrip("."), ()))


def _unique(items) -> list:
    return list(dict.fromkeys(items))


def _name(server: tuple[str, int]) -> str:
    return f"[{server[0]}]:{server[1]}" if ":" in server[0] else f"{server[0]}:{server[1]}"
