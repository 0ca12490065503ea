"""A DNS client for peer discovery: A, AAAA and SRV lookups, on trio, with deadlines.

Why not only the system resolver: ``getaddrinfo`` has no SRV lookups, and it cannot be told
to ask one given server (which a test, or an operator debugging discovery, needs).

Why dnspython: every answer comes from the network, and a DNS parser facing the network is
where a missed length or compression-pointer check becomes a crash or worse. This module had
its own; dnspython's is maintained and widely used. So dnspython builds the queries (EDNS0:
4096-byte answers over UDP) and parses every answer, checking it answers the question
asked. This module keeps the few lines that move the bytes on trio, over UDP and again
over TCP when the answer comes back truncated, as a headless Service of a thousand pods
makes it (:func:`_exchange` says why not ``dns.asyncquery``'s, :func:`_tcp` why a thread).

What this module adds: the lookups discovery needs (every address of a name; every SRV
target's addresses, from glue records or looked up, at most :data:`TARGET_LOOKUPS` at once),
a given server or else, for SRV, /etc/resolv.conf's servers and search list applied as a
pod's stub resolver does (``ndots:5``; addresses without a server come from
``getaddrinfo``, /etc/hosts included), UDP sent again every :data:`UDP_RETRY` seconds while
no answer comes, and one error: every failure, a malformed or mismatched answer included, is a
:class:`DnsError`, never another exception. What is read is bounded: one message is at most
:data:`MAX_MESSAGE` bytes (so a few thousand records), and the caller bounds the time
(``trio.fail_after``).
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

import dns.exception
import dns.inet
import dns.message
import dns.name
import dns.query
import dns.rcode
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import dns.rdtypes.IN.A
import dns.rdtypes.IN.AAAA
import dns.rdtypes.IN.SRV
import dns.rrset
import trio

A, AAAA, SRV = dns.rdatatype.A, dns.rdatatype.AAAA, dns.rdatatype.SRV
UDP_PAYLOAD = 4096  # what EDNS0 tells the server this client takes over UDP
MAX_MESSAGE = 65535  # bytes read of one answer (the UDP buffer; TCP's two-byte length)
MAX_RECORDS = 100_000  # records of one answer this client takes (a full message holds fewer)
TARGET_LOOKUPS = 32  # SRV targets without glue records looked up at once
UDP_RETRY = 1.0  # seconds before a UDP query is sent again
_T = TypeVar("_T")
RESOLV_CONF = "/etc/resolv.conf"
MAX_RESOLV_CONF = 64 << 10


class DnsError(Exception):
    """A lookup failed: no answer in time, a server error, or a malformed message."""


# -- one query -----------------------------------------------------------------------------


def _question(name: str, qtype: dns.rdatatype.RdataType) -> dns.message.Message:
    """One recursive question, with an EDNS0 record offering UDP_PAYLOAD-byte answers."""
    try:
        qname = dns.name.from_text(name)
    except (dns.exception.DNSException, ValueError) as e:  # a label over 63 bytes, a name over 255...
        raise DnsError(f"invalid DNS name {name[:80]!r}: {e}") from None
    return dns.message.make_query(qname, qtype, use_edns=0, payload=UDP_PAYLOAD)


def _parse(wire: bytes, question: dns.message.Message, udp: bool = False) -> dns.message.Message:
    """dnspython's reading of an answer to ``question``: a truncated one over UDP is dns.message.Truncated."""
    answer = dns.message.from_wire(wire, ignore_trailing=True, raise_on_truncation=udp)
    if not question.is_response(answer):  # our id, another question
        raise dns.query.BadResponse
    return answer


async def _exchange(server: tuple[str, int], question: dns.message.Message) -> dns.message.Message:
    """The answer over UDP; over TCP if it comes back truncated.

    Not ``dns.asyncquery.udp``: it parses a datagram before it looks at its id, so a forged
    one (right port, wrong id) would end the lookup in an error; or, with ``ignore_errors``,
    a malformed answer from the server itself would cost the whole deadline, not be a
    DnsError. Here a datagram with another id is dropped unread; ours is parsed.
    """
    wire = question.to_wire()
    with trio.socket.socket(dns.inet.af_for_address(server[0]), socket.SOCK_DGRAM) as sock:
        await sock.connect(server)  # the kernel then drops datagrams from anyone else, and says when nobody listens
        data = await _udp(sock, wire)
    try:
        return _parse(data, question, udp=True)
    except dns.message.Truncated:
        return await _tcp(server, question)


async def _udp(sock: trio.socket.SocketType, wire: bytes) -> bytes:
    """The bytes of the answer with the query's id; the query sent again every UDP_RETRY seconds till then."""
    while True:
        await sock.send(wire)
        with trio.move_on_after(UDP_RETRY):  # the query or its answer was lost: the same query (id) again
            while True:
                data = await sock.recv(MAX_MESSAGE)
                if data[:2] == wire[:2]:
                    return data
                # another id: a stray or forged datagram, not ours


async def _tcp(server: tuple[str, int], question: dns.message.Message) -> dns.message.Message:
    """The answer too big for UDP, parsed in a worker thread: dnspython takes ~75 ms for a thousand
    SRV records, which the trio loop (FUSE's too) should not stop for."""
    async with await trio.open_tcp_stream(*server) as stream:
        await stream.send_all(question.to_wire(prepend_length=True))
        wire = await _receive(stream, struct.unpack("!H", await _receive(stream, 2))[0])
    return await trio.to_thread.run_sync(_parse, wire, question)


