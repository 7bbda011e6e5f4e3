"""Fuzzing the gateway's front door: random bytes and mutated requests sent to a real gateway's proxy
port (one gateway process for the module).

The policy allows exactly one thing: `GET http://allowed.test:80/ok` (rule `only`). Recording
upstreams listen for every other name (other.test, api.test, deep.wild.test, and allowed.test's TLS
port). The gateway's DNS is isolated to a loopback resolver that records queries (root only;
without root the gateway runs unisolated, which is still safe: only allowed.test, a static host,
can ever be allowed, and nothing is resolved before a request is allowed).

Properties, checked after every example:
- no crash: the gateway process is alive (and at the end of each test it still answers a valid
  request and logged no crashed layer, failed-closed hook or traceback);
- no hang: every connection gets an answer or a close; one that is silent after the payload is
  kept and must be answered or closed within `tcp_timeout` (2 s here) plus 2 s;
- no allow for anything not allowed: every 2xx the client sees is the CONNECT answer for
  allowed.test:80 or the allowed.test upstream's own answer; every allow in the audit log is for
  exactly the allowed host, port, method and path; every request an upstream received is that;
- no upstream connection for a refusal: the other upstreams are never touched, allowed.test's plain
  server never has more connections than there were allow decisions, every request it received has
  its allow line, and no name was looked up in DNS.
"""

from __future__ import annotations

import collections
import json
import posixpath
import re
import socket
import time
from dataclasses import dataclass, field
from urllib.parse import unquote

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gateway.hostnames import HostError, parse_authority
from gateway.paths import PathError, normalise_path
from tests.e2e.helpers import connect_proxy, get
from tests.faults.harness import can_isolate_dns, log_problems, make_gateway, shared_loopback_dns

from .conftest import fuzz_settings

RULES = """
- id: only
  hosts: [allowed.test]
  schemes: [http]
  methods: [GET]
  paths: [/ok]
"""
TCP_TIMEOUT = 2
FIRST_BYTE_WAIT = 0.1  # longer silence: the connection is parked, and read and judged at the end
QUIET = 0.04  # after the last byte received, this much silence ends the exchange


# --------------------------------------------------------------------------------------------
# the oracle


def independent_path(path: str) -> str:
    """A normalisation written without gateway.paths: decode (repeatedly), backslashes, ;params,
    empty and dot segments."""
    p = path.split("?", 1)[0].split("#", 1)[0]
    for _ in range(5):
        p = unquote(p)
    p = p.replace("\\", "/")
    p = "/".join(segment.split(";", 1)[0] for segment in p.split("/"))
    p = re.sub("/+", "/", p)
    return posixpath.normpath(p) if p.startswith("/") else p


def is_the_allowed_path(path: str | None) -> bool:
    if not path:
        return False
    try:
        ours = normalise_path(path)
    except PathError:
        return False
    return ours == "/ok" and independent_path(path) == "/ok"


def names_allowed_test(value: str) -> bool:
    try:
        host, port = parse_authority(value, 80)
    except HostError:
        return False
    return (host.value, port) == ("allowed.test", 80)


