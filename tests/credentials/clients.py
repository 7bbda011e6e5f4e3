"""Sandbox-side clients and the leak oracle for the credential tests.

`leaks(data, secret)` says in which forms a secret value is visible in some bytes: every form
gateway.redact.forms_of lists, and independently of it: URL-decoding the whole text, decoding every
base64/base64url run at every alignment and every hex run, so an encoding the gateway missed is
caught too.
"""

from __future__ import annotations

import base64
import binascii
import re
import socket
from urllib.parse import unquote, unquote_plus

from gateway.redact import forms_of
from tests.e2e.helpers import TIMEOUT, Conn, Response, get, start_tls
from tests.support.gateway import GatewayProcess



def _b64_run(secret_length: int) -> re.Pattern[bytes]:
    """Runs long enough to hold the whole secret in base64 (shorter ones cannot reveal all of it)."""
    return re.compile(rb"[A-Za-z0-9+/_-]{%d,}={0,2}" % (secret_length * 4 // 3))


def _hex_run(secret_length: int) -> re.Pattern[bytes]:
    return re.compile(rb"[0-9A-Fa-f]{%d,}" % (secret_length * 2))


def _b64_decodings(run: bytes):
    core = run.rstrip(b"=")
    for shift in range(4):
        piece = core[shift:]
        piece = piece[: len(piece) - len(piece) % 4] if len(piece) % 4 != 1 else piece[:-1]
        for altchars in (None, b"-_"):
            try:
                padded = piece + b"=" * (-len(piece) % 4)
                yield base64.b64decode(padded, altchars=altchars, validate=False)
            except (binascii.Error, ValueError):
                continue


def leaks(data: bytes | str, secret: str) -> list[str]:
    """Every way `secret` can be read out of `data` (empty list: none)."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogateescape")
    raw = secret.encode()
    found = [f"form {form!r}" for form in sorted(forms_of(secret)) if form in data]
    for run in re.findall(rb"[!-~]{%d,}" % len(raw), data):
        if b"%" in run or b"+" in run:
            text = run.decode("ascii")
            found += [f"url-decoded run {text[:40]!r}" for decode in (unquote, unquote_plus) if secret in decode(text)]
    for run in _b64_run(len(raw)).findall(data):
        if any(raw in decoded for decoded in _b64_decodings(run)):
            found.append(f"base64 run {run[:40]!r}...")
    for run in _hex_run(len(raw)).findall(data):
        for shift in (0, 1):
            piece = run[shift:]
            piece = piece[: len(piece) - len(piece) % 2]
            try:
                if raw in bytes.fromhex(piece.decode()):
                    found.append(f"hex run {run[:40]!r}...")
            except ValueError:
                pass
    return found


def response_bytes(response: Response) -> bytes:
    head = "\r\n".join(f"{k}: {v}" for k, v in response.headers).encode("latin-1", "replace")
    return head + b"\r\n\r\n" + response.body


def assert_no_leak(data: bytes | str, secrets: dict[str, str], where: str = "response") -> None:
    problems = {name: leaks(data, value) for name, value in secrets.items()}
    problems = {k: v[:6] + ([f"... {len(v) - 6} more"] if len(v) > 6 else []) for k, v in problems.items() if v}
    assert not problems, f"secret(s) visible in the {where}: {problems}"


def assert_length_true(response: Response) -> None:
    length = response.header("Content-Length")
    if length is not None:
        assert int(length) == len(response.body), (length, len(response.body))


# --- connections ------------------------------------------------------------------------------


def read_to_end(sock: socket.socket) -> bytes:
    """Every byte until the peer closes (or the socket's timeout, or a reset, ends the reading)."""
    received = b""
    while True:
        try:
            piece = sock.recv(1 << 20)
        except OSError:
            return received
        if not piece:
            return received
        received += piece


def proxy_conn(gateway: GatewayProcess, source: str | None = None, timeout: float = TIMEOUT) -> Conn:
    sock = socket.create_connection((gateway.host, gateway.port), timeout=timeout,
                                    source_address=(source, 0) if source else None)
    sock.settimeout(timeout)
    return Conn(sock)


def connect(gateway: GatewayProcess, authority: str, source: str | None = None, timeout: float = TIMEOUT) -> tuple[Conn, Response]:
    conn = proxy_conn(gateway, source, timeout)
    conn.send(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    answer = conn.read_response(head_only=True)
    if answer.status != 200 and answer.header("Content-Length"):
        answer.body = conn.read_exactly(int(answer.header("Content-Length")))
    return conn, answer


def tls_to(gateway: GatewayProcess, host: str, sni: str | None | bool = True, source: str | None = None,
           alpn: list[str] | None = None, timeout: float = TIMEOUT) -> Conn:
    conn, answer = connect(gateway, f"{host}:443", source, timeout)
    assert answer.status == 200, (answer, answer.body)
    return start_tls(conn, gateway, host if sni is True else sni, alpn)


def fetch(gateway: GatewayProcess, host: str, path: str, headers: list[tuple[str, str]] | None = None,
          method: str = "GET", body: bytes = b"", source: str | None = None, host_header: str | None = True,
          timeout: float = TIMEOUT) -> Response:
    """One HTTPS request through a fresh CONNECT tunnel (Host defaults to `host`)."""
    with tls_to(gateway, host, source=source, timeout=timeout) as tls:
        return get(tls, path, host if host_header is True else host_header, method=method, extra=headers, body=body)
