"""Leak class 6 of issue 13, end to end: the sandbox chooses the bytes around the secret.

A placeholder is swapped only where it stands as a whole token in a position its rule allows: a
header value (whole, or a whole space/comma token), the whole value of a query parameter the rule
names, a whole path segment if the rule allows the path. Any other request holding a placeholder on
a bound rule is refused (403 placeholder_misuse, audited with where) before a byte goes upstream:
the echo origin sees no TCP connection. Real clients (curl, httpx, requests, raw HTTP/1.1, HTTP/2)
against a real echo origin that reflects what it got, decoded and re-encoded; nothing that comes
back holds the secret in any form."""

from __future__ import annotations

import base64
from urllib.parse import quote, unquote

import httpx
import pytest
import requests
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.e2e.helpers import H2Client, assert_refused, client_tls_context, curl, get, tls_tunnel

from . import bound as world
from .clients import assert_no_leak, fetch, leaks, proxy_conn, response_bytes

POS = world.SECRETS["pos_key"]


b, _fresh_b = world.fixtures(40, "positions")


def _only(b):
    assert len(b.echo.requests) == 1, [(r.method, r.path) for r in b.echo.requests]
    return b.echo.requests[0]


def _refused(b, response, location: str | None = None, reason: str = "placeholder_misuse"):
    assert_refused(response, 403, reason)
    b.assert_nothing_sent()
    assert_no_leak(response_bytes(response), b.secrets)
    line = b.audit_line(reason)
    if location is not None:
        assert line["location"] == location, line
    assert not line.get("injected")
    assert_no_leak(repr(line), b.secrets, "audit line")
    return line


# --- swapped where the rule allows it: every client ------------------------------------------------


def test_curl_header_token_is_swapped_raw(b):
    ph = b.ph("pos_key")
    result = curl(b.gateway, "https://pos.test/v1/anything", "-H", f"Authorization: Bearer {ph}",
                  "-H", f"X-List: a, {ph}")
    assert result.status == 200, result
    seen = _only(b)
    assert seen.header_all("authorization") == [f"Bearer {POS}"]
    assert seen.header_all("x-list") == [f"a, {POS}"]
    assert seen.header_all("x-injected") == [POS]
    assert ph not in seen.everything()
    assert_no_leak(result.body + repr(result.headers), b.secrets)
    line = [x for x in b.gateway.audit() if x.get("host") == "pos.test" and x["event"] == "request"][-1]
    assert line["injected"] == ["pos_key"] and line["reason"] == "allowed"


def test_requests_named_query_parameter_is_swapped_percent_encoded(b):
    ph = b.ph("pos_key")
    response = requests.get("https://pos.test/v1/anything", params={"api_key": ph, "q": "1"},
                            proxies={"https": b.gateway.proxy_url}, verify=str(b.gateway.ca_cert), timeout=10)
    assert response.status_code == 200, response.text
    seen = _only(b)
    assert seen.path == f"/v1/anything?api_key={quote(POS, safe='')}&q=1"
    args = response.json()["args"]  # the origin parsed the query: the secret came back whole, and redacted
    assert args["q"] == "1" and len(args["api_key"]) == len(POS) and set(args["api_key"]) <= set("[REDACTED]*")
    assert_no_leak(response.content, b.secrets)


def test_httpx_whole_path_segment_is_swapped_when_the_rule_allows_the_path(b):
    ph = b.ph("pos_key")
    with httpx.Client(proxy=b.gateway.proxy_url, verify=client_tls_context(b.gateway), timeout=10) as client:
        response = client.get(f"https://pos.test/v1/anything/{ph}/x")
    assert response.status_code == 200, response.text
    assert _only(b).path == f"/v1/anything/{quote(POS, safe='')}/x"
    assert_no_leak(response.content + repr(response.headers).encode(), b.secrets)


