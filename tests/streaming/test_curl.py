"""Behaviour 10: curl `--no-buffer -N` through the proxy, over HTTP/1.1 and HTTP/2, reading the
SSE stream line by line from curl's stdout while the origin waits for each event to be seen."""

from __future__ import annotations

import queue
import shutil
import subprocess
import threading
import time

import pytest

from .conftest import RULE_KINDS, check_origin_saw, model_events, name
from .origins import WAIT, paced_stream, plan_events

pytestmark = pytest.mark.e2e

VERSION_MARK = b"::http_version="  # curl -w prints it after the body


class CurlStream:
    """curl in a subprocess; its stdout lines arrive on a queue (a reader thread), waits are bounded."""

    def __init__(self, gateway, url: str, *args: str):
        self.process = subprocess.Popen(
            ["curl", "-sS", "--no-buffer", "-N", "--max-time", str(int(4 * WAIT)), "-x", gateway.proxy_url,
             "--cacert", str(gateway.ca_cert), "-w", VERSION_MARK.decode() + "%{http_version}\n", *args, url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        self.lines: queue.Queue = queue.Queue()
        self.received = b""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in iter(self.process.stdout.readline, b""):
            self.lines.put(line)
        self.lines.put(None)

    def read_event(self, n: int) -> bytes:
        """Lines up to and including the blank line that ends event n."""
        deadline = time.monotonic() + WAIT
        event = b""
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                raise AssertionError(f"event {n} never reached curl's stdout within {WAIT:g}s: the gateway "
                                     f"buffered the stream (curl printed {self.received[-200:]!r})") from None
            if line is None:
                raise AssertionError(f"curl's output ended before event {n}: {self.received[-300:]!r} "
                                     f"stderr {self.process.stderr.read()[-500:]!r}")
            if line.startswith(VERSION_MARK):
                raise AssertionError(f"the response ended before event {n} reached curl: the gateway cut the "
                                     f"stream short (curl printed {self.received[-300:]!r})")
            self.received += line
            event += line
            if line == b"\n":
                return event

    def rest(self) -> bytes:
        try:
            self.process.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError("curl did not finish after the last event") from None
        rest = b""
        while True:
            line = self.lines.get(timeout=WAIT)
            if line is None:
                return rest
            rest += line

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(5)
        for stream in (self.process.stdout, self.process.stderr):
            stream.close()


@pytest.fixture(autouse=True)
def _need_curl():
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("version", ["--http1.1", "--http2"])
def test_curl_no_buffer_reads_sse_line_by_line(gateway, routes, origins, version, rule):
    events = model_events(4)
    route, lock = paced_stream(routes, plan_events(events))
    lock.ack(0)  # curl prints no headers: the head is checked by the first event getting through at all
    curl = CurlStream(gateway, f"https://{name('h2', rule)}{route.path}", version)
    try:
        for n, event in enumerate(events, 1):
            assert curl.read_event(n) == event
            lock.ack(n)
        rest = curl.rest()
        assert curl.process.returncode == 0, (curl.process.returncode, curl.process.stderr.read()[-500:])
    finally:
        curl.close()
    expected_version = "2" if version == "--http2" else "1.1"
    assert rest == VERSION_MARK + f"{expected_version}\n".encode(), (
        f"after the last event curl printed {rest!r} (expected only its -w line: HTTP/{expected_version})")
    check_origin_saw(route.exchange, rule)
