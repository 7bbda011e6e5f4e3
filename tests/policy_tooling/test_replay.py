"""`egress-gateway replay`: re-decide audit lines under a new policy; report what changes."""

from __future__ import annotations

import json

import pytest

from gateway.audit import AuditLog
from gateway.policy import compile_policy
from gateway.replay import parse_audit, replay

from .helpers import run_cli, write

OLD = """\
version: 1
rules:
  - id: api
    hosts: [api.example.com]
    methods: [GET, POST]
    paths: ["/v1/**"]
  - id: mirror
    hosts: [mirror.example.com]
sandboxes:
  - id: ci
    source_ips: [10.8.0.0/16]
    rules: [api, mirror]
  - id: default
    rules: [api]
"""


def audit(tmp_path, *entries, name="audit.jsonl"):
    """Lines exactly as the gateway writes them (AuditLog: every field, nulls included)."""
    path = tmp_path / name
    log = AuditLog(str(path))
    for entry in entries:
        if isinstance(entry, str):
            log.close()
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(entry + "\n")
            log = AuditLog(str(path))
        else:
            log.record(**entry)
    log.close()
    return path


def request(path, method="GET", host="api.example.com", client="127.0.0.1:50000", decision="allow", reason="allowed",
            rule="api", sandbox="default", scheme="https", port=443, **extra):
    return {"event": "request", "client": client, "sandbox": sandbox, "mode": "regular", "decision": decision,
            "reason": reason, "status": None if decision == "allow" else 403, "rule": rule, "host": host,
            "port": port, "address": "151.101.0.10" if decision == "allow" else None, "method": method,
            "scheme": scheme, "path": path, "message": "..."} | extra


def test_nothing_changes_exit_0(tmp_path):
    policy = write(tmp_path / "old.yaml", OLD)
    log = audit(tmp_path, request("/v1/items"), request("/v2/x", decision="deny", reason="path_not_allowed"))
    result = run_cli("replay", "--policy", policy, log)
    assert result.status == 0, result.stdout
    assert result.stdout == (
        f"replayed 2 of 2 audit lines under {policy}\n"
        "2 replayed: 2 unchanged, 0 newly denied, 0 newly allowed, 0 newly would_deny, 0 reason/rule changed, "
        "0 credentials changed; "
        "0 lines skipped\n"
    )


def test_newly_denied_newly_allowed_and_changed(tmp_path):
    new = write(tmp_path / "new.yaml", """\
        version: 1
        rules:
          - id: api-read
            hosts: [api.example.com]
            methods: [GET]
            paths: ["/v1/**"]
          - id: new-host
            hosts: [new.example.com]
        sandboxes:
          - id: default
            rules: [api-read, new-host]
    """)
    log = audit(
        tmp_path,
        request("/v1/items"),                                                       # 1: rule renamed
        request("/v1/items", method="POST"),                                        # 2: newly denied
        request("/v1/items", method="POST"),                                        # 3: same, grouped
        request("/", host="new.example.com", decision="deny", reason="no_rule", rule=None),  # 4: newly allowed
        request("/v2/x", decision="deny", reason="no_rule", rule=None),                      # 5: reason changed
    )
    result = run_cli("replay", "--policy", new, log)
    assert result.status == 1
    assert result.stdout.splitlines() == [
        f"replayed 5 of 5 audit lines under {new}",
        f"NEWLY DENIED  request POST https://api.example.com:443/v1/items [sandbox default]  x2 ({log}:2, {log}:3)",
        "    was: allow by api",
        "    now: deny method_not_allowed (rule api-read): no rule allows POST https://api.example.com:443/v1/items "
        "(method not allowed)",
        f"NEWLY ALLOWED request GET https://new.example.com:443/ [sandbox default]  x1 ({log}:4)",
        "    was: deny no_rule",
        "    now: allow by new-host",
        f"CHANGED       request GET https://api.example.com:443/v1/items [sandbox default]  x1 ({log}:1)",
        "    was: allow by api",
        "    now: allow by api-read",
        f"CHANGED       request GET https://api.example.com:443/v2/x [sandbox default]  x1 ({log}:5)",
        "    was: deny no_rule",
        "    now: deny path_not_allowed (rule api-read): no rule allows GET https://api.example.com:443/v2/x "
        "(path not allowed)",
        "5 replayed: 0 unchanged, 2 newly denied, 1 newly allowed, 0 newly would_deny, 2 reason/rule changed, "
        "0 credentials changed; "
        "0 lines skipped",
    ]


