"""Bound rules (issue 13, leak classes 6 and 9), as an attacker in the sandbox would try them.

Class 6, the sandbox chooses the bytes around the secret: get a placeholder swapped where the bytes
next to it turn the secret into something no redaction form matches (a `%2` or `%` that takes the
secret's first hex digits into an escape, a `;` or `&` a parser splits at, a path segment an upstream
normalises), or where no swap should happen at all (header names, pseudo-headers, userinfo, another
sandbox's placeholder). Class 9, exfiltration with the attacker's own key: get a key of the
sandbox's own to a bound API (a look-alike header or parameter name, a second header line, report
mode, a Basic credential). The oracle: a refusal leaves no TCP connection upstream; an allowed
request carries the secret only whole, only where the rule swaps it, and nothing that comes back
holds any form of it (tests.credentials.clients.leaks).

The gateway is tests/credentials/bound.py's (rules pos, strict, partner, report, open) on its own
addresses; the `rt` attacks use the red-team gateway (echo injects Authorization, qecho api_key).
"""

from __future__ import annotations

import base64
import re
from urllib.parse import quote, unquote

import pytest

from tests.credentials import bound as world
from tests.credentials.clients import assert_no_leak, connect, fetch, leaks, response_bytes
from tests.e2e.helpers import H2Client, assert_refused, get, tls_tunnel

from .common import attack, nothing_reached

pytestmark = attack("credentials")

POS = world.SECRETS["pos_key"]  # starts with hex digits: "e4" after a '%' is a byte


bw, _fresh_bw = world.fixtures(44, "redteam-bound", name="bw")


def _raw(bw, host: str, head: str, alpn=None) -> bytes:
    """Send a hand-written request head in a tunnel; everything the client got back."""
    with tls_tunnel(bw.gateway, f"{host}:443") as tls:
        tls.send(head.encode("utf-8", "surrogateescape"))
        tls.sock.settimeout(1.5)
        data = b""
        try:
            while chunk := tls.sock.recv(65536):
                data += chunk
                if b"\r\n\r\n" in data and re.search(rb"Content-Length: (\d+)", data):
                    length = int(re.search(rb"Content-Length: (\d+)", data).group(1))
                    if len(data.split(b"\r\n\r\n", 1)[1]) >= length:
                        break
        except OSError:
            pass
    return data


def _held(bw, response) -> None:
    """Refused as a misplaced placeholder, and nothing reached any origin."""
    assert response.status == 403 and response.egress_reason == "placeholder_misuse", (response.status,
                                                                                     response.text[:300])
    bw.assert_nothing_sent()
    assert_no_leak(response_bytes(response), bw.secrets)


# --- class 6: the bytes around the secret --------------------------------------------------------


@pytest.mark.parametrize("query", [
    "api_key=%2{ph}",            # the escape, in a parameter the rule does swap
    "api_key=%{ph}",             # '%' + the secret's first two hex digits: a raw byte
    "api_key=%25{ph}",           # an escaped '%' an upstream decodes twice
    "api_key={ph}%",
    "api_key={ph}%2",
    "api_key={ph};api_key=x",    # servers that split at ';'
    "api_key={ph}&api_key=%2{ph}",  # one good swap does not carry a bad one
    "api_key={ph}{ph}",
    "api%5Fkey={ph}",            # a name the upstream decodes to the swapped one
    "sig=+{ph}",                 # '+' is a space to a form decoder
    "api_key=%65gress-placeholder-pos_key-{hex}",
    "api_key=egress-placeholder-pos_key-{hex}%00",
    "q={ph}",
])
def test_escapes_and_separators_next_to_an_allowed_query_placeholder(bw, query):
    ph = bw.ph("pos_key")
    response = fetch(bw.gateway, "pos.test", "/v1/anything?" + query.format(ph=ph, hex=ph.rsplit("-", 1)[1]))
    _held(bw, response)


