"""Replay: re-decide recorded decisions under another policy and say what would change.

Input is the gateway's audit log (one JSON object per line). Lines for `request`, `connect`, `tls`
and `dns` events are re-decided with the new policy's engine, by the code live traffic runs
(gateway/session.py: a `tls` line of a transparent connection as its ClientHello, one of a CONNECT
tunnel as the CONNECT; gateway/dns_answer.py; gateway/credential_checks.py), using the recorded
host, port, scheme, method, path, header and query method overrides (`method_override`; the recorded path is
capped, so the query overrides are judged as recorded, not only from it) and client (the client's address
picks the sandbox, as the gateway would; the recorded `sandbox` id is used only when there is no
client address). `request_body` lines (an override in a body) are not replayed: bodies are not logged. What the policy does not
decide is not replayed: 421s, malformed input, refusals of uninspectable bytes, upstream failures,
internal errors, raw TCP connections (the DNS memory behind them is not in the log).

Addresses: an allowed decision's address checks use the new policy's `static_hosts`, else the
recorded `address` (the one the gateway dialled); a recorded `denied_address` refusal with neither
keeps its verdict if the rules still allow the host. Credentials: the names in the recorded
`injected` list are compared with the secrets the new deciding rule would inject.

Pure: `parse_audit` and `replay` take lines and a policy; the command does the reading.
"""

from __future__ import annotations

import ipaddress
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from .decision import Decision
from .dns_answer import DnsAnswer, dns_answer, dns_question
from .engine import Engine
from .credential_checks import credential_verdict
from .hostnames import Host, HostError, IPAddress, canonical_host
from .methods import Override, described_query_overrides, parse_described
from .placeholders import ShapeTokens
from .session import UNCHECKED, ClientSession, decide_destination, decide_request, drive_now
from .policy import Policy, Scope

REPLAYED_EVENTS = ("request", "connect", "tls", "dns")
# Refusals that came from the policy (its rules and address lists). Other refusals (421 restated
# destinations, 400 malformed input, 5xx) would happen again whatever the policy says.
POLICY_REASONS = frozenset({
    "allowed", "no_rule", "port_not_allowed", "scheme_not_allowed", "method_not_allowed", "path_not_allowed",
    "method_forbidden", "bad_path", "denied_address", "dns_type_refused", "plaintext_credentials",
    "credential_host",
})
# Refusals that depend on the request's headers, which the audit log does not record: a replay could
# only ever say "newly allowed" for them, so they are skipped.
HEADER_REASONS = frozenset({"placeholder_misuse", "foreign_credential", "unexpected_body"})
CHANGE_KINDS = ("newly_denied", "newly_allowed", "newly_would_deny", "reason_changed", "rule_changed",
                "credentials_changed")


@dataclass(frozen=True)
class Record:
    source: str  # the audit file
    line: int
    event: str
    host: str
    port: int | None
    verdict: str  # allow | deny | would_deny
    reason: str
    rule: str | None
    scheme: str | None = None
    method: str | None = None
    path: str | None = None
    sandbox: str | None = None
    client: str | None = None
    address: str | None = None
    dns_type: str | None = None
    injected: tuple[str, ...] = ()
    # Header method overrides the audit line recorded (`method_override`), back as header pairs.
    headers: tuple[tuple[str, str], ...] = ()
    # Query method overrides the audit line recorded: the recorded path is capped at
    # gateway/audit.py's MAX_VALUE_LENGTH, so its query may no longer hold them.
    query_overrides: tuple[Override, ...] = ()
    # A tls line: the connection's mode, the ClientHello's SNI and what a transparent sandbox dialled.
    mode: str | None = None
    sni: str | None = None
    original_destination: str | None = None

    def describe(self) -> str:
        if self.event == "request":
            return f"{self.method} {self.scheme}://{_authority(self.host, self.port)}{self.path}"
        if self.event == "dns":
            return f"{self.dns_type or '?'} {self.host}"
        return f"{_authority(self.host, self.port)}"