def test_json_output(tmp_path):
    new = write(tmp_path / "new.yaml", OLD.replace('paths: ["/v1/**"]', 'paths: ["/v1/items"]'))
    log = audit(tmp_path, request("/v1/items"), request("/v1/other"), request("/v1/other"))
    result = run_cli("replay", "--policy", new, "--format", "json", log)
    assert result.status == 1
    report = json.loads(result.stdout)
    assert report["policy"] == str(new)
    assert report["summary"] == {
        "lines": 3, "replayed": 3, "unchanged": 1, "changed": 2, "newly_denied": 2, "newly_allowed": 0,
        "newly_would_deny": 0, "reason_changed": 0, "rule_changed": 0, "credentials_changed": 0, "reason_or_rule_changed": 0,
        "skipped": 0, "skipped_by_cause": {},
    }
    [change] = report["changes"]
    assert change == {
        "kinds": ["newly_denied"], "event": "request", "host": "api.example.com", "port": 443, "scheme": "https",
        "method": "GET", "path": "/v1/other", "dns_type": None, "sandbox": "default",
        "old": {"decision": "allow", "reason": "allowed", "rule": "api", "injected": []},
        "new": {"decision": "deny", "reason": "path_not_allowed", "rule": "api", "injected": [],
                "message": "no rule allows GET https://api.example.com:443/v1/other (path not allowed)"},
        "count": 2, "lines": [f"{log}:2", f"{log}:3"],
    }


def test_sandbox_comes_from_the_client_address(tmp_path):
    new = write(tmp_path / "new.yaml", OLD.replace("  - id: default\n    rules: [api]\n", "  - id: default\n    rules: []\n"))
    log = audit(
        tmp_path,
        request("/v1/items", client="10.8.0.5:40000", sandbox="ci"),          # still ci: unchanged
        request("/v1/items", client="192.0.2.9:40000", sandbox="default"),    # default lost api: newly denied
        request("/", host="mirror.example.com", client="127.0.0.1:1", sandbox="default",
                decision="deny", reason="no_rule", rule=None),                # unchanged deny
        request("/v1/items", client=None, sandbox="ci"),                     # no client: by sandbox id
    )
    policy = compile_policy(new.read_text(), str(new))
    records, result = parse_audit(log.read_text().splitlines(), source="a")
    result = replay(policy, records, result)
    assert (result.replayed, result.unchanged, result.count("newly_denied")) == (4, 3, 1)
    assert result.changes[0].lines == ["a:2"] and result.changes[0].new.reason == "no_rule"


def test_connect_tls_and_dns_events(tmp_path):
    new = write(tmp_path / "new.yaml", """\
        version: 1
        rules:
          - id: api
            hosts: [api.example.com]
            ports: [8443]
    """)
    log = audit(
        tmp_path,
        {"event": "connect", "client": "127.0.0.1:1", "decision": "allow", "reason": "allowed", "rule": "api",
         "host": "api.example.com", "port": 443, "address": "151.101.0.10"},
        {"event": "tls", "client": "10.203.0.2:1", "mode": "transparent", "decision": "deny", "reason": "no_rule",
         "host": "api.example.com", "port": 8443, "sni": "api.example.com"},
        {"event": "dns", "client": "10.203.0.2:1", "decision": "deny", "reason": "no_rule", "host": "api.example.com",
         "dns_type": "A", "rcode": "NXDOMAIN"},
        {"event": "dns", "client": "10.203.0.2:1", "decision": "allow", "reason": "allowed", "rule": "api",
         "host": "api.example.com", "dns_type": "TXT", "rcode": "NOERROR"},
    )
    policy = compile_policy(new.read_text(), str(new))
    records, result = parse_audit(log.read_text().splitlines(), source="a")
    result = replay(policy, records, result)
    kinds = {c.record.event + ":" + (c.record.dns_type or ""): (c.kinds, c.new.reason) for c in result.changes}
    assert kinds == {
        "connect:": (("newly_denied",), "port_not_allowed"),
        "tls:": (("newly_allowed",), "allowed"),
        "dns:A": (("newly_allowed",), "allowed"),
        "dns:TXT": (("newly_denied",), "dns_type_refused"),
    }


