"""Method overrides (issue 14): the method a request is judged by is every method it names.

Rule `bound` (api.test) injects a credential and allows GET and POST; `readonly` (allowed.test)
allows GET only, no credential; `trial` (deep.wild.test) is `methods: [GET, POST]` in report mode;
`streams` (stream.test, a recorder of this module that reads every body to its end) is bound and
allows GET and POST. A GET carrying `X-HTTP-Method-Override: DELETE`, a query `_method=DELETE` or a
POST whose form body says `_method=DELETE` must be refused before anything reaches the origin
(the recording upstreams count TCP connections), and a streamed body that turns out to carry one
must never arrive upstream complete.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import threading

import pytest

from tests.e2e.helpers import (  # noqa: F401  (fixtures are used by name)
    ALL_UPSTREAMS,
    H2Client,
    assert_refused,
    assert_untouched,
    audit_for,
    extra_static_hosts,
    fresh_upstreams,
    get,
    shared_gateway,
    tls_tunnel,
)
from tests.support.gateway import PROJECT_ROOT
from tests.support.tcp_origin import read_head, start_accepting
from tests.support.waiting import wait_for

LAST_OCTET = 97  # stream.test, in the session block
SECRET = "e2e-override-Tok7+Qq/9="

RULES = """
- id: bound
  hosts: [api.test]
  methods: [GET, POST]
  inject:
    - header: Authorization
      value: "Bearer ${secrets.tok}"
- id: readonly
  hosts: [allowed.test]
  methods: [GET]
- id: trial
  hosts: [deep.wild.test]
  methods: [GET, POST]
  mode: report
- id: streams
  hosts: [stream.test]
  methods: [GET, POST]
  inject:
    - header: Authorization
      value: "Bearer ${secrets.tok}"
"""


class BodyRecorder:
    """A TLS HTTP/1.1 origin that reads every request body to its end (Content-Length or chunked)
    and records whether it arrived complete; answers 200 to complete requests only.

    Every change to a record (its body's bytes arrive, it completes, its handler finishes) notifies
    `changed`, so tests wait for those events with `wait_for(..., cond=recorder.changed)`."""

    def __init__(self, host: str, cert, key):
        self.connections = 0
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)
        self._in_flight = 0  # accepted connections whose handler has not finished
        self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._tls.load_cert_chain(str(cert), str(key))
        self._sock = socket.create_server((host, 443), backlog=16)
        start_accepting(self._sock, self._handle, on_accept=self._accepted)

    def reset(self) -> None:
        with self.changed:
            self.connections = 0
            self.requests.clear()
            self.changed.notify_all()

    @property
    def settled(self) -> bool:
        """Every connection's handler has finished: each record is final (complete or not)."""
        return self._in_flight == 0 and all(r["finished"] for r in self.requests)

    def _update(self, record: dict, **fields) -> None:
        with self.changed:
            record.update(fields)
            self.changed.notify_all()

    def _accepted(self, _client: socket.socket, _addr) -> None:
        with self.changed:
            self.connections += 1
            self._in_flight += 1
            self.changed.notify_all()

    def _handle(self, raw: socket.socket) -> None:
        record: dict = {}
        try:
            self._exchange(raw, record)
        finally:
            with self.changed:
                self._in_flight -= 1
                record["finished"] = True
                self.changed.notify_all()

    def _exchange(self, raw: socket.socket, record: dict) -> None:
        raw.settimeout(5)
        try:
            conn = self._tls.wrap_socket(raw, server_side=True)
        except (OSError, ssl.SSLError):
            raw.close()
            return
        try:
            got = read_head(conn)
            if got is None:
                return
            head, buf = got
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = [tuple(x.strip() for x in line.split(":", 1)) for line in lines[1:]]
            fields = {k.lower(): v for k, v in headers}
            record.update(method=method, path=path, headers=headers, body=b"", complete=False, finished=False)
            with self.changed:
                self.requests.append(record)
                self.changed.notify_all()

            def more() -> bytes:
                data = conn.recv(65536)
                if not data:
                    raise ConnectionError("closed")
                return data

            if "chunked" in fields.get("transfer-encoding", "").lower():
                body = b""
                while True:
                    while b"\r\n" not in buf:
                        buf += more()
                    size_line, buf = buf.split(b"\r\n", 1)
                    size = int(size_line.split(b";")[0], 16)
                    while len(buf) < size + 2:
                        buf += more()
                    body += buf[:size]
                    buf = buf[size + 2:]
                    self._update(record, body=body)
                    if size == 0:
                        break
            else:
                length = int(fields.get("content-length", "0"))
                while len(buf) < length:
                    buf += more()
                    self._update(record, body=buf[:length])
                self._update(record, body=buf[:length])
            self._update(record, complete=True)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        except (OSError, ConnectionError, ValueError, ssl.SSLError):
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        self._sock.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory, upstreams, pki):
    address = f"{upstreams.block}.{LAST_OCTET}"
    cert, key = pki.issue(["stream.test"], [address], stem="e2e-stream")
    recorder = BodyRecorder(address, cert, key)
    secret = tmp_path_factory.mktemp("override-secret") / "tok"
    secret.write_text(SECRET)
    extra = extra_static_hosts({"stream.test": address}) + f"secrets:\n  tok: {{file: {secret}}}\n"
    # Small bodies stream too, so the streamed path is exercised without megabytes of test data.
    gateway = shared_gateway(tmp_path_factory, upstreams, pki, RULES, extra, name="overrides",
                             args=["--set", "stream_large_bodies=4k"])
    yield gateway, recorder
    gateway.stop()
    recorder.stop()


