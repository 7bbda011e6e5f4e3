"""Small clients for the end-to-end tests: raw HTTP/1.1 over sockets (optionally inside a CONNECT
tunnel and TLS with a chosen SNI), curl, httpx and HTTP/2 (h2) through the gateway.

Everything here talks to a real gateway process (tests.support.gateway.GatewayProcess) started by
the `start_gateway` fixture or by `shared_gateway` below (the same building blocks, kept for a
whole module so that the suite does not pay one process start per test).
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import policy_text
from tests.support.gateway import GatewayProcess, free_port
from tests.support.tcp_origin import TcpOrigin, read_head

TIMEOUT = 3.0  # refusals must arrive well within this


# --------------------------------------------------------------------------------------------
# gateway processes


def shared_gateway(tmp_path_factory, upstreams, pki, rules: str, extra: str = "", args: list[str] | None = None,
                   port: int | None = None, name: str = "gw", upstream_ca: Path | None | bool = True) -> GatewayProcess:
    """Like the `start_gateway` fixture, for a module-scoped fixture (the caller stops it).

    `rules` and `extra` may contain `{gw_port}`, replaced by the gateway's listening port (chosen
    before the policy is written, so a rule can name the gateway itself). `upstream_ca=True` trusts
    the test CA upstream (as start_gateway does); pass another path, or None for no --set at all
    (mitmproxy refuses a second --set of the same option, so a later one cannot override it)."""
    port = port or free_port("127.0.0.1")
    workdir = tmp_path_factory.mktemp(name)
    policy = workdir / "policy.yaml"
    policy.write_text(policy_text(upstreams, rules.replace("{gw_port}", str(port)),
                                  extra.replace("{gw_port}", str(port))))
    gateway = GatewayProcess(policy, workdir / "gw", port=port, extra_args=args or [],
                             upstream_ca=pki.ca_cert if upstream_ca is True else upstream_ca)
    gateway.start()
    upstreams.reset()
    return gateway


@dataclass
class LenientWorld:
    """A gateway and two LenientOrigins (TLS on 443, plain on 80) at one address of the session's
    upstream block, shared by a module (`lenient_world`)."""

    gateway: GatewayProcess
    tls_origin: object
    plain_origin: object

    def fresh(self) -> GatewayProcess:
        """For the next test: the origins' records emptied, the gateway's audit marked."""
        self.tls_origin.reset()
        self.plain_origin.reset()
        self.gateway.mark()
        return self.gateway


def lenient_world(tmp_path_factory, upstreams, pki, rules: str, names: list[str], last_octet: int, name: str):
    """Yield a `LenientWorld` whose origins answer for `names` (a module fixture's body)."""
    from tests.support.lenient_origin import LenientOrigin

    address = f"{upstreams.block}.{last_octet}"
    cert, key = pki.issue(names, [address], stem=f"e2e-{name}")
    tls_origin, plain_origin = LenientOrigin(address, 443, cert, key), LenientOrigin(address, 80)
    gateway = shared_gateway(tmp_path_factory, upstreams, pki, rules,
                             extra_static_hosts({host: address for host in names}), name=name)
    try:
        yield LenientWorld(gateway, tls_origin, plain_origin)
    finally:
        gateway.stop()
        tls_origin.stop()
        plain_origin.stop()


# The policy most modules share. other.test has no rule at all: it is the forbidden destination.
STANDARD_RULES = """
- id: allowed
  hosts: [allowed.test]
- id: plain
  hosts: [allowed.test, bücher.test, deep.wild.test]
  schemes: [http]
- id: api
  hosts: [api.test]
  methods: [GET]
  paths: ["/ok/**"]
- id: wild
  hosts: ["*.wild.test"]
- id: ip-literal
  hosts: ["{allowed_ip}"]
  schemes: [https, http]
- id: alias
  hosts: [alias.test]
- id: metadata
  hosts: [meta.test, mapped.test, 169.254.0.0/16]
  schemes: [https, http]
- id: self
  hosts: [self.test, 127.0.0.1, "::ffff:127.0.0.1"]
  schemes: [https, http]
  ports: [{gw_port}]
- id: nowhere
  hosts: [nowhere.invalid]
"""


def standard_policy(upstreams) -> tuple[str, str]:
    """(rules, extra) of the shared policy; alias.test and bücher.test point at allowed.test's address,
    meta.test and mapped.test at the metadata address, self.test at the gateway's own address."""
    allowed_ip = upstreams.hosts["allowed.test"]
    extra = extra_static_hosts({
        "bücher.test": allowed_ip,
        "alias.test": allowed_ip,
        "meta.test": "169.254.169.254",
        "mapped.test": "::ffff:169.254.169.254",
        "self.test": "127.0.0.1",
    })
    return STANDARD_RULES.replace("{allowed_ip}", allowed_ip), extra


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, upstreams, pki):
    """One gateway with the standard policy for a whole test module (import this fixture)."""
    rules, extra = standard_policy(upstreams)
    process = shared_gateway(tmp_path_factory, upstreams, pki, rules, extra, name="standard")
    yield process
    process.stop()