@pytest.mark.parametrize("path", [
    "/v1/anything/%2{ph}", "/v1/anything/{ph}%2Fx", "/v1/anything/{ph}%2F..%2F..", "/v1/anything/{ph};x=1",
    "/v1/anything/{ph}\\x", "/v1/anything/{ph}.json", "/v1/anything/%7B{ph}%7D",
])
def test_escapes_next_to_an_allowed_path_placeholder(bw, path):
    ph = bw.ph("pos_key")
    response = fetch(bw.gateway, "pos.test", path.format(ph=ph))
    if response.status == 400:  # the path check came first (backslash and dot tricks)
        assert response.egress_reason == "bad_path"
        bw.assert_nothing_sent()
        return
    _held(bw, response)


@pytest.mark.parametrize("name, value", [
    ("Referer", "https://pos.test/?q=%2{ph}"),      # a header an upstream parses as a URL
    ("X-Forwarded-Uri", "/v1/x?api_key=%2{ph}"),
    ("X-Key", "%{ph}"),
    ("X-Key", "{ph}="),                             # base64 padding glued on: decodes differently
    ("X-Key", "Basic%20{ph}"),
    ("X-Key", "{ph};"),
    ("X-Key", '"{ph}"'),
    ("Cookie", "a=1; {ph}"),                         # cookie values are URL-decoded by frameworks
    ("x-{ph}", "1"),                                # a header name
])
def test_escapes_next_to_a_header_placeholder(bw, name, value):
    ph = bw.ph("pos_key")
    response = fetch(bw.gateway, "pos.test", "/v1/anything", headers=[(name.format(ph=ph), value.format(ph=ph))])
    _held(bw, response)


def test_the_allowed_positions_are_safe_against_a_parsing_echo(bw):
    """Swapped where the rule allows it, the value is whole (percent-encoded in the URL, raw in a
    header between delimiters): the echo parses and re-encodes it, and every form is redacted. No
    piece of it, split at what a query parser splits at, comes back either."""
    ph = bw.ph("pos_key")
    response = fetch(bw.gateway, "pos.test", f"/v1/anything/{ph}?api_key={ph}&sig={ph}",
                     headers=[("Authorization", f"Bearer {ph}"), ("X-Key", f"a,{ph}\t%2")])
    assert response.status == 200, response.text
    [seen] = bw.echo.requests
    encoded = quote(POS, safe="")
    assert seen.path == f"/v1/anything/{encoded}?api_key={encoded}&sig={encoded}"
    assert seen.header_all("x-key") == [f"a,{POS}\t%2"]
    body = response_bytes(response)
    assert_no_leak(body, bw.secrets)
    pieces = [p for p in re.split(r"[&=+/ ]", POS) if len(p) >= 4]
    assert not all(p.encode() in body for p in pieces), pieces


