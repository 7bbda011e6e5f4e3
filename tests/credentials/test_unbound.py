"""The secret never reaches a host its rule is not bound to, and never leaves on a refused request:
a restated Host, SNI or authority (421), a CONNECT to another allowed host naming the bound one,
a redirect (the gateway does not follow it; the follow-up goes without the secret), and every
403/400/421 path leaves the upstream untouched."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.helpers import H2Client, assert_refused, audit_for, client_tls_context, get, start_tls

from .clients import assert_no_leak, connect, fetch, proxy_conn, response_bytes, tls_to
from .conftest import SECRETS

TOKEN = SECRETS["api_token"]


def _nothing_sent(cred, upstreams) -> None:
    assert not cred.echo.touched, [(r.host, r.path) for r in cred.echo.requests]
    assert not cred.mirror.touched, [(r.host, r.path) for r in cred.mirror.requests]
    for name in ("allowed.test", "other.test"):
        assert not upstreams.tls[name].touched, name


def _no_injection_logged(cred, client: str) -> None:
    """The test's own lines only: the gateway serves the module, and a later test's client may get an
    earlier one's port back (seen in CI: an earlier test's injected request matched by port)."""
    lines = audit_for(cred.gateway, client, count=2, since=cred.gateway.audit_mark)
    assert lines, "no audit line for this client"
    assert not [line for line in lines if line.get("injected")], lines


@pytest.mark.parametrize("tunnel_host, host_header, sni, reason", [
    ("echo.test", "mirror.test", "echo.test", "host_mismatch"),      # Host restated away from the bound host
    ("echo.test", "echo.test:8443", "echo.test", "host_mismatch"),   # same name, another port
    ("mirror.test", "echo.test", "mirror.test", "host_mismatch"),    # CONNECT elsewhere, Host of the bound one
    ("allowed.test", "echo.test", "allowed.test", "host_mismatch"),
    ("echo.test", "echo.test", "mirror.test", "sni_mismatch"),       # SNI restated
    ("mirror.test", "mirror.test", "echo.test", "sni_mismatch"),     # SNI of the bound host in another tunnel
    ("allowed.test", "echo.test", "echo.test", "sni_mismatch"),
], ids=lambda v: str(v))
def test_restated_destination_is_421_and_nothing_leaves(cred, upstreams, tunnel_host, host_header, sni, reason):
    cred.gateway.mark()
    conn, answer = connect(cred.gateway, f"{tunnel_host}:443")
    assert answer.status == 200
    with start_tls(conn, cred.gateway, sni) as tls:
        for path in ("/v1/anything", "/v1/anything/again"):
            response = get(tls, path, host_header, extra=[("Authorization", "Bearer sandbox")])
            assert_refused(response, 421, reason)
            assert_no_leak(response_bytes(response), SECRETS)
        client = tls.client
    _nothing_sent(cred, upstreams)
    _no_injection_logged(cred, client)


def test_absolute_form_authority_of_the_bound_host_in_another_tunnel(cred, upstreams):
    with tls_to(cred.gateway, "mirror.test") as tls:
        response = tls.request("GET", "https://echo.test/v1/anything", [("Host", "echo.test")])
        assert_refused(response, 421, response.egress_reason)
        assert response.egress_reason in ("authority_mismatch", "host_mismatch")
    _nothing_sent(cred, upstreams)


def test_http2_authority_of_the_bound_host_in_another_tunnel(cred, upstreams):
    with tls_to(cred.gateway, "mirror.test", alpn=["h2"]) as tls:
        client = H2Client(tls)
        sid = client.send("echo.test", "/v1/anything")
        client.wait(sid)
        assert client.responses[sid]["status"] == 421
        assert client.header(sid, "x-egress-reason") in ("authority_mismatch", "host_mismatch")
        assert_no_leak(client.responses[sid]["body"], SECRETS)
    _nothing_sent(cred, upstreams)


def test_plain_http_host_naming_the_bound_host_is_400(cred, upstreams):
    with proxy_conn(cred.gateway) as conn:
        response = conn.request("GET", "http://mirror.test/v1/anything", [("Host", "echo.test")])
    assert_refused(response, 400, "host_url_mismatch")
    _nothing_sent(cred, upstreams)


def test_redirect_is_not_followed_and_the_follow_up_carries_no_secret(cred):
    target = "https://mirror.test/v1/anything/landed"
    response = fetch(cred.gateway, "echo.test", f"/v1/redirect?to={target}")
    assert response.status == 302  # the sandbox sees the redirect: the gateway followed nothing
    assert response.header("Location") == target
    assert len(cred.echo.requests) == 1 and not cred.mirror.touched
    # a client that follows it (httpx, as an SDK would)
    cred.echo.reset()
    with httpx.Client(proxy=cred.gateway.proxy_url, verify=client_tls_context(cred.gateway),
                      follow_redirects=True, timeout=5) as client:
        final = client.get(f"https://echo.test/v1/redirect?to={target}",
                           headers={"Authorization": "Bearer sandbox-own", "X-Trace": "1"})
    assert final.status_code == 200
    assert [str(r.url) for r in final.history] == [f"https://echo.test/v1/redirect?to={target}"]
    [first] = cred.echo.requests
    assert first.header_all("authorization") == [f"Bearer {TOKEN}"]
    [followed] = cred.mirror.requests
    assert followed.path == "/v1/anything/landed"
    for value in SECRETS.values():
        assert value not in followed.everything()
    assert_no_leak(final.content, SECRETS)


def test_redirect_to_another_bound_path_gets_the_secret_again(cred):
    with httpx.Client(proxy=cred.gateway.proxy_url, verify=client_tls_context(cred.gateway),
                      follow_redirects=True, timeout=5) as client:
        final = client.get("https://echo.test/v1/redirect?to=/v1/anything/second")
    assert final.status_code == 200
    assert len(cred.echo.requests) == 2
    for seen in cred.echo.requests:
        assert seen.header_all("authorization") == [f"Bearer {TOKEN}"]
    assert_no_leak(final.content, SECRETS)


@pytest.mark.parametrize("path, headers, status, reason", [
    ("/admin", [], 403, "path_not_allowed"),
    ("/v1/../admin", [], 403, "path_not_allowed"),
    ("/v1/%2e%2e/admin", [], 403, "path_not_allowed"),
    ("/v1/anything", [("Host", "echo.test")], 400, "bad_host_header"),        # a second Host
    ("/v1/anything", [("Upgrade", "h2c"), ("Connection", "Upgrade")], 400, "upgrade_refused"),
])
def test_refused_requests_never_carry_the_secret(cred, upstreams, path, headers, status, reason):
    cred.gateway.mark()
    with tls_to(cred.gateway, "echo.test") as tls:
        response = get(tls, path, "echo.test", extra=headers + [("Authorization", "Bearer sandbox")])
        assert_refused(response, status, reason)
        assert_no_leak(response_bytes(response), SECRETS)
        client = tls.client
    _nothing_sent(cred, upstreams)
    _no_injection_logged(cred, client)
