"""Method overrides (issue 14): a method the rule refuses, smuggled in on a method it allows.

`echo` (echo.test) injects the platform's Authorization and allows GET, POST, HEAD and OPTIONS
under /v1/; `api` (api.test) allows GET and HEAD under /ok/ with no credential. The attacker sends
an allowed wire method and names DELETE, PUT or PATCH in every place a framework reads an
override from: the X-HTTP-Method-Override family of headers in every spelling CGI, WSGI and PHP
fold together, `_method` and its relatives in the query, in urlencoded, multipart and JSON bodies,
compressed bodies, HTTP/2, and a body large enough to stream. The oracle: a refusal with nothing at
all reaching any upstream (a streamed body: no origin ever gets the whole request), and no form of
the secret back at the client (conftest).
"""

from __future__ import annotations

import gzip
import json
import zlib

import pytest

from tests.e2e.helpers import H2Client, audit_for, tls_tunnel
from tests.support.waiting import wait_for

from .common import attack, nothing_reached, reason_of, status_of


def _gzip(data: bytes) -> bytes:
    """gzip with a fixed mtime: the bytes go into test ids, which every xdist worker must collect alike."""
    return gzip.compress(data, mtime=0)


pytestmark = attack("paths")

FORM = ("Content-Type", "application/x-www-form-urlencoded")


def _send(rt, host: str, method: str, target: str, headers=(), body: bytes = b"", raw: bytes | None = None):
    with tls_tunnel(rt.gateway, f"{host}:443") as tls:
        if raw is not None:
            tls.send(raw)
            try:
                return tls.read_response()
            except (ConnectionError, OSError):
                return None
        return tls.request(method, target, [("Host", host), *headers], body)


def _refused(response, *reasons: str) -> None:
    reasons = reasons or ("method_not_allowed",)
    assert response is None or (status_of(response) in (400, 403) and reason_of(response) in reasons
                                + ("bad_header", "malformed_request")), (
        status_of(response), reason_of(response), getattr(response, "text", "")[:300])


# --- headers -----------------------------------------------------------------------------------------

HEADER_SPELLINGS = [
    "X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override", "x-http-method-override", "X_HTTP_METHOD_OVERRIDE",
    "X-Http-Method_Override", "x_method_override", "X-HTTP_Method",
    # CGI-style servers (PHP's built-in server) turn every non-alphanumeric character into '_'
    "X.HTTP.Method.Override", "X~HTTP~Method~Override", "X.Method.Override",
]
VALUES = ["DELETE", "delete", "DeLeTe", "PUT", "PATCH", "GET, DELETE", "GET,DELETE", "HEAD , PUT", "DELETE;q=1",
          "DELETE/1.1", "PROPFIND", "MOVE", "PURGE"]


@pytest.mark.parametrize("name", HEADER_SPELLINGS)
@pytest.mark.parametrize("value", VALUES)
def test_override_header_on_a_bound_get(rt, name, value):
    _refused(_send(rt, "echo.test", "GET", "/v1/anything", [(name, value)]))
    nothing_reached(rt.everything())


@pytest.mark.parametrize("name", HEADER_SPELLINGS[:3])
def test_override_header_on_an_unbound_read_only_rule(rt, name):
    _refused(_send(rt, "api.test", "HEAD", "/ok/x", [(name, "DELETE")]))
    nothing_reached(rt.everything())


@pytest.mark.parametrize("headers", [
    [("X-HTTP-Method-Override", "GET"), ("X-HTTP-Method-Override", "DELETE")],  # first wins? last wins? both count
    [("X-HTTP-Method-Override", "GET"), ("x-http-method", "PUT")],
    [("X-Method-Override", "OPTIONS"), ("X-HTTP-Method-Override", ""), ("X_HTTP_Method", "PATCH")],
])
def test_conflicting_override_headers(rt, headers):
    _refused(_send(rt, "echo.test", "POST", "/v1/anything", headers, b"x=1"))
    nothing_reached(rt.everything())


