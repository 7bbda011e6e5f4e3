"""The transparent- and DNS-mode tests' world: the closed three-namespace network of
bench/lib/closed_net.py (`ClosedNetwork`, shared with bench/'s transparent group), with the
recorders, the test CA's upstreams and the package index in it (the diagram of the namespaces,
their links and addresses is in closed_net's docstring).

None of the namespaces has a link to the host namespace or a route off the machine (checked by
`check_closed` before any traffic). Python sockets are created inside a namespace by switching
only the calling thread (`os.setns`); a socket keeps its namespace for life. Programs (curl, pip,
python clients) run inside with `ip netns exec`, which also bind-mounts /etc/netns/NS/resolv.conf.
"""

from __future__ import annotations

import contextlib
import hashlib
import base64
import http.server
import io
import ipaddress
import os
import random
import secrets
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from bench.lib.closed_net import (  # noqa: F401  (the network; the tests import its names from here too)
    ETC_NETNS, GW_V4, GW_V6, IN_V4, IN_V6, NETNS_DIR, PROXY_VARS, SANDBOX_NET_SH, TRAP_RESOLVER, ClosedNetwork,
    Sandbox, clean_env, ip, run, unavailable_reason)
from tests.support.fence import AcceptFence, DatagramFence
from tests.support.netns import thread_inside
from tests.support.tcp_origin import start_accepting
from tests.support.upstream import RecordingUpstream
from tests.support.waiting import wait_for

HOSTS = {
    "allowed.test": "93.184.216.34",
    "other.test": "93.184.216.35",
    "tcp.test": "93.184.216.36",
    "tcpname.test": "93.184.216.37",
    "pypi.test": "93.184.216.40",
}
ALLOWED, OTHER, TCP_HOST, TCP_NAMED, PYPI = (HOSTS[n] for n in
                                             ("allowed.test", "other.test", "tcp.test", "tcpname.test", "pypi.test"))
PUBLIC_V6 = "2606:4700::1111"


# -- recorders in the internet namespace ---------------------------------------------------------


class TcpRecorder:
    """Counts TCP connections and records what arrived; echoes it back when `echo` is set."""

    def __init__(self, label: str, host: str, port: int, echo: bool = False):
        self.label = label
        self.host, self.port = host, port
        self.echo = echo
        self.connections = 0
        self.closed = 0  # connections whose gateway side went away (EOF or reset)
        self.received = b""
        self._lock = threading.Lock()
        self._closing = threading.Condition(self._lock)
        self._sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                          backlog=16)
        self._stopped = False
        self._fence = AcceptFence()
        start_accepting(self._sock, self._handle, lambda: self._stopped, self._accepted)

    def _accepted(self, conn: socket.socket, addr) -> bool:
        if self._fence.claims(conn, addr):
            return False
        with self._lock:
            self.connections += 1
        return True

    def _handle(self, conn: socket.socket) -> None:
        try:
            self._relay(conn)
        finally:
            with self._closing:
                self.closed += 1
                self._closing.notify_all()

    def wait_closed(self, n: int = 1, timeout: float = 10.0) -> bool:
        """True once `n` connections have ended here (the gateway closed its side)."""
        with self._closing:
            return self._closing.wait_for(lambda: self.closed >= n, timeout)

    def _relay(self, conn: socket.socket) -> None:
        conn.settimeout(60 if self.echo else 10)
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                with self._lock:
                    self.received += data
                if self.echo:
                    with contextlib.suppress(OSError):
                        conn.sendall(data)
                else:
                    return

    def settle(self) -> None:
        """A fence (tests.support.fence): every connection queued before the call is counted."""
        self._fence.settle((self.host, self.port))

    @property
    def touched(self) -> bool:
        return self.connections > 0 or bool(self.received)

    def reset(self) -> None:
        with self._lock:
            self.connections = 0
            self.closed = 0
            self.received = b""

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class _DatagramRecorder:
    """A datagram socket read on a thread of its own, keeping what `_record` picks from each packet
    in `seen`; a probe of `settle()` (a DatagramFence) is never recorded."""

    def __init__(self, label: str, sock: socket.socket):
        self.label = label
        self.seen: list = []
        self._sock = sock
        self._stopped = False
        self._fence = DatagramFence()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stopped:
            try:
                packet, source = self._sock.recvfrom(65536)
            except OSError:
                return
            if source is None:  # shut down (stop()): a UDP socket then reads b"" from nobody
                return
            if not self._fence.claims(packet):
                self._record(packet, source[0])

    def _record(self, packet: bytes, source: str) -> None:
        raise NotImplementedError

    def _send_probe(self, token: bytes) -> None:
        raise NotImplementedError

    def settle(self) -> None:
        """A fence (tests.support.fence): every packet queued before the call has been read once
        this returns. Call it from the recorder's namespace."""
        self._fence.settle(self._send_probe)

    @property
    def touched(self) -> bool:
        return bool(self.seen)

    @property
    def connections(self) -> int:
        return len(self.seen)

    def reset(self) -> None:
        self.seen.clear()

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class UdpRecorder(_DatagramRecorder):
    """Records every datagram that arrives on host:port (never answers)."""

    def __init__(self, label: str, host: str, port: int):
        self.host, self.port = host, port
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((host, port))
        super().__init__(label, sock)

    @property
    def datagrams(self) -> list[bytes]:
        return self.seen

    def _record(self, packet: bytes, source: str) -> None:
        self.seen.append(packet)

    def _send_probe(self, token: bytes) -> None:
        with socket.socket(self._sock.family, socket.SOCK_DGRAM) as probe:
            probe.sendto(token, (self.host, self.port))


