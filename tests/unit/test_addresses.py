"""DEFAULT_DENY_RANGES, embedded_ipv4, RangeTable and AddressGuard."""

from __future__ import annotations

import ipaddress
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.addresses import (
    DEFAULT_DENY_RANGES,
    AddressGuard,
    AddressVerdict,
    RangeTable,
    default_deny_table,
    embedded_ipv4,
    parse_network,
)

ip = ipaddress.ip_address
net = ipaddress.ip_network
V4 = ipaddress.IPv4Address


def guard(allow: list[str] = (), deny: list[str] | None = None, self_addresses=(), listeners=()) -> AddressGuard:
    deny_table = default_deny_table() if deny is None else RangeTable.of((net(c), f"test {c}") for c in deny)
    allow_table = RangeTable.of((net(c), f"allow {c}") for c in allow)
    return AddressGuard(deny_table, allow_table).with_self(
        [ip(a) for a in self_addresses], [(ip(a), p) for a, p in listeners]
    )


def teredo(server: str, client: str, flags: int = 0, port: int = 0) -> ipaddress.IPv6Address:
    value = (
        (0x20010000 << 96)
        | (int(V4(server)) << 64)
        | (flags << 48)
        | ((~port & 0xFFFF) << 32)
        | (~int(V4(client)) & 0xFFFFFFFF)
    )
    return ipaddress.IPv6Address(value)


def _unspecified(address) -> bool:
    """0.0.0.0 and :: (or an IPv6 form embedding 0.0.0.0) may be refused as "this host" instead."""
    return address.is_unspecified or any(e.is_unspecified for e in embedded_ipv4(address))


# --------------------------------------------------------------------------------------------
# the default deny list


def test_default_deny_list_is_well_formed():
    cidrs = [c for c, _ in DEFAULT_DENY_RANGES]
    assert len(cidrs) == len(set(cidrs))
    for cidr, why in DEFAULT_DENY_RANGES:
        assert parse_network(cidr) == net(cidr)  # strict: no host bits
        assert why
    assert len(default_deny_table()) == len(DEFAULT_DENY_RANGES)


@pytest.mark.parametrize(
    "cidr",
    [
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "224.0.0.0/4",
        "240.0.0.0/4",
        "100.100.100.200/32",
        "168.63.129.16/32",
        "::1/128",
        "::/128",
        "fc00::/7",
        "fe80::/10",
        "fd00:ec2::/32",
        "ff00::/8",
        "64:ff9b:1::/48",
    ],
)
def test_expected_ranges_are_in_the_default_list(cidr):
    assert cidr in {c for c, _ in DEFAULT_DENY_RANGES}


@pytest.mark.parametrize("cidr, why", DEFAULT_DENY_RANGES, ids=[c for c, _ in DEFAULT_DENY_RANGES])
def test_every_default_range_denied_at_both_ends(cidr, why):
    g = guard()
    network = net(cidr)
    for address in (network.network_address, network.broadcast_address):
        verdict = g.check(address, 443)
        assert verdict.allowed is False, address
        assert verdict.address == address
        if _unspecified(address):
            assert verdict.reason in ("denied_address", "self_address")
        else:
            assert verdict.reason == "denied_address"
            assert verdict.detail.startswith("in deny range ")


@pytest.mark.parametrize("cidr, why", [r for r in DEFAULT_DENY_RANGES if ":" not in r[0]])
def test_ipv6_forms_of_every_default_ipv4_range_are_denied(cidr, why):
    g = guard()
    network = net(cidr)
    for address in (network.network_address, network.broadcast_address):
        n = int(address)
        forms = [
            ipaddress.IPv6Address((0xFFFF << 32) | n),  # ::ffff:a.b.c.d (mapped)
            ipaddress.IPv6Address((0xFFFF << 32 << 16) | n),  # ::ffff:0:a.b.c.d (SIIT translated)
            ipaddress.IPv6Address(int(ipaddress.IPv6Address("64:ff9b::")) | n),  # NAT64
            ipaddress.IPv6Address((0x2002 << 112) | (n << 80) | 1),  # 6to4
            teredo(str(address), "8.8.8.8"),  # Teredo server
            teredo("8.8.8.8", str(address)),  # Teredo client
        ]
        for form in forms:
            verdict = g.check(form, 443)
            assert verdict.allowed is False, form
            expected = ("denied_address", "self_address") if _unspecified(form) else ("denied_address",)
            assert verdict.reason in expected, form


