"""Spec 3 and 4: inside a CONNECT tunnel the destination is pinned. No upstream connection opens
before a request passed the checks; the TLS SNI, every Host header, HTTP/2 :authority and
absolute-form authority must restate the pinned name and port (421 otherwise), on every request
of a kept-alive connection and on every HTTP/2 stream; the upstream SNI is always the pinned name."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.helpers import (  # noqa: F401  (fixtures are used by name)
    ALL_UPSTREAMS,
    H2Client,
    assert_refused,
    assert_untouched,
    audit_for,
    client_tls_context,
    curl,
    fresh_upstreams,
    gateway,
    get,
    start_tls,
    tls_tunnel,
    tunnel,
)


# --- spec 3: nothing upstream before the decision --------------------------------------------


def test_no_upstream_connection_until_a_request_is_allowed(gateway, upstreams):
    conn, answer = tunnel(gateway, "allowed.test:443")
    with conn:
        assert answer.status == 200
        # The client's handshake is done: an eager gateway would have connected upstream before its
        # 200 (and handshaken there before answering the ClientHello); assert_untouched fences the
        # upstreams' accept queues, so such a connection would be counted.
        tls = start_tls(conn, gateway, sni="allowed.test")
        assert_untouched(upstreams, *ALL_UPSTREAMS)  # lazy: CONNECT and TLS opened nothing
        assert get(tls, "/first", "allowed.test").status == 200
    assert upstreams.tls["allowed.test"].connections == 1


def test_denied_first_request_never_opens_upstream(gateway, upstreams):
    with tls_tunnel(gateway, "api.test:443") as tls:
        response = get(tls, "/admin", "api.test")
        assert_refused(response, 403, "path_not_allowed", rule="api")
        response = get(tls, "/ok/x", "api.test", method="DELETE")
        assert_refused(response, 403, "method_not_allowed", rule="api")
    assert_untouched(upstreams, *ALL_UPSTREAMS)  # both answered already; fenced at the upstreams


# --- spec 4: SNI ----------------------------------------------------------------------------


@pytest.mark.parametrize("authority", ["allowed.test:443", "ALLOWED.TEST.:443"])
def test_absent_sni_is_fine_and_upstream_sni_is_the_pinned_name(gateway, upstreams, authority):
    conn, answer = tunnel(gateway, authority)
    with conn:
        assert answer.status == 200
        tls = start_tls(conn, gateway, sni=None)
        assert get(tls, "/nosni", "allowed.test").status == 200
    [received] = upstreams.tls["allowed.test"].requests
    assert received.sni == "allowed.test"


@pytest.mark.parametrize("sni", ["allowed.test", "Allowed.Test", "allowed.test."])
def test_sni_restating_the_pinned_name_is_fine(gateway, upstreams, sni):
    with tls_tunnel(gateway, "allowed.test:443", sni=sni) as tls:
        assert get(tls, "/sni", "allowed.test").status == 200
    assert upstreams.tls["allowed.test"].requests[0].sni == "allowed.test"


@pytest.mark.parametrize("sni", ["other.test", "api.test", "allowed.test.other.test"])
def test_sni_mismatch_gets_421_on_every_request(gateway, upstreams, sni):
    with tls_tunnel(gateway, "allowed.test:443", sni=sni) as tls:
        for path in ("/one", "/two"):
            response = get(tls, path, "allowed.test")
            assert_refused(response, 421, "sni_mismatch")
        client = tls.client
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    lines = audit_for(gateway, client, 4)
    assert [(a["event"], a["reason"]) for a in lines] == [
        ("connect", "allowed"), ("tls", "sni_mismatch"), ("request", "sni_mismatch"), ("request", "sni_mismatch")
    ]
    tls_line = lines[1]
    assert (tls_line["decision"], tls_line["status"], tls_line["sni"], tls_line["host"]) == ("deny", 421, sni, "allowed.test")


def test_tls_domain_fronting_with_curl_connect_to(gateway, upstreams):
    """curl --connect-to: CONNECT names allowed.test, the TLS SNI and Host name other.test."""
    result = curl(gateway, "https://other.test/front", "--connect-to", "other.test:443:allowed.test:443")
    assert result.status == 421, result
    assert result.header("X-Egress-Reason") == "sni_mismatch"
    assert_untouched(upstreams, *ALL_UPSTREAMS)


# --- spec 4: Host headers on a kept-alive HTTP/1.1 connection -------------------------------


def test_host_checked_on_every_request_of_a_kept_alive_connection(gateway, upstreams):
    with tls_tunnel(gateway, "allowed.test:443") as tls:
        assert get(tls, "/first", "allowed.test").status == 200
        second = get(tls, "/second", "other.test")
        assert_refused(second, 421, "host_mismatch")
        assert get(tls, "/third", "allowed.test").status == 200
        client = tls.client
    assert [r.path for r in upstreams.tls["allowed.test"].requests] == ["/first", "/third"]
    assert upstreams.tls["allowed.test"].connections == 1
    assert_untouched(upstreams, "other.test")
    denied = [a for a in audit_for(gateway, client, 4) if a["decision"] == "deny"]
    assert [(a["event"], a["reason"], a["status"], a["host_header"], a["host"], a["path"]) for a in denied] == [
        ("request", "host_mismatch", 421, "other.test", "allowed.test", "/second")
    ]


@pytest.mark.parametrize("host", ["other.test", "other.test:443", "allowed.test:8443", "allowed.test.other.test", "127.0.0.1"])
def test_host_header_naming_another_destination_is_421(gateway, upstreams, host):
    with tls_tunnel(gateway, "allowed.test:443") as tls:
        assert_refused(get(tls, "/x", host), 421, "host_mismatch")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


@pytest.mark.parametrize("host", ["ALLOWED.TEST", "allowed.test.", "allowed.test:443", "Allowed.Test.:443"])
def test_host_header_restating_the_pinned_destination_is_fine(gateway, upstreams, host):
    with tls_tunnel(gateway, "allowed.test:443") as tls:
        assert get(tls, "/same", host).status == 200
    assert len(upstreams.tls["allowed.test"].requests) == 1


@pytest.mark.parametrize("host", ["allowed.test@other.test", "allowed.test:443:443", "[allowed.test]", "allowed.test%2f"])
def test_malformed_host_header_is_400(gateway, upstreams, host):
    with tls_tunnel(gateway, "allowed.test:443") as tls:
        assert_refused(get(tls, "/x", host), 400, "bad_host_header")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


def test_missing_host_header_is_400(gateway, upstreams):
    with tls_tunnel(gateway, "allowed.test:443") as tls:
        assert_refused(get(tls, "/x", None), 400, "bad_host_header")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


def test_host_mismatch_with_real_clients(gateway, upstreams):
    result = curl(gateway, "https://allowed.test/curl", "--http1.1", "-H", "Host: other.test")
    assert (result.status, result.header("X-Egress-Reason")) == (421, "host_mismatch"), result
    with httpx.Client(proxy=gateway.proxy_url, verify=client_tls_context(gateway)) as client:
        ok = client.get("https://allowed.test/httpx")
        bad = client.get("https://allowed.test/httpx2", headers={"Host": "other.test"})
    assert ok.status_code == 200
    assert_refused(bad, 421, "host_mismatch")
    assert [r.path for r in upstreams.tls["allowed.test"].requests] == ["/httpx"]
    assert_untouched(upstreams, "other.test")


# --- spec 4: absolute-form inside the tunnel ------------------------------------------------


def test_absolute_form_inside_tunnel_must_name_the_pinned_destination(gateway, upstreams):
    with tls_tunnel(gateway, "allowed.test:443") as tls:
        assert_refused(get(tls, "https://other.test/abs", "allowed.test"), 421, "authority_mismatch")
        assert_refused(get(tls, "https://allowed.test:8443/abs", "allowed.test"), 421, "authority_mismatch")
        assert get(tls, "https://allowed.test/abs-ok", "allowed.test").status == 200
    # The one allowed goes upstream in origin-form: the absolute form restated the destination.
    assert [r.path for r in upstreams.tls["allowed.test"].requests] == ["/abs-ok"]
    assert_untouched(upstreams, "other.test")


def test_absolute_form_inside_a_plain_http_tunnel_goes_upstream_in_origin_form(gateway, upstreams):
    """Found by tests/fuzz/test_front_door_fuzz.py at a larger scale: inside a CONNECT tunnel to
    port 80, `GET http://allowed.test/...` reached the origin as written (mitmproxy rewrites the
    target to origin-form only on the proxy port itself)."""
    conn, answer = tunnel(gateway, "allowed.test:80")
    with conn:
        assert answer.status == 200
        assert get(conn, "http://allowed.test/abs-plain?x=1", "allowed.test").status == 200
        # HTTP/1.0 needs no Host: the authority, checked against the pin, becomes it (review 31).
        conn.send(b"GET http://allowed.test/abs-10 HTTP/1.0\r\n\r\n")
        assert conn.read_response().status == 200
    received = upstreams.plain["allowed.test"].requests
    assert [r.path for r in received] == ["/abs-plain?x=1", "/abs-10"]
    assert [[v for k, v in r.headers if k.lower() == "host"] for r in received] == [["allowed.test"]] * 2


# --- spec 4: HTTP/2 -------------------------------------------------------------------------


def test_h2_authority_checked_on_every_stream(gateway, upstreams):
    with tls_tunnel(gateway, "allowed.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        good = h2.send("allowed.test", "/h2-good")
        bad = h2.send("other.test", "/h2-bad")
        bad_port = h2.send("allowed.test:8443", "/h2-bad-port")
        good_port = h2.send("allowed.test:443", "/h2-good-port")
        h2.wait(good, bad, bad_port, good_port)
        later = h2.send("allowed.test", "/h2-later")  # the connection is still usable afterwards
        h2.wait(later)
        client = tls.client
    for stream in (good, good_port, later):
        assert h2.responses[stream]["status"] == 200, h2.responses[stream]
    for stream in (bad, bad_port):
        assert h2.responses[stream]["status"] == 421, h2.responses[stream]
        assert h2.header(stream, "x-egress-reason") == "authority_mismatch"
        assert b"reason: authority_mismatch" in h2.responses[stream]["body"]
    assert sorted(r.path for r in upstreams.tls["allowed.test"].requests) == ["/h2-good", "/h2-good-port", "/h2-later"]
    assert all(r.sni == "allowed.test" for r in upstreams.tls["allowed.test"].requests)
    assert_untouched(upstreams, "other.test")
    denied = [a for a in audit_for(gateway, client, 6) if a["decision"] == "deny"]
    assert sorted((a["reason"], a["host_header"]) for a in denied) == [
        ("authority_mismatch", "allowed.test:8443"), ("authority_mismatch", "other.test")
    ]


def test_h2_host_header_contradicting_authority_is_not_forwarded(gateway, upstreams):
    with tls_tunnel(gateway, "allowed.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        first = h2.send("allowed.test", "/h2-first")
        h2.wait(first)
        sneaky = h2.send("allowed.test", "/h2-sneaky", extra=[("host", "other.test")])
        try:
            h2.wait(sneaky)
        except ConnectionError:
            pass  # mitmproxy treats the contradiction as a protocol error and ends the connection
        else:
            status = h2.responses[sneaky]["status"]
            assert status in (400, 421), h2.responses[sneaky]
            assert h2.header(sneaky, "x-egress-reason") in ("host_mismatch", "bad_host_header")
    assert [r.path for r in upstreams.tls["allowed.test"].requests] == ["/h2-first"]
    assert_untouched(upstreams, "other.test")


def test_h2_with_curl(gateway, upstreams):
    ok = curl(gateway, "https://allowed.test/curl-h2", "--http2")
    assert (ok.status, ok.http_version) == (200, "2"), ok
    bad = curl(gateway, "https://allowed.test/curl-h2-bad", "--http2", "-H", "Host: other.test")
    assert (bad.status, bad.http_version, bad.header("X-Egress-Reason")) == (421, "2", "authority_mismatch"), bad
    assert [r.path for r in upstreams.tls["allowed.test"].requests] == ["/curl-h2"]
    assert_untouched(upstreams, "other.test")


# --- plain HTTP inside a tunnel to port 80 --------------------------------------------------


def test_plain_http_inside_tunnel_to_port_80(gateway, upstreams):
    conn, answer = tunnel(gateway, "allowed.test:80")
    with conn:
        assert answer.status == 200
        assert get(conn, "/tunnel-plain", "allowed.test").status == 200
        assert_refused(get(conn, "/tunnel-other", "other.test"), 421, "host_mismatch")
        assert_refused(get(conn, "/tunnel-port", "allowed.test:443"), 421, "host_mismatch")
        assert get(conn, "/tunnel-plain-2", "allowed.test:80").status == 200
    assert [r.path for r in upstreams.plain["allowed.test"].requests] == ["/tunnel-plain", "/tunnel-plain-2"]
    assert_untouched(upstreams, "other.test")
    assert not upstreams.tls["allowed.test"].touched
    # the same with curl's --proxytunnel
    ok = curl(gateway, "http://allowed.test/curl-p", "-p")
    bad = curl(gateway, "http://allowed.test/curl-p-bad", "-p", "-H", "Host: other.test")
    assert ok.status == 200, ok
    assert (bad.status, bad.header("X-Egress-Reason")) == (421, "host_mismatch"), bad
    assert_untouched(upstreams, "other.test")


def test_tunnel_to_http_only_port_refuses_https_scheme_inside(gateway, upstreams):
    """deep.wild.test:80 is allowed for http only (rule plain); TLS inside that tunnel is https."""
    conn, answer = tunnel(gateway, "deep.wild.test:80")
    with conn:
        assert answer.status == 200
        tls = start_tls(conn, gateway, sni="deep.wild.test")
        response = get(tls, "/tls-on-80", "deep.wild.test:80")
        # rule wild covers deep.wild.test for https but on 443 only; rule plain covers port 80 for http only
        assert_refused(response, 403, "port_not_allowed", rule="wild")
    assert_untouched(upstreams, *ALL_UPSTREAMS)
