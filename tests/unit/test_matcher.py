"""HostPattern and HostIndex."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.hostnames import Host, canonical_host
from gateway.matcher import HostIndex, HostPattern

C = canonical_host
net = ipaddress.ip_network


def exact(text: str) -> HostPattern:
    return HostPattern.exact(C(text))


def cidr(text: str) -> HostPattern:
    network = net(text)
    return HostPattern("network", str(network), network)


def index_of(*patterns: HostPattern) -> HostIndex:
    return HostIndex.build((p, i) for i, p in enumerate(patterns))


def test_pattern_constructors_and_str():
    assert exact("Example.COM") == HostPattern("exact", "example.com")
    assert (exact("Example.COM").kind, exact("Example.COM").value) == ("exact", "example.com")
    assert HostPattern.wildcard("example.com") == HostPattern("wildcard", "example.com")
    assert cidr("10.0.0.0/8").network == net("10.0.0.0/8")
    assert str(exact("example.com")) == "example.com"
    assert str(HostPattern.wildcard("example.com")) == "*.example.com"
    assert str(cidr("2001:db8::/32")) == "2001:db8::/32"


def test_non_network_patterns_have_no_network():
    # The field `network` defaults to None; the classmethod of the same name must not replace that
    # default (in a dataclass, a later `def network` in the class body becomes the field's default).
    assert exact("example.com").network is None
    assert HostPattern.wildcard("example.com").network is None
    assert HostPattern("exact", "example.com").network is None


def test_exact_names():
    idx = index_of(exact("example.com"), exact("api.example.com"))
    assert idx.candidates(C("example.com")) == [0]
    assert idx.candidates(C("EXAMPLE.com.")) == [0]
    assert idx.candidates(C("api.example.com")) == [1]
    assert idx.candidates(C("www.example.com")) == []
    assert idx.candidates(C("example.co")) == []
    assert idx.candidates(C("xexample.com")) == []


def test_wildcard_never_matches_the_apex():
    pattern = HostPattern.wildcard("example.com")
    idx = index_of(pattern)
    assert idx.candidates(C("example.com")) == []
    assert pattern.matches(C("example.com")) is False
    assert idx.candidates(C("a.example.com")) == [0]
    assert idx.candidates(C("a.b.c.example.com")) == [0]  # deep
    assert pattern.matches(C("a.b.c.example.com")) is True
    assert idx.candidates(C("badexample.com")) == []
    assert pattern.matches(C("badexample.com")) is False
    assert idx.candidates(C("example.com.evil.net")) == []
    assert idx.candidates(C("com")) == []


def test_wildcard_does_not_match_ip_hosts():
    pattern = HostPattern.wildcard("0.1")
    assert pattern.matches(Host("1.0.0.1", ipaddress.ip_address("1.0.0.1"))) is False
    idx = index_of(pattern)
    assert idx.candidates(C("1.0.0.1")) == []


def test_ip_and_cidr_patterns():
    idx = index_of(
        exact("192.0.2.7"),
        cidr("198.51.100.0/24"),
        cidr("198.51.0.0/16"),
        exact("[2001:db8::1]"),
        cidr("2001:db8:1::/48"),
        cidr("0.0.0.0/0"),
    )
    assert idx.candidates(C("192.0.2.7")) == [0, 5]
    assert idx.candidates(C("3221225991")) == [0, 5]  # 192.0.2.7 as a number
    assert idx.candidates(C("198.51.100.200")) == [1, 2, 5]
    assert idx.candidates(C("198.51.7.7")) == [2, 5]
    assert idx.candidates(C("[2001:db8::1]")) == [3]
    assert idx.candidates(C("[2001:db8:1::abcd]")) == [4]
    assert idx.candidates(C("[2001:db8:2::1]")) == []
    # a v4 network never matches a v6 host, even one that embeds the v4 address
    assert idx.candidates(C("[::ffff:198.51.100.1]")) == []
    # names never match IP patterns
    assert idx.candidates(C("198-51-100-1.example")) == []


def test_candidates_in_policy_order_without_duplicates():
    idx = HostIndex.build(
        [
            (HostPattern.wildcard("example.com"), 0),
            (exact("a.example.com"), 1),
            (HostPattern.wildcard("a.example.com"), 2),
            (exact("a.example.com"), 3),
            (exact("a.example.com"), 3),  # same rule listing a host twice
            (HostPattern.wildcard("com"), 4),
            (exact("a.example.com"), 0),  # rule 0 also lists it exactly
        ]
    )
    assert idx.candidates(C("a.example.com")) == [0, 1, 3, 4]
    assert idx.candidates(C("x.a.example.com")) == [0, 2, 4]
    out_of_order = HostIndex.build([(exact("z.test"), 7), (HostPattern.wildcard("test"), 2), (exact("z.test"), 5)])
    assert out_of_order.candidates(C("z.test")) == [2, 5, 7]


class _CountingDict(dict):
    probes = 0

    def get(self, key, default=None):
        _CountingDict.probes += 1
        return super().get(key, default)

    def __getitem__(self, key):
        _CountingDict.probes += 1
        return super().__getitem__(key)


def _probes(idx: HostIndex, host: Host) -> int:
    saved = (idx._exact, idx._wildcard, idx._networks)
    idx._exact = _CountingDict(idx._exact)
    idx._wildcard = _CountingDict(idx._wildcard)
    idx._networks = _CountingDict({k: _CountingDict(v) for k, v in idx._networks.items()})
    _CountingDict.probes = 0
    try:
        idx.candidates(host)
    finally:
        idx._exact, idx._wildcard, idx._networks = saved
    return _CountingDict.probes


def _index(n_exact: int) -> HostIndex:
    entries = [(HostPattern("exact", f"host{i}.example.com"), i) for i in range(n_exact)]
    extra = [
        HostPattern.wildcard("example.com"),
        HostPattern.wildcard("example.org"),
        HostPattern("exact", "target.example.net"),
        cidr("203.0.113.0/24"),
        cidr("198.51.100.0/22"),
        cidr("2001:db8::/32"),
        HostPattern("exact", "192.0.2.1"),
        HostPattern.wildcard("deep.example.net"),
        HostPattern("exact", "a.example.org"),
        cidr("10.0.0.0/8"),
    ]
    entries += [(p, n_exact + j) for j, p in enumerate(extra)]
    return HostIndex.build(entries)


def test_large_index_correct_and_probe_count_independent_of_size():
    big = _index(100_000)
    small = _index(10)
    assert big.candidates(C("host99999.example.com")) == [99_999, 100_000]
    assert big.candidates(C("host0.example.com")) == [0, 100_000]
    assert big.candidates(C("target.example.net")) == [100_002]
    assert big.candidates(C("x.deep.example.net")) == [100_007]
    assert big.candidates(C("a.example.org")) == [100_001, 100_008]
    assert big.candidates(C("203.0.113.9")) == [100_003]
    assert big.candidates(C("198.51.103.255")) == [100_004]
    assert big.candidates(C("10.9.8.7")) == [100_009]
    assert big.candidates(C("[2001:db8::77]")) == [100_005]
    assert big.candidates(C("nothing.invalid")) == []
    for host in ("host5.example.com", "target.example.net", "x.y.deep.example.net", "203.0.113.9", "[2001:db8::1]",
                 "nothing.invalid"):
        assert _probes(big, C(host)) == _probes(small, C(host)), host


@st.composite
def patterns_and_host(draw):
    labels = st.sampled_from(["a", "b", "c", "example", "com"])
    names = st.lists(labels, min_size=1, max_size=4).map(".".join)
    addresses = st.sampled_from(["10.0.0.1", "10.0.1.1", "10.1.0.1", "192.0.2.1", "[2001:db8::1]", "[2001:db8:1::1]"])
    pattern = st.one_of(
        names.map(lambda n: HostPattern.exact(C(n))),
        names.map(HostPattern.wildcard),
        addresses.map(lambda a: HostPattern.exact(C(a))),
        st.sampled_from(["10.0.0.0/8", "10.0.0.0/16", "10.0.0.0/24", "0.0.0.0/0", "2001:db8::/32", "::/0",
                         "192.0.2.0/31"]).map(cidr),
    )
    entries = draw(st.lists(st.tuples(pattern, st.integers(0, 6)), max_size=12))
    host = draw(st.one_of(names.map(C), addresses.map(C)))
    return entries, host


@settings(max_examples=250, deadline=None)
@given(patterns_and_host())
def test_index_agrees_with_pattern_matches(case):
    entries, host = case
    idx = HostIndex.build(entries)
    expected = sorted({i for p, i in entries if p.matches(host)})
    assert idx.candidates(host) == expected