@dataclass
class FrontDoor:
    gateway: object
    upstreams: object
    dns: object
    audit_offset: int = 0
    allows: int = 0
    parked: list = field(default_factory=list)  # (socket, payload, sent at)
    examples: int = 0
    allowed_paths: set = field(default_factory=set)  # paths of the allowed requests in the audit log
    stats: collections.Counter = field(default_factory=collections.Counter)

    # --- one example ------------------------------------------------------------------------

    def exchange(self, payload: bytes) -> None:
        self.examples += 1
        sock = socket.create_connection((self.gateway.host, self.gateway.port), timeout=5)
        sent_at = time.monotonic()
        try:
            sock.sendall(payload)
        except OSError:
            pass  # the gateway may close early (a refusal before the whole payload arrived)
        data, closed = self._read(sock)
        self.stats[("parked" if not data and not closed else "closed" if closed else "answered")] += 1
        if not data and not closed:
            self.parked.append((sock, payload, sent_at))
        else:
            sock.close()
        self.check_answers(data, payload)
        self.check_invariants(payload)

    @staticmethod
    def _read(sock: socket.socket) -> tuple[bytes, bool]:
        data = b""
        wait = FIRST_BYTE_WAIT
        while True:
            sock.settimeout(wait)
            try:
                chunk = sock.recv(1 << 20)
            except (TimeoutError, socket.timeout):
                return data, False
            except OSError:
                return data, True
            if not chunk:
                return data, True
            data += chunk
            wait = QUIET

    def check_answers(self, data: bytes, payload: bytes) -> None:
        for match in re.finditer(rb"HTTP/1\.[01] (\d{3})([^\r\n]*)\r\n((?:[^\r\n]*\r\n)*?)\r\n", data):
            status, reason, head = int(match.group(1)), match.group(2), match.group(3)
            if not 200 <= status < 300:
                continue
            upstream = re.search(rb"(?im)^X-Upstream: *(\S+)", head)
            if upstream is None:
                assert reason.strip().lower() == b"connection established", (
                    f"a 2xx that is neither a CONNECT answer nor an upstream's: {match.group(0)!r}; sent {payload!r}")
            else:
                assert upstream.group(1) == b"allowed.test", (match.group(0), payload)

    def check_invariants(self, payload: bytes) -> None:
        gateway, upstreams = self.gateway, self.upstreams
        assert gateway.process.poll() is None, f"the gateway died after {payload!r}:\n{gateway.log()[-3000:]}"
        # every new audit line: an allow is for exactly the allowed destination
        with open(gateway.audit_path, "rb") as f:
            f.seek(self.audit_offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.audit_offset += len(complete)
        for line in complete.splitlines():
            record = json.loads(line)
            if record["decision"] != "allow":
                continue
            if record["event"] == "connect":
                assert (record["host"], record["port"], record["rule"]) == ("allowed.test", 80, "only"), record
            else:
                assert record["event"] == "request", record
                assert (record["host"], record["port"], record["scheme"], record["method"], record["rule"]) == (
                    "allowed.test", 80, "http", "GET", "only"), (record, payload)
                assert is_the_allowed_path(record["path"]), (record, payload)
                self.allows += 1
                self.allowed_paths.add(record["path"])
        # the upstreams: nothing but the allowed request, never more connections than allows
        for name in ("other.test", "api.test", "deep.wild.test"):
            assert upstreams.untouched(name), (name, payload)
        assert not upstreams.tls["allowed.test"].touched, payload
        plain = upstreams.plain["allowed.test"]
        for received in plain.requests:
            hosts = [v for k, v in received.headers if k.lower() == "host"]
            assert received.method == "GET" and is_the_allowed_path(received.path), (received, payload)
            assert len(hosts) <= 1 and all(names_allowed_test(h) for h in hosts), (received.headers, payload)
        assert plain.connections <= self.allows + 1, (plain.connections, self.allows, payload)  # +1: in flight
        if self.dns is not None:
            assert self.dns.queries == [], (self.dns.queries, payload)

    # --- after a test -------------------------------------------------------------------------

    def finish(self) -> None:
        """Parked connections were closed or answered in time; the gateway still serves; its log
        shows no internal failure; every request the upstream got has its allow line."""
        for server in self.upstreams.all():
            server.settle()  # a connection still in an accept queue counts too
        self.check_invariants(b"<end>")
        plain = self.upstreams.plain["allowed.test"]
        missing = [r.path for r in plain.requests if r.path not in self.allowed_paths]
        assert not missing, f"forwarded without an allow line: {missing}"
        hung = []
        for sock, payload, sent_at in self.parked:
            data, closed = b"", False
            while not closed:
                left = sent_at + TCP_TIMEOUT + 2 - time.monotonic()
                sock.settimeout(max(left, 0.01))  # past the deadline: only what is already there
                try:
                    chunk = sock.recv(1 << 20)
                except (TimeoutError, socket.timeout):
                    break
                except OSError:
                    chunk = b""
                data += chunk
                closed = not chunk
            sock.close()
            if not data and not closed:
                hung.append(payload)
            self.check_answers(data, payload)
        self.parked.clear()
        assert not hung, f"{len(hung)} connection(s) neither answered nor closed: {hung[:3]!r}"
        with connect_proxy(self.gateway) as conn:
            assert get(conn, "http://allowed.test/ok?final", "allowed.test").status == 200
        self.allows += 1
        self.allowed_paths.add("/ok?final")
        assert log_problems(self.gateway.log()) == [], "\n".join(log_problems(self.gateway.log())[:80])
        print(f"front door: {self.examples} exchanges so far, {dict(self.stats)}, {self.allows} allowed")


@pytest.fixture(scope="module")
def front(tmp_path_factory, upstreams, pki):
    dns = None
    if can_isolate_dns():
        dns = shared_loopback_dns(f"{upstreams.block}.153")  # .53 belongs to tests/faults
    gateway = make_gateway(tmp_path_factory.mktemp("front-door"), upstreams, pki, RULES, dns=dns, args=[
        "--set", f"tcp_timeout={TCP_TIMEOUT}", "--set", "egress_max_connections_per_sandbox=0",
        "--set", "egress_max_new_connections_per_second_per_sandbox=0",
        "--set", "egress_max_requests_per_second_per_sandbox=0"])
    upstreams.reset()
    if dns is not None:
        dns.reset()
    yield FrontDoor(gateway, upstreams, dns)
    gateway.stop()


# --------------------------------------------------------------------------------------------
# inputs

TEMPLATES = [
    b"GET http://allowed.test/ok?e=ID HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    b"CONNECT allowed.test:80 HTTP/1.1\r\nHost: allowed.test:80\r\n\r\nGET /ok?e=ID HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    b"GET http://allowed.test/ok?e=ID HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
    b"GET http://allowed.test/admin?e=ID HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
    b"GET http://api.test/ok?e=ID HTTP/1.1\r\nHost: api.test\r\n\r\n",
    b"POST http://allowed.test/ok?e=ID HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 5\r\n\r\nhello",
    b"POST http://allowed.test/ok?e=ID HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"GET http://allowed.test/ok?e=ID HTTP/1.0\r\n\r\n",
    b"GET http://other.test/ok?e=ID HTTP/1.1\r\nHost: other.test\r\n\r\n",
    b"CONNECT other.test:443 HTTP/1.1\r\nHost: other.test:443\r\n\r\n",
    b"GET http://allowed.test:80/ok?e=ID HTTP/1.1\r\nHost: allowed.test:80\r\nConnection: keep-alive\r\nAccept: */*\r\n\r\n",
    b"GET http://allowed.test/ok?e=ID HTTP/1.1\r\nHost: allowed.test\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
    b"CONNECT allowed.test:80 HTTP/1.1\r\n\r\nGET /ok?e=ID HTTP/1.1\r\nHost: other.test\r\n\r\n",
    b"GET /ok?e=ID HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    b"CONNECT allowed.test:443 HTTP/1.1\r\n\r\n",
]
TUNNEL = b"CONNECT allowed.test:80 HTTP/1.1\r\nHost: allowed.test:80\r\n\r\n"
INNER = [
    b"GET /ok?e=ID HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    b"GET /ok?e=ID HTTP/1.1\r\nHost: allowed.test\r\n\r\nGET /admin?e=ID HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    b"GET http://allowed.test/ok?e=ID HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    b"GET http://other.test/ok?e=ID HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    b"HEAD /ok?e=ID HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    b"CONNECT other.test:80 HTTP/1.1\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"\x16\x03\x01\x00\x2a\x01\x00\x00\x26\x03\x03" + b"\x00" * 32,
]
INSERTS = [b"\r", b"\n", b"\x00", b" ", b"\t", b"\r\n", b":", b"\r\n\r\n", b"%00", b"@", b"#", b"\\", b"..", b"%2e%2e/",
           b"Host: other.test\r\n", b"Host: allowed.test\r\n", b"Content-Length: 3\r\n", b"Content-Length: -1\r\n",
           b"Transfer-Encoding: chunked\r\n", b"Transfer-Encoding: identity\r\n", b"Upgrade: h2c\r\n",
           b"HTTP2-Settings: AAMAAABkAAQAAP__\r\n", b"\xff", b"\x80", "é".encode(), "ＡＢ".encode(), b"\x16\x03\x01",
           b"Expect: 100-continue\r\n", b"Connection: close\r\n", b"X-Forwarded-Host: other.test\r\n"]
HOST_SWAPS = [b"other.test", b"allowed.test.", b"ALLOWED.TEST", b"allowed.test:443", b"allowed.test@other.test",
              b"other.test#.allowed.test", b"[::1]", b"127.0.0.1", b"0x7f.1", b"allowed.test%00", b"xn--allowed-ykb.test",
              b"allowed.test:0080", b"allowed.test:8o", b"api.test", b"allowed.test\\@other.test", b"\xd0\xb0llowed.test"]
PATH_SWAPS = [b"/ok/", b"/./ok", b"/x/../ok", b"/%6fk", b"/%2e%2e/ok", b"//ok", b"/OK", b"/ok;x", b"/ok%00", b"/ok\\..\\admin",
              b"/%252e%252e/admin", b"/ok/..", b"/admin/..%2fok", b"*", b"ok", b"/ok#frag", b"/ok?a=%zz"]


@st.composite
def mutations(draw, base: bytes) -> bytes:
    data = base.replace(b"ID", str(draw(st.integers(0, 10**6))).encode())
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "delete", "dup-line", "case", "insert", "huge", "host", "path",
                                   "lf-only", "repeat"]))
        n = len(data)
        at = draw(st.integers(0, max(0, n - 1)))
        if op == "flip" and n:
            data = data[:at] + bytes([data[at] ^ (1 << draw(st.integers(0, 7)))]) + data[at + 1:]
        elif op == "truncate":
            data = data[: draw(st.integers(0, n))]
        elif op == "delete" and n:
            data = data[:at] + data[at + draw(st.integers(1, 12)):]
        elif op == "dup-line":
            lines = data.split(b"\r\n")
            i = draw(st.integers(0, len(lines) - 1))
            lines.insert(i, lines[i])
            data = b"\r\n".join(lines)
        elif op == "case" and n:
            end = min(n, at + draw(st.integers(1, 30)))
            data = data[:at] + data[at:end].swapcase() + data[end:]
        elif op == "insert":
            data = data[:at] + draw(st.sampled_from(INSERTS)) + data[at:]
        elif op == "huge":
            size = draw(st.sampled_from([1000, 9000, 70000, 200000]))
            data = data[:at] + b"A" * size + data[at:]
        elif op == "host":
            data = data.replace(b"allowed.test", draw(st.sampled_from(HOST_SWAPS)), draw(st.integers(1, 2)))
        elif op == "path":
            data = re.sub(rb"/ok(?=\?)", lambda _: draw(st.sampled_from(PATH_SWAPS)), data, count=1)
        elif op == "lf-only":
            data = data.replace(b"\r\n", b"\n", draw(st.integers(1, 3)))
        elif op == "repeat":
            data = data * draw(st.integers(2, 4))
    return data