@pytest.fixture(autouse=True)
def fresh_upstreams(upstreams):
    """Every test starts with empty upstream records (import this fixture to make it apply)."""
    upstreams.reset()
    yield upstreams


def extra_static_hosts(mapping: dict[str, str]) -> str:
    """`extra=` text for start_gateway/policy_text that adds names to resolver.static_hosts.

    policy_text dedents `extra`; the leading comment at column 0 keeps the indentation intact."""
    lines = ["# extra static_hosts for this test"]
    lines += [f"    {name}: [{address!r}]".replace("'", '"') for name, address in mapping.items()]
    return "\n".join(lines) + "\n"


def audit_for(gateway: GatewayProcess, client: str, count: int = 1, wait: float = 2.0, since: int = 0) -> list[dict]:
    """The audit lines of one client connection ("ip:port"), waiting up to `wait` s for `count` of them;
    `since`: only lines after the first `since` (an earlier connection of a long-lived gateway may
    have had the same source port)."""
    return gateway.audit_lines(since, count, wait, client=client)


def open_clients(gateway: GatewayProcess) -> set[str]:
    """The client connections ("ip:port") the gateway's log shows open: a `client connect` line
    without its `client disconnect` (written when the connection's handler ends, just before
    `client_disconnected` releases its slot)."""
    opened: set[str] = set()
    for line in gateway.log().splitlines():
        if line.endswith("] client connect"):
            opened.add(line.rsplit("][", 1)[-1].split("]", 1)[0])
        elif line.endswith("] client disconnect"):
            opened.discard(line.rsplit("][", 1)[-1].split("]", 1)[0])
    return opened


def disconnected(gateway: GatewayProcess) -> set[str]:
    """The client connections ("ip:port") whose `client disconnect` line is in the gateway's log:
    the gateway has finished with them."""
    return {line.rsplit("][", 1)[-1].split("]", 1)[0] for line in gateway.log().splitlines()
            if line.endswith("] client disconnect")}


def assert_refused(response, status: int, reason: str, rule: str | None = None) -> None:
    """A gateway refusal: status, X-Egress-Reason, X-Egress-Rule (when given) and the text body."""
    text = getattr(response, "text", None) or getattr(response, "body", "")
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    status_code = getattr(response, "status", None) or getattr(response, "status_code", None)
    header = response.header if hasattr(response, "header") else response.headers.get
    assert status_code == status, f"expected {status} {reason}, got {status_code}: {text[:300]!r}"
    assert header("X-Egress-Reason") == reason, f"X-Egress-Reason is {header('X-Egress-Reason')!r}, body {text[:300]!r}"
    assert f"reason: {reason}" in text, text
    if rule is not None:
        assert header("X-Egress-Rule") == rule, header("X-Egress-Rule")
        assert f"rule: {rule}" in text, text


def assert_untouched(upstreams, *names: str) -> None:
    """Not even a TCP connection reached these upstream hosts (TLS and plain servers), one still in
    a server's accept queue included (`settle`)."""
    for name in names:
        for kind, servers in (("tls", upstreams.tls), ("plain", upstreams.plain)):
            server = servers[name]
            server.settle()
            assert not server.touched, (
                f"{name} ({kind}) was reached: {server.connections} connection(s), "
                f"requests {[(r.method, r.path) for r in server.requests]}"
            )


ALL_UPSTREAMS = ("allowed.test", "other.test", "api.test", "deep.wild.test")


def ipv4_spellings(address: str) -> dict[str, str]:
    """inet_aton spellings of an IPv4 address: one number, hex, octal parts, short form, a mix."""
    import ipaddress

    ip = ipaddress.IPv4Address(address)
    a, b, c, d = ip.packed
    return {
        "decimal": str(int(ip)),
        "hex": hex(int(ip)),
        "octal": f"0{a:o}.0{b:o}.0{c:o}.0{d:o}",
        "short": f"{a}.{b}.{(c << 8) | d}",
        "mixed": f"0x{a:x}.{b}.0{c:o}.{d}",
    }


