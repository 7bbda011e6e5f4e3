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

from .conftest import fetch, gateway_with_metrics, proxy_get

BODY = b"slow but complete\n" * 1000


class SlowUpstream:
    """Plain HTTP on 127.0.0.1 that waits `delay` seconds before answering."""

    def __init__(self, delay: float):
        self.arrived = threading.Event()
        upstream = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                upstream.arrived.set()
                time.sleep(delay)
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
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def slow_upstream(request):
    upstream = SlowUpstream(request.param)
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


@pytest.mark.parametrize("slow_upstream", [1.5], indirect=True)
def test_sigterm_drains_in_flight_requests(tmp_path, upstreams, pki, slow_upstream):
    gateway, metrics = gateway_with_metrics(tmp_path, upstreams, pki, rules(slow_upstream.port),
                                            args=["--drain-timeout", "10"])
    thread, outcome = in_flight(gateway, slow_upstream.port)
    assert slow_upstream.arrived.wait(5), gateway.log()
    started = time.monotonic()
    gateway.process.send_signal(signal.SIGTERM)
    # it stops accepting at once, and says it is not ready any more (the endpoint stays up meanwhile)
    deadline = time.monotonic() + 1.0
    while not refuses_connections(gateway):
        assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
        time.sleep(0.02)
    status, _, body = fetch(metrics + "/readyz")
    assert status == 503 and "draining" in body, body
    # the request in flight completes, whole
    thread.join(10)
    assert "response" in outcome, outcome
    assert outcome["response"].status == 200 and outcome["response"].body == BODY
    assert gateway.process.wait(10) == 0
    assert time.monotonic() - started < 5
    log = gateway.log()
    assert "draining 1 in-flight request(s)" in log and "drained" in log, log
    lines = [json.loads(line) for line in gateway.audit_path.read_text().splitlines()]
    assert [(a["event"], a["decision"], a["path"]) for a in lines] == [("request", "allow", "/slow")]


@pytest.mark.parametrize("slow_upstream", [6.0], indirect=True)
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


@pytest.mark.parametrize("slow_upstream", [6.0], indirect=True)
def test_a_second_signal_exits_at_once(tmp_path, upstreams, pki, slow_upstream):
    gateway, _ = gateway_with_metrics(tmp_path, upstreams, pki, rules(slow_upstream.port),
                                      args=["--drain-timeout", "30"])
    in_flight(gateway, slow_upstream.port)
    assert slow_upstream.arrived.wait(5), gateway.log()
    started = time.monotonic()
    gateway.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert gateway.process.poll() is None  # draining
    gateway.process.send_signal(signal.SIGINT)
    assert gateway.process.wait(5) == 0
    assert time.monotonic() - started < 3
