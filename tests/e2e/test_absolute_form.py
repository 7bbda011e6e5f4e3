"""Spec 1 and 5: plain HTTP through the proxy port. The absolute URL's authority is the destination,
decided per request; the Host header must agree with it (400 host_url_mismatch); origin-form
requests and https:// URLs without CONNECT are refused."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.helpers import (  # noqa: F401  (fixtures are used by name)
    ALL_UPSTREAMS,
    assert_refused,
    assert_untouched,
    audit_for,
    connect_proxy,
    curl,
    fresh_upstreams,
    gateway,
    ipv4_spellings,
)


def test_plain_http_rule_with_curl(gateway, upstreams):
    result = curl(gateway, "http://allowed.test/plain?q=1")
    assert result.status == 200, result
    assert "upstream allowed.test: GET /plain?q=1" in result.body
    [received] = upstreams.plain["allowed.test"].requests
    assert dict(received.headers)["Host"] == "allowed.test"
    assert not upstreams.tls["allowed.test"].touched


def test_plain_http_with_httpx(gateway, upstreams):
    with httpx.Client(proxy=gateway.proxy_url) as client:
        ok = client.get("http://allowed.test/httpx-plain")
        denied = client.get("http://other.test/httpx-plain")
    assert ok.status_code == 200 and "upstream allowed.test" in ok.text
    assert_refused(denied, 403, "no_rule")
    assert_untouched(upstreams, "other.test")


@pytest.mark.parametrize("between", [b"\r\n", b"\n", b"\r\n" * 8])
def test_empty_lines_before_a_request_line_are_ignored(gateway, upstreams, between):
    """RFC 9112 2.2: a server SHOULD ignore at least one empty line before a request line (clients
    send a CRLF after a POST body). The request behind it waited for the 30 s head timeout (408)."""
    body = b"x=1"
    with connect_proxy(gateway) as conn:
        conn.send(b"POST http://allowed.test/a HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 3\r\n\r\n" + body
                  + between + b"GET http://allowed.test/b HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
        first = conn.read_response()
        second = conn.read_response()  # the connection's timeout (3 s) fails this long before 30 s
    assert (first.status, second.status) == (200, 200)
    assert [r.path for r in upstreams.plain["allowed.test"].requests] == ["/a", "/b"]


def test_empty_lines_are_counted_across_reads(gateway, upstreams):
    """Review 10: the limit was per read; 7 empty lines a read, 200 times, then a GET, was served."""
    with connect_proxy(gateway) as conn:
        conn.send(b"GET http://allowed.test/a HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
        assert conn.read_response().status == 200
        conn.send(b"\r\n" * 5)  # 5 + 5: within the limit per read, past it in all
        conn.send(b"\r\n" * 5 + b"GET http://allowed.test/b HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
        refused = conn.read_response()
    assert_refused(refused, 400, "malformed_request")
    assert [r.path for r in upstreams.plain["allowed.test"].requests] == ["/a"]


def test_a_run_of_empty_lines_is_refused(gateway, upstreams):
    with connect_proxy(gateway) as conn:
        conn.send(b"GET http://allowed.test/a HTTP/1.1\r\nHost: allowed.test\r\n\r\n" + b"\r\n" * 9
                  + b"GET http://allowed.test/b HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
        first = conn.read_response()
        refused = conn.read_response()
    assert first.status == 200
    assert_refused(refused, 400, "malformed_request")
    assert [r.path for r in upstreams.plain["allowed.test"].requests] == ["/a"]


@pytest.mark.parametrize("first", [b"\r\n", b"\n", b"\r\n\r\n", b"\r\n" * 8, b"\n\r\n"])
@pytest.mark.parametrize("split", [False, True])
def test_empty_lines_as_a_connections_first_bytes_are_ignored(gateway, upstreams, first, split):
    """Review 11: the same empty lines as a connection's very first bytes got 400 `non_http`: the
    proxy port's first look at a connection did not skip them. Sent with the request, or alone
    first (the gateway then waits for more, as for any partial first line)."""
    request = b"GET http://allowed.test/first HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
    with connect_proxy(gateway) as conn:
        if split:
            conn.send(first)
            conn.send(request)  # may arrive in the same read: both must work
        else:
            conn.send(first + request)
        response = conn.read_response()
    assert response.status == 200, response
    assert [r.path for r in upstreams.plain["allowed.test"].requests] == ["/first"]


@pytest.mark.parametrize("first", [b"\r\n" * 9, b"\n" * 40, b"\r\n" * 2000])
def test_a_run_of_empty_lines_as_first_bytes_is_malformed_not_non_http(gateway, upstreams, first):
    with connect_proxy(gateway) as conn:
        conn.send(first + b"GET http://allowed.test/b HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
        refused = conn.read_response()
    assert_refused(refused, 400, "malformed_request")
    assert not upstreams.plain["allowed.test"].requests


@pytest.mark.parametrize("first", [b"\r\x16\x03\x01", b"\r\n\x16\x03\x01\x00\x05", b"\r\nSSH-2.0-x\r\n"])
def test_empty_lines_before_something_other_than_http_are_refused(gateway, upstreams, first):
    with connect_proxy(gateway) as conn:
        conn.send(first)
        refused = conn.read_response()
    assert_refused(refused, 400, "non_http")


def test_destination_is_decided_per_request_on_a_kept_alive_connection(gateway, upstreams):
    with connect_proxy(gateway) as conn:
        first = conn.request("GET", "http://allowed.test/a", [("Host", "allowed.test")])
        second = conn.request("GET", "http://other.test/b", [("Host", "other.test")])
        third = conn.request("GET", "http://deep.wild.test/c", [("Host", "deep.wild.test")])
        fourth = conn.request("GET", "http://allowed.test/d", [("Host", "allowed.test")])
        client = conn.client
    assert (first.status, third.status, fourth.status) == (200, 200, 200)
    assert_refused(second, 403, "no_rule")
    assert "upstream deep.wild.test: GET /c" in third.text
    assert [r.path for r in upstreams.plain["allowed.test"].requests] == ["/a", "/d"]
    assert [r.path for r in upstreams.plain["deep.wild.test"].requests] == ["/c"]
    assert_untouched(upstreams, "other.test")
    lines = audit_for(gateway, client, 4)
    assert [(a["event"], a["decision"], a["host"], a["port"]) for a in lines] == [
        ("request", "allow", "allowed.test", 80),
        ("request", "deny", "other.test", 80),
        ("request", "allow", "deep.wild.test", 80),
        ("request", "allow", "allowed.test", 80),
    ]


@pytest.mark.parametrize("target,host", [
    ("http://ALLOWED.TEST/case", "allowed.test"),
    ("http://allowed.test./dot", "ALLOWED.TEST"),
    ("http://allowed.test:80/port", "allowed.test"),
    ("http://allowed.test/port-in-host", "allowed.test:80"),
])
def test_equivalent_spellings_of_url_and_host_agree(gateway, upstreams, target, host):
    with connect_proxy(gateway) as conn:
        response = conn.request("GET", target, [("Host", host)])
    assert response.status == 200, response.text
    assert len(upstreams.plain["allowed.test"].requests) == 1


@pytest.mark.parametrize("target,host", [
    ("http://allowed.test/x", "other.test"),
    ("http://other.test/x", "allowed.test"),
    ("http://allowed.test/x", "allowed.test:8080"),
    ("http://allowed.test:8080/x", "allowed.test"),
])
def test_host_header_must_match_url_authority(gateway, upstreams, target, host):
    with connect_proxy(gateway) as conn:
        response = conn.request("GET", target, [("Host", host)])
        client = conn.client
    assert_refused(response, 400, "host_url_mismatch")
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    [line] = audit_for(gateway, client)
    assert (line["event"], line["decision"], line["reason"], line["status"], line["host_header"]) == (
        "request", "deny", "host_url_mismatch", 400, host
    )


def test_host_url_mismatch_with_curl(gateway, upstreams):
    result = curl(gateway, "http://allowed.test/x", "-H", "Host: other.test")
    assert (result.status, result.header("X-Egress-Reason")) == (400, "host_url_mismatch"), result
    assert_untouched(upstreams, *ALL_UPSTREAMS)


def test_absolute_form_without_host_header_is_400(gateway, upstreams):
    with connect_proxy(gateway) as conn:
        response = conn.request("GET", "http://allowed.test/nohost", [])
    assert_refused(response, 400, "bad_host_header")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


def test_origin_form_to_proxy_port_is_400(gateway, upstreams):
    with connect_proxy(gateway) as conn:
        response = conn.request("GET", "/origin", [("Host", "allowed.test")])
        client = conn.client
    assert_refused(response, 400, "origin_form")
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    [line] = audit_for(gateway, client)
    assert (line["reason"], line["status"], line["path"]) == ("origin_form", 400, "/origin")
    # curl talking to the proxy port as if it were the web server
    result = curl(gateway, f"http://127.0.0.1:{gateway.port}/origin", "-H", "Host: allowed.test", proxy=False)
    assert (result.status, result.header("X-Egress-Reason")) == (400, "origin_form"), result
    assert_untouched(upstreams, *ALL_UPSTREAMS)


@pytest.mark.parametrize("target", ["https://allowed.test/x", "HTTPS://allowed.test/x", "https://allowed.test:443/x"])
def test_https_absolute_form_without_connect_is_400(gateway, upstreams, target):
    with connect_proxy(gateway) as conn:
        response = conn.request("GET", target, [("Host", "allowed.test")])
    assert_refused(response, 400, "https_absolute_form")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


def test_https_only_rule_refuses_plain_http(gateway, upstreams):
    with connect_proxy(gateway) as conn:
        response = conn.request("GET", "http://api.test/ok/x", [("Host", "api.test")])
    assert_refused(response, 403, "scheme_not_allowed", rule="api")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


def test_port_not_allowed_in_absolute_form(gateway, upstreams):
    with connect_proxy(gateway) as conn:
        response = conn.request("GET", "http://allowed.test:8080/x", [("Host", "allowed.test:8080")])
    assert_refused(response, 403, "port_not_allowed", rule="plain")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


@pytest.mark.parametrize("kind", ["decimal", "hex", "short"])
def test_ip_literal_spellings_in_absolute_form(gateway, upstreams, kind):
    allowed = ipv4_spellings(upstreams.hosts["allowed.test"])[kind]
    other = ipv4_spellings(upstreams.hosts["other.test"])[kind]
    with connect_proxy(gateway) as conn:
        ok = conn.request("GET", f"http://{allowed}/ip", [("Host", allowed)])
        denied = conn.request("GET", f"http://{other}/ip", [("Host", other)])
    assert ok.status == 200, ok.text
    assert_refused(denied, 403, "no_rule")
    assert [r.path for r in upstreams.plain["allowed.test"].requests] == ["/ip"]
    assert_untouched(upstreams, "other.test")


BAD_URL_HOSTS = {
    "percent": "allowed%2etest",
    "at": "user@allowed.test",
    "backslash": "allowed.test\\@other.test",
    "ideographic-dot": "allowed\u3002test",
    "brackets": "[allowed.test]",
    "nul": "allowed.test%00.other.test",
}


@pytest.mark.parametrize("kind", sorted(BAD_URL_HOSTS))
def test_bad_url_host_is_400_bad_host(gateway, upstreams, kind):
    with connect_proxy(gateway) as conn:
        response = conn.request("GET", f"http://{BAD_URL_HOSTS[kind]}/x", [("Host", "allowed.test")])
        client = conn.client
    assert response.status == 400, response.text
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    assert_refused(response, 400, "bad_host")
    assert [(a["event"], a["reason"]) for a in audit_for(gateway, client)] == [("request", "bad_host")]
