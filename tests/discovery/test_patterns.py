"""--peers patterns: what they expand to, and the one-line error each mistake gets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs.config import Config
from tierfs.core.errors import UserError
from tierfs.discovery.directory import unanswered
from tierfs.discovery.spec import MAX_PEERS, DnsSource, expand, parse_peers

SECRET = "s" * 16


def test_a_plain_list_is_what_it_always_was():
    spec = parse_peers("10.0.0.1:7420, 10.0.0.2:7420,[fd00::3]:7420,")
    assert spec.addresses == (("10.0.0.1", 7420), ("10.0.0.2", 7420), ("fd00::3", 7420))
    assert spec.sources == ()


def test_a_brace_range_expands_in_order():
    spec = parse_peers("trainer-{0..3}-0.train:7000")
    assert [h for h, _ in spec.addresses] == [f"trainer-{i}-0.train" for i in range(4)]
    assert {p for _, p in spec.addresses} == {7000}


def test_several_ranges_make_every_combination_first_range_slowest():
    assert expand("s{0..1}-{0..2}") == ["s0-0", "s0-1", "s0-2", "s1-0", "s1-1", "s1-2"]
    spec = parse_peers("js-slice-{0..1}-{0..1}.js.default.svc:7420,10.0.0.9:1")
    assert len(spec.addresses) == 5 and spec.addresses[-1] == ("10.0.0.9", 1)


def test_zero_padding_follows_a_padded_bound():
    assert expand("n{000..003}") == ["n000", "n001", "n002", "n003"]
    assert expand("n{08..10}") == ["n08", "n09", "n10"]
    assert expand("n{8..10}") == ["n8", "n9", "n10"]
    assert expand("n{0..0}") == ["n0"]


def test_ranges_may_stand_in_the_address_and_the_port():
    spec = parse_peers("127.0.0.{2..4}:{7000..7001}")
    assert spec.addresses == tuple((f"127.0.0.{h}", p) for h in (2, 3, 4) for p in (7000, 7001))


def test_duplicates_are_dropped_and_the_listen_address_is_not_a_peer():
    cfg = Config.build(
        mountpoint="/mnt/x", secret=SECRET, listen="127.0.0.3:7000", peers="127.0.0.{2..4}:7000,127.0.0.2:7000"
    )
    assert cfg.peers == (("127.0.0.2", 7000), ("127.0.0.4", 7000))


def test_dns_items_become_sources_resolved_later():
    spec = parse_peers(
        "dns:Train.default.svc.cluster.local:7420,dns+srv:_tierfs._tcp.train.default.svc,"
        "dns+srv:_t._tcp.x@127.0.0.53,dns:x.y:1@[::1]:5353"
    )
    assert spec.addresses == ()
    assert spec.sources == (
        DnsSource("dns", "train.default.svc.cluster.local", 7420),
        DnsSource("dns+srv", "_tierfs._tcp.train.default.svc"),
        DnsSource("dns+srv", "_t._tcp.x", None, ("127.0.0.53", 53)),
        DnsSource("dns", "x.y", 1, ("::1", 5353)),
    )
    assert [str(s) for s in spec.sources] == [
        "dns:train.default.svc.cluster.local:7420",
        "dns+srv:_tierfs._tcp.train.default.svc",
        "dns+srv:_t._tcp.x@127.0.0.53:53",
        "dns:x.y:1@[::1]:5353",
    ]


def test_the_cap_counts_before_expanding():
    n = 10**5
    assert len(parse_peers(f"n{{1..{n}}}:1").addresses) == MAX_PEERS
    with pytest.raises(UserError) as e:
        parse_peers(f"n{{1..{n}}}:1,m:1")
    assert str(e.value) == (
        "--peers expands to 100,001 addresses, more than the 100,000 allowed: narrow the ranges, or use dns+srv:NAME"
    )
    with pytest.raises(UserError, match="expands to over 1,000,000 addresses"):
        parse_peers("n{0..999999}-{0..999999}-{0..999999}:1")  # refused at once, not after expanding


@pytest.mark.parametrize(
    "text, message",
    [
        ("n{3..1}:7", "invalid range {3..1} in --peers item 'n{3..1}:7': it counts down; write {1..3}"),
        (
            "n{a..b}:7",
            "invalid range {a..b} in --peers item 'n{a..b}:7': use whole numbers, e.g. {0..15} or {000..999}",
        ),
        ("n{1..}:7", "invalid range {1..} in --peers item"),
        ("n{0..1:7", "invalid --peers: a '{' without its '}' in 'n{0..1:7'"),
        ("n0..1}:7", "invalid --peers: a '}' without its '{' in 'n0..1}:7'"),
        ("n{a,b}:7", "invalid --peers: braces hold a numeric range like {0..15}, not a list"),
        ("n{0..1}", "invalid --peers item 'n{0..1}' (which gives 'n0'): use HOST:PORT, a pattern like"),
        ("node", "invalid --peers item 'node': use HOST:PORT"),
        ("n:99999", "invalid --peers item 'n:99999': use HOST:PORT"),
        ("dns:train.svc", "invalid --peers item 'dns:train.svc': dns: needs a port"),
        ("dns:bad name:7", "invalid --peers item 'dns:bad name:7': 'bad name' is not a DNS name"),
        ("dns+srv:", "invalid --peers item 'dns+srv:': '' is not a DNS name"),
        ("dns+srv:a..b", "invalid --peers item 'dns+srv:a..b': 'a..b' is not a DNS name"),
        (
            "dns+srv:_t._tcp.x@dns.example",
            "invalid --peers item 'dns+srv:_t._tcp.x@dns.example': after '@' give the DNS server's IP[:PORT]",
        ),
        (
            "dns+srv:_t._tcp.x@127.0.0.1:0",
            "invalid --peers item 'dns+srv:_t._tcp.x@127.0.0.1:0': after '@' give the DNS server's IP[:PORT]",
        ),
    ],
)
def test_a_bad_pattern_is_one_line_naming_it(text, message):
    with pytest.raises(UserError) as e:
        parse_peers(text)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_bad_patterns_fail_the_config_as_every_option_does():
    with pytest.raises(UserError, match="counts down"):
        Config.build(mountpoint="/mnt/x", secret=SECRET, peers="n{9..0}:1")


def test_dns_peers_need_the_secret_and_leave_replicas_to_run_time():
    with pytest.raises(UserError, match="needs the job's secret"):
        Config.build(mountpoint="/mnt/x", peers="dns+srv:_t._tcp.x")
    cfg = Config.build(mountpoint="/mnt/x", secret=SECRET, peers="dns+srv:_t._tcp.x", replicas="3")
    assert cfg.peers == () and cfg.replicas == 3 and len(cfg.peer_dns) == 1
    with pytest.raises(UserError, match="between 1 and the 2 peer"):
        Config.build(mountpoint="/mnt/x", secret=SECRET, peers="n{0..1}:1", replicas="3")


def test_many_silent_peers_are_one_warning():
    assert unanswered(["a:1", "b:1"]) == [
        f"peer {n} does not answer yet; replication uses the others and retries it" for n in ("a:1", "b:1")
    ]
    (line,) = unanswered([f"n{i}:1" for i in range(1000)])
    assert line.startswith("1000 peers do not answer yet (n0:1, n1:1, n2:1 and 997 more)")


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="ab0129.:{},@[]-_+dnsrv ", max_size=60))
def test_any_text_is_peers_or_one_user_error(text):
    try:
        spec = parse_peers(text)
    except UserError as e:
        assert "\n" not in str(e)
        return
    assert len(spec.addresses) <= MAX_PEERS
