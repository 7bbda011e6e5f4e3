"""Building blocks for the fault-injection and front-door fuzz tests.

Everything here stays on loopback:

- `LoopbackDNS` is a DNS server on a loopback address of the session's block (port 53) that answers
  NXDOMAIN, or never answers at all for names starting with `hang`, and records every query.
- `IsolatedGateway` is a `GatewayProcess` started in a private mount namespace (`unshare -m`, root
  only) whose /etc/resolv.conf names that loopback server, so that no name the gateway resolves can
  ever leave the machine (the host's real resolver is never asked), and DNS failures and timeouts
  can be produced on demand.
- Scripted upstreams: a server that resets mid-response, one that accepts and never answers, a
  listener whose accept queue is full (connect never completes), TLS servers with a wrong, expired
  or self-signed certificate that record whether any application byte reached them.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import policy_text
from tests.support.gateway import GatewayProcess, free_port
from tests.support.tcp_origin import start_accepting
from tests.support.waiting import wait_for, wait_until_sent

HERE = Path(__file__).resolve().parent


# --------------------------------------------------------------------------------------------
# can we isolate DNS?


def can_isolate_dns() -> bool:
    """Root with unshare(1) and mount(8): the gateway can get a private /etc/resolv.conf."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("mount"):
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    return probe.returncode == 0


# --------------------------------------------------------------------------------------------
# a loopback DNS server


class LoopbackDNS:
    """UDP DNS on (address, 53): NXDOMAIN for every name, silence for names starting with `hang`."""

    def __init__(self, address: str, port: int = 53):
        self.address = address
        self.port = port
        self.queries: list[str] = []
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((address, port))
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="loopback-dns")
        self._thread.start()

    @staticmethod
    def _qname(packet: bytes) -> tuple[str, int]:
        labels, i = [], 12
        while i < len(packet) and packet[i]:
            n = packet[i]
            labels.append(packet[i + 1 : i + 1 + n].decode("ascii", "replace"))
            i += 1 + n
        return ".".join(labels), i + 1 + 4  # name, end of the question section

    def _serve(self) -> None:
        while not self._stopped:
            try:
                packet, peer = self._sock.recvfrom(4096)
            except OSError:
                return
            if len(packet) < 12:
                continue
            name, end = self._qname(packet)
            with self._lock:
                self.queries.append(name)
            if name.lower().startswith("hang"):
                continue  # a resolver that never answers
            (qid, flags) = struct.unpack("!HH", packet[:4])
            rd = flags & 0x0100
            answer = struct.pack("!HHHHHH", qid, 0x8000 | rd | 0x0080 | 3, 1, 0, 0, 0) + packet[12:end]
            try:
                self._sock.sendto(answer, peer)
            except OSError:
                pass

    def reset(self) -> None:
        with self._lock:
            self.queries.clear()

    def stop(self) -> None:
        self._stopped = True
        self._sock.close()

    def resolv_conf(self, directory: Path) -> Path:
        path = directory / "resolv.conf"
        path.write_text(f"nameserver {self.address}\noptions timeout:3 attempts:1\n")
        return path


_SHARED_DNS: dict[str, LoopbackDNS] = {}


def shared_loopback_dns(address: str) -> LoopbackDNS:
    """One LoopbackDNS per address for the whole session (tests/fuzz and tests/faults share it)."""
    if address not in _SHARED_DNS:
        _SHARED_DNS[address] = LoopbackDNS(address)
    return _SHARED_DNS[address]


# --------------------------------------------------------------------------------------------
# gateways


@dataclass
class IsolatedGateway(GatewayProcess):
    """A gateway process whose /etc/resolv.conf points at a `LoopbackDNS` (private mount namespace).

    Without `resolv_conf` it is a plain GatewayProcess. The PID is the gateway's own (unshare and sh
    exec it), so signals reach it directly."""

    resolv_conf: Path | None = None

    def command(self) -> list[str]:
        inner = super().command()
        if self.resolv_conf is None:
            return inner
        script = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(self.resolv_conf), *inner]