@pytest.fixture
def gw(world):
    gateway, recorder = world
    recorder.reset()
    return gateway


@pytest.fixture
def recorder(world):
    return world[1]


def _request_line(gateway, client: str, event: str = "request") -> dict:
    lines = [a for a in audit_for(gateway, client, 2) if a["event"] == event]
    assert lines, gateway.audit()[-5:]
    return lines[-1]


def _send(gateway, host: str, method: str, target: str, headers=(), body: bytes = b""):
    with tls_tunnel(gateway, f"{host}:443") as tls:
        response = tls.request(method, target, [("Host", host), *headers], body)
        return response, tls.client


# --- headers and query: decided with the head, nothing goes upstream ------------------------------


@pytest.mark.parametrize("header", [
    ("X-HTTP-Method-Override", "DELETE"),
    ("X-HTTP-Method", "DELETE"),
    ("X-Method-Override", "PUT"),
    ("x-http-method-override", "delete"),
    ("X_HTTP_METHOD_OVERRIDE", "DELETE"),
    ("X-Http-Method-Override", " PATCH "),
    ("X-HTTP-Method-Override", "GET, DELETE"),
    ("X-HTTP-Method-Override", "DELETE;x"),
    ("X-HTTP-Method-Override", "PROPFIND"),
])
def test_override_header_on_an_allowed_get_is_refused(gw, upstreams, header):
    response, client = _send(gw, "api.test", "GET", "/repos/x", [header])
    assert_refused(response, 403, "method_not_allowed", rule="bound")
    assert "method override" in response.text
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    line = _request_line(gw, client)
    assert (line["decision"], line["reason"], line["rule"], line["method"]) == ("deny", "method_not_allowed", "bound",
                                                                                 "GET")
    assert any(entry.startswith(f"header {header[0]}: ") for entry in line["method_override"]), line
    assert "injected" not in line


def test_duplicate_override_headers_each_count(gw, upstreams):
    response, client = _send(gw, "api.test", "GET", "/x", [("X-HTTP-Method-Override", "GET"),
                                                          ("X-HTTP-Method-Override", "DELETE")])
    assert_refused(response, 403, "method_not_allowed", rule="bound")
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    assert _request_line(gw, client)["method_override"] == ["header X-HTTP-Method-Override: GET",
                                                           "header X-HTTP-Method-Override: DELETE"]


@pytest.mark.parametrize("query", [
    "_method=DELETE", "_METHOD=delete", "_method=%44ELETE", "_method=%2544ELETE", "a=1;_method=PUT",
    "x-http-method-override=PATCH", "X_HTTP_Method=DELETE", "_method_override=DELETE", "method=DELETE",
    "_method[]=DELETE", "%5Fmethod=DELETE", "_method=DELETE%00",
])
def test_override_in_the_query_is_refused(gw, upstreams, query):
    response, client = _send(gw, "api.test", "GET", f"/items?{query}")
    assert_refused(response, 403, "method_not_allowed", rule="bound")
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    line = _request_line(gw, client)
    assert line["method_override"][0].startswith("query parameter "), line


def test_override_to_trace_is_method_forbidden(gw, upstreams):
    response, _ = _send(gw, "api.test", "POST", "/x", [("X-HTTP-Method-Override", "TRACE")])
    assert_refused(response, 403, "method_forbidden")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