def test_http2_header_and_query_are_swapped_and_path_refused_where_not_allowed(b):
    ph = b.ph("pos_key")
    with tls_tunnel(b.gateway, "pos.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        swapped = h2.send("pos.test", f"/v1/anything?sig={ph}", extra=[("authorization", f"Bearer {ph}")])
        h2.wait(swapped)
    assert h2.responses[swapped]["status"] == 200
    seen = _only(b)
    assert seen.path == f"/v1/anything?sig={quote(POS, safe='')}"
    assert seen.header_all("authorization") == [f"Bearer {POS}"]
    assert_no_leak(h2.responses[swapped]["body"], b.secrets)
    b.reset()
    sph = b.ph("strict_key")
    with tls_tunnel(b.gateway, "strict.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        refused = h2.send("strict.test", f"/v1/anything/{sph}")  # :path, and rule strict does not allow the path
        escape = h2.send("strict.test", "/v1/anything", extra=[("x-key", f"%2{sph}")])
        h2.wait(refused, escape)
    for stream in (refused, escape):
        assert h2.responses[stream]["status"] == 403
        assert h2.header(stream, "x-egress-reason") == "placeholder_misuse"
    b.assert_nothing_sent()


def test_plain_http_swaps_only_where_the_rule_already_sends_credentials_in_the_clear(b, upstreams):
    """allow_plaintext_credentials: the injected credential goes over http anyway, so a placeholder
    of the same secret is swapped there too; a bound rule without it refuses any plain request."""
    ph = b.ph("pos_key")
    with proxy_conn(b.gateway) as conn:
        response = conn.request("GET", "http://api.test/plain", [("Host", "api.test"), ("X-Key", ph)])
    assert response.status == 200, response.text
    [seen] = upstreams.plain["api.test"].requests
    assert [v for k, v in seen.headers if k.lower() == "x-key"] == [POS]
    with proxy_conn(b.gateway) as conn:
        response = conn.request("GET", "http://strict.test/v1/anything", [("Host", "strict.test"),
                                                                           ("X-Key", b.ph("strict_key"))])
    assert response.status == 403 and response.egress_reason in ("scheme_not_allowed", "plaintext_credentials")
    assert not b.echo.touched


def test_a_body_is_never_swapped_nor_refused(b):
    """A prompt that quotes the sandbox's environment must still reach a model API: the body goes as
    it was sent, placeholder and all, and the secret is not in it."""
    ph = b.ph("pos_key")
    body = f'{{"prompt": "env says POS_KEY={ph} and %2{ph}"}}'.encode()
    response = fetch(b.gateway, "pos.test", "/v1/anything", method="POST", body=body,
                     headers=[("Content-Type", "application/json")])
    assert response.status == 200
    seen = _only(b)
    assert seen.body == body and POS.encode() not in seen.body
    assert_no_leak(response_bytes(response), b.secrets)


def test_an_unbound_rule_forwards_a_placeholder_unchanged_wherever_it_is(b):
    """Nothing is swapped there, so no secret is near the sandbox's bytes: not refused."""
    ph = b.ph("pos_key")
    response = fetch(b.gateway, "open.test", f"/v1/anything?q=%2{ph}", headers=[("X-Key", f"xx{ph}")])
    assert response.status == 200
    [seen] = b.open.requests
    assert seen.path == f"/v1/anything?q=%2{ph}" and seen.header_all("x-key") == [f"xx{ph}"]
    assert POS not in seen.everything()


# --- refused: every shape of the class ------------------------------------------------------------


def test_the_issues_example_percent_2_before_the_placeholder(b):
    """`?q=%2<ph>`: swapped, the secret's first hex digit would finish the escape (`%2e` is '.'),
    and the echo's decoded query would hand back '.' + the rest of the secret: no redaction form."""
    for host, secret in (("pos.test", "pos_key"), ("strict.test", "strict_key")):
        ph = b.ph(secret)
        result = curl(b.gateway, f"https://{host}/v1/anything?q=%2{ph}&api_key=%2{ph}")
        assert result.status == 403 and result.header("X-Egress-Reason") == "placeholder_misuse", result
        b.assert_nothing_sent()
        assert_no_leak(result.body, b.secrets)
        assert POS[1:] not in result.body
    assert b.audit_line("placeholder_misuse")["location"].startswith("query parameter")


PH_CASES = [
    # (host, path, headers) with {ph} for pos's placeholder, {sph} for strict's, {aph} for alpha's
    ("pos.test", "/v1/anything?q={ph}", [], "query parameter q"),                  # parameter not named
    ("pos.test", "/v1/anything?API_KEY={ph}", [], "query parameter API_KEY"),
    ("pos.test", "/v1/anything?api_key=x{ph}", [], "query parameter api_key"),
    ("pos.test", "/v1/anything?api_key={ph}x", [], "query parameter api_key"),
    ("pos.test", "/v1/anything?api_key=%25{ph}", [], "query parameter api_key"),
    ("pos.test", "/v1/anything?{ph}=1", [], "query parameter name"),
    ("pos.test", "/v1/anything?api_key=egress%2Dplaceholder-pos_key-{hex}", [], "query parameter api_key"),
    ("pos.test", "/v1/anything?api_key=%2565gress-placeholder-pos_key-{hex}", [], "query parameter api_key"),
    ("pos.test", "/v1/anything?api_key={PH}", [], "query parameter api_key"),      # upper case
    ("pos.test", "/v1/anything/x{ph}/y", [], "path"),                             # not a whole segment
    ("pos.test", "/v1/anything/{ph};v=1", [], "path"),
    ("strict.test", "/v1/anything/{sph}", [], "path"),                            # the rule does not allow the path
    ("strict.test", "/v1/anything?api_key={sph}", [], "query parameter api_key"),
    ("pos.test", "/v1/anything", [("X-{ph}", "1")], "header name"),
    ("pos.test", "/v1/anything", [("Cookie", "session={ph}")], "cookie"),
    ("pos.test", "/v1/anything", [("Cookie", "{ph}")], "cookie"),
    ("pos.test", "/v1/anything", [("X-Key", "xx{ph}yy")], "header X-Key"),
    ("pos.test", "/v1/anything", [("X-Key", "{PH}")], "header X-Key"),
    ("pos.test", "/v1/anything", [("X-Key", "egress%2Dplaceholder-pos_key-{hex}")], "header X-Key"),
    ("pos.test", "/v1/anything", [("Referer", "https://x.example/?q=%2{ph}")], "header Referer"),
    ("pos.test", "/v1/anything", [("X-Key", "a"), ("x-key", "{ph}x")], "header x-key"),  # multi-valued
    ("pos.test", "/v1/anything", [("X-Key", "{sph}")], "header X-Key"),           # a secret pos is not bound to
    ("pos.test", "/v1/anything", [("X-Key", "{aph}")], "header X-Key"),           # another sandbox's
    ("pos.test", "/v1/anything", [("X-Key", "egress-placeholder-pos_key-{zeros}")], "header X-Key"),  # made up
]


@pytest.mark.parametrize("host, path, headers, location", PH_CASES,
                         ids=[f"{c[3]}:{i}" for i, c in enumerate(PH_CASES)])
def test_misplaced_placeholders_are_refused_before_anything_is_sent(b, host, path, headers, location):
    ph = b.ph("pos_key")
    values = {"ph": ph, "PH": ph.upper(), "sph": b.ph("strict_key"), "aph": b.ph("pos_key", "alpha"),
              "hex": ph.rsplit("-", 1)[1], "zeros": "0" * 40}
    response = fetch(b.gateway, host, path.format(**values),
                     headers=[(k.format(**values), v.format(**values)) for k, v in headers])
    line = _refused(b, response, location)
    assert line["rule"] == host.split(".")[0]


def test_alphas_placeholder_works_from_alpha_only(b):
    aph = b.ph("pos_key", "alpha")
    assert fetch(b.gateway, "pos.test", "/v1/anything", headers=[("X-Key", aph)],
                 source=world.ALPHA_SOURCE).status == 200
    assert _only(b).header_all("x-key") == [POS]
    b.reset()
    response = fetch(b.gateway, "pos.test", "/v1/anything", headers=[("X-Key", b.ph("pos_key"))],
                     source=world.ALPHA_SOURCE)
    _refused(b, response, "header X-Key")


def test_a_fragment_never_reaches_the_rules(b):
    response = fetch(b.gateway, "pos.test", f"/v1/anything#{b.ph('pos_key')}")
    assert response.status == 400 and response.egress_reason == "bad_path"
    b.assert_nothing_sent()


def test_a_placeholder_inside_a_basic_credential_is_not_swapped(b):
    """Inside base64 no placeholder is visible, so none is swapped: to the rule it is the sandbox's
    own credential in Authorization, refused as foreign."""
    blob = base64.b64encode(f"user:{b.ph('strict_key')}".encode()).decode()
    response = fetch(b.gateway, "strict.test", "/v1/anything", headers=[("Authorization", f"Basic {blob}")])
    _refused(b, response, "header Authorization", reason="foreign_credential")


# --- hypothesis: any bytes around a placeholder, through the real gateway -----------------------

AROUND = st.lists(st.sampled_from(["%", "%2", "%25", "2", "e", "F", "0", " ", ",", ";", "=", "&", "/", "+", "-",
                                   "egress", "%2D", "%65", "x"]), max_size=4).map("".join)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["header", "api_key", "q", "path"]), AROUND, AROUND)
