"""`explain`: one request through the policy, every step shown. Pure, given how to resolve names.

The decision is the live walk's own (gateway/session.py: a CONNECT then the request for https, an
absolute-form request for http; the engine's `check_tcp` for `tcp://IP:PORT`), so explain and the
gateway cannot disagree. Around it, explain shows what the gateway logs only in
part: each candidate rule and why it did or did not match, the addresses the name resolves to and
the deny list's verdict on each, and the names of the secrets the deciding rule would inject
(never a value: explain does not read secrets at all).

Resolution: an IP literal is itself; otherwise `addresses` (given by the caller), else the
policy's `static_hosts`, else the `resolve` callable (real DNS, only when asked for), else the
addresses are not checked and the explanation says so.

Who asks: a sandbox of the policy file or a source address (`scope_for`), or a `scope` the caller
already has: the control API (gateway/control.py) passes a registered sandbox's live scope, grants
included, so explain sees the rules a grant adds exactly as the engine does (`Scope.granted`).
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .addresses import AddressVerdict
from .decision import Decision
from .credential_checks import credential_verdict
from .engine import Engine, RequestFacts, _by_grant
from .grants import Grant, GrantRules, compile_grants
from .hostnames import Host, HostError, IPAddress, ip_host, parse_authority
from .methods import overrides as overrides_in
from .paths import PathError, normalise_path
from .placeholders import ShapeTokens
from .policy import DEFAULT_PORTS, LIMIT_KEYS, Policy, Rule, Scope
from .resolver import ResolveError
from .session import UNCHECKED, decide_raw_tcp, decide_request

Resolve = Callable[[Host], Sequence[IPAddress]]  # raises ResolveError

_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)\Z", re.DOTALL)
URL_SCHEMES = ("https", "http", "tcp")


class ExplainError(ValueError):
    """The question cannot be asked (a URL explain does not understand, an unknown sandbox): exit 2."""


@dataclass(frozen=True)
class Target:
    url: str
    scheme: str  # https | http | tcp
    host: Host | None  # None when the authority is malformed (the gateway would answer bad_host)
    port: int | None
    target: str  # origin-form path and query ("" for tcp)
    host_error: str | None = None


def parse_target(url: str) -> Target:
    """`https://host[:port]/path?query`, `http://...` or `tcp://IP:PORT` (a name too, if it resolves)."""
    match = _URL_RE.match(url.strip())
    if not match:
        raise ExplainError(f"{url!r}: give a URL like https://host/path, http://host:8080/path or tcp://IP:PORT")
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme not in URL_SCHEMES:
        raise ExplainError(f"{url!r}: scheme must be one of {', '.join(URL_SCHEMES)}")
    end = next((i for i, c in enumerate(rest) if c in "/?#"), len(rest))
    authority, remainder = rest[:end], rest[end:].split("#", 1)[0]
    if not authority:
        raise ExplainError(f"{url!r}: no host")
    if scheme == "tcp":
        if remainder not in ("", "/"):
            raise ExplainError(f"{url!r}: a tcp:// URL is only tcp://HOST:PORT")
        target = ""
    else:
        target = remainder if remainder.startswith("/") else "/" + remainder
    try:
        host, port = parse_authority(authority, DEFAULT_PORTS.get(scheme))
    except HostError as exc:
        if scheme == "tcp" and "needs a port" in str(exc):
            raise ExplainError(f"{url!r}: tcp:// needs a port") from None
        return Target(url, scheme, None, None, target, str(exc))
    return Target(url, scheme, host, port, target)


@dataclass(frozen=True)
class Candidate:
    rule: str
    outcome: str  # decided | matches | no_match | not_granted | other_protocol
    why: str
    grant: Grant | None = None  # the grant that adds this rule to the scope (a registered sandbox's)

    def as_dict(self) -> dict:
        """`grant` only when one stands behind the rule: a policy file's explanation is as it was."""
        out = {"rule": self.rule, "outcome": self.outcome, "why": self.why}
        if (g := self.grant) is not None:
            out["grant"] = {"id": g.id, "sandbox": g.sandbox, "expires_at": g.expires_at}
        return out


@dataclass(frozen=True)
class Credential:
    target: str  # header | query
    name: str
    secrets: tuple[str, ...]