def test_allowed_override_and_api_parameters_named_method_go_through(gw, upstreams):
    response, client = _send(gw, "api.test", "POST", "/x?method=flickr.photos.search",
                             [("X-HTTP-Method-Override", "GET")], b"q=1")
    assert response.status == 200, response.text
    [seen] = upstreams.tls["api.test"].requests
    assert (seen.method, seen.path, seen.body) == ("POST", "/x?method=flickr.photos.search", b"q=1")
    assert ("X-HTTP-Method-Override", "GET") in seen.headers  # forwarded as sent
    line = _request_line(gw, client)
    assert (line["decision"], line["method_override"]) == ("allow", ["header X-HTTP-Method-Override: GET"])
    assert line["injected"] == ["tok"]


def test_unbound_rule_refuses_too(gw, upstreams):
    response, _ = _send(gw, "allowed.test", "GET", "/x", [("X-HTTP-Method-Override", "POST")])
    assert_refused(response, 403, "method_not_allowed", rule="readonly")
    assert_untouched(upstreams, *ALL_UPSTREAMS)


def test_http2_override_header_and_query(gw, upstreams):
    with tls_tunnel(gw, "api.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        header = h2.send("api.test", "/x", extra=[("x-http-method-override", "DELETE")])
        query = h2.send("api.test", "/x?_method=PATCH")
        fine = h2.send("api.test", "/x", extra=[("x-http-method-override", "get")])
        h2.wait(header, query, fine)
    for stream in (header, query):
        assert h2.responses[stream]["status"] == 403, h2.responses[stream]
        assert h2.header(stream, "x-egress-reason") == "method_not_allowed"
    assert h2.responses[fine]["status"] == 200
    assert [r.method for r in upstreams.tls["api.test"].requests] == ["GET"]


def test_report_mode_lets_a_header_override_through_as_would_deny(gw, upstreams):
    response, client = _send(gw, "deep.wild.test", "GET", "/x", [("X-HTTP-Method-Override", "DELETE")])
    assert response.status == 200, response.text
    line = _request_line(gw, client)
    assert (line["decision"], line["reason"], line["rule"]) == ("would_deny", "method_not_allowed", "trial")


# --- bodies: buffered ones are checked before the upstream is dialled ------------------------------


MULTIPART = (b"--XyZ\r\nContent-Disposition: form-data; name=\"title\"\r\n\r\nhello\r\n"
             b"--XyZ\r\nContent-Disposition: form-data; name=\"_method\"\r\n\r\nDELETE\r\n--XyZ--\r\n")


@pytest.mark.parametrize("content_type, body, where", [
    ("application/x-www-form-urlencoded", b"title=x&_method=DELETE", "form field _method: DELETE"),
    ("application/x-www-form-urlencoded; charset=utf-8", b"_method=put", "form field _method: PUT"),
    (None, b"a=1&_METHOD=DELETE", "form field _METHOD: DELETE"),
    ("multipart/form-data; boundary=XyZ", MULTIPART, "form field _method: DELETE"),
    ("application/json", b'{"title": "x", "_method": "DELETE"}', "JSON key _method: DELETE"),
    ("application/json", b'{"\\u005fmethod": "patch"}', "JSON key _method: PATCH"),
])
def test_override_in_a_buffered_body_is_refused_before_any_upstream_connection(gw, upstreams, content_type,
                                                                               body, where):
    headers = [("Content-Type", content_type)] if content_type else []
    response, client = _send(gw, "api.test", "POST", "/items", headers, body)
    assert_refused(response, 403, "method_not_allowed", rule="bound")
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    allowed = _request_line(gw, client)  # the head was allowed, the credential injected...
    assert (allowed["decision"], allowed["injected"]) == ("allow", ["tok"])
    refused = _request_line(gw, client, "request_body")  # ...and the body refused: nothing was sent
    assert (refused["decision"], refused["reason"], refused["rule"], refused["method_override"]) == (
        "deny", "method_not_allowed", "bound", [where])


def test_body_overrides_that_are_not_overrides_go_through(gw, upstreams):
    bodies = [
        ("application/json", b'{"messages": [{"_method": "DELETE"}], "text": "\\"_method\\": \\"DELETE\\""}'),
        ("application/x-www-form-urlencoded", b"x_method=DELETE&_method=POST&note=_method%3DDELETE"),
        ("text/plain", b"_method=DELETE"),
        ("multipart/form-data; boundary=B", b"--B\r\nContent-Disposition: form-data; name=\"file\"; "
                                            b"filename=\"_method\"\r\n\r\nDELETE\r\n--B--\r\n"),
    ]
    for content_type, body in bodies:
        response, _ = _send(gw, "api.test", "POST", "/items", [("Content-Type", content_type)], body)
        assert response.status == 200, (content_type, response.text)
    assert [r.body for r in upstreams.tls["api.test"].requests] == [b for _, b in bodies]


def test_h2_form_body_override_is_refused(gw, upstreams):
    with tls_tunnel(gw, "api.test:443", alpn=["h2"]) as tls:
        h2 = H2Client(tls)
        stream = h2.h2.get_next_available_stream_id()
        h2.h2.send_headers(stream, [(":method", "POST"), (":scheme", "https"), (":authority", "api.test"),
                                    (":path", "/items"), ("content-type", "application/x-www-form-urlencoded"),
                                    ("content-length", "15")])
        h2.h2.send_data(stream, b"_method=DELETE&", end_stream=True)
        h2._flush()
        h2.responses[stream] = {"status": None, "headers": [], "body": b"", "trailers": [], "done": False,
                                "reset": False}
        h2.wait(stream)
    assert h2.responses[stream]["status"] == 403, h2.responses[stream]
    assert h2.header(stream, "x-egress-reason") == "method_not_allowed"
    assert_untouched(upstreams, *ALL_UPSTREAMS)


def test_report_mode_body_override_on_an_unbound_rule_is_would_deny(gw, upstreams):
    response, client = _send(gw, "deep.wild.test", "POST", "/x",
                             [("Content-Type", "application/x-www-form-urlencoded")], b"_method=DELETE")
    assert response.status == 200, response.text
    line = _request_line(gw, client, "request_body")
    assert (line["decision"], line["reason"], line["rule"]) == ("would_deny", "method_not_allowed", "trial")
    assert [r.body for r in upstreams.tls["deep.wild.test"].requests] == [b"_method=DELETE"]


# --- streamed bodies: the origin never gets a complete request ------------------------------------


def _streamed(gateway, recorder, headers: list[tuple[str, str]], first: bytes, rest: bytes,
              upstream: bytes | None = None):
    """Send a request head and the first part of its body, wait until that part is upstream (the
    recorder has a request whose body begins with `upstream`: the bytes of `first`, unframed),
    then the rest (which names the override), and read the answer."""
    if upstream is None:
        upstream = _unchunked(first) if (CHUNKED in headers) else first
    with tls_tunnel(gateway, "stream.test:443") as tls:
        head = "POST /upload HTTP/1.1\r\nHost: stream.test\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
        tls.send(head.encode() + b"\r\n" + first)
        wait_for(lambda: any(r["body"].startswith(upstream) for r in recorder.requests),
                 what="the first part of the body at the origin", cond=recorder.changed,
                 detail=lambda: repr(recorder.requests))
        tls.send(rest)
        try:
            response = tls.read_response()
        except (ConnectionError, OSError):
            response = None
        return response, tls.client


def _chunks(*pieces: bytes, end: bool = True) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + (b"0\r\n\r\n" if end else b"")


def _unchunked(framed: bytes) -> bytes:
    """The data of complete chunks (as _chunks frames them)."""
    data = b""
    while b"\r\n" in framed:
        size_line, framed = framed.split(b"\r\n", 1)
        size = int(size_line, 16)
        data, framed = data + framed[:size], framed[size + 2:]
        if size == 0:
            break
    return data


FORM = ("Content-Type", "application/x-www-form-urlencoded")
CHUNKED = ("Transfer-Encoding", "chunked")


def _settle(recorder) -> None:
    """Wait until the recorder's handlers have noticed the upstream reset and finished: its
    records are final."""
    wait_for(lambda: recorder.settled, what="the origin to finish reading", cond=recorder.changed,
             detail=lambda: repr(recorder.requests))


def test_streamed_chunked_form_with_a_late_override_never_completes_upstream(gw, recorder):
    response, client = _streamed(gw, recorder, [FORM, CHUNKED], _chunks(b"title=" + b"x" * 5000, end=False),
                                 _chunks(b"&_method=DEL", b"ETE", b"&more=1"))
    assert response is not None and response.status == 403, response
    assert response.egress_reason == "method_not_allowed"
    _settle(recorder)
    assert recorder.requests, "the head of a streamed request goes upstream before its body"
    assert not any(r["complete"] for r in recorder.requests), recorder.requests
    line = _request_line(gw, client, "request_body")
    assert (line["decision"], line["method_override"]) == ("deny", ["form field _method: DELETE"])


def test_streamed_override_as_the_last_field_is_caught_at_the_end(gw, recorder):
    """`_method=DELETE` is only complete when the body ends; the body's last byte was held back,
    so the origin (reading by Content-Length) still waits for it when the stream is reset."""
    body = b"title=" + b"y" * 6000 + b"&_method=DELETE"
    response, _ = _streamed(gw, recorder, [FORM, ("Content-Length", str(len(body)))], body[:5000],
                            body[5000:])
    assert response is not None and response.status == 403, response
    assert response.egress_reason == "method_not_allowed"
    _settle(recorder)
    assert recorder.requests and not any(r["complete"] for r in recorder.requests), recorder.requests
    assert all(len(r["body"]) < len(body) for r in recorder.requests)


@pytest.mark.parametrize("content_type, body", [
    ("multipart/form-data; boundary=B", b"--B\r\nContent-Disposition: form-data; name=\"f\"\r\n\r\n" + b"z" * 6000
     + b"\r\n--B\r\nContent-Disposition: form-data; name=\"_method\"\r\n\r\nDELETE\r\n--B--\r\n"),
    ("application/json", b'{"pad": "' + b"p" * 6000 + b'", "_method": "DELETE"}'),
])
def test_streamed_multipart_and_json_overrides(gw, recorder, content_type, body):
    response, _ = _streamed(gw, recorder, [("Content-Type", content_type), ("Content-Length", str(len(body)))],
                            body[:5000], body[5000:])
    assert response is not None and response.status == 403, response
    assert response.egress_reason == "method_not_allowed", response.text
    _settle(recorder)
    assert recorder.requests and not any(r["complete"] for r in recorder.requests), recorder.requests


def test_streamed_chunks_go_on_at_once_unless_they_end_inside_an_override(gw, recorder):
    """No latency for ordinary streamed bodies: a chunk goes upstream as soon as it is checked. Only
    a chunk ending inside an override field's value keeps its last byte (the end of the body would
    settle the value)."""
    with tls_tunnel(gw, "stream.test:443") as tls:
        tls.send(b"POST /upload HTTP/1.1\r\nHost: stream.test\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n" + _chunks(b"a=1&b=2", end=False))
        # The first chunk goes on by itself, before anything else is sent (no latency).
        wait_for(lambda: recorder.requests and recorder.requests[-1]["body"], what="the first chunk at the origin",
                 cond=recorder.changed, detail=lambda: repr(recorder.requests))
        assert recorder.requests[-1]["body"] == b"a=1&b=2"
        tls.send(_chunks(b"&_method=GE", end=False))
        # Wait for the last bytes that must go on ("&_method=G") and check there and then that the
        # held-back "E" did not come with them: the gateway sends what it lets through of a chunk
        # as one chunk, and the recorder takes in whole chunks, so a forwarded "E" would have come
        # with "G". (Waiting to see that "E" does not come later would be a sleep; that it goes on
        # with the end of the body is checked below.)
        wait_for(lambda: recorder.requests[-1]["body"].startswith(b"a=1&b=2&_method=G"),
                 what="the second chunk at the origin", cond=recorder.changed, detail=lambda: repr(recorder.requests))
        assert recorder.requests[-1]["body"] == b"a=1&b=2&_method=G"  # "E" waits: GET? GETX?
        tls.send(_chunks(b"T"))
        response = tls.read_response()
    assert response.status == 200, response.text
    assert recorder.requests[-1]["body"] == b"a=1&b=2&_method=GET" and recorder.requests[-1]["complete"]


def test_streamed_bodies_without_an_override_arrive_whole(gw, recorder):
    pieces = [b"title=" + b"x" * 5000, b"&_method=POST", b"&note=ok"]
    response, _ = _streamed(gw, recorder, [FORM, CHUNKED], _chunks(pieces[0], end=False),
                            _chunks(*pieces[1:]))
    assert response is not None and response.status == 200, response
    body = b"t" * 9000 + b"&x=1"
    response, _ = _streamed(gw, recorder, [FORM, ("Content-Length", str(len(body)))], body[:5000],
                            body[5000:])
    assert response is not None and response.status == 200, response
    complete = [r for r in recorder.requests if r["complete"]]
    assert [r["body"] for r in complete] == [b"".join(pieces), body]
    assert all(("Authorization", f"Bearer {SECRET}") in r["headers"] for r in complete)


# --- review 14a: bodies and headers real frameworks read differently (all ran as DELETE) ----------


def _gz(*members: bytes) -> bytes:
    import gzip

    return b"".join(gzip.compress(m, mtime=0) for m in members)


_MP = b'--AAA\r\nContent-Disposition: form-data; name="_method"\r\n\r\nDELETE\r\n--AAA--\r\n'
_PART = b'Content-Disposition: form-data; name="_method"\r\n\r\nDELETE\r\n'
_J = '{"a": 1, "_method": "DELETE"}'


@pytest.mark.parametrize("headers, body", [
    # F1: Content-Types PHP and Rack cut differently from a strict parser
    ([("Content-Type", "application/x-www-form-urlencoded,text/plain")], b"_method=DELETE"),
    ([("Content-Type", "application/x-www-form-urlencoded x")], b"_method=DELETE"),
    ([("Content-Type", "multipart/form-data; xboundary=AAA")], _MP),
    ([("Content-Type", "multipart/form-data,boundary=AAA")], _MP),
    ([("Content-Type", "multipart/form-data boundary=AAA")], _MP),
    ([("Content-Type", "text/plain; x=/json")], _J.encode()),
    # F2: multipart structures PHP or Rack accept
    ([("Content-Type", "multipart/form-data; boundary=AAA")], b"--AAA--\r\n--AAA\r\n" + _PART + b"--AAA--\r\n"),
    ([("Content-Type", "multipart/form-data; boundary=AAA")],
     b'--AAA\r\nContent-Disposition: form-data; name="a"\r\n\r\nx\r\n--AAA--\r\n--AAA\r\n' + _PART + b"--AAA--\r\n"),
    ([("Content-Type", "multipart/form-data; boundary=AAA")],
     b'--AAA\r\nContent-Disposition: form-data;\r\n name="_method"\r\n\r\nDELETE\r\n--AAA--\r\n'),
    ([("Content-Type", "multipart/form-data; boundary=AAA")],
     b'--AAA\r\nContent-Disposition: form-data; na\r\nme="_method"\r\n\r\nDELETE\r\n--AAA--\r\n'),
    ([("Content-Type", "multipart/form-data; boundary=AAA")],
     b"--AAA\r\nContent-Disposition: form-data; name='_method'\r\n\r\nDELETE\r\n--AAA--\r\n"),
    ([("Content-Type", "multipart/form-data; boundary=AAA")],
     b'--AAA\r\nContent-Disposition: form-data; name="_method"\n\r\nDELETE\r\n--AAA--\r\n'),
    # F3: JSON that body-parser decodes from a BOM, UTF-16 or UTF-32
    ([("Content-Type", "application/json")], b"\xef\xbb\xbf" + _J.encode()),
    ([("Content-Type", "application/json; charset=utf-16le")], _J.encode("utf-16-le")),
    ([("Content-Type", "application/json; charset=utf-16")], _J.encode("utf-16")),
    ([("Content-Type", "application/json; charset=utf-32")], _J.encode("utf-32")),
    # ...and forms Django or Tomcat decode with their charset
    ([("Content-Type", "application/x-www-form-urlencoded; charset=IBM037")], "a=1&_method=DELETE".encode("cp037")),
    # F4: every gzip member (Node's gunzip decodes them all)
    ([("Content-Type", "application/x-www-form-urlencoded"), ("Content-Encoding", "gzip")],
     _gz(b"a=b&", b"_method=DELETE")),
    ([("Content-Type", "application/json"), ("Content-Encoding", "gzip")], _gz(b'{"a":1,', b'"_method":"DELETE"}')),
])
def test_bodies_frameworks_read_as_delete_are_refused_before_any_upstream_connection(gw, upstreams, headers, body):
    response, client = _send(gw, "api.test", "POST", "/items", headers, body)
    assert_refused(response, 403, "method_not_allowed", rule="bound")
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    line = _request_line(gw, client, "request_body")
    assert (line["decision"], line["reason"], line["rule"]) == ("deny", "method_not_allowed", "bound")
    assert any(entry.endswith(": DELETE") for entry in line["method_override"]), line


@pytest.mark.parametrize("headers, body, why", [
    ([("Content-Type", "application/x-www-form-urlencoded; charset=x-unknown")], b"a=1", "charset"),
    ([("Content-Type", "application/x-www-form-urlencoded"), ("Content-Encoding", "gzip")],
     _gz(b"a=b") + b"trailing", "after the end"),
    ([("Content-Type", "application/json"), ("Content-Encoding", "gzip")], _gz(b'{"a": 1}')[:-5], "decode"),
])
def test_bodies_the_gateway_cannot_read_are_refused_as_uncheckable(gw, upstreams, headers, body, why):
    response, client = _send(gw, "api.test", "POST", "/items", headers, body)
    assert_refused(response, 403, "method_not_allowed")
    assert "could not be checked for method overrides" in response.text and why in response.text
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    assert _request_line(gw, client, "request_body")["reason"] == "method_not_allowed"


def test_cgi_style_override_header_spelling_is_refused(gw, upstreams):
    """PHP's built-in server files `X.HTTP.Method.Override` as HTTP_X_HTTP_METHOD_OVERRIDE (F5)."""
    response, client = _send(gw, "api.test", "POST", "/x", [("X.HTTP.Method.Override", "DELETE")])
    assert_refused(response, 403, "method_not_allowed", rule="bound")
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    assert _request_line(gw, client)["method_override"] == ["header X.HTTP.Method.Override: DELETE"]


def test_ordinary_client_bodies_arrive_byte_for_byte(gw, upstreams):
    """JSON APIs, requests/httpx uploads, a twine upload, an npm publish and a gzip'd git body are
    neither refused nor altered."""
    import gzip

    import httpx
    import requests

    blob = bytes(range(256)) * 64
    prepared = requests.Request("POST", "https://api.test/u", files={"file": ("a.whl", blob)},
                                data={"method": "DELETE", ":action": "file_upload"}).prepare()
    upload = httpx.Request("POST", "https://api.test/u", files={"f": ("b.bin", blob)}, data={"note": "_method=x"})
    cases = [
        [(k, v) for k, v in prepared.headers.items() if k.lower() not in ("content-length", "host")], prepared.body,
        [(k, v) for k, v in upload.headers.items() if k.lower() not in ("content-length", "host")], upload.read(),
        [("Content-Type", "application/json")],
        json.dumps({"model": "m", "messages": [{"role": "user", "content": '"_method": "DELETE"'}]}).encode(),
        [("Content-Type", "application/json; charset=utf-8")],
        json.dumps({"name": "pkg", "_attachments": {"pkg.tgz": {"data": "H4sI" + "A" * 2000}}}).encode(),
        [("Content-Type", "application/x-git-upload-pack-request"), ("Content-Encoding", "gzip")],
        gzip.compress(b"0032want 0123456789abcdef0123456789abcdef01234567\n00000009done\n"),
        [("Content-Type", "application/x-www-form-urlencoded"), ("Content-Encoding", "gzip")],
        _gz(b"grant_type=client_credentials&", b"scope=read"),
    ]
    sent = []
    for headers, body in zip(cases[::2], cases[1::2]):
        response, _ = _send(gw, "api.test", "POST", "/upload", headers, body)
        assert response.status == 200, (headers, response.text)
        sent.append(body)
    assert [r.body for r in upstreams.tls["api.test"].requests] == sent


def test_streamed_second_gzip_member_with_an_override_never_completes_upstream(gw, recorder):
    import random

    noise = random.Random(14).randbytes(12000).replace(b"&", b"").replace(b";", b"")  # does not compress
    first_member = _gz(b"title=" + noise + b"&")
    body = first_member + _gz(b"_method=DELETE")
    # The first part ends inside the second member, whose bytes the gateway may hold until it has
    # decoded them: the first member is what must be upstream before the rest is sent.
    response, _ = _streamed(gw, recorder, [FORM, ("Content-Encoding", "gzip"), ("Content-Length", str(len(body)))],
                            body[:-20], body[-20:], upstream=first_member)
    assert response is not None and response.status == 403, response
    assert response.egress_reason == "method_not_allowed"
    _settle(recorder)
    assert recorder.requests and not any(r["complete"] for r in recorder.requests), recorder.requests


# --- explain agrees ---------------------------------------------------------------------------------


def _explain(gateway, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gateway", "explain", "--policy", str(gateway.policy),
                           "--format", "json", *args], capture_output=True, text=True, cwd=PROJECT_ROOT,
                          timeout=60)


