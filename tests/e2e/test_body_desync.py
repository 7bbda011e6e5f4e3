"""Request bodies an origin may not read (issue 14, CL.0 desync): refused where the method defines
none, and never able to poison a reused upstream connection.

The origin (tests/support/lenient_origin.py) ignores bodies on GET/HEAD/OPTIONS/DELETE and on any
method under /static/, as careless servers do, and executes whatever follows as the next request.
Each attack's body is a complete request naming `other.test`, a host no rule allows. The gateway
must never let the origin execute it with an answer the sandbox can read, and for methods that
define no body it must never send it at all.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.helpers import (  # noqa: F401  (fixtures are used by name)
    H2Client,
    assert_refused,
    audit_for,
    build_request,
    connect_proxy,
    fresh_upstreams,
    lenient_world,
    tls_tunnel,
)
from tests.support.gateway import PROJECT_ROOT
from tests.support.lenient_origin import LenientOrigin

LAST_OCTET = 110  # in the session block
NAMES = ["lenient.test", "search.test", "trial.test"]

RULES = """
- id: lenient
  hosts: [lenient.test]
  schemes: [https, http]
  methods: [GET, HEAD, OPTIONS, DELETE, POST, PUT]
- id: search
  hosts: [search.test]
  schemes: [https, http]
  methods: [GET, POST]
  allow_body: true
- id: trial
  hosts: [trial.test]
  schemes: [https, http]
  methods: [GET]
  mode: report