# --------------------------------------------------------------------------------------------
# raw HTTP/1.1


@dataclass
class Response:
    status: int
    reason: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    elapsed: float = 0.0

    def header(self, name: str) -> str | None:
        values = self.headers_all(name)
        return values[0] if values else None

    def headers_all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    @property
    def egress_reason(self) -> str | None:
        return self.header("X-Egress-Reason")

    @property
    def egress_rule(self) -> str | None:
        return self.header("X-Egress-Rule")


class Conn:
    """A socket (plain or TLS) with a read buffer, speaking hand-written HTTP/1.1."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""
        host, port = sock.getsockname()[:2]
        self.client = f"{host}:{port}"  # this connection as the gateway's audit log names it

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        if not chunk:
            return False
        self.buf += chunk
        return True

    def read_until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            if not self._fill():
                raise ConnectionError(f"connection closed before {marker!r}; got {self.buf[:200]!r}")
        head, _, self.buf = self.buf.partition(marker)
        return head

    def read_exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise ConnectionError("connection closed in the middle of a body")
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def read_response(self, head_only: bool = False, method: str = "GET") -> Response:
        start = time.monotonic()
        head = self.read_until(b"\r\n\r\n").decode("latin-1")
        status_line, *lines = head.split("\r\n")
        version, status, *reason = status_line.split(" ", 2)
        assert version.startswith("HTTP/1."), status_line
        headers = []
        for line in lines:
            name, _, value = line.partition(":")
            headers.append((name.strip(), value.strip()))
        response = Response(int(status), reason[0] if reason else "", headers)
        if head_only or method == "HEAD" or response.status in (204, 304) or 100 <= response.status < 200:
            response.elapsed = time.monotonic() - start
            return response
        if response.header("Transfer-Encoding") and "chunked" in response.header("Transfer-Encoding").lower():
            body = b""
            while True:
                size = int(self.read_until(b"\r\n").split(b";")[0], 16)
                if size == 0:
                    self.read_until(b"\r\n")
                    break
                body += self.read_exactly(size)
                self.read_until(b"\r\n")
            response.body = body
        elif response.header("Content-Length") is not None:
            response.body = self.read_exactly(int(response.header("Content-Length")))
        else:
            while self._fill():
                pass
            response.body, self.buf = self.buf, b""
        response.elapsed = time.monotonic() - start
        return response

    def request(self, method: str, target: str, headers: list[tuple[str, str]] | dict | None = None,
                body: bytes = b"", raw_headers: bytes = b"") -> Response:
        self.send(build_request(method, target, headers, body, raw_headers))
        return self.read_response(method=method)

    def closed(self, wait: float = TIMEOUT) -> bool:
        """True when the peer closes (EOF or reset) within `wait` seconds, with no more data."""
        if self.buf:
            return False
        self.sock.settimeout(wait)
        try:
            return self.sock.recv(65536) == b""
        except (ConnectionResetError, BrokenPipeError, ssl.SSLError):
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def __enter__(self) -> "Conn":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_request(method: str, target: str, headers: list[tuple[str, str]] | dict | None = None,
                  body: bytes = b"", raw_headers: bytes = b"") -> bytes:
    if isinstance(headers, dict):
        headers = list(headers.items())
    lines = [f"{method} {target} HTTP/1.1".encode("utf-8", "surrogateescape")]
    for name, value in headers or []:
        lines.append(f"{name}: {value}".encode("utf-8", "surrogateescape"))
    if body:
        lines.append(f"Content-Length: {len(body)}".encode())
    data = b"\r\n".join(lines) + b"\r\n" + raw_headers + b"\r\n" + body
    return data


def connect_proxy(gateway: GatewayProcess, timeout: float = TIMEOUT) -> Conn:
    sock = socket.create_connection((gateway.host, gateway.port), timeout=timeout)
    sock.settimeout(timeout)
    return Conn(sock)


def tunnel(gateway: GatewayProcess, authority: str | bytes, timeout: float = TIMEOUT,
           host_header: str | None | bool = True) -> tuple[Conn, Response]:
    """Open a connection to the proxy and send CONNECT; returns the connection and the CONNECT answer."""
    conn = connect_proxy(gateway, timeout)
    raw = authority if isinstance(authority, bytes) else authority.encode("utf-8")
    head = b"CONNECT " + raw + b" HTTP/1.1\r\n"
    if host_header is True:
        head += b"Host: " + raw + b"\r\n"
    elif isinstance(host_header, str):
        head += b"Host: " + host_header.encode() + b"\r\n"
    conn.send(head + b"\r\n")
    response = conn.read_response(head_only=True)
    if response.status != 200 and response.header("Content-Length"):
        response.body = conn.read_exactly(int(response.header("Content-Length")))
    return conn, response


def client_tls_context(gateway: GatewayProcess, alpn: list[str] | None = None, check_hostname: bool = True) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(gateway.ca_cert))
    ctx.check_hostname = check_hostname
    if alpn:
        ctx.set_alpn_protocols(alpn)
    return ctx


def start_tls(conn: Conn, gateway: GatewayProcess, sni: str | None, alpn: list[str] | None = None,
              check_hostname: bool = False) -> Conn:
    """Wrap an established tunnel in TLS, sending `sni` (None: no SNI extension at all)."""
    ctx = client_tls_context(gateway, alpn, check_hostname=check_hostname and sni is not None)
    if sni is None:
        ctx.check_hostname = False
    tls = ctx.wrap_socket(conn.sock, server_hostname=sni)
    tls.settimeout(conn.sock.gettimeout())
    assert not conn.buf
    return Conn(tls)


def tls_tunnel(gateway: GatewayProcess, authority: str, sni: str | None | bool = True,
               alpn: list[str] | None = None) -> Conn:
    """CONNECT (must succeed) and TLS inside; sni=True uses the CONNECT host name."""
    conn, response = tunnel(gateway, authority)
    assert response.status == 200, (response, gateway.log()[-3000:])
    if sni is True:
        sni = authority.rsplit(":", 1)[0]
    return start_tls(conn, gateway, sni, alpn)


def get(conn: Conn, path: str, host: str | None, method: str = "GET", extra: list[tuple[str, str]] | None = None,
        body: bytes = b"") -> Response:
    headers = [("Host", host)] if host is not None else []
    return conn.request(method, path, headers + (extra or []), body)


# --------------------------------------------------------------------------------------------
# curl


@dataclass
class CurlResult:
    status: int  # 0 when curl got no HTTP response from the origin (e.g. CONNECT refused)
    http_version: str
    body: str
    headers: list[tuple[str, str]]  # of the last response curl saw (the CONNECT answer if it failed)
    returncode: int
    stderr: str

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None

    @property
    def connect_status(self) -> int | None:
        """The status of a refused CONNECT, as curl reports it."""
        import re

        match = re.search(r"CONNECT tunnel failed, response (\d{3})", self.stderr) or re.search(
            r"Received HTTP code (\d{3}) from proxy after CONNECT", self.stderr
        )
        return int(match.group(1)) if match else None


def curl(gateway: GatewayProcess, url: str, *args: str, proxy: bool = True) -> CurlResult:
    """curl through the gateway (trusting its CA), returning status, version, body and headers."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        head, body = Path(tmp) / "head", Path(tmp) / "body"
        cmd = ["curl", "-sS", "--max-time", "10", "--cacert", str(gateway.ca_cert), "-D", str(head), "-o", str(body),
               "-w", "%{http_code} %{http_version}"]
        if proxy:
            cmd += ["-x", gateway.proxy_url]
        cmd += [url, *args]
        out = subprocess.run(cmd, capture_output=True, timeout=30)
        code, _, version = out.stdout.decode().strip().partition(" ")
        text = head.read_text("latin-1") if head.exists() else ""
        blocks = [b for b in text.replace("\r\n", "\n").split("\n\n") if b.strip()]
        headers: list[tuple[str, str]] = []
        if blocks:
            for line in blocks[-1].split("\n")[1:]:
                name, _, value = line.partition(":")
                headers.append((name.strip(), value.strip()))
        return CurlResult(int(code or 0), version, body.read_text("utf-8", "replace") if body.exists() else "",
                          headers, out.returncode, out.stderr.decode("utf-8", "replace"))


