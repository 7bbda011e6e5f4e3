"""The shipped Prometheus config, alert rules and Grafana dashboard: valid, and naming only metrics
the gateway exposes."""

from __future__ import annotations

import json
import re
import subprocess

import yaml

from gateway.metrics import GatewayMetrics

from .conftest import PROJECT_ROOT, require_tool

PROMETHEUS_DIR = PROJECT_ROOT / "docker" / "prometheus"
DASHBOARD = PROJECT_ROOT / "docker" / "grafana" / "egress-dashboard.json"
KNOWN = set(GatewayMetrics().metric_names()) | {"up"}


def referenced_metrics(expr: str) -> set[str]:
    return set(re.findall(r"\b(egress_[a-z_]+|up)\b(?=\s*[{\[)])", expr))


def test_promtool_check_rules():
    promtool = require_tool("promtool")
    result = subprocess.run([promtool, "check", "rules", str(PROMETHEUS_DIR / "alerts.yml")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_check_config():
    promtool = require_tool("promtool")
    result = subprocess.run([promtool, "check", "config", "prometheus.yml"], cwd=PROMETHEUS_DIR,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_cover_the_required_cases_and_known_metrics():
    rules = [r for g in yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    names = {r["alert"] for r in rules}
    assert {"EgressGatewayDown", "EgressDenySpike", "EgressPolicyReloadFailed"} <= names
    for rule in rules:
        used = referenced_metrics(rule["expr"])
        assert used and used <= KNOWN, (rule["alert"], used - KNOWN)
        assert rule["labels"]["severity"] and rule["annotations"]["summary"]


def test_dashboard_panels():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    exprs = {}
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            exprs.setdefault(panel["title"], []).append(target["expr"])
    used = set().union(*(referenced_metrics(e) for es in exprs.values() for e in es))
    assert used <= KNOWN, used - KNOWN
    joined = {title: " ".join(es) for title, es in exprs.items()}

    def panel_using(pattern: str) -> bool:
        return any(re.search(pattern, text) for text in joined.values())

    assert panel_using(r"sum by \(decision\) \(rate\(egress_requests_total")  # requests by decision
    assert panel_using(r"topk\(10, sum by \(reason\).*decision=~\"deny")  # top deny reasons
    assert panel_using(r"histogram_quantile\(0\.95, .*egress_upstream_request_duration_seconds_bucket")  # latency
    assert panel_using(r"egress_credential_injections_total")  # injections
    assert panel_using(r"egress_policy_reloads_total")  # reloads
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
