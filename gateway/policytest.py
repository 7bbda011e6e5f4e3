"""Policy tests: YAML files of requests and the decision each must get, run by `egress-gateway test`.

```yaml
policy: ../github.yaml            # relative to this file
cases:
  - url: https://api.github.com/repos/example-org/app/pulls
    method: POST                  # default GET
    sandbox: ci                   # or source_ip: 10.8.0.7 (not both); default: a client no entry names
    expect: allow                 # allow | deny | would_deny (deny passes for would_deny too)
    rule: github-api              # optional: the deciding rule
    reason: allowed               # optional: a reason code
    inject: [GITHUB_TOKEN]        # optional: exactly these secret names are injected ([] = none)
    addresses: [140.82.112.6]     # optional: what the host resolves to
    headers:                      # optional: request header fields (method overrides, credentials)
      X-HTTP-Method-Override: DELETE
```

Each case is decided exactly like `explain` decides it. Names resolve through the policy's
`static_hosts`, or through the case's `addresses`; any other name is decided *without* resolution
(no DNS, so tests are deterministic and offline): its addresses are not checked against the deny
list. Give `addresses` to test the deny list.

Pure apart from `run_file`, which reads the test file and the policy it names.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from .decision import REASONS
from .engine import Engine
from .explain import ExplainError, Explanation, Target, explain, parse_target, scope_for
from .hostnames import IPAddress
from .lint import issue_dict
from .policy import Policy, PolicyError, load_policy
from .yamlsource import ConfigIssue, Location, Node, Validator, parse_checked

FILE_KEYS = {"policy", "cases", "description"}
CASE_KEYS = {"name", "url", "method", "sandbox", "source_ip", "expect", "reason", "rule", "inject", "addresses",
             "headers"}
# deny also passes for would_deny: the allowlist denies it, report mode only lets it through (so a
# test keeps passing when a rule goes from report to enforce); would_deny asserts report mode itself.
EXPECTATIONS = ("allow", "deny", "would_deny")


@dataclass(frozen=True)
class Case:
    location: Location
    path: str  # cases[i]
    url: str
    target: Target
    expect: str
    method: str = "GET"
    name: str | None = None
    sandbox: str | None = None
    source_ip: str | None = None
    reason: str | None = None
    rule: str | None = None
    inject: tuple[str, ...] | None = None
    addresses: tuple[IPAddress, ...] | None = None
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        what = self.url if self.target.scheme == "tcp" else f"{self.method} {self.url}"
        who = f" [sandbox {self.sandbox}]" if self.sandbox else f" [source {self.source_ip}]" if self.source_ip else ""
        return f"{self.name}: {what}{who}" if self.name else f"{what}{who}"


@dataclass
class CaseFile:
    file: str
    policy: str | None  # path of the policy, resolved against the test file's directory
    policy_location: Location
    cases: list[Case]


@dataclass
class CaseResult:
    case: Case
    explanation: Explanation
    failures: list[str]

    @property
    def passed(self) -> bool:
        return not self.failures


@dataclass
class FileResult:
    file: str
    policy: str | None
    results: list[CaseResult] = field(default_factory=list)
    errors: list[ConfigIssue] = field(default_factory=list)  # an invalid test file (or policy)

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def failed(self) -> int:
        return sum(not r.passed for r in self.results)


def parse_cases(text: str, source: str, policy_override: str | None = None) -> CaseFile:
    """Parse and validate a test file; PolicyError (file:line:column, key path) when it is invalid."""
    c, root, top = parse_checked(text, source, FILE_KEYS)
    policy_path = policy_override
    policy_location = root.location
    if "policy" in top:
        policy_location = top["policy"].location
        named = c.string(top["policy"], "policy")
        if named is not None and policy_override is None:
            policy_path = os.path.normpath(Path(source).parent / named)
    elif policy_override is None:
        c.error(root, "policy", "missing required key 'policy' (the policy file, relative to this file)")
    if "description" in top:
        c.string(top["description"], "description")
    cases: list[Case] = []
    if "cases" not in top:
        c.error(root, "cases", "missing required key 'cases'")
    elif not isinstance(top["cases"].value, list) or not top["cases"].value:
        c.error(top["cases"], "cases", "must be a non-empty list of cases")
    else:
        for i, item in enumerate(top["cases"].value):
            case = _case(c, item, f"cases[{i}]")
            if case is not None:
                cases.append(case)
    if c.issues:
        raise PolicyError(c.issues)
    return CaseFile(source, policy_path, policy_location, cases)


def _case(c: Validator, node: Node, path: str) -> Case | None:
    fields = c.mapping(node, path, CASE_KEYS)
    if fields is None:
        return None
    before = len(c.issues)
    c.required(node, path, fields, ("url", "expect"))
    values: dict = {}
    for key in ("name", "url", "method", "sandbox", "source_ip", "expect", "reason", "rule"):
        if key in fields:
            values[key] = c.string(fields[key], f"{path}.{key}")
    target = None
    if values.get("url"):
        try:
            target = parse_target(values["url"])
        except ExplainError as exc:
            c.error(fields["url"], f"{path}.url", str(exc))
    if values.get("method"):
        values["method"] = values["method"].upper()
    if values.get("expect") and values["expect"] not in EXPECTATIONS:
        c.error(fields["expect"], f"{path}.expect", f"{values['expect']!r}: expect must be allow, deny or would_deny")
    if values.get("reason") and values["reason"] not in REASONS:
        c.error(fields["reason"], f"{path}.reason", f"{values['reason']!r} is not a reason code")
    if "sandbox" in fields and "source_ip" in fields:
        c.error(node, path, "give sandbox or source_ip, not both")
    if values.get("source_ip"):
        try:
            ipaddress.ip_address(values["source_ip"].strip("[]"))
        except ValueError:
            c.error(fields["source_ip"], f"{path}.source_ip", f"{values['source_ip']!r} is not an IP address")
    inject = None
    if "inject" in fields:
        items = c.strings(fields["inject"], f"{path}.inject")
        inject = tuple(v for _, v in items or ())
    addresses = None
    if "addresses" in fields:
        found = []
        for item, literal in c.strings(fields["addresses"], f"{path}.addresses") or ():
            try:
                found.append(ipaddress.ip_address(literal.strip("[]")))
            except ValueError:
                c.error(item, f"{path}.addresses", f"{literal!r} is not an IP address")
        addresses = tuple(found)
        if isinstance(fields["addresses"].value, list) and not fields["addresses"].value:
            c.error(fields["addresses"], f"{path}.addresses", "must not be empty (leave it out to use static_hosts)")
    headers: list[tuple[str, str]] = []
    if "headers" in fields:
        given = fields["headers"].value
        if not isinstance(given, dict) or not given:
            c.error(fields["headers"], f"{path}.headers", "must be a non-empty mapping of header name to value")
        else:
            for name, item in given.items():
                value = item.value if isinstance(item.value, str) else None
                if not isinstance(name, str) or not name or any(ch in name for ch in " :\r\n\0") or value is None \
                        or any(ch in value for ch in "\r\n\0"):
                    c.error(item, f"{path}.headers.{name}", "a header needs a token name and a one-line string value")
                else:
                    headers.append((name, value))
    if len(c.issues) > before or target is None:
        return None
    return Case(node.location, path, values["url"], target, values["expect"], values.get("method") or "GET",
                values.get("name"), values.get("sandbox"), values.get("source_ip"), values.get("reason"),
                values.get("rule"), inject, addresses, tuple(headers))


def run_cases(policy: Policy, cases: list[Case]) -> tuple[list[CaseResult], list[ConfigIssue]]:
    """Decide every case; the issues are cases the policy cannot answer (an unknown sandbox)."""
    engine = Engine.build(policy)
    results, issues = [], []
    for case in cases:
        try:
            scope_for(policy, case.sandbox, case.source_ip)
        except ExplainError as exc:
            issues.append(ConfigIssue(case.location, case.path, str(exc)))
            continue
        e = explain(policy, case.target, case.method, sandbox=case.sandbox, source_ip=case.source_ip,
                    addresses=case.addresses, engine=engine, headers=case.headers)
        results.append(CaseResult(case, e, _failures(case, e)))
    return results, issues


def _failures(case: Case, e: Explanation) -> list[str]:
    d = e.decision
    got = d.verdict
    out = []
    matches = got == case.expect or (case.expect == "deny" and got == "would_deny")
    if not matches or (case.reason and case.reason != d.reason):
        want = case.expect + (f" ({case.reason})" if case.reason else "")
        out.append(f"expected {want}, got {got} ({d.reason}{', rule ' + d.rule if d.rule else ''}): {d.message}")
    if case.rule is not None and case.rule != d.rule:
        out.append(f"expected rule {case.rule}, got {d.rule or 'no rule'}")
    if case.inject is not None and sorted(case.inject) != sorted(e.injected):
        out.append(f"expected injected [{', '.join(case.inject)}], got [{', '.join(e.injected)}]")
    return out


def run_file(path: str | Path, policy_override: str | None = None) -> FileResult:
    """Read a test file and the policy it names, and run every case."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return FileResult(str(path), None, errors=[ConfigIssue(Location(str(path), 1, 1), "", f"cannot read: {exc}")])
    try:
        suite = parse_cases(text, str(path), policy_override)
    except PolicyError as exc:
        return FileResult(str(path), None, errors=list(exc.issues))
    try:
        policy = load_policy(suite.policy)
    except PolicyError as exc:
        where = ConfigIssue(suite.policy_location, "policy", f"the policy {suite.policy} does not load:")
        return FileResult(str(path), suite.policy, errors=[where, *exc.issues])
    results, issues = run_cases(policy, suite.cases)
    return FileResult(str(path), suite.policy, results, issues)


