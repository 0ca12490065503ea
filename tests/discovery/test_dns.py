"""The DNS client against a real DNS server on loopback, and its parser against hostile bytes."""

from __future__ import annotations

import logging
import socket
import struct

import pytest
import trio
from hypothesis import given, settings
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
    conf.write_text("# kube\nnameserver 10.96.0.10\nnameserver bogus\n"
                    "search ns.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5 timeout:1\n")
    rc = dns.resolv_conf(str(conf))
    assert rc.nameservers == (("10.96.0.10", 53),) and rc.ndots == 5
    assert dns.candidates("a.b.ns.svc", rc) == ["a.b.ns.svc.ns.svc.cluster.local", "a.b.ns.svc.svc.cluster.local",
                                                "a.b.ns.svc.cluster.local", "a.b.ns.svc"]
    assert dns.candidates("x.", rc) == ["x."]
    assert dns.resolv_conf(str(tmp_path / "absent")).nameservers == (("127.0.0.1", 53),)


# -- hostile answers ----------------------------------------------------------------------


def answer_with(body: bytes, an: int = 1, qid: int = 7) -> bytes:
    return struct.pack("!HHHHHH", qid, 0x8180, 0, an, 0, 0) + body


def test_a_compression_loop_is_refused():
    looped = answer_with(b"\xc0\x0c" + struct.pack("!HHIH", dns.A, 1, 0, 4) + b"\1\2\3\4")
    with pytest.raises(dns.DnsError, match="loops"):
        dns.parse_response(looped, 7)


@pytest.mark.parametrize("body, message", [
    (b"\x05abc", "runs past the end"),
    (b"\0" + struct.pack("!HHIH", dns.A, 1, 0, 9) + b"\1\2\3\4", "record data runs past the end"),
    (b"\0" + struct.pack("!HHIH", dns.A, 1, 0, 3) + b"\1\2\3", "not 4 bytes"),
    (b"\0" + struct.pack("!HHIH", dns.SRV, 1, 0, 7) + b"\0\1\0\1\0\1\x05ab", "past"),
    (b"\x80", "unknown label type"),
])
def test_malformed_records_are_dns_errors(body, message):
    with pytest.raises(dns.DnsError, match=message):
        dns.parse_response(answer_with(body), 7)


def test_an_answer_to_another_query_is_not_taken():
    with pytest.raises(dns.DnsError, match="another query"):
        dns.parse_response(answer_with(b"", an=0, qid=8), 7)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=600), st.integers(0, 3), st.integers(0, 3))
def test_any_bytes_parse_or_fail_as_dns_errors(body, qd, an):
    message = struct.pack("!HHHHHH", 7, 0x8180, qd, an, 0, 0) + body
    try:
        answer = dns.parse_response(message, 7)
    except dns.DnsError:
        return
    assert all(isinstance(r, tuple) and len(r) == 3 for r in answer.records)