@pytest.mark.parametrize(
    "address",
    ["8.8.8.8", "1.1.1.1", "9.9.9.9", "2606:4700::1111", "2001:4860:4860::8888", "151.101.0.223", "100.63.255.255",
     "100.128.0.0", "172.15.255.255", "172.32.0.0", "192.167.255.255", "192.169.0.0", "11.0.0.0", "9.255.255.255",
     "223.255.255.255", "169.253.255.255", "169.255.0.0"],
)
def test_public_addresses_allowed(address):
    verdict = guard().check(ip(address), 443)
    assert verdict == AddressVerdict(True, ip(address), "allowed", "not in any deny range")


# --------------------------------------------------------------------------------------------
# embedded IPv4


@pytest.mark.parametrize(
    "address, expected",
    [
        ("::ffff:169.254.169.254", ["169.254.169.254"]),  # mapped
        ("::ffff:0:a9fe:a9fe", ["169.254.169.254"]),  # ::ffff:0:0:0/96, SIIT "IPv4-translated"
        ("64:ff9b::a9fe:a9fe", ["169.254.169.254"]),  # NAT64 well-known prefix
        ("64:ff9b::8.8.8.8", ["8.8.8.8"]),
        ("2002:a9fe:a9fe::1", ["169.254.169.254"]),  # 6to4
        ("::a9fe:a9fe", ["169.254.169.254"]),  # IPv4-compatible
        ("::2", ["0.0.0.2"]),
        ("::1", []),  # loopback, not a compatible address
        ("::", []),
        ("2606:4700::1111", []),
        ("1.2.3.4", []),
        ("64:ff9b:1::a9fe:a9fe", []),  # local-use NAT64 is denied as a range, not decoded
    ],
)
def test_embedded_ipv4(address, expected):
    assert embedded_ipv4(ip(address)) == [ip(e) for e in expected]


def test_embedded_ipv4_teredo():
    assert embedded_ipv4(teredo("10.0.0.1", "8.8.8.8")) == [V4("10.0.0.1"), V4("8.8.8.8")]
    assert embedded_ipv4(teredo("8.8.8.8", "192.168.1.1", flags=0x8000, port=3544)) == [
        V4("8.8.8.8"),
        V4("192.168.1.1"),
    ]
    # the RFC 4380 example: server 65.54.227.120, client 192.0.2.45
    assert embedded_ipv4(ip("2001:0:4136:e378:8000:63bf:3fff:fdd2")) == [V4("65.54.227.120"), V4("192.0.2.45")]


@pytest.mark.parametrize(
    "address, expected_detail",
    [
        ("::ffff:169.254.169.254", "in deny range 169.254.0.0/16 (link-local / cloud metadata) (embeds 169.254.169.254)"),
        ("::ffff:0:a9fe:a9fe", "in deny range 169.254.0.0/16 (link-local / cloud metadata) (embeds 169.254.169.254)"),
        ("64:ff9b::a9fe:a9fe", "in deny range 169.254.0.0/16 (link-local / cloud metadata) (embeds 169.254.169.254)"),
        ("2002:a9fe:a9fe::1", "in deny range 169.254.0.0/16 (link-local / cloud metadata) (embeds 169.254.169.254)"),
        ("::ffff:127.0.0.1", "in deny range 127.0.0.0/8 (loopback) (embeds 127.0.0.1)"),
        ("::ffff:10.1.2.3", "in deny range 10.0.0.0/8 (private (RFC 1918)) (embeds 10.1.2.3)"),
        ("::a9fe:a9fe", "in deny range ::/96 (IPv4-compatible (deprecated))"),
        ("::808:808", "in deny range ::/96 (IPv4-compatible (deprecated))"),
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "in deny range 192.0.2.0/24 (documentation (TEST-NET-1)) (embeds 192.0.2.45)"),
    ],
)
def test_embedded_private_addresses_denied(address, expected_detail):
    verdict = guard().check(ip(address), 443)
    assert verdict == AddressVerdict(False, ip(address), "denied_address", expected_detail)