async def _receive(stream: trio.SocketStream, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        piece = await stream.receive_some(n - len(data))
        if not piece:
            raise EOFError
        data += piece
    return bytes(data)


async def query(server: tuple[str, int], name: str, qtype: dns.rdatatype.RdataType) -> dns.message.Message:
    """Ask ``server`` once (UDP, then TCP if truncated); the caller sets the deadline.

    The answer, NOERROR or NXDOMAIN; anything else (no server, another rcode, an answer to
    another question, bytes dnspython cannot parse) is a DnsError.
    """
    question = _question(name, qtype)
    where = _name(server)
    try:
        answer = await _exchange(server, question)
    except ConnectionRefusedError:
        raise DnsError(f"DNS server {where} refused the connection (nothing listens)") from None
    except OSError as e:
        raise DnsError(f"DNS server {where}: {e.strerror or e}") from None
    except EOFError:
        raise DnsError(f"DNS server {where} closed the TCP connection mid-answer") from None
    except dns.query.BadResponse:
        raise DnsError(f"DNS server {where} sent an answer to another query") from None
    except (dns.exception.DNSException, ValueError) as e:  # the parser's: FormError, BadPointer, ...
        raise DnsError(f"malformed answer from DNS server {where}: {e}") from None
    if sum(len(rrset) for rrset in (*answer.answer, *answer.authority, *answer.additional)) > MAX_RECORDS:
        raise DnsError(f"DNS server {where} answered with more than {MAX_RECORDS} records")
    if answer.rcode() not in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN):
        raise DnsError(f"DNS server {where} answered {dns.rcode.to_text(answer.rcode())} for {name}")
    return answer


def _records(
    section: list[dns.rrset.RRset], rdtype: dns.rdatatype.RdataType
) -> list[tuple[dns.name.Name, dns.rdata.Rdata]]:
    """(owner, rdata) of every ``rdtype`` record of class IN in ``section``, whatever its owner (a CNAME's target)."""
    return [
        (rrset.name, rdata)
        for rrset in section
        if rrset.rdtype == rdtype and rrset.rdclass == dns.rdataclass.IN
        for rdata in rrset
    ]


def _addresses_in(section: list[dns.rrset.RRset], qtype: dns.rdatatype.RdataType) -> list[tuple[dns.name.Name, str]]:
    """(owner, address) of every A or AAAA record (``qtype``) of class IN in ``section``."""
    return [
        (owner, str(ipaddress.ip_address(rdata.address)))
        for owner, rdata in _records(section, qtype)
        if isinstance(rdata, (dns.rdtypes.IN.A.A, dns.rdtypes.IN.AAAA.AAAA))  # what dnspython parses them as
    ]


def _text(name: dns.name.Name) -> str:
    return name.to_text(omit_final_dot=True).lower()


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


async def lookup(
    name: str, qtype: dns.rdatatype.RdataType, server: tuple[str, int] | None = None
) -> dns.message.Message | None:
    """The answer holding ``qtype`` records for ``name`` (their glue in its additional section); None if none exist.

    ``server``: ask that one; None: the system's name servers and search domains. The
    caller bounds the time (``trio.fail_after``).
    """
    if server is not None:
        answer = await query(server, name, qtype)
        return answer if _records(answer.answer, qtype) else None
    conf = resolv_conf()
    error: DnsError | None = None
    for candidate in candidates(name, conf):
        for ns in conf.nameservers:
            try:
                answer = await query(ns, candidate, qtype)
            except DnsError as e:
                error = e
                continue
            if _records(answer.answer, qtype):
                return answer
            break  # this server knows the name has none: try the next candidate name
    if error is not None:
        raise error
    return None


async def addresses(name: str, server: tuple[str, int] | None = None) -> list[str]:
    """Every A and AAAA address of ``name``: from ``server``, or the system resolver (/etc/hosts too)."""
    if server is None:
        try:
            infos = await trio.socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                return []
            raise DnsError(f"cannot resolve {name}: {e.strerror or e}") from None
        return _unique(str(info[4][0]) for info in infos)  # an IP's text (str() for typeshed's int case)
    found: list[str] = []
    for qtype in (A, AAAA):
        answer = await lookup(name, qtype, server)
        if answer is not None:
            found += [address for _, address in _addresses_in(answer.answer, qtype)]
    return _unique(found)


async def services(name: str, server: tuple[str, int] | None = None) -> list[tuple[str, int]]:
    """The (address, port) of every SRV target of ``name``; targets resolved as ``addresses``."""
    answer = await lookup(name, SRV, server)
    if answer is None:
        return []
    glue: dict[str, list[str]] = {}
    for qtype in (A, AAAA):
        for owner, address in _addresses_in(answer.additional, qtype):
            glue.setdefault(_text(owner), []).append(address)
    ordered = sorted(
        (srv.priority, _text(srv.target), srv.port)
        for _, srv in _records(answer.answer, SRV)
        if isinstance(srv, dns.rdtypes.IN.SRV.SRV) and srv.target != dns.name.root
    )  # "." means "no such service here"
    wanted = {target for _, target, _ in ordered} - glue.keys()
    limiter = trio.CapacityLimiter(TARGET_LOOKUPS)

    async def resolve(target: str) -> None:
        async with limiter:
            glue[target] = await addresses(target, server)

    async with trio.open_nursery() as nursery:
        for target in sorted(wanted):
            nursery.start_soon(resolve, target)
    return _unique((ip, port) for _, target, port in ordered for ip in glue.get(target, ()))


def _unique(items: Iterable[_T]) -> list[_T]:
    return list(dict.fromkeys(items))


def _name(server: tuple[str, int]) -> str:
    return f"[{server[0]}]:{server[1]}" if ":" in server[0] else f"{server[0]}:{server[1]}"