def test_http2_pseudo_headers_and_names(bw):
    ph = bw.ph("strict_key")
    with tls_tunnel(bw.gateway, "strict.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        streams = [
            h2.send("strict.test", f"/v1/anything?q=%2{ph}"),
            h2.send("strict.test", f"/v1/anything/{ph}"),
            h2.send("strict.test", "/v1/anything", extra=[(f"x-{ph}", "1")]),
            h2.send("strict.test", "/v1/anything", extra=[("x-key", ph.upper())]),
        ]
        h2.wait(*streams)
    for stream in streams:
        assert h2.responses[stream]["status"] == 403, h2.responses[stream]
        assert h2.header(stream, "x-egress-reason") == "placeholder_misuse"
        assert_no_leak(h2.responses[stream]["body"], bw.secrets)
    # a placeholder in :authority: refused (421, or the connection, for a name that is no host name)
    with tls_tunnel(bw.gateway, "strict.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        authority = h2.send(f"{ph}.strict.test", "/v1/anything")
        try:
            h2.wait(authority)
            assert h2.responses[authority]["status"] in (400, 421)
            assert_no_leak(h2.responses[authority]["body"], bw.secrets)
        except ConnectionError:
            pass
    bw.assert_nothing_sent()


def test_userinfo_and_authority(bw):
    ph = bw.ph("pos_key")
    for head in (f"GET https://u:{ph}@pos.test/v1/anything HTTP/1.1\r\nHost: pos.test\r\n\r\n",
                 f"GET /v1/anything HTTP/1.1\r\nHost: {ph}@pos.test\r\n\r\n",
                 f"GET /v1/anything HTTP/1.1\r\nHost: pos.test\r\nHost: {ph}\r\n\r\n"):
        data = _raw(bw, "pos.test", head)
        assert re.match(rb"HTTP/1.1 (400|421|403) ", data), data[:200]
        assert not leaks(data, POS)
    conn, answer = connect(bw.gateway, f"u:{ph}@pos.test:443")
    conn.close()
    assert answer.status == 400
    bw.assert_nothing_sent()


def test_another_sandboxs_placeholder_and_a_placeholder_of_another_rule(bw):
    mine_from_alpha = bw.ph("pos_key", "alpha")
    _held(bw, fetch(bw.gateway, "pos.test", "/v1/anything", headers=[("X-Key", mine_from_alpha)]))
    _held(bw, fetch(bw.gateway, "pos.test", "/v1/anything", headers=[("X-Key", bw.ph("strict_key"))],
                    source=world.ALPHA_SOURCE))
    _held(bw, fetch(bw.gateway, "strict.test", "/v1/anything", headers=[("X-Key", bw.ph("pos_key"))]))


def test_a_redirect_that_puts_the_placeholder_next_to_an_escape(bw):
    """The origin redirects the client to a URL of the sandbox's making; following it is a new
    request, judged like any other, and asking for such a redirect is itself refused."""
    ph = bw.ph("pos_key")
    location = f"/v1/anything?api_key=%2{ph}"
    # asking for the redirect already carries the placeholder next to an escape (in `to`)
    _held(bw, fetch(bw.gateway, "pos.test", "/v1/redirect?to=" + quote(location, safe="")))
    # a redirect the origin makes up by itself, followed
    assert fetch(bw.gateway, "pos.test", "/v1/redirect?to=/v1/anything/next").status == 302
    bw.reset()
    _held(bw, fetch(bw.gateway, "pos.test", location))


def test_unicode_look_alikes_are_never_swapped(bw):
    """Not the placeholder, so not swapped: the origin gets the look-alike, never the secret."""
    ph = bw.ph("pos_key")
    for spelling in (ph.replace("-", "%E2%80%90", 1), ph.replace("e", "%D0%B5", 1)):  # U+2010, Cyrillic e
        response = fetch(bw.gateway, "pos.test", f"/v1/anything?api_key={spelling}")
        assert response.status in (200, 403), response.text
        for seen in bw.echo.requests:
            assert POS not in unquote(seen.path) and quote(POS, safe="") not in seen.path
        assert_no_leak(response_bytes(response), bw.secrets)
        bw.reset()


# --- class 9: the attacker's own key -------------------------------------------------------------


@pytest.mark.parametrize("headers, path", [
    ([("X-API-KEY", "own-key-123")], "/v1/anything"),                       # the injected name: replaced
    ([("x_api_key", "own-key-123")], "/v1/anything"),                       # its WSGI twin: not replaced
    ([("X-Api_Key", "own-key-123")], "/v1/anything"),
    ([("Authorization", "Bearer own-key-123")], "/v1/anything"),
    ([("Proxy-Authorization", "Basic b3duOmtleQ==")], "/v1/anything"),
    ([("X-Goog-Api-Key", "own-key-123")], "/v1/anything"),
    ([("Authorization", "Bearer {ph}"), ("Authorization", "Bearer own-key-123")], "/v1/anything"),
    ([("Authorization", "Bearer {ph}, Bearer own-key-123")], "/v1/anything"),
    ([("Authorization", "ownkeyletters {ph}")], "/v1/anything"),  # a "scheme word" beside the platform's
    ([], "/v1/anything?ke%79=own-key-123"),
    ([], "/v1/anything?%256Bey=own-key-123"),
    ([], "/v1/anything?Access-Token=own-key-123"),
    ([], "/v1/anything?api key=own-key-123".replace(" ", "+")),
    ([], "/v1/anything?q=1;key=own-key-123"),
    ([], "/v1/anything?key[x]=own-key-123"),
])
def test_own_key_spellings_on_a_bound_rule(bw, headers, path):
    ph = bw.ph("strict_key")
    response = fetch(bw.gateway, "strict.test", path, headers=[(k, v.format(ph=ph)) for k, v in headers])
    if headers and headers[0][0] == "X-API-KEY":
        assert response.status == 200  # what the rule injects is replaced: the origin sees the platform's
        [seen] = bw.echo.requests
        assert seen.header_all("x-api-key") == [world.SECRETS["strict_key"]]
        assert "own-key-123" not in seen.everything()
    else:
        assert_refused(response, 403, "foreign_credential", "strict")
        bw.assert_nothing_sent()
        assert "own-key-123" not in response.text
    assert_no_leak(response_bytes(response), bw.secrets)


def test_own_key_as_basic_with_the_placeholder_inside(bw):
    """Base64 hides the placeholder, so it is not swapped: a Basic credential of the sandbox's own."""
    blob = base64.b64encode(f"{bw.ph('strict_key')}:own-key-123".encode()).decode()
    response = fetch(bw.gateway, "strict.test", "/v1/anything", headers=[("Authorization", f"Basic {blob}")])
    assert_refused(response, 403, "foreign_credential")
    bw.assert_nothing_sent()


def test_own_key_through_report_mode(bw):
    for headers, path in (([("X-Api-Key", "own-key-123")], "/v1/not-ok"), ([], "/v1/not-ok?key=own-key-123")):
        response = fetch(bw.gateway, "report.test", path, headers=headers)
        assert_refused(response, 403, "foreign_credential", "report")
        bw.assert_nothing_sent()


def test_own_key_over_http2_second_header_line(bw):
    with tls_tunnel(bw.gateway, "strict.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        stream = h2.send("strict.test", "/v1/anything", extra=[("authorization", f"Bearer {bw.ph('strict_key')}"),
                                                               ("authorization", "Bearer own-key-123")])
        h2.wait(stream)
    assert h2.responses[stream]["status"] == 403
    assert h2.header(stream, "x-egress-reason") == "foreign_credential"
    bw.assert_nothing_sent()


def test_own_session_cookie_where_the_rule_lists_cookie(bw):
    response = fetch(bw.gateway, "partner.test", "/v1/anything", headers=[("Cookie", "session=own-key-123")])
    assert_refused(response, 403, "foreign_credential", "partner")
    bw.assert_nothing_sent()


@pytest.mark.parametrize("host, headers, path", [
    ("echo.test", [("X-Api-Key", "own-key-123")], "/v1/anything"),
    ("echo.test", [("Api-Key", "own-key-123")], "/v1/anything"),
    ("echo.test", [], "/v1/anything?access_token=own-key-123"),
    ("qecho.test", [], "/v1/anything?key=own-key-123"),
    ("qecho.test", [], "/v1/anything?Api_Key=own-key-123"),
    ("qecho.test", [("Authorization", "Bearer own-key-123")], "/v1/anything"),
])
def test_own_key_on_the_red_team_gateways_bound_rules(rt, host, headers, path):
    with tls_tunnel(rt.gateway, f"{host}:443") as tls:
        response = get(tls, path, host, extra=headers)
    assert_refused(response, 403, "foreign_credential")
    nothing_reached({"echo": rt.servers["echo"]})
