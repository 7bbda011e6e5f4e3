"""Spec 9: what a refusal looks like (status from the reason table, a short text body naming the
reason and the rule, X-Egress-Reason / X-Egress-Rule headers) and the audit log: one JSON line per
decision, every documented field present, values as the gateway saw them."""

from __future__ import annotations

import json
import re

import pytest

from gateway.decision import REASONS
from tests.e2e.helpers import (  # noqa: F401  (fixtures are used by name)
    ALL_UPSTREAMS,
    assert_untouched,
    audit_for,
    connect_proxy,
    fresh_upstreams,
    gateway,
    get,
    tls_tunnel,
    tunnel,
)

DOCUMENTED_FIELDS = ("time", "event", "client", "decision", "reason", "status", "rule", "host", "port", "address",
                     "sni", "host_header", "method", "scheme", "path", "message")
EVENTS = {"connect", "request", "tls", "connection", "response"}
RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")


def _check_shape(line: dict) -> None:
    missing = [f for f in DOCUMENTED_FIELDS if f not in line]
    assert not missing, (missing, line)
    assert RFC3339.match(line["time"]), line["time"]
    assert line["event"] in EVENTS, line
    assert line["decision"] in ("allow", "deny"), line
    assert line["reason"] in REASONS, line
    if line["decision"] == "deny":
        assert line["status"] == REASONS[line["reason"]][0], line
    else:
        assert (line["reason"], line["status"]) == ("allowed", None), line
    assert isinstance(line["message"], str) and line["message"], line


# --- the refusal on the wire ----------------------------------------------------------------


def _refusals(gateway):
    """(response, expected reason, expected rule) for one refusal of each status class."""
    out = []
    conn, answer = tunnel(gateway, "other.test:443")
    conn.close()
    out.append((answer, "no_rule", None))
    conn, answer = tunnel(gateway, "allowed.test:8443")
    conn.close()
    out.append((answer, "port_not_allowed", "allowed"))
    with tls_tunnel(gateway, "api.test:443") as tls:
        out.append((get(tls, "/admin", "api.test"), "path_not_allowed", "api"))
        out.append((get(tls, "/ok/x", "other.test"), "host_mismatch", None))
    with connect_proxy(gateway) as plain:
        out.append((plain.request("GET", "/x", [("Host", "allowed.test")]), "origin_form", None))
    conn, answer = tunnel(gateway, "nowhere.invalid:443")
    conn.close()
    out.append((answer, "resolve_failed", "nowhere"))  # the rule that allowed it, before resolution failed
    return out


def test_refusals_name_reason_and_rule(gateway, upstreams):
    for response, reason, rule in _refusals(gateway):
        assert response.status == REASONS[reason][0], (reason, response)
        assert response.header("X-Egress-Reason") == reason
        assert response.header("X-Egress-Rule") == rule
        assert response.header("Content-Type") == "text/plain; charset=utf-8"
        assert response.header("Cache-Control") == "no-store"
        lines = response.text.splitlines()
        assert lines[0].startswith("egress gateway: "), response.text
        assert f"reason: {reason}" in lines
        assert (f"rule: {rule}" in lines) == (rule is not None), response.text
        assert len(response.body) < 2048
    assert_untouched(upstreams, *ALL_UPSTREAMS)


# --- the audit log --------------------------------------------------------------------------


def test_one_line_per_decision_in_a_tunnel(gateway, upstreams):
    with tls_tunnel(gateway, "allowed.test:443") as tls:
        assert get(tls, "/audited?q=1", "allowed.test").status == 200
        assert get(tls, "/other", "other.test").status == 421
        client = tls.client
    lines = audit_for(gateway, client, 3)
    for line in lines:
        _check_shape(line)
    connect, allowed, denied = lines
    address = upstreams.hosts["allowed.test"]
    assert {k: connect[k] for k in ("event", "client", "decision", "reason", "rule", "host", "port", "address", "method")} == {
        "event": "connect", "client": client, "decision": "allow", "reason": "allowed", "rule": "allowed",
        "host": "allowed.test", "port": 443, "address": address, "method": "CONNECT",
    }
    assert {k: allowed[k] for k in ("event", "decision", "rule", "host", "port", "address", "sni", "host_header",
                                    "method", "scheme", "path")} == {
        "event": "request", "decision": "allow", "rule": "allowed", "host": "allowed.test", "port": 443,
        "address": address, "sni": "allowed.test", "host_header": "allowed.test", "method": "GET",
        "scheme": "https", "path": "/audited?q=1",
    }
    assert {k: denied[k] for k in ("event", "decision", "reason", "status", "host", "port", "host_header", "path")} == {
        "event": "request", "decision": "deny", "reason": "host_mismatch", "status": 421, "host": "allowed.test",
        "port": 443, "host_header": "other.test", "path": "/other",
    }
    # nothing else was logged for this connection, even after it closed
    assert len(audit_for(gateway, client, 4, wait=0.3)) == 3