# --------------------------------------------------------------------------------------------
# HTTP/2


def new_entry() -> dict:
    """What an `H2Client` records of one stream's answer."""
    return {"status": None, "interim": [], "headers": [], "body": b"", "trailers": [], "done": False, "reset": False}


class H2Client:
    """An HTTP/2 client connection (h2 library) over a TLS tunnel that negotiated ALPN h2."""

    def __init__(self, conn: Conn):
        import h2.config
        import h2.connection

        assert conn.sock.selected_alpn_protocol() == "h2", conn.sock.selected_alpn_protocol()
        self.conn = conn
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8",
                                                                        validate_outbound_headers=False,
                                                                        normalize_outbound_headers=False))
        self.h2.initiate_connection()
        self._flush()
        self.responses: dict[int, dict] = {}

    def _flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.conn.sock.sendall(data)

    def send(self, authority: str, path: str = "/", method: str = "GET",
             extra: list[tuple[str, str]] | None = None, body: bytes | None = None) -> int:
        """Open a stream; `body` (even b""): HEADERS without END_STREAM, then one DATA frame ending it."""
        stream_id = self.h2.get_next_available_stream_id()
        headers = [(":method", method), (":scheme", "https"), (":authority", authority), (":path", path)]
        self.h2.send_headers(stream_id, headers + (extra or []), end_stream=body is None)
        if body is not None:
            self.h2.send_data(stream_id, body, end_stream=True)
        self._flush()
        self.responses[stream_id] = new_entry()
        return stream_id

    def wait(self, *stream_ids: int, timeout: float = TIMEOUT) -> None:
        """Read until every one of `stream_ids` has ended (or was reset)."""
        self._read_until(lambda: all(self.responses[s]["done"] for s in stream_ids), stream_ids, timeout)

    def wait_interim(self, *stream_ids: int, timeout: float = TIMEOUT) -> None:
        """Read until every one of `stream_ids` has had an interim (1xx) answer or has ended: a
        `100 Continue` is sent once the request's head is decided and its stream goes on."""
        self._read_until(lambda: all(self.responses[s].get("interim") or self.responses[s]["done"] for s in stream_ids),
                         stream_ids, timeout)

    def _read_until(self, done, stream_ids, timeout: float) -> None:
        import h2.events

        deadline = time.monotonic() + timeout
        idle = self.conn.sock.gettimeout()
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"h2 streams {stream_ids} not there: {self.responses}")
            # `timeout` bounds the wait, not the socket's own per-read timeout (3 s: a body of
            # 200,000 one-byte frames buffered by the gateway on a loaded machine went quiet longer).
            self.conn.sock.settimeout(max(idle or 0.0, left) if idle is not None else None)
            try:
                data = self.conn.sock.recv(65536)
            finally:
                self.conn.sock.settimeout(idle)
            if not data:
                raise ConnectionError(f"connection closed; streams so far: {self.responses}")
            for event in self.h2.receive_data(data):
                sid = getattr(event, "stream_id", None)
                entry = self.responses.get(sid)
                if isinstance(event, h2.events.ResponseReceived) and entry is not None:
                    entry["headers"] = [(k, v) for k, v in event.headers]
                    entry["status"] = int(dict(event.headers)[":status"])
                elif isinstance(event, h2.events.InformationalResponseReceived) and entry is not None:
                    entry.setdefault("interim", []).append(int(dict(event.headers)[":status"]))
                elif isinstance(event, h2.events.TrailersReceived) and entry is not None:
                    entry["trailers"] = [(k, v) for k, v in event.headers]
                elif isinstance(event, h2.events.DataReceived) and entry is not None:
                    entry["body"] += event.data
                    self.h2.acknowledge_received_data(event.flow_controlled_length, sid)
                elif isinstance(event, h2.events.StreamEnded) and entry is not None:
                    entry["done"] = True
                elif isinstance(event, h2.events.StreamReset) and entry is not None:
                    entry["done"] = entry["reset"] = True
                elif isinstance(event, h2.events.ConnectionTerminated):
                    raise ConnectionError(f"GOAWAY {event}; streams so far: {self.responses}")
            self._flush()

    def header(self, stream_id: int, name: str) -> str | None:
        for k, v in self.responses[stream_id]["headers"]:
            if k.lower() == name.lower():
                return v
        return None


# --------------------------------------------------------------------------------------------
# a hostile upstream


class ScriptedUpstream(TcpOrigin):
    """A plain TCP server that answers every connection's first request head with fixed bytes,
    holds the connection for `HOLD` seconds (the peer reads the answer at its own pace), then closes.

    Used for upstream misbehaviour the recording servers never show, such as an unsolicited
    `101 Switching Protocols` followed by raw bytes."""

    timeout = 5.0
    HOLD = 1.0

    def __init__(self, host: str, answer: bytes, port: int = 0):
        self.answer = answer
        self._held = threading.Event()  # set by stop(): a held connection closes at once
        super().__init__(host, port)

    @property
    def heads(self) -> list[bytes]:
        return self.recorder.entries

    def handle(self, conn: socket.socket, number: int) -> None:
        got = read_head(conn)
        if got is None:
            return
        self.recorder.add(got[0])
        conn.sendall(self.answer)
        self._held.wait(self.HOLD)  # a hold window, not a synchronisation

    def stop(self) -> None:
        self._held.set()
        super().stop()