@pytest.mark.parametrize("raw", [
    b"GET /v1/anything HTTP/1.1\r\nHost: echo.test\r\nX-HTTP-Method-Override : DELETE\r\n\r\n",  # space before ':'
    b"GET /v1/anything HTTP/1.1\r\nHost: echo.test\r\nX-HTTP-Method-Override: DEL\x00ETE\r\n\r\n",
    b"GET /v1/anything HTTP/1.1\r\nHost: echo.test\r\nX-HTTP-Method-Override:\r\n DELETE\r\n\r\n",  # obs-fold
    b"GET /v1/anything HTTP/1.1\r\nHost: echo.test\r\nX-HTTP-Method-Override: \xc4\x90ELETE\r\n\r\n",
])
def test_malformed_override_headers(rt, raw):
    _refused(_send(rt, "echo.test", "GET", "", raw=raw))
    nothing_reached(rt.everything())


@pytest.mark.parametrize("value", ["TRACE", "track", "CONNECT"])
def test_override_to_a_method_that_is_never_allowed(rt, value):
    """TRACE would echo the injected credential back: as an override it is refused like on the
    wire, and not a report-mode candidate (method_forbidden)."""
    _refused(_send(rt, "echo.test", "POST", "/v1/anything", [("X-HTTP-Method-Override", value)], b"a=1"),
             "method_forbidden")
    nothing_reached(rt.everything())


# --- the query -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("query", [
    "_method=DELETE", "_METHOD=put", "_method=%64elete", "_method=%2564elete", "%5f%6d%65%74%68%6f%64=PATCH",
    "_me%74hod=DELETE", "_method[]=DELETE", "_method[x]=DELETE", ".method=DELETE", "a=1;_method=DELETE",
    "a=1&_method=GET&_method=DELETE", "x-http-method-override=DELETE", "X.HTTP.Method.Override=PUT",
    "x_method_override=DELETE", "_method_override=DELETE", "method=PATCH", "METHOD=delete", "_method=+DELETE+",
    "_method=GET%2CDELETE", "_method=DELETE%00", "_method=%C4%90ELETE",
])
def test_override_in_the_query(rt, query):
    _refused(_send(rt, "echo.test", "GET", f"/v1/anything?{query}"))
    nothing_reached(rt.everything())


def test_override_in_the_query_over_http2(rt):
    with tls_tunnel(rt.gateway, "echo.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        streams = [h2.send("echo.test", "/v1/anything?_method=DELETE"),
                   h2.send("echo.test", "/v1/anything", extra=[("x-http-method-override", "put")]),
                   h2.send("echo.test", "/v1/anything", extra=[("x_http_method", "PATCH")]),
                   h2.send("api.test", "/ok/x", extra=[("x-method-override", "DELETE")])]
        h2.wait(*streams)
    for stream in streams:
        assert h2.responses[stream]["status"] in (403, 421), h2.responses[stream]
    nothing_reached(rt.everything())


# --- bodies ----------------------------------------------------------------------------------------------

MULTIPART = [
    b'--b\r\nContent-Disposition: form-data; name="_method"\r\n\r\nDELETE\r\n--b--\r\n',
    b"--b\r\nContent-Disposition: form-data; name=_method\r\n\r\nPUT\r\n--b--\r\n",
    b"--b\r\nContent-Disposition: form-data; name*=UTF-8''%5Fmethod\r\n\r\nPATCH\r\n--b--\r\n",
    b'--b\r\nCONTENT-DISPOSITION: form-data; NAME="_METHOD"\r\n\r\ndelete\r\n--b--\r\n',
    b'preamble\r\n--b\r\nContent-Disposition: form-data; name="a"\r\n\r\n1\r\n--b\r\nContent-Type: text/plain\r\n'
    b'Content-Disposition: form-data; name="_method"\r\n\r\nDELETE\r\n--b--\r\n',
    b'--b\nContent-Disposition: form-data; name="_method"\n\nDELETE\n--b--\n',  # bare LF, as PHP accepts
    b'--b\r\nContent-Disposition: form-data; name="_method"\r\n\r\nDELETE',  # no closing delimiter
]


