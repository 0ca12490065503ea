"""The DNS client against a real DNS server on loopback, and against one answering hostile bytes."""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.discovery.dns_server import DnsServer
from tierfs.discovery import dns
from tierfs.discovery.directory import PeerDirectory
from tierfs.discovery.spec import DnsSource, PeerSpec, parse_peers


def nodes(n: int, port: int = 7420) -> list[tuple[str, str, int]]:
    """SRV targets: (name, address, port), addresses 127.0.0.10, 127.0.0.11, ..."""
    return [(f"node-{i}.train.test", f"127.0.{(10 + i) // 250}.{(10 + i) % 250}", port) for i in range(n)]


def test_srv_records_give_each_target_address_at_its_port(dns_server):
    dns_server.set_srv("_tierfs._tcp.train.test", nodes(3))
    found = trio.run(dns.services, "_tierfs._tcp.train.test", dns_server.address)
    assert found == [(f"127.0.0.{10 + i}", 7420) for i in range(3)]
    # No glue records: each target was asked for its A and AAAA records.
    asked = {name for _, name, qtype in dns_server.queries if qtype in (dns.A, dns.AAAA)}
    assert asked == {f"node-{i}.train.test" for i in range(3)}


def test_glue_records_save_the_target_lookups():
    server = DnsServer(glue=True)
    try:
        server.set_srv("_tierfs._tcp.train.test", nodes(3))
        found = trio.run(dns.services, "_tierfs._tcp.train.test", server.address)
        assert len(found) == 3
        assert [q[2] for q in server.queries] == [dns.SRV]
    finally:
        server.close()


def test_a_truncated_answer_is_asked_again_over_tcp():
    server = DnsServer(udp_limit=512)
    try:
        server.set_srv("_tierfs._tcp.big.test", nodes(1000))
        found = trio.run(dns.services, "_tierfs._tcp.big.test", server.address)
        assert len(found) == 1000
        srv_queries = [q[0] for q in server.queries if q[2] == dns.SRV]
        assert srv_queries == ["udp", "tcp"]
    finally:
        server.close()


def test_a_and_aaaa_records_of_a_headless_service(dns_server):
    dns_server.set_addresses("train.test", ["127.0.0.2", "127.0.0.3", "::1"])
    assert trio.run(dns.addresses, "train.test", dns_server.address) == ["127.0.0.2", "127.0.0.3", "::1"]


def test_a_name_that_does_not_exist_has_no_peers(dns_server):
    assert trio.run(dns.addresses, "nobody.test", dns_server.address) == []
    assert trio.run(dns.services, "_tierfs._tcp.nobody.test", dns_server.address) == []


def test_the_system_resolver_answers_for_an_address():
    assert trio.run(dns.addresses, "127.0.0.7") == ["127.0.0.7"]


def test_nobody_listening_is_an_error_at_once():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.251", 0))
        port = s.getsockname()[1]
    with pytest.raises(dns.DnsError, match="refused"):
        trio.run(dns.query, ("127.0.0.251", port), "x.test", dns.A)


def test_a_silent_server_costs_the_deadline_and_the_last_answer_stays(dns_server, caplog):
    """A DNS server that stops answering: one log line, the peers it gave before are kept."""
    dns_server.set_srv("_tierfs._tcp.train.test", nodes(2))
    directory = PeerDirectory(parse_peers(f"dns+srv:_tierfs._tcp.train.test{dns_server.at}"), timeout=1.0)
    assert trio.run(directory.resolve) == [("127.0.0.10", 7420), ("127.0.0.11", 7420)]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
        silent.bind(("127.0.0.252", 0))
        source = DnsSource("dns+srv", "_tierfs._tcp.train.test", None, silent.getsockname())
        directory.spec = PeerSpec((("127.0.0.9", 1),), directory.spec.sources + (source,))
        caplog.set_level(logging.INFO, logger="tierfs.discovery.directory")
        for _ in range(2):
            found = trio.run(directory.resolve)
        assert found == [("127.0.0.9", 1), ("127.0.0.10", 7420), ("127.0.0.11", 7420)]
    failures = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert failures == [f"peer discovery: {source} failed (no answer within 1s); retrying"]


def test_a_failing_source_keeps_the_peers_it_gave(dns_server, caplog):
    dns_server.set_srv("_tierfs._tcp.train.test", nodes(2))
    directory = PeerDirectory(parse_peers(f"dns+srv:_tierfs._tcp.train.test{dns_server.at}"), timeout=1.0)
    trio.run(directory.resolve)
    dns_server.udp.shutdown()
    dns_server.udp.server_close()  # nothing listens: every query is refused
    caplog.set_level(logging.WARNING, logger="tierfs.discovery.directory")
    assert trio.run(directory.resolve) == [("127.0.0.10", 7420), ("127.0.0.11", 7420)]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "failed (DNS server" in line and line.endswith("keeping its 2 peer(s) from before")


def test_late_records_appear_at_the_next_lookup(dns_server):
    dns_server.set_srv("_tierfs._tcp.train.test", nodes(1))
    directory = PeerDirectory(parse_peers(f"dns+srv:_tierfs._tcp.train.test{dns_server.at},127.0.0.9:1"))
    assert trio.run(directory.resolve) == [("127.0.0.9", 1), ("127.0.0.10", 7420)]
    dns_server.set_srv("_tierfs._tcp.train.test", nodes(3))
    assert trio.run(directory.resolve)[-1] == ("127.0.0.12", 7420)


