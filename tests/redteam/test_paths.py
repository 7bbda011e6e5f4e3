"""Path and method policy evasion against api.test, whose rule allows only GET/HEAD under /ok/.
The gateway matches the normalised path (percent-decoding repeated, backslashes as slashes,
`;params` dropped, dot segments resolved), which must be at least as wide as what any server makes
of the target it forwards. A forbidden wire method is refused whatever an override says; overrides
on an allowed wire method (X-HTTP-Method-Override, `_method=`, form and JSON bodies) are attacked in
test_method_overrides.py: every method a request names must be allowed."""

from __future__ import annotations

import pytest

from gateway.paths import PathError, compile_glob, normalise_path
from tests.e2e.helpers import H2Client, assert_refused, tls_tunnel

from .common import attack, nothing_reached

pytestmark = attack("paths")

OK = compile_glob("/ok/**")
OTHERS = ("allowed.test", "other.test", "deep.wild.test")

TRAVERSALS = [
    "/ok/../admin", "/ok/./../admin", "/ok/%2e%2e/admin", "/ok/%2E%2E/admin", "/ok/.%2e/admin",
    "/ok/%252e%252e/admin", "/ok/%25252e%25252e/admin", "/ok%2f..%2fadmin", "/ok/..%2fadmin", "/ok/..%5cadmin",
    "/ok/..\\admin", "/ok\\..\\admin", "/ok/..;/admin", "/ok;jsessionid=1/../admin", "/ok/x/..%252f..%252fadmin",
    "//admin", "/OK/x", "/ok/%c0%ae%c0%ae/admin", "/ok/%00/../admin", "/ok/%0a/../../admin", "/admin;/ok/x",
    "/ok/..%00/admin",
]


@pytest.mark.parametrize("path", TRAVERSALS)
def test_path_traversal_and_encodings(rt, path):
    with tls_tunnel(rt.gateway, "api.test:443") as tls:
        tls.send(f"GET {path} HTTP/1.1\r\nHost: api.test\r\n\r\n".encode())
        try:
            response = tls.read_response()
        except (ConnectionError, OSError):
            response = None
    assert response is None or response.status in (400, 403), (response.status, response.text)
    nothing_reached(rt.everything())


def _literal(target: str) -> str:
    """The path a server makes of a target when it takes `#` as an ordinary character (Go's
    net/http keeps it in URL.Path; http.FileServer then cleans the path), normalised like the
    gateway does otherwise."""
    return normalise_path(target.replace("#", "%23"))


@pytest.mark.parametrize("target", ["/ok/x#/../../admin", "/ok/x?/../../admin", "/ok/x#%2f..%2f..%2fadmin"])
def test_what_the_upstream_gets_stays_inside_the_rule(rt, target):
    """The gateway strips the query and a fragment before matching. Whatever it forwards must
    stay inside /ok/ for a server that does not strip what the gateway stripped: a query is split
    off by every server, a `#` is not (it cannot even occur in an HTTP request-target)."""
    with tls_tunnel(rt.gateway, "api.test:443") as tls:
        tls.send(f"GET {target} HTTP/1.1\r\nHost: api.test\r\n\r\n".encode())
        response = tls.read_response()
    forwarded = [r.path for r in rt.upstreams.tls["api.test"].requests]
    for path in forwarded:
        try:
            literal = _literal(path.split("?", 1)[0])
        except PathError:
            literal = "(climbs above the root)"
        assert OK.match(literal), f"forwarded {path!r}: a server taking '#' literally serves {literal!r}"
    assert response.status in (200, 400, 403), response.text
    nothing_reached(rt.recorders(*OTHERS))


def test_absolute_form_traversal_inside_the_tunnel(rt):
    with tls_tunnel(rt.gateway, "api.test:443") as tls:
        response = tls.request("GET", "https://api.test/ok/../admin", [("Host", "api.test")])
    assert_refused(response, 403, "path_not_allowed", rule="api")
    nothing_reached(rt.everything())


@pytest.mark.parametrize("path", ["/ok/../admin", "/ok/%2e%2e/admin", "/ok%2f..%2fadmin"])
def test_h2_path_traversal(rt, path):
    with tls_tunnel(rt.gateway, "api.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        stream = h2.send("api.test", path)
        h2.wait(stream)
    assert h2.responses[stream]["status"] in (400, 403), h2.responses[stream]
    nothing_reached(rt.everything())


@pytest.mark.parametrize("method", ["DELETE", "POST", "PUT", "PATCH", "PROPFIND", "GET2", "delete"])
def test_forbidden_wire_methods(rt, method):
    with tls_tunnel(rt.gateway, "api.test:443") as tls:
        tls.send(f"{method} /ok/x HTTP/1.1\r\nHost: api.test\r\nContent-Length: 0\r\n\r\n".encode())
        response = tls.read_response()
    assert response.status in (400, 403), response.text  # lower-case methods are not HTTP/1 at all: 400
    nothing_reached(rt.everything())


@pytest.mark.parametrize("override", [("X-HTTP-Method-Override", "GET"), ("X-HTTP-Method", "GET"),
                                      ("X-Method-Override", "HEAD")])
def test_override_header_cannot_launder_a_forbidden_wire_method(rt, override):
    with tls_tunnel(rt.gateway, "api.test:443") as tls:
        response = tls.request("DELETE", "/ok/x?_method=GET", [("Host", "api.test"), override])
    assert_refused(response, 403, "method_not_allowed", rule="api")
    nothing_reached(rt.everything())


def test_h2_forbidden_method(rt):
    with tls_tunnel(rt.gateway, "api.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        stream = h2.send("api.test", "/ok/x", method="DELETE", extra=[("x-http-method-override", "GET")])
        h2.wait(stream)
    assert h2.responses[stream]["status"] == 403, h2.responses[stream]
    nothing_reached(rt.everything())