@pytest.mark.parametrize("headers, body", [
    ([FORM], b"_method=DELETE"),
    ([FORM], b"title=x&_METHOD=PUT"),  # Slim's spelling
    ([FORM], b"a=1;_method=DELETE"),
    ([FORM], b"_method%5B%5D=DELETE"),
    ([FORM], b"_method=%44%45%4c%45%54%45"),
    ([("Content-Type", "APPLICATION/X-WWW-FORM-URLENCODED; charset=UTF-8")], b"_method=delete"),
    ([], b"_method=DELETE"),  # no Content-Type: Rack parses the body as a form
    ([("Content-Type", "")], b"_method=DELETE"),
    *[([("Content-Type", "multipart/form-data; boundary=b")], body) for body in MULTIPART],
    ([("Content-Type", 'multipart/form-data; boundary="b"')], MULTIPART[0]),
    ([("Content-Type", "multipart/mixed; boundary=b")], MULTIPART[0]),  # Rack parses other multiparts too
    ([("Content-Type", "application/json")], b'{"_method": "DELETE"}'),
    ([("Content-Type", "application/json")], b'{"\\u005fmethod": "\\u0050UT"}'),
    ([("Content-Type", "application/json; charset=utf-8")], b'{"a": {"b": 1}, "_METHOD": "patch"}'),
    ([("Content-Type", "application/vnd.api+json")], b'{"_method": "GET", "_method": "DELETE"}'),
    ([("Content-Type", "text/json")], b' \n{"_method":"DELETE"}'),
    ([FORM, ("Content-Encoding", "gzip")], _gzip(b"_method=DELETE")),
    ([FORM, ("Content-Encoding", "deflate")], zlib.compress(b"_method=DELETE")),
    ([("Content-Type", "application/json"), ("Content-Encoding", "gzip")], _gzip(b'{"_method":"PUT"}')),
])
def test_override_in_a_post_body(rt, headers, body):
    _refused(_send(rt, "echo.test", "POST", "/v1/anything", headers, body))
    nothing_reached(rt.everything())


def _gzip_members(*members: bytes) -> bytes:
    return b"".join(_gzip(m) for m in members)


_PART = b'Content-Disposition: form-data; name="_method"\r\n\r\nDELETE\r\n'
_MP = b"--A\r\n" + _PART + b"--A--\r\n"
_J = '{"x": 1, "_method": "DELETE"}'