def _authority(host: str, port: int | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{shown}:{port}" if port is not None else shown


@dataclass(frozen=True)
class Verdict:
    verdict: str  # allow | deny | would_deny (report mode: let through and logged)
    reason: str
    rule: str | None
    injected: tuple[str, ...] = ()
    message: str = ""

    def text(self) -> str:
        if self.verdict == "allow":
            head = f"allow by {self.rule}"
        else:
            head = f"{self.verdict} {self.reason}" + (f" (rule {self.rule})" if self.rule else "")
        return head + (f", injects [{', '.join(self.injected)}]" if self.injected else "")

    def as_dict(self) -> dict:
        return {"decision": self.verdict, "reason": self.reason, "rule": self.rule, "injected": list(self.injected)}


@dataclass
class Change:
    kinds: tuple[str, ...]
    record: Record
    old: Verdict
    new: Verdict
    sandbox: str | None  # under the new policy
    lines: list[str] = field(default_factory=list)  # "FILE:LINE" of every audit line with this change

    def as_dict(self) -> dict:
        r = self.record
        return {
            "kinds": list(self.kinds), "event": r.event, "host": r.host, "port": r.port, "scheme": r.scheme,
            "method": r.method, "path": r.path, "dns_type": r.dns_type, "sandbox": self.sandbox,
            "old": self.old.as_dict(), "new": self.new.as_dict() | {"message": self.new.message},
            "count": len(self.lines), "lines": self.lines,
        }


@dataclass
class ReplayResult:
    lines: int = 0
    replayed: int = 0
    unchanged: int = 0
    skipped: Counter = field(default_factory=Counter)  # why -> lines
    changes: list[Change] = field(default_factory=list)  # grouped: identical changes share one entry

    def count(self, *kinds: str) -> int:
        """Lines whose change is of any of these kinds."""
        return sum(len(c.lines) for c in self.changes if set(kinds) & set(c.kinds))

    @property
    def changed(self) -> int:
        return sum(len(c.lines) for c in self.changes)

    def summary(self) -> dict:
        return {
            "lines": self.lines, "replayed": self.replayed, "unchanged": self.unchanged, "changed": self.changed,
            **{kind: self.count(kind) for kind in CHANGE_KINDS},
            "reason_or_rule_changed": self.count("reason_changed", "rule_changed"),
            "skipped": sum(self.skipped.values()), "skipped_by_cause": dict(sorted(self.skipped.items())),
        }

    def as_dict(self) -> dict:
        return {"summary": self.summary(), "changes": [c.as_dict() for c in self.changes]}


def parse_audit(lines: Iterable[str], result: ReplayResult | None = None, source: str = "-") -> tuple[list[Record], ReplayResult]:
    """Records to replay; every other line is counted in result.skipped with its cause."""
    result = result or ReplayResult()
    records = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        result.lines += 1
        record, why = _record(source, number, raw)
        if record is None:
            result.skipped[why] += 1
        else:
            records.append(record)
    return records, result


def _record(source: str, number: int, raw: str) -> tuple[Record | None, str]:
    try:
        entry = json.loads(raw)
    except ValueError:
        return None, "not JSON"
    if not isinstance(entry, dict):
        return None, "not a JSON object"
    event = entry.get("event")
    if event not in REPLAYED_EVENTS:
        return None, f"event {event} (not replayed)"
    verdict, reason = entry.get("decision"), entry.get("reason")
    if verdict not in ("allow", "deny", "would_deny") or not isinstance(reason, str):
        return None, "no decision"
    if verdict == "deny" and reason in HEADER_REASONS:
        return None, f"reason {reason} (depends on request headers, which are not recorded)"
    if verdict == "deny" and reason not in POLICY_REASONS:
        return None, f"reason {reason} (not decided by the policy)"
    host, port = entry.get("host"), entry.get("port")
    if not isinstance(host, str) or not host:
        return None, "no host"
    if event != "dns" and (not isinstance(port, int) or isinstance(port, bool)):
        return None, "no port"
    fields = {k: entry.get(k) for k in ("scheme", "method", "path", "sandbox", "client", "address", "dns_type", "rule",
                                         "mode", "sni", "original_destination")}
    if any(v is not None and not isinstance(v, str) for v in fields.values()):
        return None, "malformed fields"
    if event == "request" and not (fields["scheme"] and fields["method"] and fields["path"]):
        return None, "request without scheme, method or path"
    injected = entry.get("injected") or []
    if not isinstance(injected, list) or not all(isinstance(n, str) for n in injected):
        return None, "malformed fields"
    overrides = entry.get("method_override") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        return None, "malformed fields"
    return Record(
        source, number, event, host, port if event != "dns" else None, verdict, reason, fields["rule"],
        fields["scheme"], fields["method"], fields["path"], fields["sandbox"], fields["client"], fields["address"],
        fields["dns_type"], tuple(injected), tuple(parse_described(overrides)),
        tuple(described_query_overrides(overrides)), fields["mode"], fields["sni"], fields["original_destination"],
    ), ""


def _client_ip(client: str | None) -> IPAddress | None:
    if not client:
        return None
    text = client
    if text.startswith("["):
        text = text[1:].split("]", 1)[0]
    elif text.count(":") == 1:
        text = text.rsplit(":", 1)[0]
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


def _scope(policy: Policy, record: Record) -> Scope:
    client = _client_ip(record.client)
    if client is not None:
        return policy.scope_for(client=client)
    if record.sandbox is not None:
        return policy.scope_for(sandbox_id=record.sandbox)
    return policy.scope_for()


def _recorded_addresses(record: Record) -> tuple[IPAddress, ...]:
    found = []
    for text in (record.address or "").split(","):
        try:
            found.append(ipaddress.ip_address(text.strip()))
        except ValueError:
            continue
    return tuple(found)


def _answer(engine: Engine, record: Record, host: Host):
    """What the walk is told `host` resolves to: itself (an IP), static_hosts, the addresses the audit
    line recorded, or UNCHECKED when none is known (the rules' verdict stands; see _unknown_address)."""
    if host.ip is not None:
        return (host.ip,)
    if host.value in engine.policy.static_hosts:
        return engine.policy.static_hosts[host.value]
    return _recorded_addresses(record) or UNCHECKED


def _unknown_address(record: Record, decision: Decision, answer) -> Decision:
    """No address known, and the line recorded an address refusal: that refusal stands."""
    if decision.allowed and answer is UNCHECKED and record.reason == "denied_address":
        return Decision.deny("denied_address", "address unknown: the recorded refusal stands", decision.rule)
    return decision


def redecide(engine: Engine, record: Record) -> tuple[Verdict, Scope]:
    policy = engine.policy
    scope = _scope(policy, record)
    try:
        host = canonical_host(record.host)
    except HostError as exc:
        return Verdict("deny", "bad_host", None, (), str(exc)), scope
    injected: tuple[str, ...] = ()
    if record.event == "dns":
        decision = _dns(engine, record, scope)
    elif record.event == "request":
        scheme = record.scheme.lower()
        # the live walk (gateway/session.py): for https the CONNECT is judged first, as it was
        answer = _answer(engine, record, host)
        decision = decide_request(engine, scope, scheme, host, record.port, record.method, record.path,
                                  record.headers, answer, record.query_overrides)
        decision = _unknown_address(record, decision, answer)
        rule = policy.rules_by_id.get(decision.rule or "")
        if rule is not None:  # the recorded path only: no headers are recorded
            verdict = credential_verdict(rule, decision, scheme, host, (), record.path or "/",
                                         ShapeTokens(rule.secrets))
            decision, injected = verdict.decision, rule.secrets if verdict.inject else ()
    elif record.event == "tls" and (dialled := _dialled(record)) is not None:
        decision = _client_hello(engine, record, scope, host, dialled)
    else:  # connect, and a tls line of a CONNECT tunnel (passthrough): the destination the CONNECT named
        answer = _answer(engine, record, host)
        decision = _unknown_address(record, decide_destination(engine, scope, host, record.port, answer).decision,
                                    answer)
    return Verdict(decision.verdict, decision.reason, decision.rule, injected, decision.message), scope


def _dns(engine: Engine, record: Record, scope: Scope) -> Decision:
    """The live DNS guard's decision (gateway/dns_answer.py), told the addresses replay knows."""
    question = dns_question(engine.policy, record.host, (record.dns_type or "A").upper(), scope)
    if isinstance(question, DnsAnswer):
        return question.decision
    answer = _answer(engine, record, question.host)
    found = dns_answer(engine, question, () if answer is UNCHECKED else answer)
    return _unknown_address(record, found.decision, answer)


def _dialled(record: Record) -> tuple[str, int] | None:
    """What a transparent sandbox dialled (its TLS then names the destination), from the line."""
    if record.mode != "transparent" or not record.original_destination:
        return None
    address, _, port = record.original_destination.rpartition(":")  # "IP:PORT", an IPv6 IP unbracketed
    try:
        return ipaddress.ip_address(address.strip("[]")).compressed, int(port)
    except ValueError:
        return None


def _client_hello(engine: Engine, record: Record, scope: Scope, host: Host, dialled: tuple[str, int]) -> Decision:
    """A transparent connection's ClientHello, as the session decides it (SNI, else the dialled IP,
    names the destination; `strict_original_destination` holds it to the name's addresses)."""
    session = ClientSession(record.client or "replay", "transparent", _client_ip(record.client))
    session.original_destination = dialled
    step = drive_now(session.client_hello(record.sni, dialled, engine, scope, engine.passthrough_rule),
                     lambda name: _answer(engine, record, name))
    answer = _answer(engine, record, host)
    if step.decision.reason == "original_destination_mismatch" and not _all_known(engine, host):
        # The line recorded the one address dialled, not all the name's: a mismatch cannot be told.
        return _unknown_address(record, decide_destination(engine, scope, host, dialled[1], answer).decision, answer)
    return _unknown_address(record, step.decision, answer)


def _all_known(engine: Engine, host: Host) -> bool:
    """Whether replay knows every address of `host` (an IP, or a name in static_hosts)."""
    return host.ip is not None or host.value in engine.policy.static_hosts


def replay(policy: Policy, records: Iterable[Record], result: ReplayResult | None = None) -> ReplayResult:
    result = result or ReplayResult()
    engine = Engine.build(policy)
    groups: dict[tuple, Change] = {}
    for record in records:
        new, scope = redecide(engine, record)
        old = Verdict(record.verdict, record.reason, record.rule, record.injected if record.event == "request" else ())
        result.replayed += 1
        kinds = _kinds(old, new)
        if not kinds:
            result.unchanged += 1
            continue
        key = (record.event, record.scheme, record.method, record.host, record.port, record.path, record.dns_type,
               scope.sandbox, old, new.verdict, new.reason, new.rule, new.injected)
        change = groups.get(key)
        if change is None:
            change = groups[key] = Change(kinds, record, old, new, scope.sandbox)
            result.changes.append(change)
        change.lines.append(f"{record.source}:{record.line}")
    return result


_NEWLY = {"deny": "newly_denied", "allow": "newly_allowed", "would_deny": "newly_would_deny"}


def _kinds(old: Verdict, new: Verdict) -> tuple[str, ...]:
    kinds = []
    if old.verdict != new.verdict:
        kinds.append(_NEWLY[new.verdict])
    else:
        if old.reason != new.reason:
            kinds.append("reason_changed")
        if old.rule != new.rule:
            kinds.append("rule_changed")
    if set(old.injected) != set(new.injected):
        kinds.append("credentials_changed")
    return tuple(kinds)


_TITLES = {"newly_denied": "NEWLY DENIED", "newly_allowed": "NEWLY ALLOWED", "newly_would_deny": "WOULD DENY",
           "reason_changed": "CHANGED", "rule_changed": "CHANGED", "credentials_changed": "CREDENTIALS"}


def render_text(result: ReplayResult, policy_source: str) -> str:
    lines = [f"replayed {result.replayed} of {result.lines} audit lines under {policy_source}"]
    order = {"newly_denied": 0, "newly_allowed": 1, "newly_would_deny": 2, "reason_changed": 3, "rule_changed": 3,
             "credentials_changed": 4}
    for change in sorted(result.changes, key=lambda c: order[c.kinds[0]]):  # stable: file order within a group
        r = change.record
        title = _TITLES[change.kinds[0]]
        where = ", ".join(change.lines[:5]) + (", ..." if len(change.lines) > 5 else "")
        who = f" [sandbox {change.sandbox}]" if change.sandbox else ""
        lines.append(f"{title:<13} {r.event} {r.describe()}{who}  x{len(change.lines)} ({where})")
        lines.append(f"    was: {change.old.text()}")
        lines.append(f"    now: {change.new.text()}" + (f": {change.new.message}" if change.new.verdict != "allow" else ""))
    s = result.summary()
    lines.append(
        f"{s['replayed']} replayed: {s['unchanged']} unchanged, {s['newly_denied']} newly denied, "
        f"{s['newly_allowed']} newly allowed, {s['newly_would_deny']} newly would_deny, {s['reason_or_rule_changed']} "
        f"reason/rule changed, {s['credentials_changed']} credentials changed; {s['skipped']} lines skipped"
    )
    for why, n in sorted(result.skipped.items()):
        lines.append(f"  skipped {n}: {why}")
    return "\n".join(lines) + "\n"