def test_explain_agrees_with_the_gateway(gw, upstreams):
    cases = [
        (["-X", "GET", "-H", "X-HTTP-Method-Override: DELETE", "https://api.test/x"], "GET", "/x",
         [("X-HTTP-Method-Override", "DELETE")]),
        (["https://api.test/x?_method=put"], "GET", "/x?_method=put", []),
        (["-X", "POST", "-H", "X-HTTP-Method-Override: GET", "https://api.test/x"], "POST", "/x",
         [("X-HTTP-Method-Override", "GET")]),
    ]
    for args, method, target, headers in cases:
        explained = json.loads(_explain(gw, *args).stdout)
        response, _ = _send(gw, "api.test", method, target, headers)
        assert (explained["decision"]["reason"], explained["decision"]["status"]) == (
            response.egress_reason or "allowed", response.status if response.egress_reason else None), (args,
                                                                                                        explained)


def _sparse_form(mib: int) -> bytes:
    """A form of `mib` MiB that gzip compresses ~50:1 (within the 100:1 ratio): zeros with a
    random byte every 150 bytes."""
    import random
    import zlib

    rnd = random.Random(15)
    block = bytearray(1 << 20)
    for j in range(0, len(block), 150):
        block[j] = rnd.randrange(1, 256)
    c = zlib.compressobj(6, zlib.DEFLATED, 31)
    return b"".join([c.compress(bytes(block)) for _ in range(mib)] + [c.flush()])