@dataclass(frozen=True)
class AppliedLimit:
    """A policy limit that counts this request (explain has no live counters: the limit, not what is left)."""

    owner: str  # "sandbox ID" | "rule ID"
    key: str  # a LIMIT_KEYS name
    value: int
    counted: str  # what one counter covers
    reason: str  # the refusal once it is used up

    def describe(self) -> str:
        unit = LIMIT_KEYS[self.key][1]
        return f"{self.owner}: {self.key} {self.value} {unit} ({self.counted}; over it 429 {self.reason})"


LIMIT_REASONS = {"requests_per_minute": "rate_limited", "upload_bytes_per_hour": "upload_quota_exceeded",
                 "download_bytes_per_hour": "download_quota_exceeded",
                 "requests_per_credential_per_minute": "credential_rate_limited"}


def applied_limits(policy: Policy, scope: Scope, rule: Rule | None, injected: Sequence[str]) -> list[AppliedLimit]:
    """The `limits:` that count a request the gateway lets through: its sandbox's and its rule's."""
    out: list[AppliedLimit] = []
    who = f"sandbox {scope.sandbox}" if scope.sandbox else "all clients (no sandboxes section)"
    if scope.sandbox is not None:
        for key, value in policy.sandbox_limits(scope.profile).items():
            if key == "requests_per_credential_per_minute":
                for secret in injected:
                    out.append(AppliedLimit(f"sandbox {scope.sandbox}", key, value,
                                            f"this sandbox's requests with secrets.{secret}", LIMIT_REASONS[key]))
            else:
                out.append(AppliedLimit(f"sandbox {scope.sandbox}", key, value, "every rule of this sandbox",
                                        LIMIT_REASONS[key]))
    if rule is not None:
        for key, value in rule.limits.items():
            if key == "requests_per_credential_per_minute":
                for secret in injected:
                    out.append(AppliedLimit(f"rule {rule.id}", key, value,
                                            f"secrets.{secret}: one count shared by every rule that injects "
                                            f"it and every sandbox; this rule's limit applies to it",
                                            LIMIT_REASONS[key]))
            else:
                out.append(AppliedLimit(f"rule {rule.id}", key, value, f"this rule, for {who}", LIMIT_REASONS[key]))
    return out


@dataclass
class Explanation:
    target: Target
    method: str
    scope: Scope
    scope_text: str
    policy_decision: Decision  # the rules' verdict
    decision: Decision  # the final verdict, after address and credential checks
    candidates: list[Candidate]
    path: str | None  # the normalised path the rules saw
    resolution: str  # ip | given | static_hosts | dns | unresolved | failed
    addresses: list[AddressVerdict]
    resolve_error: str | None
    credentials: list[Credential]
    mode: str | None  # the deciding rule's effective mode (enforce | report), when a rule decided
    notes: list[str] = field(default_factory=list)
    headers: tuple[tuple[str, str], ...] = ()  # given with -H: the request's header fields
    overrides: tuple[str, ...] = ()  # the method overrides in the headers and the URL, described
    limits: list[AppliedLimit] = field(default_factory=list)  # the policy limits that count it

    @property
    def verdict(self) -> str:
        """allow | deny | would_deny (report mode: let through, but the allowlist would refuse it)."""
        return self.decision.verdict

    @property
    def exit_status(self) -> int:
        """0 when the gateway lets the request through (would_deny included), 1 when it refuses it."""
        return 0 if self.decision.allowed else 1

    def as_dict(self) -> dict:
        t = self.target
        return {
            "url": t.url,
            "method": None if t.scheme == "tcp" else self.method,
            "headers": [[k, v] for k, v in self.headers],
            "method_override": list(self.overrides),
            "scheme": t.scheme,
            "host": t.host.value if t.host else None,
            "port": t.port,
            "path": self.path,
            "sandbox": self.scope.sandbox,
            "scope": self.scope_text,
            "verdict": self.verdict,
            "decision": _decision_dict(self.decision),
            "policy_decision": _decision_dict(self.policy_decision),
            "mode": self.mode,
            "candidates": [c.as_dict() for c in self.candidates],
            "resolution": self.resolution,
            "addresses": [
                {"address": v.address.compressed, "allowed": v.allowed, "reason": v.reason, "detail": v.detail}
                for v in self.addresses
            ],
            "resolve_error": self.resolve_error,
            "credentials": [{"target": c.target, "name": c.name, "secrets": list(c.secrets)} for c in self.credentials],
            "injected": self.injected,
            "limits": [{"owner": x.owner, "key": x.key, "value": x.value, "counted": x.counted, "reason": x.reason}
                       for x in self.limits],
            "notes": list(self.notes),
            "exit": self.exit_status,
        }

    @property
    def injected(self) -> list[str]:
        """Secret names the request would carry (as the audit line's `injected` lists them)."""
        return list(dict.fromkeys(name for c in self.credentials for name in c.secrets))