def make_gateway(workdir: Path, upstreams, pki, rules: str, extra: str = "", args: list[str] | None = None,
                 dns: LoopbackDNS | None = None, audit_path: Path | None = None,
                 upstream_ca: Path | None | bool = True, start: bool = True) -> IsolatedGateway:
    """A gateway with `policy_text(upstreams, rules, extra)`; DNS isolated when `dns` is given."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    policy = workdir / "policy.yaml"
    policy.write_text(policy_text(upstreams, rules.replace("{gw_port}", str(port)), extra))
    gateway = IsolatedGateway(policy, workdir / "gw", port=port, extra_args=args or [],
                              upstream_ca=pki.ca_cert if upstream_ca is True else upstream_ca,
                              resolv_conf=dns.resolv_conf(workdir) if dns is not None else None)
    if audit_path is not None:
        gateway.audit_path = audit_path
    if start:
        gateway.start()
    upstreams.reset()
    return gateway


def static_hosts(mapping: dict[str, str]) -> str:
    """`extra=` text adding names to resolver.static_hosts (see tests.e2e.helpers.extra_static_hosts)."""
    lines = ["# more static_hosts"] + [f'    {name}: ["{address}"]' for name, address in mapping.items()]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# scripted upstreams


class ScriptedServer:
    """A TCP server on (host, port) that hands every accepted socket to `handle(sock)` in a thread.

    Counts connections and records the request heads it read (via `read_head`)."""

    def __init__(self, host: str, port: int, handle, backlog: int = 64):
        self.host, self.port = host, port
        self.handle = handle
        self.connections = 0
        self.heads: list[bytes] = []
        self.open_sockets: list[socket.socket] = []
        self._sock = socket.create_server((host, port), backlog=backlog)
        self._stopped = False
        start_accepting(self._sock, self._run, lambda: self._stopped, self._accepted)

    def _accepted(self, client: socket.socket, _addr) -> None:
        self.connections += 1
        self.open_sockets.append(client)

    def _run(self, client: socket.socket) -> None:
        try:
            self.handle(self, client)
        except OSError:
            pass

    def read_head(self, client: socket.socket, timeout: float = 5.0) -> bytes:
        client.settimeout(timeout)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = client.recv(65536)
            if not chunk:
                break
            data += chunk
        self.heads.append(data.split(b"\r\n\r\n", 1)[0])
        return data

    def reset(self) -> None:
        self.connections = 0
        self.heads.clear()

    @property
    def touched(self) -> bool:
        return self.connections > 0

    def stop(self) -> None:
        self._stopped = True
        self._sock.close()
        for s in self.open_sockets:
            try:
                s.close()
            except OSError:
                pass


def rst_close(sock: socket.socket) -> None:
    """Close with a TCP RST (SO_LINGER 0) instead of a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def reset_mid_response(server: ScriptedServer, client: socket.socket) -> None:
    """Answer `GET /small` with 200 + Content-Length 100000 but only 1000 body bytes, `/large` with
    Content-Length 8 MB but only 3 MB (so the gateway streams it); then reset the connection."""
    head = server.read_head(client)
    large = b" /large" in head.split(b"\r\n", 1)[0]
    total, sent = (8 * 1024 * 1024, 3 * 1024 * 1024) if large else (100_000, 1000)
    client.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                   b"Content-Length: " + str(total).encode() + b"\r\n\r\n")
    chunk = b"r" * 65536
    remaining = sent
    while remaining > 0:
        n = min(remaining, len(chunk))
        client.sendall(chunk[:n])
        remaining -= n
    wait_until_sent(client)  # the reset must not drop the part of the body that was sent
    rst_close(client)


def stall_after_head(server: ScriptedServer, client: socket.socket) -> None:
    """Read the request head and then say nothing, holding the connection open."""
    server.read_head(client, timeout=60)
    client.settimeout(120)
    try:
        while client.recv(65536):
            pass
    except OSError:
        pass


def answer_ok(server: ScriptedServer, client: socket.socket) -> None:
    server.read_head(client)
    client.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n")
    client.close()