# Review 14a: what PHP + Symfony, Rack and Express + body-parser read that a strict parser does not.
@pytest.mark.parametrize("headers, body", [
    # Content-Types cut at ',', whitespace or ';' by one server or another; boundary found anywhere
    ([("Content-Type", "application/x-www-form-urlencoded,text/plain")], b"_method=DELETE"),
    ([("Content-Type", "application/x-www-form-urlencoded x")], b"_method=DELETE"),
    ([("Content-Type", "text/html, application/x-www-form-urlencoded")], b"_method=DELETE"),
    ([("Content-Type", "multipart/form-data; xboundary=A")], _MP),
    ([("Content-Type", "multipart/form-data,boundary=A")], _MP),
    ([("Content-Type", "multipart/form-data boundary=A")], _MP),
    ([("Content-Type", "multipart/form-data; boundary=Q; boundary=A")], _MP),
    ([("Content-Type", "multipart/form-data")], _MP),  # no boundary: guessed from the first line
    ([("Content-Type", "multipart/form-data; charset=boundary; b=A")], _MP),
    ([("Content-Type", "text/plain; q=/json")], _J.encode()),  # Laravel's isJson
    # multipart structure
    ([("Content-Type", "multipart/form-data; boundary=A")], b"--A--\r\n--A\r\n" + _PART + b"--A--\r\n"),
    ([("Content-Type", "multipart/form-data; boundary=A")],
     b'--A\r\nContent-Disposition: form-data; name="z"\r\n\r\n1\r\n--A--\r\n--A\r\n' + _PART),
    ([("Content-Type", "multipart/form-data; boundary=A")],
     b'--A\r\nContent-Disposition: form-data;\r\n\tname="_method"\r\n\r\nDELETE\r\n--A--\r\n'),
    ([("Content-Type", "multipart/form-data; boundary=A")],
     b'--A\r\nContent-Disposition: form-data; n\r\name="_method"\r\n\r\nDELETE\r\n--A--\r\n'),
    ([("Content-Type", "multipart/form-data; boundary=A")],
     b"--A\r\nContent-Disposition: form-data; name='_method'\r\n\r\nPUT\r\n--A--\r\n"),
    ([("Content-Type", "multipart/form-data; boundary=A")],
     b'--A\r\nContent-Disposition: form-data; name="_method"\n\r\nDELETE\r\n--A--\r\n'),
    ([("Content-Type", "multipart/form-data; boundary=A")],
     b'--A\r\nX-Content-Disposition: form-data; name="_method"\r\n\r\nDELETE\r\n--A--\r\n'),
    # charsets: BOM, UTF-16/32 declared or detected, EBCDIC, UTF-7, Tomcat's per-field decoding
    ([("Content-Type", "application/json")], b"\xef\xbb\xbf" + _J.encode()),
    ([("Content-Type", "application/json; charset=utf-16le")], _J.encode("utf-16-le")),
    ([("Content-Type", "application/json; charset=utf-16")], _J.encode("utf-16-be")),
    ([("Content-Type", "application/json; charset=utf-32")], _J.encode("utf-32")),
    ([("Content-Type", "application/json")], _J.encode("utf-16")),
    ([("Content-Type", "application/json; charset=utf-7")], _J.replace("_", "+AF8-").encode()),
    ([("Content-Type", "application/x-www-form-urlencoded; charset=IBM037")], "_method=DELETE".encode("cp037")),
    ([("Content-Type", "application/x-www-form-urlencoded; charset=utf-16le")], "_method=DELETE".encode("utf-16-le")),
    ([("Content-Type", "application/x-www-form-urlencoded; charset=utf-16le")],
     "_method".encode("utf-16-le") + b"=" + "DELETE".encode("utf-16-le")),
    ([FORM], b"\xef\xbb\xbf_method=DELETE"),
    ([("Content-Type", "application/x-www-form-urlencoded; charset=x-mystery")], b"_method=GET"),  # uncheckable
    # compression: every member and stream, stacked codings, bytes as sent when the coding is a lie
    ([FORM, ("Content-Encoding", "gzip")], _gzip_members(b"a=b&", b"_method=DELETE")),
    ([("Content-Type", "application/json"), ("Content-Encoding", "gzip")],
     _gzip_members(b'{"a":1,', b'"_method":"DELETE"}')),
    ([FORM, ("Content-Encoding", "deflate")], zlib.compress(b"a=b&") + zlib.compress(b"_method=DELETE")),
    ([FORM, ("Content-Encoding", "gzip")], _gzip(b"a=b") + b"&_method=DELETE"),  # trailing data
    ([FORM, ("Content-Encoding", "gzip")], b"_method=DELETE"),  # PHP does not decode it
    ([FORM, ("Content-Encoding", "x-unknown")], b"_method=DELETE"),
    ([FORM, ("Content-Encoding", "gzip, deflate")], zlib.compress(_gzip(b"_method=DELETE"))),
    # Salesforce's REST API override
    ([FORM], b"_HttpMethod=PATCH"),
])
def test_override_in_a_body_a_real_framework_reads(rt, headers, body):
    _refused(_send(rt, "echo.test", "POST", "/v1/anything", headers, body))
    nothing_reached(rt.everything())


def test_salesforce_override_in_the_query(rt):
    _refused(_send(rt, "echo.test", "POST", "/v1/sobjects/Account/1?_HttpMethod=DELETE"))
    nothing_reached(rt.everything())


