"""A running gateway with --metrics: the endpoint, the metrics real traffic produces, promtool on a
live scrape, a real Prometheus server scraping it, and the metrics port out of the proxy's reach."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.parse

import pytest

from tests.support.gateway import free_port
from tests.support.waiting import wait_for

from .conftest import (
    connect_status,
    fetch,
    gateway_with_metrics,
    proxy_get,
    require_tool,
    samples,
    scrape,
    value,
)

RULES = """
- id: tls
  hosts: [allowed.test]
- id: plain
  hosts: [allowed.test]
  schemes: [http]
- id: api
  hosts: [api.test]
  schemes: [http]
  methods: [GET]
  paths: ["/ok/**"]
- id: metrics-port      # allows the metrics port by rule: only the address guard stands in the way
  hosts: [127.0.0.1, localhost.test]
  schemes: [http, https]
  ports: [{metrics_port}]
"""
EXTRA = """\
# extra static_hosts
    localhost.test: [127.0.0.1]
"""


@pytest.fixture(scope="module")
def gw(tmp_path_factory, upstreams, pki):
    gateway, base = gateway_with_metrics(tmp_path_factory.mktemp("metrics"), upstreams, pki, RULES, EXTRA)
    gateway.metrics_base = base
    gateway.metrics_port = int(base.rsplit(":", 1)[1])
    yield gateway
    gateway.stop()


def traffic(gw) -> None:
    """Requests every test can rely on: allowed, denied by path, denied without a rule."""
    assert proxy_get(gw, "http://allowed.test/hello").status == 200
    assert proxy_get(gw, "http://api.test/ok/1").status == 200
    assert proxy_get(gw, "http://api.test/admin/secret-path-xyz").status == 403
    assert proxy_get(gw, "http://unlisted-host-xyz.test/").status == 403


def test_health_and_readiness(gw):
    status, headers, body = fetch(gw.metrics_base + "/healthz")
    assert (status, body) == (200, "ok\n")
    status, headers, body = fetch(gw.metrics_base + "/readyz")
    assert status == 200, body
    assert body.startswith("ready\n")
    assert "policy: ok (sha256 " in body and "listeners: ok" in body and "ca: ok" in body
    assert str(gw.ca_cert) in body
    assert fetch(gw.metrics_base + "/nothing")[0] == 404


def test_requests_show_up_with_bounded_labels(gw):
    before = scrape(gw.metrics_base)
    traffic(gw)
    after = scrape(gw.metrics_base)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("egress_requests_total", sandbox="none", rule="plain", decision="allow", reason="allowed") == 1
    assert delta("egress_requests_total", rule="api", decision="allow", reason="allowed") == 1
    assert delta("egress_requests_total", rule="api", decision="deny", reason="path_not_allowed") == 1
    assert delta("egress_requests_total", rule="none", decision="deny", reason="no_rule") == 1
    assert delta("egress_decision_duration_seconds_count", kind="request") >= 4
    assert delta("egress_upstream_request_duration_seconds_count", rule="plain") == 1
    assert delta("egress_bytes_total", direction="received", rule="plain") == len(b"upstream allowed.test: GET /hello\n")
    assert value(after, "egress_policy_info", version="1") == 1
    assert value(after, "egress_policy_last_reload_timestamp_seconds") > time.time() - 3600
    # no host name or path the sandbox sent is a label value
    text = fetch(gw.metrics_base + "/metrics")[2]
    for leaked in ("unlisted-host-xyz", "secret-path-xyz", "api.test", "allowed.test", "/hello"):
        assert leaked not in text


def test_https_bytes_and_latency_including_streamed_bodies(gw):
    before = scrape(gw.metrics_base)
    sizes = (5000, 3_000_000)  # the second is above stream_large_bodies (1m): streamed, counted chunk by chunk
    for size in sizes:
        result = subprocess.run(
            ["curl", "-sS", "--max-time", "20", "-x", gw.proxy_url, "--cacert", str(gw.ca_cert), "-o", "/dev/null",
             "-w", "%{http_code} %{size_download}", f"https://allowed.test/bytes/{size}"],
            capture_output=True, text=True, timeout=30,
        )
        assert result.stdout == f"200 {size}", result.stdout + result.stderr
    after = scrape(gw.metrics_base)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("egress_bytes_total", direction="received", rule="tls") == sum(sizes)
    assert delta("egress_upstream_request_duration_seconds_count", rule="tls") == 2
    assert delta("egress_connections_total", mode="regular", decision="allow", reason="allowed") == 2
    assert delta("egress_requests_total", rule="tls", decision="allow") == 2


def test_request_bodies_count_as_sent(gw):
    import http.client

    before = value(scrape(gw.metrics_base), "egress_bytes_total", direction="sent", rule="plain")
    for size in (1000, 2_000_000):  # buffered, then streamed (above stream_large_bodies)
        conn = http.client.HTTPConnection(gw.host, gw.port, timeout=20)
        conn.request("POST", "http://allowed.test/upload", body=b"u" * size, headers={"Host": "allowed.test"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        conn.close()
    after = value(scrape(gw.metrics_base), "egress_bytes_total", direction="sent", rule="plain")
    assert after - before == 2_001_000


def test_active_connections_gauge(gw):
    import socket

    def active() -> float:
        return value(scrape(gw.metrics_base), "egress_active_connections", mode="regular")

    with socket.create_connection((gw.host, gw.port)):
        wait_for(lambda: active() >= 1, what="egress_active_connections to count the connection")
    wait_for(lambda: active() == 0, what="egress_active_connections back to 0")


def test_text_and_openmetrics_formats(gw):
    status, headers, body = fetch(gw.metrics_base + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# TYPE egress_requests_total counter" in body
    status, headers, body = fetch(gw.metrics_base + "/metrics",
                                  {"Accept": "application/openmetrics-text; version=1.0.0; charset=utf-8"})
    assert status == 200 and headers["content-type"].startswith("application/openmetrics-text")
    assert body.endswith("# EOF\n")
    assert "# TYPE egress_requests counter" in body and "# TYPE egress_policy info" in body


def test_metrics_port_is_never_reachable_through_the_proxy(gw):
    # a rule allows 127.0.0.1:<metrics port>; the gateway's own listener is still refused
    for authority in (f"127.0.0.1:{gw.metrics_port}", f"localhost.test:{gw.metrics_port}"):
        status, headers = connect_status(gw, authority)
        assert (status, headers.get("x-egress-reason")) == (403, "self_address"), (authority, headers)
    response = proxy_get(gw, f"http://127.0.0.1:{gw.metrics_port}/metrics")
    assert (response.status, response.headers.get("x-egress-reason")) == (403, "self_address")
    assert b"egress_requests" not in response.body
    lines = [a for a in gw.audit() if a.get("port") == gw.metrics_port]
    assert lines and all(a["decision"] == "deny" and a["reason"] == "self_address" for a in lines)
    after = scrape(gw.metrics_base)
    assert value(after, "egress_connections_total", mode="regular", decision="deny", reason="self_address") >= 2


def test_promtool_check_metrics_on_a_live_scrape(gw):
    promtool = require_tool("promtool")
    traffic(gw)
    connect_status(gw, f"127.0.0.1:{gw.metrics_port}")
    body = fetch(gw.metrics_base + "/metrics")[2]
    assert "egress_requests_total{" in body and "egress_upstream_request_duration_seconds_bucket{" in body
    result = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (result.stdout + result.stderr).strip() == "", result.stdout + result.stderr


def test_a_real_prometheus_scrapes_the_gateway(gw, tmp_path):
    prometheus = require_tool("prometheus")
    alerts = os.path.join(os.path.dirname(__file__), "..", "..", "docker", "prometheus", "alerts.yml")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files: [{json.dumps(os.path.abspath(alerts))}]\n"
        "scrape_configs:\n"
        "  - job_name: egress-gateway\n"
        "    scrape_interval: 1s\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{gw.metrics_port}']}}]\n"
    )
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    log = open(tmp_path / "prometheus.log", "wb")
    process = subprocess.Popen(
        [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
    )
    api = f"http://127.0.0.1:{port}"

    def query(expr: str) -> list:
        status, _, body = fetch(f"{api}/api/v1/query?query={urllib.parse.quote(expr)}")
        assert status == 200, body
        return json.loads(body)["data"]["result"]

    def prometheus(what, check, timeout=20.0):
        """wait_for `check()` of Prometheus's API (unreachable counts as not yet), failing at once if
        Prometheus exits."""
        def checked():
            if process.poll() is not None:
                raise AssertionError(f"prometheus exited: {(tmp_path / 'prometheus.log').read_text()}")
            try:
                return check()
            except OSError:
                return None

        return wait_for(checked, timeout, what, interval=0.2,
                        detail=lambda: (tmp_path / "prometheus.log").read_text())

    try:
        prometheus("prometheus ready", lambda: fetch(f"{api}/-/ready")[0] == 200)
        assert proxy_get(gw, "http://allowed.test/through-prometheus").status == 200
        assert proxy_get(gw, "http://unlisted-host-xyz.test/").status == 403
        expected_allowed = value(scrape(gw.metrics_base), "egress_requests_total", rule="plain", decision="allow")
        up = prometheus("up == 1", lambda: query('up{job="egress-gateway"} == 1'))
        assert up[0]["metric"]["instance"] == f"127.0.0.1:{gw.metrics_port}"
        result = prometheus(
            "the request in egress_requests_total",
            lambda: [r for r in query('egress_requests_total{job="egress-gateway", rule="plain", decision="allow"}')
                     if float(r["value"][1]) >= expected_allowed],
        )
        assert result[0]["metric"]["reason"] == "allowed" and result[0]["metric"]["sandbox"] == "none"
        denied = query('sum(egress_requests_total{job="egress-gateway", decision="deny", reason="no_rule"})')
        assert float(denied[0]["value"][1]) >= 1
        # the example alert rules load and evaluate against real series without errors
        def rules_evaluated():
            groups = json.loads(fetch(f"{api}/api/v1/rules")[2])["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            return rules if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules) else None
        rules = prometheus("alert rules evaluated", rules_evaluated)
        assert {r["name"] for r in rules} >= {"EgressGatewayDown", "EgressDenySpike", "EgressPolicyReloadFailed"}
        assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
        # with the gateway scraped, "gateway down" resolves to inactive (it may be pending at first:
        # absent(up) holds until the first scrape)
        prometheus("EgressGatewayDown inactive", lambda: [
            r for g in json.loads(fetch(f"{api}/api/v1/rules")[2])["data"]["groups"] for r in g["rules"]
            if r["name"] == "EgressGatewayDown" and r["state"] == "inactive" and r["health"] == "ok"])
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
        log.close()


def test_openmetrics_scrape_parses(gw):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    body = fetch(gw.metrics_base + "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"})[2]
    families = {f.name for f in text_string_to_metric_families(body)}
    assert {"egress_requests", "egress_policy", "egress_upstream_request_duration_seconds"} <= families
    assert samples(fetch(gw.metrics_base + "/metrics")[2])  # and the classic format too


def test_metrics_port_in_use_stops_start_up(tmp_path):
    import socket
    import sys

    from .conftest import PROJECT_ROOT

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "gateway", "run", "--mode", f"regular@127.0.0.1:{free_port()}",
             "--confdir", str(tmp_path / "conf"), "--metrics", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=30, cwd=PROJECT_ROOT,
        )
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in result.stdout + result.stderr
    bad = subprocess.run([sys.executable, "-m", "gateway", "run", "--confdir", str(tmp_path / "conf"),
                          "--metrics", "metrics.example:9464"], capture_output=True, text=True, timeout=30,
                         cwd=PROJECT_ROOT)
    assert bad.returncode == 2 and "the host must be an IP address" in bad.stderr, bad.stderr