class IcmpRecorder(_DatagramRecorder):
    """Records the sources of ICMP echo requests from the sandboxes (10.203.0.0/16) arriving in a
    namespace (a raw socket sees a copy of every ICMP packet; the kernel still answers them itself).
    Its fence's probe is an echo request to the namespace's own loopback."""

    def __init__(self, label: str):
        super().__init__(label, socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))

    @property
    def sources(self) -> list[str]:
        return self.seen

    def _record(self, packet: bytes, source: str) -> None:
        header = (packet[0] & 0x0F) * 4
        if len(packet) > header and packet[header] == 8 and source.startswith("10.203."):
            self.seen.append(source)

    def _send_probe(self, token: bytes) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as probe:
            probe.sendto(echo_request(random.randrange(65536), token), ("127.0.0.1", 0))


def echo_request(ident: int, payload: bytes) -> bytes:
    """An ICMP echo request (type 8) with its checksum."""
    data = struct.pack("!BBHHH", 8, 0, 0, ident, 1) + payload
    total = 0
    for i in range(0, len(data), 2):
        total += (data[i] << 8) + (data[i + 1] if i + 1 < len(data) else 0)
    total = (total >> 16) + (total & 0xFFFF)
    checksum = ~(total + (total >> 16)) & 0xFFFF
    return struct.pack("!BBHHH", 8, 0, checksum, ident, 1) + payload