def _passes(d: Decision) -> bool:
    """Allowed by the allowlist itself (not merely let through by report mode)."""
    return d.allowed and not d.would_deny


def _decision_dict(d: Decision) -> dict:
    return {"allowed": d.allowed, "verdict": d.verdict, "reason": d.reason, "status": None if d.allowed else d.status,
            "rule": d.rule, "message": d.message, "notes": list(d.notes)}


def scope_for(policy: Policy, sandbox: str | None = None, source_ip: str | None = None) -> tuple[Scope, str]:
    """The scope a client gets, and a sentence saying why; ExplainError for an unknown sandbox."""
    if sandbox is not None and source_ip is not None:
        raise ExplainError("give a sandbox or a source IP, not both")
    client = None
    if source_ip is not None:
        try:
            client = ipaddress.ip_address(source_ip.strip("[]"))
        except ValueError:
            raise ExplainError(f"{source_ip!r} is not an IP address") from None
    if policy.sandboxes is None:
        return policy.scope_for(), "every rule (the policy has no sandboxes section)"
    known = [s.id for s in policy.sandboxes]
    if sandbox is not None:
        if sandbox not in known:
            raise ExplainError(f"no sandbox {sandbox!r} in the policy (known: {', '.join(known) or 'none'})")
        scope = policy.scope_for(sandbox_id=sandbox)
        return scope, f"sandbox {sandbox}"
    scope = policy.scope_for(client=client)
    who = f"source IP {client}" if client is not None else "a client no sandbox entry names"
    if scope.sandbox is None:
        return scope, f"{who}: no sandbox (no rule at all)"
    return scope, f"{who}: sandbox {scope.sandbox}"


def describe_scope(scope: Scope) -> str:
    """A sentence for a scope the caller made (a registered sandbox's): who, which profile, which grants."""
    if scope.sandbox is None:
        return "every rule (the policy has no sandboxes section)" if scope.rule_ids is None else "no sandbox"
    text = f"sandbox {scope.sandbox}"
    if scope.profile is None:
        return text + " (its profile is no longer in the policy: no rule at all)"
    text += f" (profile {scope.profile}"
    grants = _active_grants(scope)
    if grants:
        text += ", grants " + ", ".join(f"{g.id} until {_until(g)}" for g in grants)
    return text + ")"


def _active_grants(scope: Scope) -> list[Grant]:
    granted = scope.granted
    if not isinstance(granted, GrantRules):
        return []
    return sorted({g.id: g for g in granted.by_rule.values()}.values(), key=lambda g: g.id)


def _until(grant: Grant) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(grant.expires_at))


def parse_header(text: str) -> tuple[str, str]:
    """`NAME: VALUE` (the -H of curl and of `explain`), or ExplainError."""
    name, colon, value = text.partition(":")
    if not colon or not name.strip() or name != name.strip():
        raise ExplainError(f"header {text!r}: give a header as 'NAME: VALUE'")
    return name, value.strip(" \t")


def credentials_of(rule: Rule) -> list[Credential]:
    return [Credential(i.target, i.name, tuple(i.template.secrets)) for i in rule.injections]


