"""Helpers for the observability tests: gateways with --metrics, scraping, Prometheus tools.

Tests that need `prometheus` or `promtool` (Debian package `prometheus`; `.ci/setup --test` installs
it) skip with a reason when they are missing.
"""

from __future__ import annotations

import http.client
import shutil
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import policy_text
from tests.support.gateway import GatewayProcess, free_port
from tests.support.waiting import wait_for

PROJECT_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 5.0


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian package 'prometheus'; `bash .ci/setup --test` installs it)")
    return path


# --- gateways ------------------------------------------------------------------------------------


def gateway_with_metrics(workdir: Path, upstreams, pki, rules: str, extra: str = "", args: list[str] | None = None,
                         metrics_port: int | None = None) -> tuple[GatewayProcess, str]:
    """A started gateway serving metrics on 127.0.0.1:<metrics_port> (rules may use {metrics_port}, {gw_port});
    returns it and its metrics base URL. The caller stops it."""
    port = free_port()
    metrics_port = metrics_port or free_port()
    rules = rules.replace("{metrics_port}", str(metrics_port)).replace("{gw_port}", str(port))
    workdir.mkdir(parents=True, exist_ok=True)
    policy = workdir / "policy.yaml"
    policy.write_text(policy_text(upstreams, rules, extra))
    gateway = GatewayProcess(policy, workdir / "gw", port=port, upstream_ca=pki.ca_cert,
                             extra_args=["--metrics", f"127.0.0.1:{metrics_port}", *(args or [])])
    gateway.start()
    base = f"http://127.0.0.1:{metrics_port}"
    wait_ready(base, gateway)
    return gateway, base


def wait_ready(base: str, gateway: GatewayProcess | None = None, timeout: float = 15.0) -> None:
    last: list = [None]

    def ready() -> bool:
        try:
            status, _, body = fetch(base + "/readyz")
        except OSError as exc:
            last[0] = exc
            return False
        last[0] = body
        return status == 200

    wait_for(ready, timeout, "/readyz to say ready",
             detail=lambda: f"last answer: {last[0]}\n{gateway.log() if gateway else ''}")


# --- HTTP ----------------------------------------------------------------------------------------


def fetch(url: str, headers: dict | None = None, timeout: float = TIMEOUT) -> tuple[int, dict[str, str], str]:
    """GET without any proxy: (status, headers with lower-case names, body)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read().decode()


@dataclass
class ProxyResponse:
    status: int
    headers: dict[str, str]
    body: bytes


def proxy_get(gateway: GatewayProcess, url: str, host: str | None = None, timeout: float = TIMEOUT,
              method: str = "GET") -> ProxyResponse:
    """One absolute-form request through the gateway on a connection of its own."""
    conn = http.client.HTTPConnection(gateway.host, gateway.port, timeout=timeout)
    try:
        authority = url.split("/", 3)[2]
        conn.request(method, url, headers={"Host": host or authority, "Connection": "close"})
        response = conn.getresponse()
        return ProxyResponse(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        conn.close()


def connect_status(gateway: GatewayProcess, authority: str, timeout: float = TIMEOUT) -> tuple[int, dict[str, str]]:
    """Send CONNECT authority; return the status and headers of the gateway's answer."""
    with socket.create_connection((gateway.host, gateway.port), timeout=timeout) as sock:
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    headers = {}
    for line in head[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


# --- metrics -------------------------------------------------------------------------------------


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, frozenset of label items): value} of a text-format scrape."""
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(scraped: dict, name: str, **labels) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in scraped.items() if n == name and wanted <= ls)


def scrape(base: str) -> dict[tuple[str, frozenset], float]:
    status, _, body = fetch(base + "/metrics")
    assert status == 200, body
    return samples(body)
