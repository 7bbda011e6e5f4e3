"""Clients that run inside a sandbox with no proxy settings at all: curl, httpx and requests (as
`ip netns exec SB python ...`), raw sockets (opened in the sandbox namespace by the test process),
and a hand-built TLS ClientHello (for SNI-less and ECH hellos)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import ssl
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.netns.lab import Reply, read_response
from tests.support.topology import Sandbox, Topology

PYTHON = sys.executable


@dataclass
class HttpResult:
    rc: int  # the client's exit code (0 when a response arrived)
    status: int | None
    headers: dict[str, str]
    body: str
    stderr: str

    @property
    def egress_reason(self) -> str | None:
        return self.headers.get("x-egress-reason")

    def __str__(self) -> str:
        return f"rc={self.rc} status={self.status} headers={self.headers} body={self.body[:300]!r} stderr={self.stderr[-500:]!r}"


def curl(sandbox: Sandbox, ca: Path, url: str, *extra: str, timeout: float = 10) -> HttpResult:
    """curl in the sandbox; the response head and body come back on stdout (-i)."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    result = sandbox.exec(["curl", "-sS", "-i", "-m", str(timeout), "--cacert", str(ca), *extra, url],
                          timeout=timeout + 10)
    status, headers, body = None, {}, result.stdout
    if result.returncode == 0 and result.stdout:
        raw = result.stdout.replace("\r\n", "\n")
        head, _, body = raw.partition("\n\n")
        lines = head.split("\n")
        status = int(lines[0].split()[1])
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return HttpResult(result.returncode, status, headers, body, result.stderr)


_PY_CLIENT = r"""
import json, ssl, sys
library, ca, url = sys.argv[1:4]
try:
    if library == "httpx":
        import httpx
        context = ssl.create_default_context(cafile=ca)
        response = httpx.get(url, verify=context, timeout=10)
        status, headers, body = response.status_code, dict(response.headers), response.text
    else:
        import requests
        response = requests.get(url, verify=ca, timeout=10)
        status, headers, body = response.status_code, dict(response.headers), response.text
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    sys.exit(3)
print(json.dumps({"status": status, "headers": {k.lower(): v for k, v in headers.items()}, "body": body}))
"""


def python_get(sandbox: Sandbox, library: str, ca: Path, url: str) -> HttpResult:
    """httpx or requests in the sandbox (no proxy variables, so both go direct: transparently)."""
    result = sandbox.exec([PYTHON, "-c", _PY_CLIENT, library, str(ca), url], timeout=40)
    try:
        data = json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return HttpResult(result.returncode or 99, None, {}, result.stdout, result.stderr)
    if "error" in data:
        return HttpResult(result.returncode, None, {}, data["error"], result.stderr)
    return HttpResult(result.returncode, data["status"], data["headers"], data["body"], result.stderr)


# -- raw sockets in the sandbox ----------------------------------------------------------------------


def http_exchange(sock, requests: list[bytes]) -> list[Reply]:
    """Send HTTP/1.1 requests one after the other on one kept-alive connection."""
    replies = []
    for request in requests:
        sock.sendall(request)
        replies.append(read_response(sock))
    return replies


def http_request(host_header: str, path: str = "/", close: bool = False) -> bytes:
    connection = "close" if close else "keep-alive"
    return f"GET {path} HTTP/1.1\r\nHost: {host_header}\r\nConnection: {connection}\r\n\r\n".encode()


def tls_get(topology: Topology, sandbox: Sandbox, address: str, server_name: str | None, ca: Path,
            host_header: str, path: str = "/") -> Reply:
    """Python ssl from inside the sandbox; server_name=None sends no SNI at all."""
    sock = topology.connect(sandbox, address, 443)
    context = ssl.create_default_context(cafile=str(ca))
    context.check_hostname = False  # the gateway's CA is still verified
    context.set_alpn_protocols(["http/1.1"])
    with context.wrap_socket(sock, server_hostname=server_name) as tls:
        tls.sendall(http_request(host_header, path, close=True))
        return read_response(tls)


def wait_closed(sock: socket.socket, timeout: float = 5.0) -> tuple[float, bytes]:
    """Seconds until the peer closed (EOF or reset), and what it sent before; raises on timeout."""
    start = time.monotonic()
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
            return time.monotonic() - start, data
        except TimeoutError:
            raise AssertionError(f"connection still open after {timeout}s (got {data!r})") from None
        if not chunk:
            return time.monotonic() - start, data
        data += chunk


