"""Three ways a credential could leave without the redactor seeing it, as an attacker tries them.

- Transfer-codings: the sandbox asks for `TE: gzip` (in every spelling, duplicated, hidden behind
  `trailers`, over HTTP/2) so that an origin compresses its echo of the credential *below* the
  chunked framing, where a redactor that reads chunks finds only gzip. And an origin that answers
  `Transfer-Encoding: gzip, chunked` to a bound request unasked.
- Hop-by-hop nomination: `Connection: Authorization` (strip the injected credential somewhere
  past the gateway), `Connection: Host` (let a front end route the credential to its default
  virtual host), `Connection: Content-Length` (a body without framing: smuggling), `Connection:
  Accept-Encoding` (let the origin compress).
- Values and output the sandbox does not control but may read: a secret whose variable holds a
  CRLF and a second request; mitmdump's flow line cut at the terminal width in the middle of the
  query-injected secret (job logs are often readable from inside a CI sandbox).

The gateway here is this module's own (its secrets and its origins); every response is searched
for every form of the secret, decompressed when it is compressed.
"""

from __future__ import annotations

import gzip
import socket
import ssl
import zlib
from urllib.parse import quote_plus

import pytest

from tests.credentials.clients import leaks
from tests.credentials.servers import EchoUpstream
from tests.e2e.helpers import H2Client, extra_static_hosts, get, shared_gateway, tls_tunnel
from tests.support.gateway import wait_for_port
from tests.support.tcp_origin import read_head, start_accepting
from tests.support.mitmdump import clean_env, secret_forms_in, start_mitmdump, stop

from .common import attack

pytestmark = attack("credentials")

SECRET = "lk-Tok7+Yy/Qq5=Pp3&Nn1_live"
SMUGGLE = "lk-first\r\nX-Injected: 1\r\n\r\nGET /admin HTTP/1.1\r\nHost: lk-echo.test"
ENV = {"lk_token": ("EGRESS_LK_TOKEN", SECRET), "lk_smuggle": ("EGRESS_LK_SMUGGLE", SMUGGLE)}
OCTETS = {"te": 50, "echo": 51}  # in the session block (.40-.47 are taken, .53 and .60+ too)

RULES = """
- id: lk-te
  hosts: [lk-te.test]
  inject:
    - header: Authorization
      value: "Bearer ${secrets.lk_token}"
- id: lk-echo
  hosts: [lk-echo.test]
  methods: [GET, POST]
  inject:
    - header: Authorization
      value: "Bearer ${secrets.lk_token}"
    - query: api_key
      value: "${secrets.lk_token}"
- id: lk-smuggle
  hosts: [lk-smuggle.test]
  inject:
    - header: Authorization
      value: "Bearer ${secrets.lk_smuggle}"
"""


