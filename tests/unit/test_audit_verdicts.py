"""One place builds an audit line's verdict (issue 14 part 5): gateway.decision.verdict_fields.

In report mode the transparent TLS and raw TCP lines were written `allow` for connections the
allowlist refused, because those guards spelled the verdict by hand (`"allow" if pin else "deny"`).
Here: the builder says `would_deny` for every report-mode let-through, from the Decision alone, and
no addon spells `decision=`, `reason=` or `status=` into an audit record itself.
"""

from __future__ import annotations

import ast
import ipaddress
from pathlib import Path

import pytest

from gateway.decision import Decision, verdict_fields
from gateway.engine import Engine, RequestFacts
from gateway.hostnames import canonical_host
from gateway.policy import compile_policy

ADDONS = Path(__file__).resolve().parents[2] / "addons"

REPORT = """
version: 1
mode: report
rules:
  - id: web
    hosts: [allowed.example]
    methods: [GET]
  - id: ssh
    protocol: tcp
    hosts: [203.0.113.7]
    ports: [22]
"""


@pytest.fixture(scope="module")
def engine():
    return Engine.build(compile_policy(REPORT, "report.yaml"))


def test_allow_deny_and_would_deny():
    assert verdict_fields(Decision.allow("r", "ok")) == {"decision": "allow", "reason": "allowed", "status": None,
                                                        "rule": "r", "message": "ok"}
    assert verdict_fields(Decision.deny("no_rule", "no")) == {"decision": "deny", "reason": "no_rule", "status": 403,
                                                             "rule": None, "message": "no"}
    would = Decision(True, "path_not_allowed", "report mode: x", "r", would_deny=True)
    assert verdict_fields(would) == {"decision": "would_deny", "reason": "path_not_allowed", "status": None,
                                     "rule": "r", "message": "report mode: x"}


def test_status_only_when_an_http_refusal_carried_it():
    assert verdict_fields(Decision.deny("too_many_connections", "x"), status_sent=False)["status"] is None
    assert verdict_fields(Decision.deny("too_many_connections", "x"))["status"] == 503
    assert verdict_fields(Decision(False, "policy_invalid", "bad"))["status"] is None  # not a refusal code
    assert verdict_fields(Decision(True, "redacted", "x"))["decision"] == "allow"


def test_report_mode_decisions_of_every_kind_are_would_deny(engine):
    """The decisions the TLS guard (destination), layer guard (raw TCP) and request guard get."""
    destination = engine.check_destination(canonical_host("other.example"), 443)
    tcp = engine.check_tcp(ipaddress.ip_address("198.51.100.9"), 22)
    tcp_port = engine.check_tcp(ipaddress.ip_address("203.0.113.7"), 2222)
    request = engine.check_request(RequestFacts(canonical_host("allowed.example"), 443, "https", "DELETE", "/"))
    for decision, reason in ((destination, "no_rule"), (tcp, "no_rule"), (tcp_port, "port_not_allowed"),
                             (request, "method_not_allowed")):
        assert decision.allowed  # let through...
        fields = verdict_fields(decision)
        assert (fields["decision"], fields["reason"], fields["status"]) == ("would_deny", reason, None)  # ...said so
    allowed = engine.check_tcp(ipaddress.ip_address("203.0.113.7"), 22)
    assert verdict_fields(allowed)["decision"] == "allow"


def _record_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "record":
            yield node


@pytest.mark.parametrize("path", sorted(ADDONS.glob("*.py")), ids=lambda p: p.name)
def test_no_addon_spells_a_verdict_by_hand(path):
    tree = ast.parse(path.read_text(), str(path))
    hand_spelled = []
    for call in _record_calls(tree):
        for keyword in call.keywords:
            if keyword.arg in ("decision", "reason", "status"):
                hand_spelled.append(f"{path.name}:{call.lineno}: record(..., {keyword.arg}=...)")
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key in node.keys:
                if isinstance(key, ast.Constant) and key.value == "decision":
                    hand_spelled.append(f"{path.name}:{node.lineno}: a dict with a 'decision' key")
    assert hand_spelled == [], "build the verdict with gateway.decision.verdict_fields"


def test_the_scan_would_see_the_old_spelling():
    old = 'self.state.record(event="tls", decision="allow" if pin is not None else "deny", reason=d.reason)'
    assert [k.arg for call in _record_calls(ast.parse(old)) for k in call.keywords] == ["event", "decision", "reason"]