# -- a hand-built TLS 1.3 ClientHello ------------------------------------------------------------------

ECH_EXTENSION = 0xFE0D


def _ext(ext_type: int, body: bytes) -> bytes:
    return struct.pack("!HH", ext_type, len(body)) + body


def _vec(body: bytes, width: int) -> bytes:
    return len(body).to_bytes(width, "big") + body


def ech_outer_extension(inner_size: int = 223) -> bytes:
    """An `encrypted_client_hello` extension of type outer (RFC 9849 section 5): HPKE suite
    (HKDF-SHA256, AES-128-GCM), a config id, an X25519 `enc` and a payload. The payload is random:
    the gateway cannot decrypt it anyway (it holds no ECH keys), which is exactly the situation
    of a sandbox trying to hide its real destination inside the inner ClientHello."""
    body = bytes([0]) + struct.pack("!HH", 0x0001, 0x0001) + os.urandom(1)
    body += _vec(os.urandom(32), 2) + _vec(os.urandom(inner_size), 2)
    return _ext(ECH_EXTENSION, body)


def tlslite_with_ech(monkeypatch):
    """tlslite-ng's TLSConnection, patched so that its ClientHello carries an ECH (outer) extension:
    a real client stack hiding its destination (skips when tlslite-ng is not installed)."""
    import pytest

    tlsconnection = pytest.importorskip("tlslite.tlsconnection")
    from tlslite.extensions import TLSExtension
    from tlslite.messages import ClientHello

    extension = ech_outer_extension()[4:]  # the extension body, without type and length

    class EchClientHello(ClientHello):
        def create(self, *args, **kwargs):
            super().create(*args, **kwargs)
            self.extensions = list(self.extensions or [])
            self.extensions.append(TLSExtension(extType=ECH_EXTENSION).create(bytearray(extension)))
            return self

    monkeypatch.setattr(tlsconnection, "ClientHello", EchClientHello)
    return tlsconnection.TLSConnection


def client_hello(server_name: str | None, *, ech: bool = False, alpn: bytes = b"http/1.1") -> bytes:
    """A TLS 1.3 ClientHello record (with an X25519 key share OpenSSL will accept)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    public = X25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    extensions = b""
    if server_name:
        name = server_name.encode()
        extensions += _ext(0x0000, _vec(b"\x00" + _vec(name, 2), 2))
    extensions += _ext(0x000A, _vec(struct.pack("!HH", 0x001D, 0x0017), 2))  # supported_groups
    extensions += _ext(0x000B, _vec(b"\x00", 1))  # ec_point_formats
    extensions += _ext(0x000D, _vec(struct.pack("!HHHHH", 0x0403, 0x0804, 0x0401, 0x0503, 0x0805), 2))
    extensions += _ext(0x0010, _vec(_vec(alpn, 1), 2))  # ALPN
    extensions += _ext(0x002B, _vec(struct.pack("!HH", 0x0304, 0x0303), 1))  # supported_versions
    extensions += _ext(0x002D, _vec(b"\x01", 1))  # psk_key_exchange_modes
    extensions += _ext(0x0033, _vec(struct.pack("!HH", 0x001D, 32) + public, 2))  # key_share
    if ech:
        extensions += ech_outer_extension()
    suites = struct.pack("!HHHHH", 0x1301, 0x1302, 0x1303, 0xC02B, 0xC02F)
    body = b"\x03\x03" + os.urandom(32) + _vec(os.urandom(32), 1) + _vec(suites, 2) + _vec(b"\x00", 1)
    body += _vec(extensions, 2)
    handshake = b"\x01" + _vec(body, 3)
    return b"\x16\x03\x01" + _vec(handshake, 2)


def read_tls_record(sock: socket.socket, timeout: float = 5.0) -> tuple[int, bytes] | None:
    """(content type, payload) of the next TLS record, None on EOF."""
    sock.settimeout(timeout)
    data = b""
    while len(data) < 5 or len(data) < 5 + struct.unpack("!H", data[3:5])[0]:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, ConnectionAbortedError):
            return None
        if not chunk:
            return None
        data += chunk
    length = struct.unpack("!H", data[3:5])[0]
    return data[0], data[5:5 + length]