def test_override_in_an_h2_body(rt):
    with tls_tunnel(rt.gateway, "echo.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        ids = []
        for body, content_type in ((b"_method=DELETE", "application/x-www-form-urlencoded"),
                                   (b'{"_method": "PUT"}', "application/json")):
            stream = h2.h2.get_next_available_stream_id()
            h2.h2.send_headers(stream, [(":method", "POST"), (":scheme", "https"), (":authority", "echo.test"),
                                        (":path", "/v1/anything"), ("content-type", content_type)])
            h2.h2.send_data(stream, body[:5])
            h2.h2.send_data(stream, body[5:], end_stream=True)  # no content-length: a streamed body
            h2._flush()
            h2.responses[stream] = {"status": None, "headers": [], "body": b"", "trailers": [], "done": False,
                                    "reset": False}
            ids.append(stream)
        h2.wait(*ids)
    for stream in ids:
        assert h2.responses[stream]["status"] == 403, h2.responses[stream]
    seen = rt.servers["echo"].requests
    assert all(b"_method" not in r.body for r in seen), seen  # no origin got a complete body
    nothing_reached(rt.recorders(*[n for n in rt.upstreams.tls]) | {k: v for k, v in rt.servers.items()
                                                                   if k != "echo"})


def test_override_at_the_end_of_a_streamed_body(rt):
    """1.5 MiB: above stream_large_bodies, so the body streams upstream while it is checked. The
    override is the last field; the last byte is held back until the end has been checked, so the
    origin (reading by Content-Length) never has the whole request."""
    body = b"blob=" + b"A" * (1536 * 1024) + b"&_method=DELETE"
    with tls_tunnel(rt.gateway, "echo.test:443") as tls:
        tls.send(f"POST /v1/anything HTTP/1.1\r\nHost: echo.test\r\nContent-Type: application/x-www-form-urlencoded"
                 f"\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        tls.sock.sendall(body)
        try:
            response = tls.read_response()
        except (ConnectionError, OSError):
            response = None
    _refused(response)
    echo = rt.servers["echo"]
    # The refusal resets the upstream connection; once the origin's handler has finished with it,
    # whatever part of the body reached the origin is recorded.
    wait_for(lambda: echo.settled, what="the origin to finish handling the refused request", cond=echo.changed)
    seen = echo.requests
    assert all(len(r.body) < len(body) for r in seen), [(r.method, len(r.body)) for r in seen]


def _audit_lines(gateway, client: str, event: str, wait: float = 10.0) -> list[dict]:
    """The audit lines of one client connection with this event, polling the audit file up to
    `wait` s for the first of them."""
    try:
        return wait_for(lambda: [a for a in audit_for(gateway, client, wait=0) if a["event"] == event], wait,
                        f"a {event} line of {client}", interval=0.02)
    except AssertionError:
        return []


def test_override_inside_a_chunked_body_split_across_chunks(rt):
    chunks = [b"note=hello&_me", b"th", b"od=DEL", b"ETE&more=1"]
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    raw = (b"POST /v1/anything HTTP/1.1\r\nHost: echo.test\r\nContent-Type: application/x-www-form-urlencoded\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n" + body)
    with tls_tunnel(rt.gateway, "echo.test:443") as tls:
        tls.send(raw)
        client = tls.client
        try:
            response = tls.read_response()
        except (ConnectionError, OSError):
            response = None
    _refused(response)
    # The refusal's audit line is written as the body is refused: wait for it to appear in the file.
    lines = _audit_lines(rt.gateway, client, "request_body")
    assert [(a["decision"], a["method_override"]) for a in lines] == [("deny", ["form field _method: DELETE"])]


@pytest.mark.parametrize("headers, body", [
    ([("Content-Type", "application/json")], json.dumps({"pad": "x" * 70000, "_method": "DELETE"}).encode()),
    ([("Content-Type", "multipart/form-data; boundary=b")],
     b'--b\r\nContent-Disposition: form-data; name="f"; filename="a.bin"\r\n\r\n' + b"\x00" * 70000
     + b'\r\n--b\r\nContent-Disposition: form-data; name="_method"\r\n\r\nDELETE\r\n--b--\r\n'),
])
def test_override_after_a_large_field(rt, headers, body):
    _refused(_send(rt, "echo.test", "POST", "/v1/anything", headers, body))
    nothing_reached(rt.everything())