def test_a_compressed_body_decoding_past_the_scan_budget_is_413(gw, upstreams):
    """Within the ratio, a 7.7 MB gzip form decoded to 400 MiB and cost seconds of scanning on the
    event loop per request; past egress_max_decoded_request_bytes (8 MiB) it cannot be checked."""
    body = _sparse_form(12)
    response, client = _send(gw, "api.test", "POST", "/items",
                             [("Content-Type", "application/x-www-form-urlencoded"), ("Content-Encoding", "gzip")],
                             body)
    assert (response.status, response.egress_reason) == (413, "request_too_large"), response
    assert _request_line(gw, client, "request_body")["reason"] == "request_too_large"
    # under the budget the same kind of body still goes through
    response, _ = _send(gw, "api.test", "POST", "/items",
                        [("Content-Type", "application/x-www-form-urlencoded"), ("Content-Encoding", "gzip")],
                        _sparse_form(4))
    assert response.status == 200, response


# --- a sandbox shapes the size of its audit line (fix of the uncapped method_override list) ------


def _raw_lines(gateway) -> list[bytes]:
    return [raw for raw in gateway.audit_path.read_bytes().splitlines() if raw]


def test_a_repeated_override_is_one_entry_and_the_line_stays_small(gw, upstreams):
    """`X-HTTP-Method-Override: GET,GET,...` (15,000 elements, 60 KB) used to be written as 15,000
    entries (a 555 KB line); one distinct override is one entry, and no line passes 8 KiB."""
    response, client = _send(gw, "api.test", "GET", "/x", [("X-HTTP-Method-Override", ",".join(["GET"] * 15000))])
    assert response.status == 200, response.text
    line = _request_line(gw, client)
    assert line["method_override"] == ["header X-HTTP-Method-Override: GET"]
    assert len(line["message"]) < 1024, line["message"][:200]
    assert max(len(raw) for raw in _raw_lines(gw)) <= 8192


def test_a_query_of_repeated_overrides_is_one_entry_and_the_path_is_truncated(gw, upstreams):
    response, client = _send(gw, "api.test", "GET", "/x?" + "&".join(["_method=GET"] * 1000))
    assert response.status == 200, response.text
    line = _request_line(gw, client)
    assert line["method_override"] == ["query parameter _method: GET"]
    assert max(len(raw) for raw in _raw_lines(gw)) <= 8192


def test_many_distinct_overrides_are_capped_in_the_line_and_refused(gw, upstreams):
    methods = ",".join(f"M{i}" for i in range(3000))
    response, client = _send(gw, "allowed.test", "GET", "/x", [("X-HTTP-Method-Override", methods)])
    assert_refused(response, 403, "method_not_allowed", rule="readonly")
    assert_untouched(upstreams, *ALL_UPSTREAMS)
    line = _request_line(gw, client)
    assert len(line["method_override"]) == 17 and line["method_override"][-1].endswith(" more"), line
    assert max(len(raw) for raw in _raw_lines(gw)) <= 8192