"""

SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: other.test\r\n\r\n"


@pytest.fixture(scope="module")
def world(tmp_path_factory, upstreams, pki):
    yield from lenient_world(tmp_path_factory, upstreams, pki, RULES, NAMES, LAST_OCTET, "desync")


@pytest.fixture
def gw(world):
    return world.fresh()


@pytest.fixture
def origin(world):
    return world.tls_origin


@pytest.fixture
def plain_origin(world):
    return world.plain_origin


def _smuggled(origin: LenientOrigin) -> list:
    return [e for e in origin.executed if e.path == "/smuggled" or e.host == "other.test"]


def _lines(gateway, client: str, count: int = 1) -> list[dict]:
    return [a for a in audit_for(gateway, client, count) if a["event"] in ("request", "request_body")]


# --- no body where the method defines none ----------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "HEAD", "OPTIONS", "DELETE"])
def test_a_declared_body_on_a_bodyless_method_is_refused_before_any_upstream_byte(gw, origin, method):
    with tls_tunnel(gw, "lenient.test:443") as tls:
        response = tls.request(method, "/page", [("Host", "lenient.test")], SMUGGLED)
        assert_refused(response, 400, "unexpected_body", rule="lenient") if method != "HEAD" else None
        assert response.status == 400 and response.egress_reason == "unexpected_body"
        client = tls.client
    assert origin.connections == 0 and origin.executed == []
    line = _lines(gw, client)[-1]
    assert (line["decision"], line["reason"], line["rule"]) == ("deny", "unexpected_body", "lenient")


@pytest.mark.parametrize("framing", [
    [("Transfer-Encoding", "chunked")],
    [("Transfer-Encoding", "gzip, chunked")],
    [("Content-Length", "1")],
    [("Content-Length", f" {len(SMUGGLED)}")],
])
def test_every_declared_framing_counts_as_a_body(gw, origin, framing):
    body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(SMUGGLED), SMUGGLED) if "chunked" in framing[0][1] else SMUGGLED
    with tls_tunnel(gw, "lenient.test:443") as tls:
        tls.send(build_request("GET", "/page", [("Host", "lenient.test"), *framing]) + body)
        response = tls.read_response()
    assert response.status in (400,), response
    assert response.egress_reason in ("unexpected_body", "malformed_request"), response
    assert origin.connections == 0 and origin.executed == []


def test_a_large_refused_body_is_read_and_thrown_away(gw, origin):
    """A body over stream_large_bodies (1m) on a refused head: read to its end, not buffered, the
    refusal answered, the connection usable after it (mitmproxy's stream used to crash on it)."""
    body = b"x" * (3 * 1024 * 1024)
    with tls_tunnel(gw, "lenient.test:443") as tls:
        response = tls.request("GET", "/page", [("Host", "lenient.test")], body)
        assert response.status == 400 and response.egress_reason == "unexpected_body"
        after = tls.request("GET", "/after", [("Host", "lenient.test")])
    assert after.text == "GET lenient.test /after"
    assert "crashed" not in gw.log() and "Traceback" not in gw.log()


def test_explicit_plain_http_is_refused_the_same_way(gw, plain_origin):
    with connect_proxy(gw) as conn:
        response = conn.request("GET", "http://lenient.test/page", [("Host", "lenient.test")], SMUGGLED)
    assert_refused(response, 400, "unexpected_body", rule="lenient")
    assert plain_origin.connections == 0


def test_no_body_and_content_length_zero_still_pass_and_reuse_the_upstream(gw, origin):
    with tls_tunnel(gw, "lenient.test:443") as tls:
        first = tls.request("GET", "/one", [("Host", "lenient.test")])
        second = tls.request("GET", "/two", [("Host", "lenient.test"), ("Content-Length", "0")])
        third = tls.request("DELETE", "/three", [("Host", "lenient.test")])
    assert [first.text, second.text, third.text] == ["GET lenient.test /one", "GET lenient.test /two",
                                                     "DELETE lenient.test /three"]
    assert origin.connections == 1  # body-less exchanges keep the upstream connection


def test_allow_body_lets_the_body_go_and_its_leftovers_never_answer_the_sandbox(gw, origin):
    """`allow_body: true` is the documented risk: this origin does read the smuggled bytes as a
    request, but the upstream connection ends with the exchange, so the sandbox never reads that
    request's answer: its next request gets its own answer, on a fresh upstream connection."""
    with tls_tunnel(gw, "search.test:443") as tls:
        first = tls.request("GET", "/_search", [("Host", "search.test")], SMUGGLED)
        second = tls.request("GET", "/next", [("Host", "search.test")])
    assert first.status == 200 and first.text == "GET search.test /_search"
    assert second.status == 200 and second.text == "GET search.test /next", second
    executed = origin.wait_executed(2)
    assert [e.path for e in executed if e.connection == 1][0] == "/_search"
    nexts = [e for e in executed if e.path == "/next"]
    assert nexts and nexts[0].connection != 1  # not the connection the body may have desynchronised


def test_a_post_body_the_origin_ignores_cannot_answer_the_next_request(gw, origin):
    """The classic CL.0: a POST to a static file. The gateway cannot know the origin ignores the
    body; it makes sure the answer to whatever the origin read from it is never handed on."""
    with tls_tunnel(gw, "lenient.test:443") as tls:
        first = tls.request("POST", "/static/app.js", [("Host", "lenient.test")], SMUGGLED)
        second = tls.request("GET", "/mine", [("Host", "lenient.test")])
        third = tls.request("GET", "/mine-too", [("Host", "lenient.test")])
    assert first.text == "POST lenient.test /static/app.js"
    assert second.text == "GET lenient.test /mine", second
    assert third.text == "GET lenient.test /mine-too", third
    assert origin.connections == 2  # the one after the body, then kept alive for body-less ones


def test_an_early_response_ends_the_upstream_connection(gw, origin):
    """The origin answers 401 before reading the body, and reads the body as a request."""
    with tls_tunnel(gw, "lenient.test:443") as tls:
        first = tls.request("POST", "/early", [("Host", "lenient.test")], SMUGGLED)
        second = tls.request("GET", "/after", [("Host", "lenient.test")])
    assert first.status == 401 and first.text == "nope"
    assert second.text == "GET lenient.test /after", second
    assert [e.connection for e in origin.executed if e.path == "/after"] == [2]


def test_bytes_after_an_early_response_to_a_streamed_body_answer_nothing(gw, origin):
    """Review finding: the origin answers 401 while the chunked body still streams, then reads the
    rest of the body as requests and answers those (400s). Those answers belong to no request:
    they are dropped (mitmproxy's stream crashed on them), the body finishes, the connection ends."""
    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    with tls_tunnel(gw, "lenient.test:443") as tls:
        tls.send(build_request("POST", "/early", [("Host", "lenient.test"), ("Transfer-Encoding", "chunked")])
                 + chunk(SMUGGLED))
        first = tls.read_response()
        assert (first.status, first.text) == (401, "nope")
        answered = origin.answered
        tls.send(chunk(SMUGGLED))  # the origin answers this as a request of its own
        assert origin.wait_answered(answered + 1) > answered
        tls.send(chunk(b"x") + b"0\r\n\r\n")
        after = tls.request("GET", "/after", [("Host", "lenient.test")])
    assert after.text == "GET lenient.test /after", after
    assert "crashed" not in gw.log() and "Traceback" not in gw.log()


def test_an_origin_that_answers_early_and_closes_while_the_body_streams(gw, origin):
    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    with tls_tunnel(gw, "lenient.test:443") as tls:
        tls.send(build_request("POST", "/early-close", [("Host", "lenient.test"), ("Transfer-Encoding", "chunked")])
                 + chunk(SMUGGLED))
        first = tls.read_response()
        # Closing with the body unread makes the origin's kernel reset the connection, which may
        # overtake its answer: either the answer or a clean 502 is right.
        assert (first.status, first.text) == (401, "nope") or first.egress_reason == "upstream_failed", first
        try:
            tls.send(chunk(SMUGGLED) + chunk(b"x") + b"0\r\n\r\n")
            after = tls.request("GET", "/after", [("Host", "lenient.test")])
            assert after.text == "GET lenient.test /after", after
        except (ConnectionError, OSError):
            pass  # closing the client connection too is fine; crashing is not
    with tls_tunnel(gw, "lenient.test:443") as tls:
        assert tls.request("GET", "/again", [("Host", "lenient.test")]).text == "GET lenient.test /again"
    assert "crashed" not in gw.log() and "Traceback" not in gw.log()


# --- interim responses -------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 3])
def test_interim_responses_are_read_past_and_end_the_connection(gw, origin, count):
    with tls_tunnel(gw, "lenient.test:443") as tls:
        first = tls.request("GET", f"/interim/{count}", [("Host", "lenient.test")])
        second = tls.request("GET", "/after", [("Host", "lenient.test")])
    assert (first.status, first.text) == (200, f"GET lenient.test /interim/{count}"), first
    assert second.text == "GET lenient.test /after", second
    assert origin.connections == 2


def test_too_many_interim_responses_are_an_upstream_failure(gw, origin):
    with tls_tunnel(gw, "lenient.test:443") as tls:
        response = tls.request("GET", "/interim/40", [("Host", "lenient.test")])
    assert response.status == 502, response


def test_an_interim_response_then_a_close_is_an_upstream_failure(gw, origin):
    with tls_tunnel(gw, "lenient.test:443") as tls:
        response = tls.request("GET", "/continue-then-close", [("Host", "lenient.test")])
        assert response.status == 502 and response.egress_reason == "upstream_failed", response
        assert tls.closed()  # an upstream failure ends the client connection too


def test_expect_100_continue_with_a_body_on_get_is_refused_without_inviting_the_body(gw, origin):
    """Refused at its head: the refusal comes instead of the `100 Continue` (mitmproxy sent the 100
    whatever the hook decided, and the body then sent was read and dropped), and the connection
    ends after it (tests/e2e/test_expect_continue.py). Nothing goes upstream."""
    with tls_tunnel(gw, "lenient.test:443") as tls:
        tls.send(build_request("GET", "/page", [("Host", "lenient.test"), ("Expect", "100-continue"),
                                                ("Content-Length", str(len(SMUGGLED)))]))
        response = tls.read_response()
        assert response.status == 400 and response.egress_reason == "unexpected_body", response
        assert tls.closed()
    assert origin.connections == 0 and origin.executed == []


# --- HTTP/2 -------------------------------------------------------------------------------------------


def _h2(gateway, host: str) -> H2Client:
    return H2Client(tls_tunnel(gateway, f"{host}:443", alpn=["h2"]))


def test_http2_get_with_data_is_refused_before_any_upstream_byte(gw, origin):
    client = _h2(gw, "lenient.test")
    sid = client.send("lenient.test", "/page", body=SMUGGLED)
    client.wait(sid)
    assert client.responses[sid]["status"] == 400, client.responses[sid]
    assert client.header(sid, "x-egress-reason") == "unexpected_body"
    assert origin.connections == 0 and origin.executed == []
    client.conn.close()


def test_http2_get_with_a_declared_length_is_refused_at_its_head(gw, origin):
    client = _h2(gw, "lenient.test")
    sid = client.send("lenient.test", "/page", extra=[("content-length", "5")])
    client.wait(sid)
    assert client.responses[sid]["status"] == 400 and client.header(sid, "x-egress-reason") == "unexpected_body"
    assert origin.connections == 0
    client.conn.close()


def test_http2_get_left_open_with_no_data_goes_upstream_without_body_framing(gw, origin):
    client = _h2(gw, "lenient.test")
    sid = client.send("lenient.test", "/open", body=b"")
    client.wait(sid)
    assert client.responses[sid]["status"] == 200 and client.responses[sid]["body"] == b"GET lenient.test /open"
    executed = origin.wait_executed(1)
    assert "transfer-encoding" not in executed[0].headers and executed[0].headers.get("content-length") in (None, "0")
    client.conn.close()


def test_http2_post_body_on_an_allow_body_rule_is_fine(gw, origin):
    client = _h2(gw, "search.test")
    sid = client.send("search.test", "/_search", body=b'{"query": {}}')
    client.wait(sid)
    assert client.responses[sid]["status"] == 200
    client.conn.close()


# --- report mode and explain ----------------------------------------------------------------------------


def test_report_mode_records_would_deny_for_a_body_on_get(gw, origin):
    with tls_tunnel(gw, "trial.test:443") as tls:
        response = tls.request("GET", "/page", [("Host", "trial.test")], b"x=1")
        client = tls.client
        after = tls.request("GET", "/after", [("Host", "trial.test")])
    assert response.status == 200 and after.text == "GET trial.test /after"
    line = _lines(gw, client)[0]
    assert (line["decision"], line["reason"]) == ("would_deny", "unexpected_body")


def test_report_mode_still_refuses_a_trace_override_in_the_body(gw, origin):
    """A head report mode lets through (POST is not in trial's methods: would_deny) still has its
    body checked: TRACE is never relaxed, and other overrides are recorded."""
    form = [("Content-Type", "application/x-www-form-urlencoded")]
    with tls_tunnel(gw, "trial.test:443") as tls:
        response = tls.request("POST", "/form", [("Host", "trial.test"), *form], b"a=1&_method=TRACE")
        client = tls.client
    assert_refused(response, 403, "method_forbidden")
    assert not [e for e in origin.executed if e.path == "/form" and e.method == "POST" and "trace" in str(e)]
    lines = _lines(gw, client, 2)
    assert [(a["event"], a["decision"], a["reason"]) for a in lines] == [
        ("request", "would_deny", "method_not_allowed"), ("request_body", "deny", "method_forbidden")]
    with tls_tunnel(gw, "trial.test:443") as tls:
        response = tls.request("POST", "/form", [("Host", "trial.test"), *form], b"_method=DELETE")
        client = tls.client
    assert response.status == 200
    lines = _lines(gw, client, 2)
    assert [(a["event"], a["decision"]) for a in lines] == [("request", "would_deny"), ("request_body", "would_deny")]
    assert lines[1]["method_override"] == ["form field _method: DELETE"]


def test_explain_agrees_with_live_traffic(gw):
    result = subprocess.run([sys.executable, "-m", "gateway", "explain", "--policy", str(gw.policy),
                             "--format", "json", "-H", "Content-Length: 87", "https://lenient.test/page"],
                            capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=60)
    assert result.returncode != 2, result.stderr
    verdict = json.loads(result.stdout)
    assert (verdict["verdict"], verdict["decision"]["reason"], verdict["decision"]["rule"]) == (
        "deny", "unexpected_body", "lenient"), verdict