def test_resolv_conf_and_the_search_order(tmp_path):
    conf = tmp_path / "resolv.conf"
    conf.write_text(
        "# kube\nnameserver 10.96.0.10\nnameserver bogus\n"
        "search ns.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5 timeout:1\n"
    )
    rc = dns.resolv_conf(str(conf))
    assert rc.nameservers == (("10.96.0.10", 53),) and rc.ndots == 5
    assert dns.candidates("a.b.ns.svc", rc) == [
        "a.b.ns.svc.ns.svc.cluster.local",
        "a.b.ns.svc.svc.cluster.local",
        "a.b.ns.svc.cluster.local",
        "a.b.ns.svc",
    ]
    assert dns.candidates("x.", rc) == ["x."]
    assert dns.resolv_conf(str(tmp_path / "absent")).nameservers == (("127.0.0.1", 53),)


# -- hostile answers ----------------------------------------------------------------------
# The server answers every query with the bytes given: dnspython parses them, and whatever
# it finds must come out of the client as a DnsError, never as another exception.


def reply(body: bytes, an: int = 1, qd: int = 0, flags: int = 0x8180, qid_xor: int = 0):
    """For the server's ``raw``: the query's id, a header of ``qd`` questions and ``an`` answers, ``body``.

    With ``qd``, the query's own question comes first (the query ends in its 11-byte EDNS0 record).
    """

    def answer(query: bytes, transport: str) -> bytes:
        qid = struct.unpack("!H", query[:2])[0] ^ qid_xor
        return struct.pack("!HHHHHH", qid, flags, qd, an, 0, 0) + (query[12:-11] if qd else b"") + body

    return answer


def ask(server: DnsServer, raw) -> object:
    server.raw = raw
    return trio.run(dns.query, server.address, "x.test", dns.A)


LOOPED = b"\xc0\x0c" + struct.pack("!HHIH", dns.A, 1, 0, 4) + b"\1\2\3\4"  # its name points at itself


def test_a_compression_loop_is_refused(dns_server):
    with pytest.raises(dns.DnsError, match="malformed answer from DNS server .*pointer"):
        ask(dns_server, reply(LOOPED))


@pytest.mark.parametrize(
    "body",
    [
        b"\x05abc",  # a name runs past the end
        b"\0" + struct.pack("!HHIH", dns.A, 1, 0, 9) + b"\1\2\3\4",  # record data runs past the end
        b"\0" + struct.pack("!HHIH", dns.A, 1, 0, 3) + b"\1\2\3",  # an A record of 3 bytes
        b"\0" + struct.pack("!HHIH", dns.SRV, 1, 0, 7) + b"\0\1\0\1\0\1\x05ab",  # a SRV target past its record
        b"\x80",  # an unknown label type
    ],
)
def test_malformed_records_are_dns_errors(dns_server, body):
    with pytest.raises(dns.DnsError, match="malformed answer from DNS server"):
        ask(dns_server, reply(body))


def test_a_datagram_with_another_id_is_not_taken(dns_server):
    """Dropped unread (a forged one cannot end the lookup), and the answer after it is taken."""
    stray = reply(b"\x80", qid_xor=1)  # malformed too: never parsed
    ours = reply(b"\xc0\x0c" + struct.pack("!HHIH", dns.A, 1, 0, 4) + b"\1\2\3\4", qd=1)
    dns_server.raw = lambda query, transport: [stray(query, transport), ours(query, transport)]
    assert trio.run(dns.addresses, "x.test", dns_server.address) == ["1.2.3.4"]


def test_an_answer_to_another_question_is_a_dns_error(dns_server):
    with pytest.raises(dns.DnsError, match="answer to another query"):
        ask(dns_server, reply(b"", an=0))


def test_a_server_failure_is_a_dns_error(dns_server):
    with pytest.raises(dns.DnsError, match="answered SERVFAIL for x.test"):
        ask(dns_server, reply(b"", an=0, qd=1, flags=0x8182))


@pytest.mark.parametrize(
    "tcp_answer, message",
    [
        (None, "closed the TCP connection mid-answer"),  # truncated over UDP, then nothing over TCP
        (reply(LOOPED), "malformed answer"),
    ],
)
def test_after_truncation_a_bad_tcp_answer_is_a_dns_error(dns_server, tcp_answer, message):
    truncated = reply(b"", an=0, qd=1, flags=0x8380)

    def raw(query: bytes, transport: str) -> bytes | None:
        if transport == "udp":
            return truncated(query, transport)
        return tcp_answer(query, transport) if tcp_answer else None

    with pytest.raises(dns.DnsError, match=message):
        ask(dns_server, raw)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=600), qd=st.integers(0, 3), an=st.integers(0, 3))
def test_any_bytes_answer_or_fail_as_dns_errors(dns_server, body, qd, an):
    dns_server.raw = reply(body, an=an, qd=qd)
    try:
        found = trio.run(dns.addresses, "x.test", dns_server.address)
    except dns.DnsError:
        return
    assert all(ipaddress.ip_address(ip) for ip in found)