def test_denied_connect_line(gateway, upstreams):
    conn, answer = tunnel(gateway, "other.test:443")
    conn.close()
    assert answer.status == 403
    [line] = audit_for(gateway, conn.client)
    _check_shape(line)
    assert {k: line[k] for k in ("event", "decision", "reason", "status", "rule", "host", "port", "address", "method")} == {
        "event": "connect", "decision": "deny", "reason": "no_rule", "status": 403, "rule": None,
        "host": "other.test", "port": 443, "address": None, "method": "CONNECT",
    }


def test_absolute_form_lines(gateway, upstreams):
    with connect_proxy(gateway) as conn:
        assert conn.request("GET", "http://allowed.test/a", [("Host", "allowed.test")]).status == 200
        assert conn.request("POST", "http://other.test/b", [("Host", "other.test")], body=b"x").status == 403
        client = conn.client
    allowed, denied = audit_for(gateway, client, 2)
    for line in (allowed, denied):
        _check_shape(line)
    assert (allowed["event"], allowed["decision"], allowed["rule"], allowed["host"], allowed["port"], allowed["address"],
            allowed["scheme"], allowed["method"], allowed["path"]) == (
        "request", "allow", "plain", "allowed.test", 80, upstreams.hosts["allowed.test"], "http", "GET", "/a")
    assert (denied["decision"], denied["reason"], denied["host"], denied["port"], denied["address"], denied["method"]) == (
        "deny", "no_rule", "other.test", 80, None, "POST")


@pytest.mark.parametrize("path", [
    '/ok/"},{"decision":"allow"}',
    "/ok/%0a%7b%22decision%22%3a%22allow%22%7d",
    "/ok/\u00e9t\u00e9",
    "/ok/" + "a" * 5000,
])
def test_hostile_values_stay_one_json_line(gateway, upstreams, path):
    before = gateway.audit_path.read_text(encoding="utf-8").count("\n") if gateway.audit_path.exists() else 0
    with tls_tunnel(gateway, "api.test:443") as tls:
        tls.send(f"GET {path} HTTP/1.1\r\nHost: api.test\r\n\r\n".encode("utf-8"))
        try:
            tls.read_response()
        except ConnectionError:
            pass
        client = tls.client
    lines = audit_for(gateway, client, 2)
    raw = gateway.audit_path.read_text(encoding="utf-8").split("\n")[before:-1]
    assert all(json.loads(r) for r in raw)  # every physical line is one JSON object
    assert [line["event"] for line in lines][:1] == ["connect"]
    requests = [line for line in lines if line["event"] == "request"]
    assert len(requests) == 1, lines
    _check_shape(requests[0])
    logged = requests[0]["path"]
    assert logged == (path if len(path) <= 2048 else path[:2048] + "\u2026")  # long values are clipped


def test_unicode_line_separators_do_not_split_audit_lines(start_gateway, upstreams):
    """Sandbox-chosen paths with U+2028/U+2029/U+0085 must not break the one-line-per-decision
    format for readers that split on every Unicode line boundary (Python's str.splitlines, which
    the test support's GatewayProcess.audit() uses, JavaScript, many log shippers)."""
    gateway = start_gateway("""
    - id: api
      hosts: [api.test]
      paths: ["/ok/**"]
    """)
    paths = [f"/ok/a{separator}b" for separator in ("\u2028", "\u2029", "\u0085")]
    for path in paths:
        with tls_tunnel(gateway, "api.test:443") as tls:
            tls.send(f"GET {path} HTTP/1.1\r\nHost: api.test\r\n\r\n".encode("utf-8"))
            try:
                tls.read_response()
            except ConnectionError:
                pass
    text = gateway.audit_path.read_text(encoding="utf-8")
    physical = text.split("\n")[:-1]
    assert all(json.loads(line) for line in physical)
    assert len(physical) == 2 * len(paths)  # connect + request per path
    assert text.splitlines() == physical, "an audit line contains a raw Unicode line separator"
    requests = [line for line in gateway.audit() if line["event"] == "request"]
    assert [line["path"] for line in requests] == paths
