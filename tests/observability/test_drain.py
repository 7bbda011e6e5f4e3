"""Graceful shutdown: SIGTERM stops accepting, lets in-flight requests finish (up to --drain-timeout),
flushes the audit log and exits 0."""

from __future__ import annotations

import http.server
import json
import signal
import socket
import threading
import time

import pytest

from tests.support.gateway import free_port
from tests.support.waiting import wait_for

from .conftest import fetch, gateway_with_metrics, proxy_get

BODY = b"slow but complete\n" * 1000


class SlowUpstream:
    """Plain HTTP on 127.0.0.1 that holds each request until the test sets `released` (so a request
    is in flight for exactly as long as a test needs it to be), then answers it whole."""

    def __init__(self):
        self.arrived = threading.Event()
        self.released = threading.Event()
        upstream = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                upstream.arrived.set()
                upstream.released.wait(60)
                self.send_response(200)
                self.send_header("Content-Length", str(len(BODY)))
                self.end_headers()
                self.wfile.write(BODY)

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

        self.server = Server(("127.0.0.1", free_port()), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def slow_upstream():
    upstream = SlowUpstream()
    yield upstream
    upstream.stop()


def rules(port: int) -> str:
    return f"""
- id: slow
  hosts: [127.0.0.1]
  schemes: [http]
  ports: [{port}]
"""


def in_flight(gateway, port: int) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run():
        try:
            outcome["response"] = proxy_get(gateway, f"http://127.0.0.1:{port}/slow", timeout=20)
        except Exception as exc:  # noqa: BLE001  (the test inspects it)
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def refuses_connections(gateway) -> bool:
    try:
        socket.create_connection((gateway.host, gateway.port), timeout=0.5).close()
        return False
    except OSError:
        return True


def stopping(gateway) -> bool:
    """The gateway has taken in a SIGTERM/SIGINT: it logs that it stops, before closing its listener."""
    return "egress gateway: stopping: no new connections" in gateway.log()


def listener_closed(gateway) -> bool:
    return f"proxy at {gateway.host}:{gateway.port} stopped." in gateway.log()


def test_sigterm_drains_in_flight_requests(tmp_path, upstreams, pki, slow_upstream):
    gateway, metrics = gateway_with_metrics(tmp_path, upstreams, pki, rules(slow_upstream.port),
                                            args=["--drain-timeout", "10"])
    thread, outcome = in_flight(gateway, slow_upstream.port)
    assert slow_upstream.arrived.wait(5), gateway.log()
    started = time.monotonic()
    gateway.process.send_signal(signal.SIGTERM)
    # it stops accepting while the request is still in flight (held by the upstream), and says it
    # is not ready any more (the endpoint stays up meanwhile)
    wait_for(lambda: listener_closed(gateway), what="the listener's stopped line", detail=gateway.log)
    assert refuses_connections(gateway), "still accepting connections after SIGTERM"
    status, _, body = fetch(metrics + "/readyz")
    assert status == 503 and "draining" in body, body
    assert thread.is_alive() and not outcome
    # the request in flight completes, whole
    slow_upstream.released.set()
    thread.join(10)
    assert "response" in outcome, outcome
    assert outcome["response"].status == 200 and outcome["response"].body == BODY
    assert gateway.process.wait(10) == 0
    assert time.monotonic() - started < 5
    log = gateway.log()
    assert "draining 1 in-flight request(s)" in log and "drained" in log, log
    lines = [json.loads(line) for line in gateway.audit_path.read_text().splitlines()]
    assert [(a["event"], a["decision"], a["path"]) for a in lines] == [("request", "allow", "/slow")]


def test_drain_timeout_cuts_what_is_left(tmp_path, upstreams, pki, slow_upstream):
    gateway, _ = gateway_with_metrics(tmp_path, upstreams, pki, rules(slow_upstream.port),
                                      args=["--drain-timeout", "0.5"])
    thread, outcome = in_flight(gateway, slow_upstream.port)
    assert slow_upstream.arrived.wait(5), gateway.log()
    started = time.monotonic()
    gateway.process.send_signal(signal.SIGTERM)
    assert gateway.process.wait(5) == 0
    assert time.monotonic() - started < 3
    assert "drain timeout: 1 request(s) still in flight are cut" in gateway.log()
    thread.join(5)
    assert "error" in outcome or outcome["response"].status != 200


def test_a_second_signal_exits_at_once(tmp_path, upstreams, pki, slow_upstream):
    gateway, _ = gateway_with_metrics(tmp_path, upstreams, pki, rules(slow_upstream.port),
                                      args=["--drain-timeout", "30"])
    in_flight(gateway, slow_upstream.port)
    assert slow_upstream.arrived.wait(5), gateway.log()
    started = time.monotonic()
    gateway.process.send_signal(signal.SIGTERM)
    wait_for(lambda: stopping(gateway), what="the gateway to take in the SIGTERM", detail=gateway.log)
    assert gateway.process.poll() is None  # draining (the upstream holds the request till teardown)
    gateway.process.send_signal(signal.SIGINT)
    assert gateway.process.wait(5) == 0
    assert time.monotonic() - started < 3
