"""Plain HTTP through the transparent listener: the first request's Host names the destination,
the gateway resolves it itself (the dialled IP is never used) and pins the connection to it; a
later request naming another host on the same connection is refused with 421."""

from __future__ import annotations

import pytest

from .clients import curl, http_exchange, http_request
from tests.support.topology import ALLOWED, OTHER

pytestmark = pytest.mark.netns


def test_curl_plain_http_by_name(topology, main):
    result = curl(main.sandbox, main.ca, "http://allowed.test/plain?q=1")
    assert result.status == 200, result
    assert [(r.method, r.path) for r in topology.server(f"{ALLOWED}:80").requests] == [("GET", "/plain?q=1")]
    assert topology.touched() == [f"{ALLOWED}:80"]


def test_host_switch_on_a_kept_alive_connection(topology, main):
    mark = main.audit_mark()
    with topology.connect(main.sandbox, ALLOWED, 80) as sock:
        first, second = http_exchange(sock, [http_request("allowed.test", "/first"),
                                             http_request("other.test", "/second")])
    assert first.status == 200, first.text()
    assert first.headers.get("x-upstream") == "allowed.test"
    assert (second.status, second.egress_reason) == (421, "host_mismatch"), second.text()
    assert [r.path for r in topology.server(f"{ALLOWED}:80").requests] == ["/first"]
    assert topology.touched() == [f"{ALLOWED}:80"], "other.test must not be touched"
    requests = main.audit_since(mark, event="request")
    assert [(e["host_header"], e["decision"], e["reason"]) for e in requests] == [
        ("allowed.test", "allow", "allowed"), ("other.test", "deny", "host_mismatch")]


def test_a_refused_first_host_cannot_be_followed_by_another(topology, main):
    with topology.connect(main.sandbox, OTHER, 80) as sock:
        first, second = http_exchange(sock, [http_request("other.test", "/first"),
                                             http_request("allowed.test", "/second")])
    assert (first.status, first.egress_reason) == (403, "no_rule"), first.text()
    assert (second.status, second.egress_reason) == (421, "host_mismatch"), second.text()
    assert topology.touched() == []


def test_plain_http_to_an_ip_reaches_the_names_address(topology, main):
    """Dial other.test's IP with Host: allowed.test: the request goes to allowed.test's real
    address, never to the dialled IP."""
    mark = main.audit_mark()
    with topology.connect(main.sandbox, OTHER, 80) as sock:
        (reply,) = http_exchange(sock, [http_request("allowed.test", "/by-host", close=True)])
    assert reply.status == 200, reply.text()
    assert reply.headers.get("x-upstream") == "allowed.test"
    assert [r.path for r in topology.server(f"{ALLOWED}:80").requests] == ["/by-host"]
    assert topology.touched() == [f"{ALLOWED}:80"]
    line = main.audit_since(mark, event="request")[0]
    assert (line["mode"], line["original_destination"], line["address"]) == ("transparent", f"{OTHER}:80", ALLOWED)


def test_strict_mode_refuses_plain_http_to_another_ip(topology, strict):
    with topology.connect(strict.sandbox, OTHER, 80) as sock:
        (reply,) = http_exchange(sock, [http_request("allowed.test", "/by-host", close=True)])
    assert (reply.status, reply.egress_reason) == (421, "original_destination_mismatch"), reply.text()
    assert topology.touched() == []


@pytest.mark.parametrize("host", ["other.test", OTHER, ALLOWED, "allowed.test:8080"])
def test_plain_http_refusals(topology, main, host):
    with topology.connect(main.sandbox, OTHER, 80) as sock:
        (reply,) = http_exchange(sock, [http_request(host, "/nope", close=True)])
    # ALLOWED's IP is named by a rule for https only.
    expected = {"other.test": (403, "no_rule"), OTHER: (403, "no_rule"), ALLOWED: (403, "scheme_not_allowed"),
                "allowed.test:8080": (421, "host_mismatch")}[host]
    assert (reply.status, reply.egress_reason) == expected, reply.text()
    assert topology.touched() == []


def test_an_absolute_form_request_goes_upstream_in_origin_form(topology, main):
    """The absolute-form authority restated the destination (it names allowed.test, as Host does):
    the origin gets origin-form, as through the proxy port (an origin may route by the absolute
    form: RFC 9112 3.2.2)."""
    with topology.connect(main.sandbox, ALLOWED, 80) as sock:
        (reply,) = http_exchange(sock, [http_request("allowed.test", "http://allowed.test/abs?x=1", close=True)])
    assert reply.status == 200, reply.text()
    assert [r.path for r in topology.server(f"{ALLOWED}:80").requests] == ["/abs?x=1"]
