"""What it costs that an upstream HTTP/1 connection is not reused after a request body (issue 14,
gateway/bodies.py; not a test, see bench/README.md).

    .venv/bin/python bench/reuse.py                # about 20 seconds
    .venv/bin/python bench/reuse.py --requests 2000 --rounds 5

One gateway (one worker, this checkout) in front of a loopback TLS origin that honours
Content-Length and keeps connections alive. One client keeps one CONNECT tunnel open and sends
`--requests` requests, one after the other: GET without a body (the upstream connection is reused:
the baseline) and POST with a 1 KiB body (a fresh upstream TCP + TLS connection per request now).
Both are measured in the same run, interleaved per round; the figure is the median requests/s and
the ratio POST / GET, plus the upstream connections the origin accepted (which shows the reuse).
Traffic stays on 127.0.0.0/8.
"""

from __future__ import annotations

import argparse
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib.gateway_process import GatewayProcess  # noqa: E402
from bench.lib.http1_wire import read_request  # noqa: E402
from bench.lib.pki import TestPKI  # noqa: E402

ORIGIN = "127.0.0.1"
BODY = b"x" * 1024


class Origin:
    """Keep-alive TLS HTTP/1.1 origin: reads Content-Length bodies, answers 200 `ok`."""

    def __init__(self, cert: Path, key: Path):
        self.accepted = 0
        self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._tls.load_cert_chain(str(cert), str(key))
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((ORIGIN, 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                raw, _ = self._sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._handle, args=(raw,), daemon=True).start()

    def _handle(self, raw: socket.socket) -> None:
        try:
            conn = self._tls.wrap_socket(raw, server_side=True)
            buf = b""
            while (request := read_request(conn, buf)) is not None:
                _, buf = request
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        except (OSError, ssl.SSLError, ValueError):
            pass
        finally:
            raw.close()

    def stop(self) -> None:
        self._sock.close()


def tunnel(gateway: GatewayProcess, port: int) -> ssl.SSLSocket:
    sock = socket.create_connection((gateway.host, gateway.port))
    sock.sendall(f"CONNECT origin.bench:{port} HTTP/1.1\r\nHost: origin.bench:{port}\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    context = ssl.create_default_context(cafile=str(gateway.ca_cert))
    context.set_alpn_protocols(["http/1.1"])
    return context.wrap_socket(sock, server_hostname="origin.bench")


def run(tls: ssl.SSLSocket, port: int, method: str, count: int) -> float:
    body = BODY if method == "POST" else b""
    request = (f"{method} /x HTTP/1.1\r\nHost: origin.bench:{port}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    started = time.perf_counter()
    buf = b""
    for _ in range(count):
        tls.sendall(request)
        while b"\r\n\r\nok" not in buf:
            buf += tls.recv(65536)
        buf = buf.split(b"\r\n\r\nok", 1)[1]
    return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pki = TestPKI(work / "pki")
        cert, key = pki.issue(["origin.bench"], [ORIGIN], stem="origin")
        origin = Origin(cert, key)
        policy = work / "policy.yaml"
        policy.write_text(f"version: 1\nnetwork:\n  allow_ip_ranges: [127.0.0.0/8]\nresolver:\n  static_hosts:\n"
                          f"    origin.bench: [{ORIGIN}]\nrules:\n  - id: bench\n    hosts: [origin.bench]\n"
                          f"    methods: [GET, POST]\n    ports: [{origin.port}]\n")
        gateway = GatewayProcess(policy, work / "gw", upstream_ca=pki.ca_cert).start()
        figures: dict[str, list[float]] = {"GET": [], "POST": []}
        connections: dict[str, list[int]] = {"GET": [], "POST": []}
        try:
            for round_ in range(args.rounds):
                for method in (("GET", "POST") if round_ % 2 == 0 else ("POST", "GET")):
                    with tunnel(gateway, origin.port) as tls:
                        before = origin.accepted
                        figures[method].append(run(tls, origin.port, method, args.requests))
                        connections[method].append(origin.accepted - before)
        finally:
            gateway.stop()
            origin.stop()
    get, post = (statistics.median(figures[m]) for m in ("GET", "POST"))
    print(f"{args.requests} requests per round, {args.rounds} rounds, one kept-alive tunnel each\n")
    print("| request | req/s (median) | upstream connections per round |")
    print("|---|---:|---:|")
    print(f"| GET, no body (reused upstream: baseline) | {get:.0f} | {statistics.median(connections['GET']):.0f} |")
    print(f"| POST, 1 KiB body (fresh upstream each) | {post:.0f} | {statistics.median(connections['POST']):.0f} |")
    print(f"\nPOST / GET: {post / get:.2f}")


if __name__ == "__main__":
    main()