def test_teredo_with_private_server_or_client_denied():
    g = guard()
    server = g.check(teredo("10.0.0.1", "8.8.8.8"), 443)
    assert (server.allowed, server.reason) == (False, "denied_address")
    assert server.detail.endswith("(embeds 10.0.0.1)")
    client = g.check(teredo("8.8.8.8", "169.254.169.254"), 443)
    assert (client.allowed, client.reason) == (False, "denied_address")
    assert client.detail.endswith("(embeds 169.254.169.254)")
    # both ends public: a Teredo address is not denied for being Teredo
    assert g.check(teredo("8.8.8.8", "1.1.1.1"), 443).allowed is True


@pytest.mark.parametrize("address", ["::ffff:8.8.8.8", "::ffff:0:808:808", "64:ff9b::808:808", "2002:808:808::1"])
def test_embedded_public_addresses_allowed(address):
    assert guard().check(ip(address), 443).allowed is True


# --------------------------------------------------------------------------------------------
# allow_ip_ranges and the gateway's own addresses


def test_allow_ranges_exempt_from_deny():
    g = guard(allow=["10.1.0.0/16", "fd00::/16"])
    verdict = g.check(ip("10.1.2.3"), 443)
    assert verdict == AddressVerdict(True, ip("10.1.2.3"), "allowed", "exempted by allow_ip_ranges 10.1.0.0/16")
    assert g.check(ip("fd00::5"), 443).allowed is True
    # just outside the exemption: still denied
    assert g.check(ip("10.2.0.1"), 443).reason == "denied_address"
    assert g.check(ip("fd01::5"), 443).reason == "denied_address"
    # an exempted IPv4 address is exempted in its mapped form too
    assert g.check(ip("::ffff:10.1.2.3"), 443).detail == "exempted by allow_ip_ranges 10.1.0.0/16"


def test_self_addresses_denied_unless_allowed():
    g = guard(self_addresses=["8.8.4.4", "2001:4860:4860::8844"])
    assert g.check(ip("8.8.4.4"), 443) == AddressVerdict(
        False, ip("8.8.4.4"), "self_address", "is an address of the gateway itself"
    )
    assert g.check(ip("2001:4860:4860::8844"), 443).reason == "self_address"
    assert g.check(ip("::ffff:8.8.4.4"), 443).reason == "self_address"
    assert g.check(ip("8.8.8.8"), 443).allowed is True
    # a self address inside a deny range reports the deny range first
    assert guard(self_addresses=["10.0.0.5"]).check(ip("10.0.0.5"), 443).reason == "denied_address"
    # allow_ip_ranges exempts self addresses (but not listeners, below)
    allowed = guard(allow=["8.8.4.0/24"], self_addresses=["8.8.4.4"]).check(ip("8.8.4.4"), 443)
    assert allowed.allowed is True


def test_listener_always_denied_even_when_allowed():
    g = guard(allow=["0.0.0.0/0", "::/0"], listeners=[("10.0.0.5", 3128), ("::1", 3129)])
    verdict = g.check(ip("10.0.0.5"), 3128)
    assert verdict == AddressVerdict(False, ip("10.0.0.5"), "self_address", "is the gateway's own listener")
    assert g.check(ip("::ffff:10.0.0.5"), 3128).reason == "self_address"
    assert g.check(ip("::1"), 3129).reason == "self_address"
    # same address, other port: the allow list applies
    assert g.check(ip("10.0.0.5"), 3129).allowed is True
    assert g.check(ip("::1"), 3128).allowed is True
    # no port known: not a listener check
    assert g.check(ip("10.0.0.5")).allowed is True