@example("header", "Bearer ", "")
@example("header", "a,", " b")
@example("api_key", "", "")
@example("api_key", "", "&x=1")
@example("path", "", "")
@example("q", "%2", "")
@example("api_key", "%", "")
@example("path", "%ff", "")
def test_random_surroundings_swap_whole_tokens_or_refuse(b, where, prefix, suffix):
    b.reset()
    ph = b.ph("pos_key")
    token = prefix + ph + suffix
    path, headers = "/v1/anything", []
    if where == "header":
        headers = [("X-Key", token)]
    elif where == "path":
        path = f"/v1/anything/{quote(token, safe='%/;=&+,')}/end"
    else:
        path = f"/v1/anything?{where}={quote(token, safe='%/;=&+,')}"
    if " " in path:
        return
    with tls_tunnel(b.gateway, "pos.test:443") as tls:
        response = get(tls, path, "pos.test", extra=headers)
    assert_no_leak(response_bytes(response), b.secrets)
    if response.status == 403:
        assert response.egress_reason == "placeholder_misuse", response.text
        b.assert_nothing_sent()
        return
    if response.status == 400 and response.egress_reason == "bad_path":
        b.assert_nothing_sent()  # random bytes made a path the gateway refuses anyway (e.g. %ff)
        return
    assert response.status == 200, response.text
    seen = _only(b)
    encoded = quote(POS, safe="")
    if where == "header":
        [value] = seen.header_all("x-key")
        for piece in value.replace(",", " ").split():
            assert piece == POS or POS not in piece, value
    elif where == "path":
        assert seen.path.split("/").count(encoded) == (seen.path.count(encoded)), seen.path
    else:
        pairs = seen.path.partition("?")[2].split("&")
        assert all(p == f"api_key={encoded}" for p in pairs if encoded in p), seen.path
        assert where == "api_key" or encoded not in seen.path
    # the secret is whole wherever it is: never glued to a byte the sandbox chose
    assert POS[1:] not in unquote(seen.path).replace(POS, "")
    assert not leaks(response_bytes(response), POS)