class TeOrigin:
    """An HTTPS origin that echoes the credential it got, under a transfer-coding when asked:
    `/honour` compresses (`Transfer-Encoding: gzip, chunked`) only if the request's TE lists gzip,
    `/always` compresses whatever the request said. Records every raw request head."""

    def __init__(self, address: str, cert, key):
        self.heads: list[bytes] = []
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        self.sock = socket.create_server((address, 443))
        start_accepting(self.sock, self._handle)

    def _handle(self, client: socket.socket) -> None:
        try:
            tls = self.context.wrap_socket(client, server_side=True)
            tls.settimeout(5)
            got = read_head(tls)
            if got is None:
                return
            head = got[0]
            self.heads.append(head)
            lines = head.split(b"\r\n")
            fields = [line.split(b":", 1) for line in lines[1:]]
            token = next((v.strip().split(b" ", 1)[-1] for k, v in fields if k.lower() == b"authorization"), b"none")
            te = b",".join(v for k, v in fields if k.strip().lower() == b"te").lower()
            body = b"token=" + token + b"\n"
            if lines[0].split(b" ")[1].startswith(b"/always") or b"gzip" in te:
                packed = gzip.compress(body)
                tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: gzip, chunked\r\n"
                            b"Connection: close\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(packed), packed))
            else:
                tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                            b"Connection: close\r\n\r\n%s" % (len(body), body))
            tls.close()
        except (OSError, ssl.SSLError):
            pass

    def stop(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def lk(tmp_path_factory, upstreams, pki):
    block = upstreams.block
    cert, key = pki.issue(["lk-te.test"], [f"{block}.{OCTETS['te']}"], stem="leak-te")
    origin = TeOrigin(f"{block}.{OCTETS['te']}", cert, key)
    cert, key = pki.issue(["lk-echo.test", "lk-smuggle.test"], [f"{block}.{OCTETS['echo']}"], stem="leak-echo")
    echo = EchoUpstream("lk-echo", f"{block}.{OCTETS['echo']}", 443, cert, key)
    extra = extra_static_hosts({"lk-te.test": f"{block}.{OCTETS['te']}", "lk-echo.test": f"{block}.{OCTETS['echo']}",
                                "lk-smuggle.test": f"{block}.{OCTETS['echo']}"})
    extra += "secrets:\n" + "".join(f"  {name}: {{env: {var}}}\n" for name, (var, _) in ENV.items())
    patch = pytest.MonkeyPatch()
    try:
        for var, value in ENV.values():
            patch.setenv(var, value)
        gateway = shared_gateway(tmp_path_factory, upstreams, pki, RULES, extra, name="leaks")
    finally:
        patch.undo()
    gateway.origin, gateway.echo = origin, echo
    yield gateway
    gateway.stop()
    origin.stop()
    echo.stop()


def every_reading(body: bytes) -> bytes:
    """The body as received and every way it decompresses (what a client could do with it)."""
    found = [body]
    for decode in (gzip.decompress, zlib.decompress, lambda b: zlib.decompress(b, -15)):
        try:
            found.append(decode(body))
        except Exception:
            pass
    return b"\n".join(found)


def assert_no_secret(response_bytes: bytes) -> None:
    hits = leaks(every_reading(response_bytes), SECRET)
    assert not hits, f"the secret came back: {hits[:4]}"


def _raw_get(gateway, host: str, path: str, extra: bytes) -> tuple[int, bytes, bytes]:
    """One request with raw extra header lines; (status, head, body as framed by the gateway)."""
    with tls_tunnel(gateway, f"{host}:443") as tls:
        tls.send(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: " + host.encode() + b"\r\n" + extra + b"\r\n")
        response = tls.read_response()
    head = "\r\n".join(f"{k}: {v}" for k, v in response.headers).encode("latin-1", "replace")
    return response.status, head, response.body


def _te_fields(head: bytes) -> list[bytes]:
    return [line for line in head.split(b"\r\n")[1:] if line.split(b":", 1)[0].strip().lower() == b"te"]


@pytest.mark.parametrize("extra", [
    b"TE: gzip\r\n",
    b"te: gzip\r\n",
    b"Te: GZIP\r\n",
    b"TE: trailers, gzip\r\n",
    b"TE: trailers\r\nTE: gzip\r\n",
    b"TE: gzip;q=1.0, deflate;q=0.5\r\n",
    b"TE: x-gzip\r\nConnection: TE\r\n",
    b"Connection: close, TE\r\nTE: gzip\r\n",
])
def test_te_gzip_never_reaches_the_origin(lk, extra):
    before = len(lk.origin.heads)
    status, head, body = _raw_get(lk, "lk-te.test", "/honour", extra)
    assert status == 200, (status, body)
    [seen] = lk.origin.heads[before:]
    assert _te_fields(seen) == [], seen
    assert b"Authorization: Bearer " + SECRET.encode() in seen  # the credential went; the attack was real
    assert b"transfer-encoding: gzip" not in head.lower()
    assert body.startswith(b"token=[REDACTED]"), body
    assert_no_secret(head + b"\r\n\r\n" + body)


def test_h2_te_trailers_is_kept_and_nothing_else(lk):
    """gRPC's `te: trailers` survives (grpc-core servers refuse calls without it)."""
    before = len(lk.origin.heads)
    with tls_tunnel(lk, "lk-te.test:443", alpn=["h2"]) as tls:
        client = H2Client(tls)
        stream = client.send("lk-te.test", "/honour", extra=[("te", "trailers")])
        client.wait(stream)
        entry = client.responses[stream]
    assert entry["status"] == 200
    [seen] = lk.origin.heads[before:]
    assert _te_fields(seen) == [b"te: trailers"], seen
    assert_no_secret(entry["body"])


def test_h2_te_gzip_is_refused_before_anything_is_sent(lk):
    before = len(lk.origin.heads)
    with tls_tunnel(lk, "lk-te.test:443", alpn=["h2"]) as tls:
        client = H2Client(tls)
        stream = client.send("lk-te.test", "/honour", extra=[("te", "gzip")])
        try:
            client.wait(stream)
            entry = client.responses[stream]
            assert entry["reset"] or entry["status"] >= 400, entry
            assert_no_secret(entry["body"])
        except ConnectionError:
            pass  # the whole connection refused: as good
    assert lk.origin.heads[before:] == []


def test_origin_answering_gzip_transfer_coding_unasked_is_refused(lk):
    """The other half: an origin that compresses below the chunks anyway gets a 502, not a pass."""
    status, head, body = _raw_get(lk, "lk-te.test", "/always", b"")
    assert status == 502, (status, head, body)
    assert b"undecodable_response" in head
    assert_no_secret(head + b"\r\n\r\n" + body)


def _echo_seen(lk, before: int):
    [seen] = lk.echo.requests[before:]
    return seen


def test_connection_nominating_authorization_cannot_strip_the_credential_downstream(lk):
    before = len(lk.echo.requests)
    status, head, body = _raw_get(lk, "lk-echo.test", "/v1/anything",
                                  b"Connection: close, Authorization\r\nAuthorization: Bearer sandbox-own\r\n")
    assert status == 200
    seen = _echo_seen(lk, before)
    assert seen.header_all("authorization") == [f"Bearer {SECRET}"]
    assert seen.header_all("connection") == ["close"]  # no nomination goes upstream
    assert_no_secret(head + b"\r\n\r\n" + body)


@pytest.mark.parametrize("nominated", [b"Host", b"Accept-Encoding", b"Authorization", b"X-Trace, Cookie"])
def test_no_nomination_of_what_the_gateway_sets_goes_upstream(lk, nominated):
    before = len(lk.echo.requests)
    status, head, body = _raw_get(lk, "lk-echo.test", "/v1/anything",
                                  b"Connection: " + nominated + b"\r\nX-Trace: 1\r\nCookie: a=b\r\n")
    assert status == 200
    seen = _echo_seen(lk, before)
    assert seen.header_all("connection") == []
    assert seen.header_all("host") == ["lk-echo.test"]
    assert seen.header_all("accept-encoding") == ["identity"]
    assert seen.header_all("authorization") == [f"Bearer {SECRET}"]
    if b"X-Trace" in nominated:
        assert seen.header_all("x-trace") == [] and seen.header_all("cookie") == []
    assert_no_secret(head + b"\r\n\r\n" + body)


@pytest.mark.parametrize("framing", [b"Content-Length: 11\r\n", b"Transfer-Encoding: chunked\r\n"])
def test_connection_nominating_framing_does_not_unframe_the_body(lk, framing):
    """`Connection: Content-Length` honoured naively would send the body unframed: the origin would
    read it as a second request (smuggling)."""
    before = len(lk.echo.requests)
    body = b"hello=world" if b"Length" in framing else b"b\r\nhello=world\r\n0\r\n\r\n"
    name = framing.split(b":")[0]
    with tls_tunnel(lk, "lk-echo.test:443") as tls:
        tls.send(b"POST /v1/anything HTTP/1.1\r\nHost: lk-echo.test\r\nConnection: " + name + b"\r\n" + framing +
                 b"\r\n" + body)
        response = tls.read_response()
    assert response.status == 200
    seen = _echo_seen(lk, before)  # one request, not two
    if b"Length" in framing:
        assert seen.header_all("content-length") == ["11"] and seen.body == b"hello=world", seen
    else:  # (the echo server does not read chunked bodies; the framing field is what matters)
        assert seen.header_all("transfer-encoding") == ["chunked"], seen


def test_a_secret_holding_crlf_and_a_second_request_sends_nothing(lk):
    before, connections = len(lk.echo.requests), lk.echo.connections
    status, head, body = _raw_get(lk, "lk-smuggle.test", "/", b"")
    assert status == 502 and b"secret_unavailable" in head
    assert lk.echo.requests[before:] == [] and lk.echo.connections == connections
    assert b"X-Injected" not in body and b"/admin" not in body
    assert "X-Injected" not in lk.log() and "GET /admin" not in lk.log()


def test_flow_line_cut_inside_the_query_secret_shows_no_piece_of_it(lk, tmp_path, upstreams, pki):
    """mitmdump at flow_detail 1 cuts each URL at the terminal width; the sandbox chooses the path
    length, so it can place the cut anywhere inside the injected api_key."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(lk.policy.read_text())
    proc, proxy = start_mitmdump(tmp_path, policy, pki.ca_cert, ["--set", "flow_detail=1"],
                                 clean_env(COLUMNS="100", **{var: value for var, value in ENV.values()}))
    before = len(lk.echo.requests)
    try:
        wait_for_port("127.0.0.1", proxy.port, process=proc)
        with tls_tunnel(proxy, "lk-echo.test:443") as tls:
            for pad in range(0, 40, 3):  # a cut every 3 characters across the secret
                assert get(tls, "/v1/" + "p" * pad, "lk-echo.test").status == 200
    finally:
        stop(proc)
    assert f"api_key={quote_plus(SECRET)}" in lk.echo.requests[before].path  # it was injected
    out = (tmp_path / "mitmdump.out").read_bytes()
    assert "…".encode() in out, out[-2000:]  # the lines were cut
    assert not secret_forms_in(out, SECRET, piece=6), secret_forms_in(out, SECRET, piece=6)