def test_wildcard_listener_covers_loopback_and_self_addresses():
    g = guard(allow=["0.0.0.0/0", "::/0"], self_addresses=["203.0.113.7"], listeners=[("0.0.0.0", 3128)])
    for address in ("0.0.0.0", "127.0.0.1", "127.1.2.3", "::1", "::ffff:127.0.0.1", "203.0.113.7"):
        verdict = g.check(ip(address), 3128)
        assert (verdict.allowed, verdict.reason) == (False, "self_address"), address
    # another host on the listener's port is fine, and loopback on another port is allowed by the allow list
    assert g.check(ip("8.8.8.8"), 3128).allowed is True
    assert g.check(ip("127.0.0.1"), 3129).allowed is True
    g6 = guard(allow=["0.0.0.0/0", "::/0"], listeners=[("::", 8080)])
    assert g6.check(ip("127.0.0.1"), 8080).reason == "self_address"
    assert g6.check(ip("::1"), 8080).reason == "self_address"


def test_loopback_listener_not_confused_with_other_hosts():
    g = guard(allow=["0.0.0.0/0"], listeners=[("127.0.0.1", 3128)])
    assert g.check(ip("127.0.0.1"), 3128).reason == "self_address"
    assert g.check(ip("8.8.8.8"), 3128).allowed is True


@pytest.mark.parametrize(
    "listener, destination",
    [("127.0.0.1", "0.0.0.0"), ("::", "0.0.0.0"), ("::1", "::"), ("127.0.0.1", "::ffff:0.0.0.0")],
)
def test_unspecified_destination_reaches_a_loopback_or_dual_stack_listener(listener, destination):
    # On Linux, connect() to 0.0.0.0 reaches a socket bound to 127.0.0.1 (and a dual-stack socket
    # bound to ::), and connect() to :: reaches ::1 -- checked with real sockets. So an unspecified
    # destination on the listener's port is the listener, even when allow_ip_ranges covers it.
    g = guard(allow=["0.0.0.0/0", "::/0"], listeners=[(listener, 3128)])
    verdict = g.check(ip(destination), 3128)
    assert (verdict.allowed, verdict.reason) == (False, "self_address")


def test_with_self_returns_a_new_guard():
    base = guard()
    extended = base.with_self([ip("8.8.4.4")], [(ip("1.2.3.4"), 80)])
    assert base.self_addresses == frozenset()
    assert base.listeners == frozenset()
    assert extended.self_addresses == frozenset({ip("8.8.4.4")})
    assert extended.listeners == frozenset({(ip("1.2.3.4"), 80)})
    again = extended.with_self([ip("8.8.8.8")], [])
    assert again.self_addresses == frozenset({ip("8.8.4.4"), ip("8.8.8.8")})


def test_explicit_deny_list_replaces_the_default():
    g = guard(deny=["203.0.113.0/24"])
    assert g.check(ip("127.0.0.1"), 80).allowed is True
    assert g.check(ip("203.0.113.9"), 80).detail == "in deny range 203.0.113.0/24 (test 203.0.113.0/24)"


def test_verdict_describe():
    verdict = guard().check(ip("10.0.0.1"), 443)
    assert verdict.describe() == "10.0.0.1: in deny range 10.0.0.0/8 (private (RFC 1918))"


# --------------------------------------------------------------------------------------------
# RangeTable


def test_range_table_shortest_prefix_wins_and_versions_are_separate():
    table = RangeTable.of(
        [
            (net("10.0.0.0/8"), "eight"),
            (net("10.1.0.0/16"), "sixteen"),
            (net("10.1.2.3/32"), "host"),
            (net("::/96"), "v6"),
        ]
    )
    assert table.lookup(ip("10.1.2.3")) == (net("10.0.0.0/8"), "eight")
    assert table.lookup(ip("10.255.255.255")) == (net("10.0.0.0/8"), "eight")
    assert table.lookup(ip("11.0.0.0")) is None
    assert table.lookup(ip("9.255.255.255")) is None
    assert table.lookup(ip("::a00:1")) == (net("::/96"), "v6")  # v4 ranges never match v6 addresses
    assert table.lookup(ip("::1:0:0")) is None
    assert len(table) == 4