def test_addresses_are_rechecked(tmp_path):
    new = write(tmp_path / "new.yaml", """\
        version: 1
        network:
          allow_ip_ranges: [10.20.30.0/24]
        resolver:
          static_hosts:
            mirror.internal: [10.20.30.5]
        rules:
          - id: api
            hosts: [api.example.com, mirror.internal, old.internal]
    """)
    log = audit(
        tmp_path,
        request("/", host="mirror.internal", decision="deny", reason="denied_address", rule="api", client=None, sandbox=None),
        request("/", host="old.internal", decision="deny", reason="denied_address", rule="api", client=None, sandbox=None),
        request("/", client=None, sandbox=None, address="10.1.1.1"),
    )
    policy = compile_policy(new.read_text(), str(new))
    records, result = parse_audit(log.read_text().splitlines(), source="a")
    result = replay(policy, records, result)
    changes = {c.record.host: (c.kinds, c.new.reason) for c in result.changes}
    assert changes == {
        "mirror.internal": (("newly_allowed",), "allowed"),  # now in static_hosts, exempted
        "api.example.com": (("newly_denied",), "denied_address"),  # the recorded address is re-checked
    }
    assert result.unchanged == 1  # old.internal: address unknown, the recorded refusal stands


def test_lines_that_are_not_replayed(tmp_path):
    policy = write(tmp_path / "old.yaml", OLD)
    log = audit(
        tmp_path,
        request("/v1/items"),
        "not json at all",
        "[1, 2]",
        {"event": "response", "decision": "allow", "reason": "allowed", "host": "api.example.com", "port": 443},
        {"event": "connection", "decision": "deny", "reason": "non_http", "protocol": "tcp"},
        request("/v1/items", decision="deny", reason="host_mismatch", rule=None),
        {"event": "request", "decision": "deny", "reason": "internal_error", "status": 500},
        request("/v1/items", decision="deny", reason="malformed_request", rule=None),
        "",
    )
    result = run_cli("replay", "--policy", policy, log)
    assert result.status == 0
    assert "1 replayed: 1 unchanged" in result.stdout
    assert "; 7 lines skipped\n" in result.stdout
    for cause in ("skipped 1: not JSON", "skipped 1: not a JSON object", "skipped 1: event response (not replayed)",
                  "skipped 1: event connection (not replayed)",
                  "skipped 1: reason host_mismatch (not decided by the policy)",
                  "skipped 1: reason internal_error (not decided by the policy)",
                  "skipped 1: reason malformed_request (not decided by the policy)"):
        assert cause in result.stdout


def test_several_files_and_bad_input(tmp_path):
    policy = write(tmp_path / "old.yaml", OLD)
    a = audit(tmp_path, request("/v1/items"), name="a.jsonl")
    b = audit(tmp_path, request("/v3/x"), name="b.jsonl")
    result = run_cli("replay", "--policy", policy, "--format", "json", a, b)
    assert result.status == 1
    report = json.loads(result.stdout)
    assert report["changes"][0]["lines"] == [f"{b}:1"]
    assert run_cli("replay", "--policy", policy, tmp_path / "missing.jsonl").status == 2
    bad = write(tmp_path / "bad.yaml", "version: 1\nrules: 3\n")
    result = run_cli("replay", "--policy", bad, a)
    assert result.status == 2 and f"{bad}:2:8: rules: must be a list" in result.stderr


def test_credential_changes(tmp_path):
    new = write(tmp_path / "new.yaml", """\
        version: 1
        secrets:
          TOKEN: {env: TOKEN}
          OTHER: {env: OTHER}
        rules:
          - id: api
            hosts: [api.example.com]
            methods: [GET, POST]
            paths: ["/v1/**"]
            inject:
              - header: Authorization
                value: "Bearer ${secrets.TOKEN}"
          - id: mirror
            hosts: [mirror.example.com]
    """)
    log = audit(
        tmp_path,
        request("/v1/items", client=None, sandbox=None, injected=["TOKEN"]),                 # unchanged
        request("/v1/items", client=None, sandbox=None),                                    # now gets TOKEN
        request("/", host="mirror.example.com", rule="mirror", client=None, sandbox=None, injected=["OTHER"]),  # loses it
    )
    result = run_cli("replay", "--policy", new, log)
    assert result.status == 1
    out = result.stdout.splitlines()
    assert f"CREDENTIALS   request GET https://api.example.com:443/v1/items  x1 ({log}:2)" in out
    assert "    now: allow by api, injects [TOKEN]" in out
    assert "    was: allow by mirror, injects [OTHER]" in out
    assert out[-1].endswith("2 credentials changed; 0 lines skipped")