def explain(
    policy: Policy,
    url: str | Target,
    method: str = "GET",
    *,
    sandbox: str | None = None,
    source_ip: str | None = None,
    scope: Scope | None = None,
    scope_text: str | None = None,
    addresses: Sequence[IPAddress] | None = None,
    resolve: Resolve | None = None,
    engine: Engine | None = None,
    headers: Sequence[tuple[str, str]] = (),
) -> Explanation:
    """One request explained. Who asks: `sandbox` or `source_ip` (looked up in the policy file), or
    `scope` as the caller has it (a registered sandbox's, with its grants), described by `scope_text`."""
    target = url if isinstance(url, Target) else parse_target(url)
    method = method.upper()
    if scope is None:
        scope, scope_text = scope_for(policy, sandbox, source_ip)
    elif sandbox is not None or source_ip is not None:
        raise ExplainError("give a scope, or a sandbox or source IP, not both")
    elif scope_text is None:
        scope_text = describe_scope(scope)
    engine = engine or Engine.build(policy)
    if target.host is None:
        bad = Decision.deny("bad_host", f"bad host in {target.url!r}: {target.host_error}")
        return Explanation(target, method, scope, scope_text, bad, bad, [], None, "unresolved", [], None, [], None)
    host, port = target.host, target.port

    resolution, found, resolve_error = _resolve(policy, host, addresses, resolve)
    verdicts = engine.check_addresses(found or (), port)
    notes: list[str] = []
    if target.scheme == "tcp":
        policy_decision, candidates, path = _tcp(engine, policy, host, port, found, scope)
        # The live walk (gateway/session.py raw_tcp) on the address the sandbox would dial.
        decision = policy_decision if not found else decide_raw_tcp(
            engine, scope, found[0], port, () if host.is_ip else (host.value,))
    else:
        # The live walk itself (gateway/session.py), as a sandbox sends this request: once as if every
        # address passed (the rules' verdict), once with the addresses explain has.
        answer = ResolveError(resolve_error) if resolve_error is not None else (found or None)  # none given: unchecked
        ask = (engine, scope, target.scheme, host, port, method, target.target, headers)
        policy_decision = decide_request(*ask, answer=UNCHECKED)
        decision = decide_request(*ask, answer=UNCHECKED if answer is None else answer)
        if decision.allowed and answer is None:
            notes.append(f"addresses not checked: {host} is not in static_hosts (live traffic checks every address "
                         "it resolves to; `egress-gateway explain --resolve` looks it up in DNS)")
        facts = RequestFacts(host, port, target.scheme, method, target.target, tuple(headers))
        candidates = _http_candidates(engine, policy, facts, scope, policy_decision)
        try:
            path = normalise_path(target.target)
        except PathError:
            path = None
    rule = policy.rules_by_id.get(policy_decision.rule or "")
    credentials: list[Credential] = []
    # explain has no placeholder key (and only the headers given with -H): the URL's own query and
    # path and those headers are checked, and any well-formed placeholder of a secret the rule is
    # bound to counts as the sandbox's.
    bound = rule is not None and bool(rule.secrets) and target.scheme != "tcp"
    overrides = () if target.scheme == "tcp" else tuple(o.describe() for o in overrides_in(headers, target.target))
    if overrides:
        notes.append("method overrides: a request is allowed only if every method it names (headers "
                     "X-HTTP-Method-Override, X-HTTP-Method, X-Method-Override; query _method, method, ...) is "
                     "allowed by the rule")
    if target.scheme != "tcp" and decision.allowed and method not in ("GET", "HEAD"):
        notes.append("request bodies: a form or JSON body naming a method the deciding rule does not allow "
                     "(`_method=DELETE`) is refused when it arrives (403 method_not_allowed); explain has no body")
    if decision.would_deny:
        notes.append("report mode: the allowlist would refuse this request; the gateway lets it through, "
                     "logged as would_deny, without any credential")
    if bound:
        verdict = credential_verdict(rule, decision, target.scheme, host, tuple(headers), target.target,
                                     ShapeTokens(rule.secrets))
        decision = verdict.decision
        if verdict.inject:
            credentials = credentials_of(rule)
            notes.append("credentials: only secret names are shown; a secret that cannot be read at "
                         "request time makes the gateway refuse (502 secret_unavailable)")
    if bound and rule.id == decision.rule:
        notes.append(f"placeholders: rule {rule.id} swaps them only as {rule.placeholders.describe()}; "
                     "anywhere else a placeholder is refused (403 placeholder_misuse)")
        notes.append(f"foreign credentials: rule {rule.id} refuses requests carrying a key of their own in "
                     f"{rule.foreign_credentials.describe()} or in a look-alike of what it injects "
                     "(403 foreign_credential); only its query and the headers given with -H are checked")
    if decision.allowed and not decision.would_deny and target.scheme == "https":
        tunnel = engine.check_destination(host, port, scope)
        relay = policy.rules_by_id.get(tunnel.rule or "") if tunnel.allowed and not tunnel.would_deny else None
        if relay is not None and not relay.inspect:
            notes.append(f"passthrough: the tunnel to {host.authority(port)} is decided by rule {relay.id} "
                         f"(inspect: false), so its TLS is relayed unread: the gateway checks only the "
                         f"ClientHello (SNI = {host}, no ECH), never this method or path")
    mode = policy.mode
    if rule is not None:
        mode = rule.mode or mode
    limits: list[AppliedLimit] = []
    if decision.allowed and target.scheme != "tcp":
        injected = list(dict.fromkeys(name for c in credentials for name in c.secrets))
        limits = applied_limits(policy, scope, rule if rule is not None and rule.id == decision.rule else None,
                                injected)
        if limits:
            notes.append("limits: explain knows no live counters; the gateway refuses with 429 once a limit is "
                         "used up (and applies its own per-sandbox request and connection rates, egress_* options)")
    return Explanation(target, method, scope, scope_text, policy_decision, decision, candidates, path,
                       resolution, verdicts, resolve_error, credentials, mode, notes, tuple(headers), overrides,
                       limits)