def test_range_table_first_label_kept_for_duplicates():
    table = RangeTable.of([(net("10.0.0.0/8"), "first"), (net("10.0.0.0/8"), "second")])
    assert table.lookup(ip("10.0.0.1")) == (net("10.0.0.0/8"), "first")
    assert len(table) == 1


def test_range_table_default_route_and_host_routes():
    table = RangeTable.of([(net("0.0.0.0/0"), "all4"), (net("2001:db8::1/128"), "one")])
    assert table.lookup(ip("255.255.255.255")) == (net("0.0.0.0/0"), "all4")
    assert table.lookup(ip("2001:db8::1")) == (net("2001:db8::1/128"), "one")
    assert table.lookup(ip("2001:db8::2")) is None
    assert RangeTable().lookup(ip("1.2.3.4")) is None


class _CountingDict(dict):
    probes = 0

    def get(self, key, default=None):
        type(self).probes += 1
        return super().get(key, default)


def _count_probes(table: RangeTable, address) -> int:
    counted = {k: _CountingDict(v) for k, v in table._by_len.items()}
    original = table._by_len
    table._by_len = counted
    _CountingDict.probes = 0
    try:
        table.lookup(address)
    finally:
        table._by_len = original
    return _CountingDict.probes


def test_range_table_with_100k_ranges():
    rng = random.Random(1234)
    prefixes = {rng.randrange(0, 2**24) for _ in range(100_000)}
    prefixes.discard(int(V4("8.8.8.0")) >> 8)
    prefixes.add(int(V4("203.0.113.0")) >> 8)
    table = RangeTable.of((ipaddress.IPv4Network((p << 8, 24)), f"r{p}") for p in prefixes)
    table.add(net("198.51.100.0/24"), "extra")
    assert len(table) == len(prefixes) + (0 if (int(V4("198.51.100.0")) >> 8) in prefixes else 1)
    assert table.lookup(ip("203.0.113.77"))[0] == net("203.0.113.0/24")
    assert table.lookup(ip("198.51.100.1"))[0] == net("198.51.100.0/24")
    assert table.lookup(ip("8.8.8.8")) is None
    sample = rng.sample(sorted(prefixes), 200)
    for p in sample:
        address = V4((p << 8) | rng.randrange(256))
        assert table.lookup(address)[0] == ipaddress.IPv4Network((p << 8, 24))
    # one prefix length present: one probe per lookup, whatever the number of ranges
    small = RangeTable.of([(net("203.0.113.0/24"), "x")])
    assert _count_probes(table, ip("8.8.8.8")) == _count_probes(small, ip("8.8.8.8")) == 1


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 32)), min_size=0, max_size=20),
    st.integers(0, 2**32 - 1),
)
def test_range_table_matches_brute_force(entries, value):
    networks = [ipaddress.IPv4Network((n >> (32 - length) << (32 - length) if length else 0, length)) for n, length in entries]
    table = RangeTable.of((n, str(n)) for n in networks)
    address = V4(value)
    containing = [n for n in networks if address in n]
    hit = table.lookup(address)
    if not containing:
        assert hit is None
    else:
        shortest = min(n.prefixlen for n in containing)
        assert hit is not None
        assert hit[0].prefixlen == shortest
        assert address in hit[0]


@settings(max_examples=300, deadline=None)
@given(st.ip_addresses(v=4))
def test_mapped_form_judged_like_the_ipv4_address(address):
    g = guard()
    mapped = ipaddress.IPv6Address((0xFFFF << 32) | int(address))
    assert g.check(mapped, 443).allowed == g.check(address, 443).allowed