class FullBacklog:
    """A listener that never accepts, with its accept queue filled: SYNs to it are dropped, so a
    connect() to it neither succeeds nor fails until the kernel gives up (minutes)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(0)
        self._fillers: list[socket.socket] = []
        for _ in range(4):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect((host, port))
            except (BlockingIOError, OSError):
                pass
            self._fillers.append(s)
        wait_for(self.filled, 5, "the accept queue to fill")

    def filled(self) -> bool:
        probe = socket.socket()
        probe.settimeout(0.5)
        try:
            probe.connect((self.host, self.port))
        except (TimeoutError, socket.timeout):
            return True
        except OSError:
            return False
        finally:
            probe.close()
        return False

    def stop(self) -> None:
        for s in self._fillers:
            s.close()
        self._sock.close()


class TLSRecorder:
    """A TLS server on (host, 443) with the given certificate: records completed handshakes and any
    application byte it receives (there must be none when the gateway refuses the certificate)."""

    def __init__(self, host: str, cert: Path, key: Path, port: int = 443):
        self.host, self.port = host, port
        self.connections = 0
        self.handshakes = 0
        self.received = b""
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.load_cert_chain(str(cert), str(key))
        self._ctx.set_alpn_protocols(["http/1.1"])
        self._sock = socket.create_server((host, port), backlog=16)
        self._stopped = False
        start_accepting(self._sock, self._handle, lambda: self._stopped, self._accepted)

    def _accepted(self, _client: socket.socket, _addr) -> None:
        self.connections += 1

    def _handle(self, client: socket.socket) -> None:
        client.settimeout(5)
        try:
            tls = self._ctx.wrap_socket(client, server_side=True)
        except (OSError, ssl.SSLError):
            client.close()
            return
        self.handshakes += 1
        try:
            while True:
                data = tls.recv(65536)
                if not data:
                    break
                self.received += data
                if b"\r\n\r\n" in self.received:
                    tls.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nbad")
                    break
        except (OSError, ssl.SSLError):
            pass
        finally:
            tls.close()

    def reset(self) -> None:
        self.connections = self.handshakes = 0
        self.received = b""

    def stop(self) -> None:
        self._stopped = True
        self._sock.close()


# --------------------------------------------------------------------------------------------
# small client helpers


@dataclass
class Outcome:
    """What a raw client saw: all bytes, whether the peer closed, how long it took."""

    data: bytes = b""
    closed: bool = False
    reset: bool = False
    timed_out: bool = False
    elapsed: float = 0.0
    statuses: list[int] = field(default_factory=list)


def drain(sock: socket.socket, limit: float) -> Outcome:
    """Read until EOF/reset or `limit` seconds pass."""
    import re

    out = Outcome()
    started = time.monotonic()
    while True:
        left = limit - (time.monotonic() - started)
        if left <= 0:
            out.timed_out = True
            break
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 << 20)
        except (TimeoutError, socket.timeout):
            out.timed_out = True
            break
        except (ConnectionResetError, BrokenPipeError, ssl.SSLError, ConnectionAbortedError):
            out.reset = out.closed = True
            break
        if not chunk:
            out.closed = True
            break
        out.data += chunk
    out.elapsed = time.monotonic() - started
    out.statuses = [int(s) for s in re.findall(rb"HTTP/1\.[01] (\d{3}) ", out.data)]
    return out


def header(data: bytes, name: str) -> str | None:
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    for line in head.split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name.lower():
            return value.strip()
    return None


def log_problems(log: str) -> list[str]:
    """Lines of a gateway log that show an internal failure (a crashed layer, a hook that failed),
    each traceback whole (its lines up to the next log line), so that a failure seen once on a busy
    CI machine says where it came from."""
    markers = ("mitmproxy has crashed", "failed closed", "Traceback", "fallback for", "addon error")
    problems: list[str] = []
    in_traceback = False
    for line in log.splitlines():
        if any(m in line for m in markers):
            problems.append(line)
            in_traceback = "Traceback" in line
        elif in_traceback and not line.startswith("["):
            problems.append(line)
        else:
            in_traceback = False
    return problems