RANDOM_BYTES = st.one_of(
    st.binary(max_size=2048),
    st.binary(max_size=512).map(lambda b: b"GET " + b),
    st.binary(max_size=512).map(lambda b: b"CONNECT " + b),
    st.binary(max_size=512).map(lambda b: b"GET http://allowed.test/ok HTTP/1.1\r\n" + b + b"\r\n\r\n"),
    st.binary(max_size=512).map(lambda b: b + b"\r\n\r\n"),
    st.lists(st.sampled_from([b"GET", b"CONNECT", b" ", b"http://", b"allowed.test", b"other.test", b":80", b"/ok",
                              b"HTTP/1.1", b"\r\n", b"Host:", b"\x00", b"\n", b"\r\n\r\n"]), max_size=30).map(b"".join),
)


# --------------------------------------------------------------------------------------------
# the tests


def test_random_bytes(front):
    @fuzz_settings(150)
    @given(RANDOM_BYTES)
    @example(b"")
    @example(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
    @example(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    @example(b"SSH-2.0-OpenSSH_9.6\r\n")
    def run(payload):
        front.exchange(payload)

    run()
    front.finish()


def test_mutated_requests(front):
    @fuzz_settings(300)
    @given(st.sampled_from(TEMPLATES).flatmap(mutations))
    @example(TEMPLATES[0].replace(b"ID", b"0"))
    @example(TEMPLATES[1].replace(b"ID", b"1"))
    def run(payload):
        front.exchange(payload)

    run()
    front.finish()


def test_mutated_requests_inside_an_allowed_tunnel(front):
    @fuzz_settings(150)
    @given(st.one_of(st.sampled_from(INNER).flatmap(mutations), st.binary(max_size=512)))
    @example(INNER[0].replace(b"ID", b"2"))
    def run(inner):
        front.exchange(TUNNEL + inner)

    run()
    front.finish()