def icmp_echo(topology: "Topology", ns: str, address: str, timeout: float = 1.0) -> bool:
    """Send one ICMP echo request from namespace `ns`; True when an echo reply came back."""
    ident = random.randrange(65536)
    packet = echo_request(ident, b"egress-test-ping")
    with topology.inside(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    with sock:
        sock.settimeout(timeout)
        sock.sendto(packet, (address, 0))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                reply, (source, _port) = sock.recvfrom(65536)
            except (TimeoutError, OSError):
                return False
            header_len = (reply[0] & 0x0F) * 4
            kind, _code, _sum, reply_id = struct.unpack("!BBHH", reply[header_len:header_len + 6])
            if kind == 0 and reply_id == ident and source == address:
                return True
    return False


@dataclass
class PackageIndex:
    """A tiny PEP 503 "simple" index over HTTPS (pypi.test) serving one wheel, recording requests."""

    host: str
    cert: Path
    key: Path
    project: str = "egress-tinypkg"
    version: str = "1.0"
    requests: list[tuple[str, str | None]] = field(default_factory=list)  # (path, sni)
    connections: int = 0

    def __post_init__(self) -> None:
        self.label = f"{self.host}:443"
        self.wheel_name = f"{self.project.replace('-', '_')}-{self.version}-py3-none-any.whl"
        self.wheel = build_wheel(self.project, self.version)
        self.sha256 = hashlib.sha256(self.wheel).hexdigest()
        self._fence = AcceptFence()
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                index.requests.append((self.path, getattr(self.connection, "egress_sni", None)))
                path = self.path.split("?", 1)[0]
                if path in ("/simple/", "/simple"):
                    body, kind = f'<a href="/simple/{index.project}/">{index.project}</a>'.encode(), "text/html"
                elif path.rstrip("/") == f"/simple/{index.project}":
                    link = f"/packages/{index.wheel_name}#sha256={index.sha256}"
                    body = (f"<!DOCTYPE html><html><body><a href=\"{link}\">{index.wheel_name}</a>"
                            "</body></html>").encode()
                    kind = "text/html"
                elif path == f"/packages/{index.wheel_name}":
                    body, kind = index.wheel, "application/octet-stream"
                else:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(str(self.cert), str(self.key))
        tls.set_alpn_protocols(["http/1.1"])

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

            def get_request(self):
                sock, addr = super().get_request()
                if index._fence.claims(sock, addr):  # settle()'s own connection: not counted
                    raise OSError("settle probe")  # socketserver drops the request
                index.connections += 1
                holder = {}
                tls.sni_callback = lambda s, name, c: holder.__setitem__("sni", name)
                sock.settimeout(5)
                sock = tls.wrap_socket(sock, server_side=True)
                sock.egress_sni = holder.get("sni")
                sock.settimeout(None)
                return sock, addr

        self._server = Server((self.host, 443), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def settle(self) -> None:
        """A fence (tests.support.fence): every connection queued before the call is counted."""
        self._fence.settle((self.host, 443))

    @property
    def touched(self) -> bool:
        return self.connections > 0 or bool(self.requests)

    def reset(self) -> None:
        self.requests.clear()
        self.connections = 0

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def build_wheel(project: str, version: str) -> bytes:
    """A minimal valid pure-Python wheel."""
    dist = project.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{dist}/__init__.py": b"VERSION = '%s'\n" % version.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: egress-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return buffer.getvalue()

# -- the whole network -----------------------------------------------------------------------------


class Topology(ClosedNetwork):
    """The closed network (bench/lib/closed_net.py) with the tests' recorders and upstreams in it."""

    def __init__(self, pki):
        super().__init__()
        self.pki = pki
        self.servers: dict[str, object] = {}

    def destroy(self) -> None:
        for server in self.servers.values():
            with contextlib.suppress(Exception):
                server.stop()
        super().destroy()


    # -- namespaces for this thread ----------------------------------------------------------------

    @contextlib.contextmanager
    def inside(self, ns: str):
        """Run the block with this thread in namespace `ns` (one of ours); sockets made here stay there."""
        if ns not in (self.gw, self.inet, *(s.ns for s in self.sandboxes.values())):
            raise AssertionError(f"{ns} is not a namespace of this topology")
        with thread_inside(NETNS_DIR / ns):
            yield

    # -- upstreams ---------------------------------------------------------------------------------

    def serve_web(self, name: str, address: str) -> None:
        """RecordingUpstream on 443 (TLS, cert for the name and the IP) and 80."""
        cert, key = self.pki.issue([name], [address], stem=f"transparent-{name}")
        with self.inside(self.inet):
            self.servers[f"{address}:443"] = RecordingUpstream(name, address, 443, cert, key)
            self.servers[f"{address}:80"] = RecordingUpstream(name, address, 80)

    def serve_tcp(self, address: str, port: int, echo: bool = False) -> TcpRecorder:
        with self.inside(self.inet):
            server = self.servers[f"{address}:{port}"] = TcpRecorder(f"{address}:{port}", address, port, echo)
        return server

    def serve_udp(self, address: str, port: int) -> UdpRecorder:
        with self.inside(self.inet):
            server = self.servers[f"udp:{address}:{port}"] = UdpRecorder(f"udp:{address}:{port}", address, port)
        return server

    def record_icmp(self) -> IcmpRecorder:
        with self.inside(self.inet):
            server = self.servers["icmp"] = IcmpRecorder("icmp")
        return server

    def serve_index(self, address: str) -> PackageIndex:
        cert, key = self.pki.issue(["pypi.test"], [address], stem="transparent-pypi.test")
        with self.inside(self.inet):
            server = self.servers[f"{address}:443"] = PackageIndex(address, cert, key)
        return server

    def server(self, label: str):
        return self.servers[label]

    def reset(self) -> None:
        for server in self.servers.values():
            server.reset()

    def touched(self) -> list[str]:
        """Labels of every recorder that saw anything at all, a connection or datagram still queued
        included: each recorder is fenced first (tests.support.fence)."""
        with self.inside(self.inet):
            for server in self.servers.values():
                server.settle()
        return sorted(label for label, server in self.servers.items() if server.touched)

    # -- sockets from inside a sandbox ---------------------------------------------------------------

    def connect(self, sandbox: Sandbox, address: str, port: int, timeout: float = 5.0) -> socket.socket:
        with self.inside(sandbox.ns):
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.settimeout(timeout)
            try:
                sock.connect((address, port))
            except BaseException:
                sock.close()
                raise
        return sock

    def udp_send(self, ns: str, address: str, port: int, payload: bytes) -> None:
        with self.inside(ns):
            with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.sendto(payload, (address, port))


# -- a small DNS client ------------------------------------------------------------------------------

QTYPES = {"A": 1, "NS": 2, "CNAME": 5, "MX": 15, "TXT": 16, "AAAA": 28, "SVCB": 64, "HTTPS": 65, "ANY": 255}
RCODES = {0: "NOERROR", 1: "FORMERR", 2: "SERVFAIL", 3: "NXDOMAIN", 4: "NOTIMP", 5: "REFUSED"}


@dataclass
class DnsReply:
    rcode: str
    answers: list[tuple[int, str | bytes]]  # (type, address text or raw rdata)

    @property
    def addresses(self) -> list[str]:
        return [a for t, a in self.answers if t in (1, 28)]


def dns_query_packet(name: str, qtype: str, query_id: int | None = None) -> bytes:
    query_id = random.randrange(65536) if query_id is None else query_id
    header = struct.pack("!HHHHHH", query_id, 0x0100, 1, 0, 0, 0)
    qname = b"".join(bytes([len(label)]) + label.encode() for label in name.rstrip(".").split(".")) + b"\0"
    return header + qname + struct.pack("!HH", QTYPES[qtype], 1)


def _skip_name(data: bytes, offset: int) -> int:
    while True:
        length = data[offset]
        if length & 0xC0 == 0xC0:
            return offset + 2
        if length == 0:
            return offset + 1
        offset += 1 + length


def parse_dns_reply(data: bytes) -> DnsReply:
    _id, flags, qd, an, _ns, _ar = struct.unpack("!HHHHHH", data[:12])
    offset = 12
    for _ in range(qd):
        offset = _skip_name(data, offset) + 4
    answers = []
    for _ in range(an):
        offset = _skip_name(data, offset)
        rtype, _cls, _ttl, length = struct.unpack("!HHIH", data[offset:offset + 10])
        offset += 10
        rdata = data[offset:offset + length]
        offset += length
        if rtype == 1:
            answers.append((rtype, str(ipaddress.IPv4Address(rdata))))
        elif rtype == 28:
            answers.append((rtype, str(ipaddress.IPv6Address(rdata))))
        else:
            answers.append((rtype, rdata))
    return DnsReply(RCODES.get(flags & 0xF, str(flags & 0xF)), answers)


def dns_query(topology: Topology, ns: str, server: str, name: str, qtype: str, *, port: int = 53,
              tcp: bool = False, timeout: float = 2.0) -> DnsReply | None:
    """Ask `server` from inside namespace `ns`; None when nothing answered in time."""
    packet = dns_query_packet(name, qtype)
    with topology.inside(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM if tcp else socket.SOCK_DGRAM)
    with sock:
        sock.settimeout(timeout)
        try:
            if tcp:
                sock.connect((server, port))
                sock.sendall(struct.pack("!H", len(packet)) + packet)
                data = b""
                while len(data) < 2 or len(data) < 2 + struct.unpack("!H", data[:2])[0]:
                    chunk = sock.recv(65536)
                    if not chunk:
                        return None
                    data += chunk
                data = data[2:]
            else:
                sock.sendto(packet, (server, port))
                data, _ = sock.recvfrom(65536)
        except (TimeoutError, ConnectionError, OSError):
            return None
    return parse_dns_reply(data)


def wait_dns_answers(topology: Topology, sandbox: Sandbox, timeout: float = 15.0) -> None:
    """Wait until the gateway's DNS listener answers this sandbox (each try waits up to 0.5 s): the
    gateway is up on its redirected side too."""
    wait_for(lambda: dns_query(topology, sandbox.ns, sandbox.gateway_address, "probe.invalid", "A", timeout=0.5),
             timeout, f"the gateway's DNS to answer sandbox {sandbox.ns}")
