"""gateway/bodies.py: what a request head says about its body, and when an upstream exchange
leaves its connection unfit for another request."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from gateway.bodies import (
    BODYLESS_METHODS,
    MAX_INTERIM_RESPONSES,
    Framing,
    UpstreamExchange,
    must_stay_empty,
    needs_allow_body,
    request_framing,
)
from gateway.engine import RequestFacts, _first_failure
from gateway.hostnames import canonical_host
from gateway.policy import compile_policy, PolicyError


@pytest.mark.parametrize("headers, end_stream, framing", [
    ([], None, Framing.NONE),
    ([], True, Framing.NONE),
    ([], False, Framing.UNKNOWN),  # HTTP/2 HEADERS without END_STREAM
    ([("Content-Length", "0")], None, Framing.NONE),
    ([("content-length", "00")], None, Framing.NONE),
    ([("Content-Length", "0")], False, Framing.UNKNOWN),
    ([("Content-Length", "1")], None, Framing.DECLARED),
    ([("Content-Length", " 87 ")], None, Framing.DECLARED),
    ([("Content-Length", "5")], True, Framing.DECLARED),  # declared, then not sent: still a body
    ([("Content-Length", "-1")], None, Framing.DECLARED),
    ([("Content-Length", "x")], None, Framing.DECLARED),
    ([("Transfer-Encoding", "chunked")], None, Framing.DECLARED),
    ([("TRANSFER-ENCODING", "identity")], None, Framing.DECLARED),
    ([("transfer-encoding", "")], True, Framing.DECLARED),
    ([("Content-Type", "text/plain")], None, Framing.NONE),
])
def test_request_framing(headers, end_stream, framing):
    assert request_framing(headers, end_stream) is framing


@given(st.lists(st.tuples(st.sampled_from(["Content-Length", "content-length", "Transfer-Encoding", "Accept",
                                            "X-Content-Length"]),
                          st.text(alphabet="0123456789 chunked,-x", max_size=8)), max_size=4),
       st.sampled_from([None, True, False]))
def test_framing_is_none_only_when_no_byte_of_body_can_follow(headers, end_stream):
    """NONE never hides a body: no Transfer-Encoding, any Content-Length is zero, and the head
    ended the message (or, HTTP/1, framing says nothing follows)."""
    framing = request_framing(headers, end_stream)
    names = [n.lower() for n, _ in headers]
    if framing is Framing.NONE:
        assert "transfer-encoding" not in names
        for name, value in headers:
            if name.lower() == "content-length":
                assert value.strip().isdigit() and int(value.strip()) == 0
        assert end_stream is not False
    if "transfer-encoding" in names:
        assert framing is Framing.DECLARED


@pytest.mark.parametrize("method", sorted(BODYLESS_METHODS))
def test_bodyless_methods_need_allow_body_for_a_declared_body(method):
    assert needs_allow_body(method, Framing.DECLARED)
    assert needs_allow_body(method.lower(), Framing.DECLARED)
    assert not needs_allow_body(method, Framing.NONE)
    assert must_stay_empty(method, Framing.UNKNOWN, allow_body=False)
    assert not must_stay_empty(method, Framing.UNKNOWN, allow_body=True)


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "PROPFIND"])
def test_methods_with_body_semantics_never_need_it(method):
    assert not needs_allow_body(method, Framing.DECLARED)
    assert not must_stay_empty(method, Framing.UNKNOWN, allow_body=False)


# --- the rule stage --------------------------------------------------------------------------------


POLICY = """
version: 1
rules:
  - id: plain
    hosts: [a.example]
  - id: search
    hosts: [a.example]
    allow_body: true
"""


def _facts(method: str, headers=()) -> RequestFacts:
    return RequestFacts(canonical_host("a.example"), 443, "https", method, "/x", tuple(headers))


def test_a_body_on_get_fails_a_rule_without_allow_body_and_passes_one_with_it():
    policy = compile_policy(POLICY, "p.yaml")
    plain, search = policy.rules
    facts = _facts("GET", [("Content-Length", "3")])
    assert _first_failure(plain, facts, "GET", "/x")[0] == 4
    assert _first_failure(search, facts, "GET", "/x")[0] is None
    assert _first_failure(plain, _facts("POST", [("Content-Length", "3")]), "POST", "/x")[0] is None
    assert _first_failure(plain, _facts("GET", [("Content-Length", "0")]), "GET", "/x")[0] is None


@pytest.mark.parametrize("text, where", [
    ("  - id: r\n    hosts: [a.example]\n    allow_body: yes please\n", "rules[0].allow_body"),
    ("  - id: r\n    hosts: [a.example]\n    inspect: false\n    allow_body: true\n", "rules[0].allow_body"),
    ("  - id: r\n    hosts: [10.0.0.1]\n    protocol: tcp\n    ports: [22]\n    allow_body: true\n",
     "rules[0].allow_body"),
])
def test_allow_body_errors_name_the_key(text, where):
    with pytest.raises(PolicyError) as info:
        compile_policy("version: 1\nrules:\n" + text, "p.yaml")
    assert where in str(info.value) and "p.yaml:" in str(info.value)


# --- upstream exchanges ----------------------------------------------------------------------------


def _exchange(framing=Framing.NONE, data=(), end=True, heads=(200,), early_at=None) -> UpstreamExchange:
    exchange = UpstreamExchange()
    exchange.request_head(framing)
    for i, size in enumerate(data):
        if early_at == i:
            for status in heads:
                exchange.response_head(status)
        exchange.request_data(size)
    if end:
        exchange.request_end()
    if early_at is None:
        for status in heads:
            exchange.response_head(status)
    return exchange


def test_a_bodyless_exchange_may_be_reused():
    assert _exchange().single_use_reason() is None
    assert _exchange(heads=(101,)).single_use_reason() is None  # a switch is handled as a pipe


@pytest.mark.parametrize("exchange, words", [
    (_exchange(Framing.DECLARED, data=(5,)), "body"),
    (_exchange(Framing.DECLARED, data=()), "body"),  # declared, nothing sent yet
    (_exchange(Framing.UNKNOWN, data=(0,)), "body"),
    (_exchange(Framing.DECLARED, data=(5, 5), early_at=1), "before the request body"),
    (_exchange(heads=(100, 200)), "interim"),
    (_exchange(heads=(103, 103, 200)), "interim"),
])
def test_exchanges_that_may_leave_bytes_behind_end_the_connection(exchange, words):
    assert words in exchange.single_use_reason()


@given(st.lists(st.integers(0, 1 << 20), max_size=6), st.sampled_from(list(Framing)),
       st.lists(st.sampled_from([100, 102, 103, 200, 204, 301, 401, 500]), min_size=1, max_size=4))
def test_reuse_only_without_any_body_or_interim(sizes, framing, heads):
    final = [h for h in heads if not 100 <= h < 200] or [200]
    interim = [h for h in heads if 100 <= h < 200]
    exchange = _exchange(framing, tuple(sizes), heads=(*interim, final[0]))
    reusable = exchange.single_use_reason() is None
    assert reusable == (framing is Framing.NONE and not any(sizes) and not interim)


def test_interim_responses_are_bounded():
    exchange = UpstreamExchange()
    for _ in range(MAX_INTERIM_RESPONSES):
        exchange.response_head(103)
    assert not exchange.too_many_interim
    exchange.response_head(100)
    assert exchange.too_many_interim