def _resolve(policy: Policy, host: Host, given: Sequence[IPAddress] | None, resolve: Resolve | None):
    if host.ip is not None:
        return "ip", (host.ip,), None
    if given is not None:
        return "given", tuple(given), None
    if host.value in policy.static_hosts:
        return "static_hosts", policy.static_hosts[host.value], None
    if resolve is None:
        return "unresolved", None, None
    try:
        return "dns", tuple(resolve(host)), None
    except ResolveError as exc:
        return "failed", None, str(exc)


def _only(scope: Scope, rule: Rule) -> Scope:
    """`scope` narrowed to `rule` alone, keeping the grant that adds it: checked alone, a granted
    rule (a rule grant's, or a hosts grant's transient rule) decides as it does live, by that grant."""
    grant = _grant_of(scope, rule)
    if grant is None:
        return Scope(scope.sandbox, frozenset({rule.id}), scope.profile)
    one = compile_grants([grant])
    return Scope(scope.sandbox, one.rule_ids, scope.profile, one)


def _grant_of(scope: Scope, rule: Rule) -> Grant | None:
    """The grant behind `rule` in this scope (None: the profile's own rule, or no grants)."""
    granted = scope.granted
    return granted.grant_of(rule.id) if isinstance(granted, GrantRules) else None


def _granted_rules(scope: Scope, host: Host) -> list[Rule]:
    """The transient rules of the scope's hosts grants that cover `host` (the engine's lookup)."""
    granted = scope.granted
    if not isinstance(granted, GrantRules) or not granted.rules:
        return []
    return [granted.rules[i] for i in granted.index.candidates(host)]


def _candidate(rule: Rule, alone: Decision, decided: Decision, scope: Scope) -> Candidate:
    """What one rule, checked alone, says next to the policy's decision (and the grant behind it)."""
    grant = _grant_of(scope, rule)
    by = _by_grant(scope, rule)
    if _passes(alone) and _passes(decided) and rule.id == decided.rule:
        return Candidate(rule.id, "decided", alone.message, grant)  # the engine's message names the grant
    if _passes(alone):
        return Candidate(rule.id, "matches", f"also matches{by}, but rule {decided.rule} comes first", grant)
    return Candidate(rule.id, "no_match", _why(alone, rule) + by, grant)


def _not_granted(policy: Policy, scope: Scope, rule: Rule) -> Candidate:
    """A rule the client may not use; for a registered sandbox, whether a grant could add it."""
    why = f"not granted to {scope.sandbox or 'this client'}"
    entry = policy.sandboxes_by_id.get(scope.profile or "")
    if entry is not None and scope.sandbox != entry.id and entry.grantable is not None \
            and rule.id in entry.grantable.rules:
        why += f" (profile {entry.id}'s grantable.rules: a rule grant could add it)"
    return Candidate(rule.id, "not_granted", why)


def _why(decision: Decision, rule: Rule) -> str:
    prefix = f"rule {rule.id}: "
    for note in reversed(decision.notes):
        if note.startswith(prefix):
            return note[len(prefix):]
    return decision.message


def _http_candidates(engine: Engine, policy: Policy, facts: RequestFacts, scope: Scope, decided: Decision) -> list[Candidate]:
    """Every rule covering the host, in the engine's order: the policy's, then the hosts grants'."""
    out = []
    for i in policy.index.candidates(facts.host):
        rule = policy.rules[i]
        if rule.protocol != "http":
            out.append(Candidate(rule.id, "other_protocol", f"a protocol: {rule.protocol} rule (raw TCP only)"))
        elif not scope.grants(rule):
            out.append(_not_granted(policy, scope, rule))
        else:
            out.append(_candidate(rule, engine.check_request(facts, _only(scope, rule)), decided, scope))
    for rule in _granted_rules(scope, facts.host):
        out.append(_candidate(rule, engine.check_request(facts, _only(scope, rule)), decided, scope))
    return out


