"""A closed two-namespace network for tests that must name non-loopback addresses.

Topology (both namespaces are created here and deleted at the end; neither has a default route
nor any link to the host namespace, so nothing sent inside can leave the machine):

    [gateway ns]  lo: 127.0.0.1, 93.184.216.1 (an address of the gateway itself)
        veth GW_IF 10.200.0.1/30, fd99::1/64
            |   (a veth pair between the two test namespaces, nothing else)
        veth UP_IF 10.200.0.2/30, fd99::2/64, fe80::5/64
    [upstream ns] lo: every upstream address (metadata, private, CGNAT, "public-looking", ...)

The gateway process and the test client live in the gateway namespace, the recording upstreams in
the upstream namespace (so that the upstream addresses are not the gateway's own addresses), with
one host route per upstream address through the veth. Python sockets are put into a namespace by
switching only the calling thread (`os.setns`) while the socket is created; a socket keeps its
namespace for life.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import socket
import ssl
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from bench.lib.closed_net import link_pair
from tests.support.fence import AcceptFence
from tests.support.netns import thread_inside
from tests.support.tcp_origin import start_accepting
from tests.support.upstream import RecordingUpstream

NETNS_DIR = Path("/var/run/netns")
ETC_NETNS = Path("/etc/netns")

GW_V4, UP_V4 = "10.200.0.1", "10.200.0.2"
GW_V6, UP_V6 = "fd99::1", "fd99::2"
GATEWAY_OWN = "93.184.216.1"  # an address of the gateway's namespace that is in no deny range


def run_ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")


def netns_unavailable_reason() -> str | None:
    """None when this process can create network namespaces with `ip netns`; else why not."""
    if not hasattr(os, "setns"):
        return "os.setns is unavailable (needs Python 3.12 on Linux)"
    if os.geteuid() != 0:
        return "network namespace tests need root"
    if shutil.which("ip") is None:
        return "iproute2 `ip` is not installed"
    probe = f"egwprobe{os.getpid()}x{secrets.token_hex(3)}"
    try:
        run_ip("netns", "add", probe)
    except (RuntimeError, OSError) as exc:
        return f"`ip netns add` does not work here: {exc}"
    try:
        run_ip("netns", "del", probe)
    except RuntimeError:
        pass
    return None


class AcceptCounter:
    """A bare listener that only counts TCP connections (for addresses RecordingUpstream cannot bind,
    e.g. an IPv6 link-local address, which needs a scope id)."""

    def __init__(self, name: str, sockaddr: tuple):
        self.name = name
        self.host = sockaddr[0]
        self.sockaddr = sockaddr
        self.connections = 0
        self._fence = AcceptFence()
        self._sock = socket.socket(socket.AF_INET6 if ":" in sockaddr[0] else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(sockaddr)
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self._stopped = False
        start_accepting(self._sock, None, lambda: self._stopped, self._count)

    def _count(self, conn: socket.socket, addr) -> bool:
        """Counted and closed at once (a fence's probe is not counted): nothing more to handle."""
        if not self._fence.claims(conn, addr):
            self.connections += 1
            conn.close()
        return False

    def settle(self, timeout: float = 5.0) -> None:
        """A fence (tests.support.fence): every connection queued before the call is counted."""
        self._fence.settle(self.sockaddr, timeout)

    @property
    def touched(self) -> bool:
        return self.connections > 0

    @property
    def requests(self) -> list:
        return []

    def reset(self) -> None:
        self.connections = 0

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


@dataclass
class Lab:
    pki: object  # bench.lib.pki.TestPKI
    tag: str = field(default_factory=lambda: f"{os.getpid()}x{secrets.token_hex(2)}")

    def __post_init__(self) -> None:
        self.gw = f"egw{self.tag}g"
        self.up = f"egw{self.tag}u"
        self.gw_if = f"vg{self.tag}"[:15]
        self.up_if = f"vu{self.tag}"[:15]
        self.upstreams: dict[tuple[str, int], RecordingUpstream | AcceptCounter] = {}
        self.forbidden: set[tuple[str, int]] = set()
        self.namespace_of: dict[tuple[str, int], str] = {}  # (address, port) -> the upstream's namespace
        self._created: list[str] = []
        self._routed: set[str] = set()

    # -- namespaces ------------------------------------------------------------------------------

    def create(self) -> "Lab":
        for ns in (self.gw, self.up):
            run_ip("netns", "add", ns)
            self._created.append(ns)
        link_pair((self.gw, self.gw_if, GW_V4, GW_V6), (self.up, self.up_if, UP_V4, UP_V6))
        run_ip("-n", self.gw, "addr", "add", f"{GATEWAY_OWN}/32", "dev", "lo")
        self.check_closed()
        # Name resolution inside the gateway namespace: `ip netns exec` bind-mounts these over
        # /etc/hosts and /etc/resolv.conf; the resolver points at the namespace's own loopback,
        # where nothing listens, so a name missing from the hosts file fails at once.
        etc = ETC_NETNS / self.gw
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        self.write_hosts("")
        return self

    def check_closed(self) -> None:
        """Refuse to go on if either namespace had a way off the machine."""
        for ns in (self.gw, self.up):
            for family in ("-4", "-6"):
                routes = subprocess.run(["ip", "-n", ns, family, "route", "show", "table", "all"],
                                        capture_output=True, text=True).stdout
                for line in routes.splitlines():
                    if line.startswith("default") or " default " in f" {line} ":
                        raise RuntimeError(f"namespace {ns} has a default route: {line}")
            links = subprocess.run(["ip", "-n", ns, "-o", "link"], capture_output=True, text=True).stdout
            for line in links.splitlines():
                name = line.split(":")[1].strip().split("@")[0]
                if name not in ("lo", self.gw_if, self.up_if):
                    raise RuntimeError(f"namespace {ns} has an unexpected link {name!r}")

    def write_hosts(self, text: str) -> None:
        (ETC_NETNS / self.gw / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n" + text)

    def destroy(self) -> None:
        for server in self.upstreams.values():
            with contextlib.suppress(Exception):
                server.stop()
        for ns in reversed(self._created):
            with contextlib.suppress(RuntimeError):
                run_ip("netns", "del", ns)
        shutil.rmtree(ETC_NETNS / self.gw, ignore_errors=True)
        with contextlib.suppress(OSError):
            ETC_NETNS.rmdir()  # only if empty (another run may still use it)

    @contextlib.contextmanager
    def inside(self, ns: str):
        """Run the block with this thread in namespace `ns`; sockets created here stay there."""
        with thread_inside(NETNS_DIR / ns):
            yield

    def assert_thread_in(self, ns: str) -> None:
        here = os.stat("/proc/thread-self/ns/net")
        there = os.stat(NETNS_DIR / ns)
        if (here.st_dev, here.st_ino) != (there.st_dev, there.st_ino):
            raise AssertionError(f"refusing to open a socket outside namespace {ns}")

    # -- addresses and upstreams -----------------------------------------------------------------

    def _add_address(self, ns: str, address: str) -> None:
        ip = ipaddress.ip_address(address)
        if ip.version == 4:
            run_ip("-n", ns, "addr", "add", f"{address}/32", "dev", "lo")
        else:
            run_ip("-n", ns, "-6", "addr", "add", f"{address}/128", "dev", "lo", "nodad")

    def _route(self, address: str) -> None:
        if address in self._routed:
            return
        ip = ipaddress.ip_address(address)
        if ip.version == 4:
            run_ip("-n", self.gw, "route", "add", f"{address}/32", "via", UP_V4)
        else:
            run_ip("-n", self.gw, "-6", "route", "add", f"{address}/128", "via", UP_V6)
        self._routed.add(address)

    def serve(self, address: str, *, names: list[str], forbidden: bool, ports=(443, 80),
              in_gateway_ns: bool = False) -> None:
        """Recording upstreams (TLS on 443, plain HTTP on 80) on `address` in the upstream namespace
        (or the gateway's own namespace), reachable from the gateway through the veth."""
        ns = self.gw if in_gateway_ns else self.up
        if not in_gateway_ns:
            self._add_address(ns, address)
            self._route(address)
        cert, key = self.pki.issue(names, [address], stem=f"{names[0]}-{address}".replace(":", "_"))
        with self.inside(ns):
            self.assert_thread_in(ns)
            for port in ports:
                tls = port == 443
                server = RecordingUpstream(names[0], address, port, cert if tls else None, key if tls else None)
                self.upstreams[(address, port)] = server
                self.namespace_of[(address, port)] = ns
                if forbidden:
                    self.forbidden.add((address, port))

    def serve_link_local(self, address: str, name: str, ports=(443, 80)) -> None:
        """Accept counters on an IPv6 link-local address of the upstream end of the veth."""
        run_ip("-n", self.up, "-6", "addr", "add", f"{address}/64", "dev", self.up_if, "nodad")
        with self.inside(self.up):
            self.assert_thread_in(self.up)
            scope = socket.if_nametoindex(self.up_if)
            for port in ports:
                self.upstreams[(address, port)] = AcceptCounter(name, (address, port, 0, scope))
                self.namespace_of[(address, port)] = self.up
                self.forbidden.add((address, port))

    def upstream(self, address: str, port: int) -> RecordingUpstream:
        return self.upstreams[(address, port)]

    def reset(self) -> None:
        for server in self.upstreams.values():
            server.reset()

    def settle(self) -> None:
        """Fence every upstream in its namespace (tests.support.fence): a connection still in an
        accept queue is counted before anything is asserted."""
        for key, server in self.upstreams.items():
            with self.inside(self.namespace_of[key]):
                server.settle()

    def touched_forbidden(self) -> list[str]:
        """Forbidden upstreams that saw anything (a connection still queued included)."""
        self.settle()
        return sorted(f"{a}:{p} ({s.connections} conn, {len(s.requests)} req)"
                      for (a, p), s in self.upstreams.items() if (a, p) in self.forbidden and s.touched)

    def touched_any(self) -> list[str]:
        self.settle()
        return sorted(f"{a}:{p}" for (a, p), s in self.upstreams.items() if s.touched)

    def free_port(self, host: str) -> int:
        with self.inside(self.gw):
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                s.bind((host, 0))
                return s.getsockname()[1]


# -- a raw HTTP client that only ever opens sockets inside the gateway namespace -----------------


@dataclass
class Reply:
    status: int
    reason_phrase: str
    headers: dict[str, str]
    body: bytes

    @property
    def egress_reason(self) -> str | None:
        return self.headers.get("x-egress-reason")

    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


def _read_head(sock) -> tuple[int, str, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"connection closed before a full response head: {data!r}")
        data += chunk
        if len(data) > 1 << 20:
            raise ConnectionError("response head too long")
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    status = int(parts[1])
    phrase = parts[2] if len(parts) > 2 else ""
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, phrase, headers, rest


def read_response(sock, *, head_only: bool = False) -> Reply:
    status, phrase, headers, rest = _read_head(sock)
    if head_only:
        return Reply(status, phrase, headers, rest)
    if "content-length" in headers:
        want = int(headers["content-length"])
        while len(rest) < want:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        body = rest[:want]
    else:
        body = rest
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionError, ssl.SSLError):
                break
            if not chunk:
                break
            body += chunk
    return Reply(status, phrase, headers, body)


@dataclass
class Client:
    lab: Lab
    gateway: object  # tests.support.gateway.GatewayProcess
    timeout: float = 10.0

    def _connect(self) -> socket.socket:
        with self.lab.inside(self.lab.gw):
            self.lab.assert_thread_in(self.lab.gw)
            # mitmproxy's block_global refuses clients with public-looking source addresses; a
            # gateway listening on such an address is reached from the private veth address.
            host = ipaddress.ip_address(self.gateway.host)
            source = None if host.is_loopback or host.is_unspecified else (GW_V4, 0)
            sock = socket.create_connection((self.gateway.host, self.gateway.port), timeout=self.timeout,
                                            source_address=source)
        return sock

    def connect_tunnel(self, authority: str) -> tuple[Reply, socket.socket]:
        """Send CONNECT authority; return the reply and the (still open) socket."""
        sock = self._connect()
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        status, phrase, headers, rest = _read_head(sock)
        body = rest
        if status != 200 and "content-length" in headers:
            want = int(headers["content-length"])
            while len(body) < want:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                body += chunk
        return Reply(status, phrase, headers, body), sock

    def connect_only(self, authority: str) -> Reply:
        reply, sock = self.connect_tunnel(authority)
        sock.close()
        return reply

    def https_get(self, authority: str, server_name: str, path: str = "/") -> tuple[Reply, Reply | None]:
        """CONNECT, TLS with the gateway's CA and SNI `server_name`, then GET path."""
        connect_reply, sock = self.connect_tunnel(authority)
        if connect_reply.status != 200:
            sock.close()
            return connect_reply, None
        context = ssl.create_default_context(cafile=str(self.gateway.ca_cert))
        context.set_alpn_protocols(["http/1.1"])
        with context.wrap_socket(sock, server_hostname=server_name) as tls:
            tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode())
            reply = read_response(tls)
        return connect_reply, reply

    def absolute_get(self, url: str, host_header: str) -> Reply:
        """A plain-HTTP absolute-form request (`GET http://host/path`) to the proxy port."""
        sock = self._connect()
        try:
            sock.sendall(f"GET {url} HTTP/1.1\r\nHost: {host_header}\r\nConnection: close\r\n\r\n".encode())
            return read_response(sock)
        finally:
            sock.close()


def audit_since(gateway, mark: int) -> list[dict]:
    """Audit lines written after `mark` (a previous len(gateway.audit()))."""
    return gateway.audit()[mark:]


def assert_refused(lab: Lab, reply: Reply, reason: str, status: int = 403) -> None:
    """The gateway answered `status` with X-Egress-Reason `reason`, and no upstream at all (forbidden
    or not) saw even a TCP connection."""
    assert reply.status == status, f"expected {status} {reason}, got {reply.status} {reply.headers}\n{reply.text()}"
    assert reply.egress_reason == reason, f"X-Egress-Reason {reply.egress_reason!r}\n{reply.text()}"
    touched = lab.touched_any()
    assert touched == [], f"upstreams reached despite the refusal: {touched}"