def test_report_mode_verdicts(tmp_path):
    """would_deny is a verdict of its own: replaying a report-mode log under the enforcing policy shows
    what enforcement would refuse, and a report-mode policy shows what it would only log."""
    enforce = write(tmp_path / "enforce.yaml", OLD)
    report = write(tmp_path / "report.yaml", OLD.replace("version: 1\n", "version: 1\nmode: report\n"))
    log = audit(
        tmp_path,
        request("/v2/x", decision="would_deny", reason="path_not_allowed"),
        request("/v2/x", decision="deny", reason="path_not_allowed"),
        request("/v1/items"),
    )
    result = run_cli("replay", "--policy", enforce, "--format", "json", log)
    summary = json.loads(result.stdout)["summary"]
    assert (result.status, summary["newly_denied"], summary["unchanged"]) == (1, 1, 2)
    result = run_cli("replay", "--policy", report, log)
    assert result.status == 1
    assert f"WOULD DENY    request GET https://api.example.com:443/v2/x [sandbox default]  x1 ({log}:2)" in result.stdout
    assert "    now: would_deny path_not_allowed (rule api): report mode: no rule allows" in result.stdout
    assert "1 newly would_deny" in result.stdout


def test_header_method_overrides_are_replayed(tmp_path):
    """A request line records the header overrides it carried (`method_override`); replay judges them
    again, so a refusal made for an override is not reported as newly allowed."""
    old = write(tmp_path / "old.yaml", OLD)
    read_only = write(tmp_path / "new.yaml", OLD.replace("methods: [GET, POST]", "methods: [GET]"))
    log = audit(tmp_path,
                request("/v1/items", method="POST", method_override=["header X-HTTP-Method-Override: DELETE"],
                        decision="deny", reason="method_not_allowed"),
                request("/v1/items", method="GET", method_override=["header X-HTTP-Method-Override: POST"]),
                request("/v1/items?_method=POST", method="GET"))
    result = run_cli("replay", "--policy", old, "--format", "json", log)
    assert result.status == 0, result.stdout
    result = run_cli("replay", "--policy", read_only, "--format", "json", log)
    data = json.loads(result.stdout)
    assert data["summary"]["newly_denied"] == 2 and data["summary"]["newly_allowed"] == 0, data
    [record] = parse_audit([json.dumps(request("/x", method_override=["header X_HTTP_Method: PUT",
                                                                       "query parameter _method: GET"]))])[0]
    assert record.headers == (("X_HTTP_Method", "PUT"),)
    _, result = parse_audit([json.dumps(request("/x", method_override="header X: y"))])
    assert result.skipped == {"malformed fields": 1}


def test_query_overrides_are_replayed_as_recorded_when_the_path_lost_them(tmp_path):
    """The audit line's path is capped (AuditLog, 2048 characters): a long path loses its query and
    the `_method` in it. Replay judges the query overrides the line recorded, so a live refusal is
    not replayed as newly allowed (review 14a F7)."""
    old = write(tmp_path / "old.yaml", OLD)
    long = "/v1/" + "a" * 2100
    log = audit(tmp_path,
                request(long + "?_method=DELETE", decision="deny", reason="method_not_allowed",
                        method_override=["query parameter _method: DELETE"]),
                request(long + "?_method=x;y", decision="deny", reason="method_not_allowed",
                        method_override=["query parameter _method: (not a method name)"]))
    [line, _] = [json.loads(raw) for raw in log.read_text().splitlines()]
    assert "_method" not in line["path"]  # the recorded path really did lose it
    result = run_cli("replay", "--policy", old, "--format", "json", log)
    assert result.status == 0, result.stdout
    [record] = parse_audit([json.dumps(request("/x", method_override=["query parameter a: b: DELETE"]))])[0]
    assert [(o.name, o.method) for o in record.query_overrides] == [("a: b", "DELETE")]
