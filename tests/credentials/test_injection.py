"""The secret arrives exactly once, in the header (or query parameter) the rule names, on the
rule's host only; whatever the sandbox sent under that name, in any spelling, is replaced."""

from __future__ import annotations

from urllib.parse import parse_qsl, quote_plus, urlsplit

import pytest

from tests.e2e.helpers import H2Client, assert_refused, get

from .clients import assert_length_true, assert_no_leak, fetch, proxy_conn, response_bytes, tls_to
from .conftest import SECRETS

TOKEN = SECRETS["api_token"]


def _only_request(server, host: str):
    seen = server.for_host(host)
    assert len(seen) == 1, [(r.method, r.path) for r in server.requests]
    return seen[0]


@pytest.mark.parametrize("sandbox_headers", [
    [],
    [("Authorization", "Bearer sandbox-own-value")],
    [("authorization", "Bearer one"), ("AUTHORIZATION", "Basic dHdvOnR3bw=="), ("AuThOrIzAtIoN", "token three")],
    [("Authorization", "")],
], ids=["none", "one", "three-spellings", "empty"])
def test_secret_arrives_exactly_once_in_the_named_header(cred, sandbox_headers):
    response = fetch(cred.gateway, "echo.test", "/v1/anything", headers=sandbox_headers + [("X-Keep", "kept")])
    assert response.status == 200, response.text
    seen = _only_request(cred.echo, "echo.test")
    assert seen.header_all("authorization") == [f"Bearer {TOKEN}"]
    assert seen.everything().count(TOKEN) == 1
    for _, value in sandbox_headers:
        if value:
            assert value not in seen.everything()
    assert seen.header_all("x-keep") == ["kept"]  # other headers untouched
    assert seen.sni == "echo.test"
    assert_no_leak(response_bytes(response), SECRETS)
    assert_length_true(response)


def test_body_and_other_headers_are_not_touched(cred):
    body = b'{"prompt": "hello", "Authorization": "not a header"}'
    response = fetch(cred.gateway, "echo.test", "/v1/anything", method="POST", body=body,
                     headers=[("Content-Type", "application/json"), ("X-Authorization", "sandbox")])
    assert response.status == 200
    seen = _only_request(cred.echo, "echo.test")
    assert seen.body == body
    assert seen.header_all("x-authorization") == ["sandbox"]
    assert seen.everything().count(TOKEN) == 1


def test_every_request_on_a_kept_alive_tunnel_gets_it_once(cred):
    with tls_to(cred.gateway, "echo.test") as tls:
        for i in range(3):
            response = get(tls, f"/v1/anything/{i}", "echo.test", extra=[("authorization", f"Bearer mine-{i}")])
            assert response.status == 200
    assert len(cred.echo.requests) == 3
    for seen in cred.echo.requests:
        assert seen.header_all("authorization") == [f"Bearer {TOKEN}"]
        assert seen.everything().count(TOKEN) == 1
    assert cred.echo.connections == 1


def test_http2_duplicates_are_replaced_too(cred):
    tls = tls_to(cred.gateway, "echo.test", alpn=["h2"])
    with tls:
        client = H2Client(tls)
        sid = client.send("echo.test", "/v1/anything/h2",
                          extra=[("authorization", "Bearer a"), ("authorization", "Bearer b")])
        client.wait(sid)
        assert client.responses[sid]["status"] == 200
        body = client.responses[sid]["body"]
    seen = _only_request(cred.echo, "echo.test")
    assert seen.header_all("authorization") == [f"Bearer {TOKEN}"]
    assert seen.everything().count(TOKEN) == 1
    assert_no_leak(body, SECRETS, "HTTP/2 response body")


def test_other_allowed_hosts_never_get_it(cred, upstreams):
    own = [("Authorization", "Bearer sandbox-own-value")]
    for host in ("mirror.test", "allowed.test", "other.test"):
        assert fetch(cred.gateway, host, "/v1/anything", headers=own).status == 200
    seen = _only_request(cred.mirror, "mirror.test")
    assert seen.header_all("authorization") == ["Bearer sandbox-own-value"]  # forwarded as the sandbox sent it
    for name in ("allowed.test", "other.test"):
        [received] = upstreams.tls[name].requests
        assert [v for k, v in received.headers if k.lower() == "authorization"] == ["Bearer sandbox-own-value"]
    everything = [r.everything() for r in cred.mirror.requests]
    everything += [repr(r.headers) + r.path for s in upstreams.all() for r in s.requests]
    for value in SECRETS.values():
        assert not any(value in text for text in everything)


def test_query_parameter_injection(cred):
    response = fetch(cred.gateway, "qecho.test", "/v1/anything?x=1&api_key=sandbox-own&y=2&api_key=again")
    assert response.status == 200
    seen = _only_request(cred.echo, "qecho.test")
    query = parse_qsl(urlsplit(seen.path).query, keep_blank_values=True)
    assert [v for k, v in query if k == "api_key"] == [SECRETS["query_key"]]
    assert ("x", "1") in query and ("y", "2") in query
    assert "sandbox-own" not in seen.path and "again" not in seen.path
    assert seen.path.count(quote_plus(SECRETS["query_key"])) == 1
    assert not seen.header_all("authorization")
    assert all(SECRETS["query_key"] not in v for _, v in seen.headers)
    assert_no_leak(response_bytes(response), SECRETS)
    assert_length_true(response)


def test_query_parameter_injection_without_a_query(cred):
    assert fetch(cred.gateway, "qecho.test", "/v1/anything/plain").status == 200
    seen = _only_request(cred.echo, "qecho.test")
    assert dict(parse_qsl(urlsplit(seen.path).query)) == {"api_key": SECRETS["query_key"]}
    assert urlsplit(seen.path).path == "/v1/anything/plain"


def test_wildcard_rule_with_allow_wildcard_credentials(cred, upstreams):
    response = fetch(cred.gateway, "deep.wild.test", "/wild", headers=[("x-wild-token", "sandbox")])
    assert response.status == 200
    [received] = upstreams.tls["deep.wild.test"].requests
    assert [v for k, v in received.headers if k.lower() == "x-wild-token"] == [SECRETS["wild_token"]]


def test_plain_http_with_allow_plaintext_credentials(cred, upstreams):
    with proxy_conn(cred.gateway) as conn:
        response = conn.request("GET", "http://api.test/plain", [("Host", "api.test")])
    assert response.status == 200, response.text
    [received] = upstreams.plain["api.test"].requests
    assert [v for k, v in received.headers if k.lower() == "authorization"] == [f"token {SECRETS['plain_token']}"]
    assert fetch(cred.gateway, "api.test", "/tls").status == 200
    [received] = upstreams.tls["api.test"].requests
    assert [v for k, v in received.headers if k.lower() == "authorization"] == [f"token {SECRETS['plain_token']}"]


def test_plain_http_to_an_https_only_bound_host_is_refused(cred, upstreams):
    with proxy_conn(cred.gateway) as conn:
        response = conn.request("GET", "http://echo.test/v1/anything", [("Host", "echo.test")])
    assert_refused(response, 403, "scheme_not_allowed")
    assert not cred.echo.touched
    assert_no_leak(response_bytes(response), SECRETS)


@pytest.mark.parametrize("method", ["TRACE", "TRACK"])
def test_trace_stays_refused_on_a_bound_host(cred, method):
    with tls_to(cred.gateway, "echo.test") as tls:
        response = get(tls, "/v1/anything", "echo.test", method=method)
    assert_refused(response, 403, "method_forbidden")
    assert not cred.echo.touched
    assert_no_leak(response_bytes(response), SECRETS)

