"""A tiny, real DNS server on a loopback address, answering A, AAAA and SRV from a dict.

It speaks the wire format over UDP and TCP as a cluster DNS server does: answers name the
question by a compression pointer, an answer too large for ``udp_limit`` comes back
truncated over UDP (the client must ask again over TCP), and a name it does not hold is
NXDOMAIN. Tests change ``records`` while it runs (a node that comes up late).
"""

from __future__ import annotations

import ipaddress
import socketserver
import struct
import threading

A, AAAA, SRV = 1, 28, 33


def _name(text: str) -> bytes:
    out = b""
    for label in text.rstrip(".").split("."):
        out += bytes([len(label)]) + label.encode()
    return out + b"\0"


class DnsServer:
    def __init__(self, host: str = "127.0.0.250", udp_limit: int = 4096, glue: bool = False):
        self.records: dict[str, list[tuple[int, object]]] = {}  # name -> [(type, value)]
        self.udp_limit = udp_limit  # answers longer than this are truncated over UDP
        self.glue = glue  # SRV answers carry their targets' addresses
        self.queries: list[tuple[str, str, int]] = []  # (transport, name, type)
        self.raw = None  # hostile answers: f(query, transport) -> bytes to send instead, None, or (UDP) a list
        self.lock = threading.Lock()
        server = self

        class Udp(socketserver.BaseRequestHandler):
            def handle(self):
                data, sock = self.request
                answer = server.answer(data, "udp")
                for datagram in answer if isinstance(answer, list) else [answer]:
                    if datagram is not None:
                        sock.sendto(datagram, self.client_address)

        class Tcp(socketserver.StreamRequestHandler):
            def handle(self):
                head = self.rfile.read(2)
                if len(head) == 2:
                    answer = server.answer(self.rfile.read(struct.unpack("!H", head)[0]), "tcp")
                    if answer is not None:
                        self.wfile.write(struct.pack("!H", len(answer)) + answer)

        socketserver.TCPServer.allow_reuse_address = True
        self.tcp = socketserver.ThreadingTCPServer((host, 0), Tcp)
        self.address = (host, self.tcp.server_address[1])
        self.udp = socketserver.ThreadingUDPServer(self.address, Udp)
        self.threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (self.tcp, self.udp)]
        for t in self.threads:
            t.start()

    @property
    def at(self) -> str:
        """The ``@IP:PORT`` suffix that points a ``--peers`` DNS item at this server."""
        return f"@{self.address[0]}:{self.address[1]}"

    def set_srv(self, name: str, targets: list[tuple[str, str, int]]) -> None:
        """``name`` gets one SRV record per (target name, its IPv4 address, port)."""
        with self.lock:
            self.records[name] = [(SRV, (0, 10, port, target)) for target, _, port in targets]
            for target, ip, _ in targets:
                self.records[target] = [(A, ip)]

    def set_addresses(self, name: str, ips: list[str]) -> None:
        with self.lock:
            self.records[name] = [(AAAA if ":" in ip else A, ip) for ip in ips]

    def answer(self, query: bytes, transport: str) -> bytes | None:
        if len(query) < 12:
            return None
        if self.raw is not None:
            return self.raw(query, transport)
        qid, flags, qd = struct.unpack("!HHH", query[:6])
        labels, offset = [], 12
        while query[offset]:
            n = query[offset]
            labels.append(query[offset + 1 : offset + 1 + n].decode())
            offset += 1 + n
        qtype = struct.unpack("!H", query[offset + 1 : offset + 3])[0]
        question = query[12 : offset + 5]
        name = ".".join(labels).lower()
        with self.lock:
            self.queries.append((transport, name, qtype))
            held = self.records.get(name)
            found = [v for t, v in held or () if t == qtype]
            extra = []
            if self.glue and qtype == SRV:
                for _, _, _, target in found:
                    extra += [(target, t, v) for t, v in self.records.get(target, ()) if t == A]
        answers = b"".join(self._record(b"\xc0\x0c", qtype, v) for v in found)
        additional = b"".join(self._record(_name(n), t, v) for n, t, v in extra)
        rcode = 3 if held is None else 0
        header = struct.pack("!HHHHHH", qid, 0x8180 | rcode, 1, len(found), 0, len(extra))
        message = header + question + answers + additional
        if transport == "udp" and len(message) > self.udp_limit:
            return struct.pack("!HHHHHH", qid, 0x8380, 1, 0, 0, 0) + question  # TC: ask over TCP
        return message

    @staticmethod
    def _record(owner: bytes, rtype: int, value) -> bytes:
        if rtype == A:
            data = ipaddress.IPv4Address(value).packed
        elif rtype == AAAA:
            data = ipaddress.IPv6Address(value).packed
        else:
            priority, weight, port, target = value
            data = struct.pack("!HHH", priority, weight, port) + _name(target)
        return owner + struct.pack("!HHIH", rtype, 1, 5, len(data)) + data

    def close(self) -> None:
        for s in (self.tcp, self.udp):
            s.shutdown()
            s.server_close()
