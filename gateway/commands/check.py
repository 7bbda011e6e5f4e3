"""`egress-gateway check [--strict] [--format json] FILE...`: validate policy files without running anything.

Errors are the loader's, exactly (FILE:LINE:COLUMN: KEY: MESSAGE); a policy that loads is then
linted (gateway/lint.py) for what a reviewer wants to know: unused rules and secrets, shadowed
rules, wildcards over multi-tenant platforms, credentials on broad rules, static_hosts entries the
deny list refuses. Exit status: 2 when any file has errors, 1 when --strict and any warning, else 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..lint import Finding, issue_dict, lint
from ..policy import Policy, PolicyError, load_policy
from ..secretmap import secret_map
from ..secrets import SecretStore
from ..yamlsource import parse
from . import EXIT_FAILED, EXIT_INVALID, EXIT_OK


def register(sub) -> None:
    check = sub.add_parser(
        "check",
        help="validate policy files",
        description=(
            "Validate policy files; print every problem as FILE:LINE:COLUMN: KEY: MESSAGE, then warnings "
            "(FILE:LINE:COLUMN: KEY: warning: MESSAGE [CODE]) for policies that load. Exit status: 2 errors, "
            "1 warnings with --strict, 0 otherwise."
        ),
    )
    check.add_argument("files", metavar="FILE", nargs="+", help="policy files to check")
    check.add_argument("--strict", action="store_true", help="treat warnings as errors (exit status 1)")
    check.add_argument("--format", choices=("text", "json"), default="text",
                       help="json: {\"files\": [{\"file\", \"ok\", \"errors\": [...], \"warnings\": [...], "
                            "\"secrets\": {...}}]}")
    check.set_defaults(func=main)


def check_file(path: str) -> tuple[dict, str | None, list[Finding], PolicyError | None]:
    """(json result, ok line, warnings, loader error) for one file."""
    try:
        policy = load_policy(path)
    except PolicyError as exc:
        result = {"file": path, "ok": False, "errors": [issue_dict(i) for i in exc.issues], "warnings": [],
                  "rules": None, "sha256": None, "secrets": None}
        return result, None, [], exc
    text = Path(path).read_text(encoding="utf-8")
    findings = sorted(lint(policy, text) + unusable_secrets(policy, text),
                      key=lambda f: (f.location.line, f.location.column, f.code))
    summary = f"{path}: ok ({len(policy.rules)} rules, sha256 {policy.sha256})"
    result = {"file": path, "ok": True, "errors": [], "warnings": [f.as_dict() for f in findings],
              "rules": len(policy.rules), "sha256": policy.sha256,
              # where every secret can go, and the proof it goes nowhere else (docs/policy.md)
              "secrets": secret_map(policy, text).as_dict()}
    return result, summary, findings, None


def unusable_secrets(policy: Policy, text: str) -> list[Finding]:
    """Secrets whose variable is set, or whose file exists, here, but whose value the gateway would
    refuse (a second line, a control character, ...): the requests that need them would fail with
    502 secret_unavailable. Absent ones are not reported: `check` often runs where secrets are not.
    Read from this process's environment and files; the messages never hold a value."""
    problems = SecretStore(policy.secrets).problems(present_only=True)
    if not problems:
        return []
    root, _ = parse(text, policy.source)
    found = []
    for name, why in problems.items():
        kind = "env" if policy.secrets[name].env else "file"
        node = root
        for key in ("secrets", name, kind):
            child = node.value.get(key) if isinstance(node.value, dict) else None
            if child is None:
                break
            node = child
        found.append(Finding("unusable-secret", node.location, f"secrets.{name}.{kind}",
                             f"secret {name} is unavailable: {why}"))
    return found


def main(args: argparse.Namespace) -> int:
    status = EXIT_OK
    results = []
    for path in args.files:
        result, summary, findings, error = check_file(path)
        if error is not None:
            status = EXIT_INVALID
        elif findings and args.strict:
            result["ok"] = False
            status = max(status, EXIT_FAILED)
        results.append(result)
        if args.format == "json":
            continue
        if error is not None:
            print(error, file=sys.stderr)
            continue
        for finding in findings:
            print(finding, file=sys.stderr)
        if findings:
            n = f"{len(findings)} warning{'s' if len(findings) > 1 else ''}"
            summary += f", {n} (errors with --strict)" if args.strict else f", {n}"
        print(summary if result["ok"] else summary.replace(": ok (", ": FAILED (", 1))
    if args.format == "json":
        print(json.dumps({"files": results}, indent=2))
    return status