def _tcp(engine: Engine, policy: Policy, host: Host, port: int, found, scope: Scope):
    """Raw TCP: decided on the (first) address the sandbox would dial; a name counts as a name the
    gateway's DNS answered with that address."""
    if not found:
        decision = Decision.deny(
            "no_rule", f"tcp://{host.authority(port)}: no address to decide on "
            "(give tcp://IP:PORT, put the name in static_hosts, or use --resolve)")
        return decision, [], None
    names = () if host.is_ip else (host.value,)
    address = found[0]
    decision = engine.check_tcp(address, port, names, scope)
    out, seen = [], set()
    hosts = [ip_host(address), *(Host(n) for n in names)]
    for h in hosts:
        rules = [(policy.rules[i], False) for i in policy.index.candidates(h)]
        for rule, granted in rules + [(r, True) for r in _granted_rules(scope, h)]:
            if rule.id in seen:
                continue
            seen.add(rule.id)
            if rule.protocol != "tcp":
                out.append(Candidate(rule.id, "other_protocol", "an HTTP rule (tcp:// asks about raw TCP)",
                                     _grant_of(scope, rule)))
            elif not granted and not scope.grants(rule):
                out.append(_not_granted(policy, scope, rule))
            else:
                out.append(_candidate(rule, engine.check_tcp(address, port, names, _only(scope, rule)), decision,
                                      scope))
    return decision, out, None


def render_text(e: Explanation) -> str:
    return render_dict(e.as_dict())


def render_dict(e: dict) -> str:
    """The text form of `Explanation.as_dict()`: what `explain` prints, and what `sandbox explain`
    prints from the control API's JSON (a thin client has the JSON, not the Explanation)."""
    d = e["decision"]
    verdict = {"allow": "ALLOW", "deny": "DENY", "would_deny": "WOULD_DENY"}[e["verdict"]]
    what = e["url"] if e["scheme"] == "tcp" else f"{e['method']} {e['url']}"
    lines = [f"{verdict}  {what}"]
    status = "" if d["allowed"] else f" ({d['status']})"
    lines.append(f"  reason:    {d['reason']}{status}")
    lines.append(f"  rule:      {d['rule'] or '-'}")
    if e["mode"] == "report" or e["verdict"] == "would_deny":
        lines.append("  mode:      report (allowlist denials are let through and logged as would_deny)")
    lines.append(f"  message:   {d['message']}")
    lines.append(f"  client:    {e['scope']}")
    if e["host"] is not None:
        host = f"[{e['host']}]" if ":" in e["host"] else e["host"]
        lines.append(f"  target:    {e['scheme']}://{host}:{e['port']}" + (f"  path {e['path']}" if e["path"] else ""))
    for override in e["method_override"]:
        lines.append(f"  override:  {override}")
    if e["policy_decision"]["allowed"] and not d["allowed"]:
        lines.append(f"  rules:     allowed by {e['policy_decision']['rule']}, then refused ({d['reason']})")
    candidates = e["candidates"]
    lines.append("candidate rules:" if candidates else "candidate rules: none covers this host")
    width = max((len(c["rule"]) for c in candidates), default=0)
    for c in candidates:
        lines.append(f"  {c['rule']:<{width}}  {c['outcome']:<14} {c['why']}")
    source = {"ip": "an IP literal", "given": "given", "static_hosts": "static_hosts", "dns": "DNS",
              "unresolved": "not resolved", "failed": "DNS lookup failed"}[e["resolution"]]
    lines.append(f"addresses ({source}):" if e["addresses"] else f"addresses: {source}")
    for v in e["addresses"]:
        lines.append(f"  {v['address']:<39} {'allowed' if v['allowed'] else 'REFUSED'}: {v['detail']}")
    if e["resolve_error"]:
        lines.append(f"  {e['resolve_error']}")
    if e["credentials"]:
        lines.append("credentials injected (names only):")
        for c in e["credentials"]:
            lines.append(f"  {c['target']} {c['name']} <- {', '.join('secrets.' + s for s in c['secrets'])}")
    else:
        lines.append("credentials injected: none")
    if e["limits"]:
        lines.append("limits that count this request:")
        lines.extend(f"  {AppliedLimit(**x).describe()}" for x in e["limits"])
    for note in e["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"