def summary(files: list[FileResult]) -> str:
    passed = sum(f.passed for f in files)
    failed = sum(f.failed for f in files)
    return f"{passed} passed, {failed} failed"


def render_text(files: list[FileResult], verbose: bool = False) -> str:
    lines = []
    for f in files:
        if f.errors:
            lines.append(f"{f.file}: INVALID")
            lines.extend(f"  {issue}" for issue in f.errors)
            if not f.results:
                continue
        marks = "".join("." if r.passed else "F" for r in f.results)
        lines.append(f"{f.file} (policy {f.policy}): {marks}")
        for r in f.results:
            if verbose or not r.passed:
                status = "PASS" if r.passed else "FAIL"
                lines.append(f"  {status} {r.case.location}: {r.case.label}")
                lines.extend(f"       {why}" for why in r.failures)
                if verbose:
                    lines.extend(f"       limit: {x.describe()}" for x in r.explanation.limits)
    invalid = sum(1 for f in files if f.errors)
    if invalid:
        lines.append(f"{invalid} test file{'s' if invalid > 1 else ''} invalid")
    lines.append(summary(files))
    return "\n".join(lines) + "\n"


def as_dict(files: list[FileResult]) -> dict:
    return {
        "files": [
            {
                "file": f.file,
                "policy": f.policy,
                "ok": not f.errors and f.failed == 0,
                "errors": [issue_dict(i) for i in f.errors],
                "cases": [
                    {"line": r.case.location.line, "path": r.case.path, "label": r.case.label, "passed": r.passed,
                     "failures": r.failures, "decision": r.explanation.decision.reason, "verdict": r.explanation.verdict,
                     "rule": r.explanation.decision.rule, "injected": r.explanation.injected,
                     "limits": r.explanation.as_dict()["limits"]}
                    for r in f.results
                ],
            }
            for f in files
        ],
        "passed": sum(f.passed for f in files),
        "failed": sum(f.failed for f in files),
        "invalid": sum(1 for f in files if f.errors),
    }


def exit_status(files: list[FileResult]) -> int:
    if any(f.errors for f in files):
        return 2
    return 1 if any(f.failed for f in files) else 0
