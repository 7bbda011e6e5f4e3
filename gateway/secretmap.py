"""Where each secret can go: a map, and a proof, for the policy as written. Pure, reads no secret.

For every declared secret, `secret_map` lists every rule that can put it into a request, and for
each such rule the exact destinations the credential can reach (host patterns, schemes, ports),
the methods and paths, the sandboxes granted the rule, its mode, where the value is written
(header NAME, query parameter NAME, placeholder positions) and what counts as a foreign
credential there. Then it checks and states, as properties with findings:

- `only-bound-rules` (a): secret S is written only by a rule in S's binding set
  {R : S in R.secrets}. The injector (addons/credentials.py, `CredentialInjector.apply`) takes the
  rule as `policy.rules_by_id[decision.rule]`, where `decision` is the engine's `check_request`
  verdict (allowed, not would_deny), renders `rule.injections`, and looks for placeholders only
  among this sandbox's tokens for `rule.secrets`. So the binding set is read off the same
  `Rule.secrets`/`Rule.injections` the injector reads, and checked: ids are unique in
  `rules_by_id`, each rule's secrets are exactly what its templates reference, all declared, and
  the engine's host index holds exactly the rules' host patterns (a rebuilt index is equal).
- `https-only` (b): no bound rule reaches a scheme other than https unless it says
  `allow_plaintext_credentials` (the loader refuses it; `credential_refusal` (gateway/credential_checks.py) refuses
  it again at request time, `plaintext_credentials`).
- `exact-hosts-only` (c): no bound rule reaches a wildcard name or a CIDR range unless it says
  `allow_wildcard_credentials` (the loader refuses it; `credential_refusal` refuses it again,
  `credential_host`). An IP literal is an exact host: it needs no allowance (kind `ip`).
- `no-unbound-overlap` (d): no rule that injects nothing (inspected, `inspect: false` or
  `protocol: tcp`) and is granted to some client reaches a host a bound rule sends a secret to:
  there the sandbox could send its own key (`foreign_credential` is refused only on bound rules).
  The lint warning `bound-host-also-unbound` reports the overlaps where the unbound rule covers
  the whole bound pattern; this property reports every intersection (a bound `*.example.com`
  against an unbound `api.example.com` too) and raw TCP rules.
- `foreign-credentials-on` (e): every bound rule refuses foreign credentials in headers and in the
  query (a rule whose `foreign_credentials.headers` or `.query` is `[]` is a finding).
- `inspected-only`: no bound rule is `inspect: false` or `protocol: tcp` (load errors: the relay
  never sees a request to inject into).

Destinations are derived with the engine's own predicates (`Rule.allows_port`,
`Rule.allows_method`, `credential_refusal`), so the map is never narrower than what the engine
would inject into; tests/unit/test_secretmap_property.py checks that against the real injector.
Report mode: a request its rule allows carries the credential; one the allowlist would deny is
let through (`would_deny`) with none, so report mode widens where the sandbox goes, never where a
secret goes.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from .credentials import Template
from .credential_checks import credential_refusal
from .hostnames import Host
from .lint import _pattern_covers
from .matcher import HostIndex, HostPattern
from .policy import DEFAULT_PORTS, STANDARD_METHODS, Policy, Rule, Scope
from .yamlsource import Location, Node, PolicyError, node_at, parse

SCHEMA_VERSION = 1

PROPERTIES: dict[str, str] = {
    "only-bound-rules": "every rule that can write a secret into a request is in that secret's binding set",
    "https-only": "no bound rule sends a secret over a scheme other than https unless it says "
                  "allow_plaintext_credentials",
    "exact-hosts-only": "no bound rule sends a secret to a wildcard name or a CIDR range unless it says "
                        "allow_wildcard_credentials",
    "no-unbound-overlap": "no granted rule that injects nothing reaches a host a secret is sent to",
    "foreign-credentials-on": "every bound rule refuses the sandbox's own credentials in headers and query",
    "inspected-only": "no bound rule is a passthrough (inspect: false) or raw TCP rule",
}

# How the proof of each property rests on the code: the load rule, then the request-time check.
ENFORCED_BY: dict[str, tuple[str, ...]] = {
    "only-bound-rules": ("addons/credentials.py CredentialInjector.apply: rule = policy.rules_by_id[decision.rule], "
                         "values and placeholder tokens for rule.secrets only",
                         "gateway/policy.py: unique rule ids; inject templates name declared secrets"),
    "https-only": ("gateway/policy.py: inject with http in schemes needs allow_plaintext_credentials",
                   "gateway/credential_checks.py credential_refusal: plaintext_credentials"),
    "exact-hosts-only": ("gateway/policy.py: inject with a wildcard or CIDR host needs allow_wildcard_credentials",
                         "gateway/credential_checks.py credential_refusal: credential_host"),
    "no-unbound-overlap": ("check warning bound-host-also-unbound (gateway/lint.py)",),
    "foreign-credentials-on": ("gateway/credential_checks.py check_bound_request: foreign_credential",),
    "inspected-only": ("gateway/policy.py: inject is a load error on inspect: false and protocol: tcp rules",),
}

FOREIGN_WHY = "the sandbox's own key there is refused (403 foreign_credential)"


@dataclass(frozen=True)
class HostDestination:
    host: str  # as the policy says it: api.example.com, *.example.com, 203.0.113.7, 198.51.100.0/24
    kind: str  # name | ip | wildcard | cidr
    allowed_by: str | None  # "allow_wildcard_credentials" for wildcard and cidr, else None

    def as_dict(self) -> dict:
        return {"host": self.host, "kind": self.kind, "allowed_by": self.allowed_by}


@dataclass(frozen=True)
class Write:
    """Where a rule writes a secret: an inject template, or a position where placeholders are swapped."""

    via: str  # inject | placeholder
    target: str  # header | query | path
    name: str | None  # the header or parameter name (None: any header value, a path segment)
    template: str | None = None  # inject: the value's template, "Bearer ${secrets.NAME}"
    defined_at: Location | None = None

    def describe(self) -> str:
        if self.via == "inject":
            return f"inject {self.target} {self.name}: {self.template}"
        if self.target == "header":
            return ("placeholder swapped in any header value, as the whole value or a whole space/comma-delimited "
                    "token (never in Cookie or a header the rule injects)")
        if self.target == "query":
            return f"placeholder swapped as the whole value of query parameter {self.name}"
        return "placeholder swapped as a whole path segment"

    def as_dict(self) -> dict:
        return {"via": self.via, "target": self.target, "name": self.name, "template": self.template,
                "defined_at": _loc(self.defined_at)}


@dataclass(frozen=True)
class Refused:
    """A destination the rule's match allows but the engine refuses credentials for (never, once loaded)."""

    host: str
    scheme: str
    reason: str  # plaintext_credentials | credential_host

    def as_dict(self) -> dict:
        return {"host": self.host, "scheme": self.scheme, "reason": self.reason}


@dataclass(frozen=True)
class Binding:
    """One rule that can carry one secret, and everything about where it goes."""

    secret: str
    rule: Rule
    mode: str  # enforce | report
    sandboxes: tuple[str, ...] | None  # None: every client (no sandboxes section)
    hosts: tuple[HostDestination, ...]
    ports: dict[str, tuple[int, ...]]  # scheme -> ports, for the schemes the credential goes over
    methods: tuple[str, ...]
    paths: tuple[str, ...] | None  # None: any path
    writes: tuple[Write, ...]
    refused: tuple[Refused, ...]

    @property
    def schemes(self) -> tuple[str, ...]:
        return tuple(self.ports)

    def as_dict(self) -> dict:
        r = self.rule
        return {
            "rule": r.id, "index": r.index, "defined_at": _loc(r.location), "mode": self.mode,
            "sandboxes": None if self.sandboxes is None else list(self.sandboxes),
            "hosts": [h.as_dict() for h in self.hosts],
            "schemes": list(self.schemes),
            "ports": {s: list(p) for s, p in self.ports.items()},
            "methods": list(self.methods),
            "paths": None if self.paths is None else list(self.paths),
            "writes": [w.as_dict() for w in self.writes],
            "foreign_credentials": {"headers": list(r.foreign_credentials.headers),
                                    "query": list(r.foreign_credentials.query)},
            "allow_wildcard_credentials": r.allow_wildcard_credentials,
            "allow_plaintext_credentials": r.allow_plaintext_credentials,
            "inspect": r.inspect, "protocol": r.protocol,
            "refused": [x.as_dict() for x in self.refused],
        }


@dataclass(frozen=True)
class Entry:
    name: str
    source: dict[str, str]  # {"env": VAR} or {"file": PATH}: where the value lives, never the value
    declared_at: Location | None
    bindings: tuple[Binding, ...]  # the rules the scope grants
    status: str  # bound | unused (no rule references it) | ungranted (no granted rule does)
    referenced_by: tuple[str, ...]  # every rule referencing it, granted or not

    @property
    def sandboxes(self) -> tuple[str, ...] | None:
        if any(b.sandboxes is None for b in self.bindings):
            return None
        return tuple(dict.fromkeys(s for b in self.bindings for s in b.sandboxes or ()))

    def as_dict(self) -> dict:
        sandboxes = self.sandboxes
        return {"name": self.name, "source": dict(self.source), "declared_at": _loc(self.declared_at),
                "status": self.status, "referenced_by": list(self.referenced_by),
                "sandboxes": None if sandboxes is None else list(sandboxes),
                "rules": [b.as_dict() for b in self.bindings]}


@dataclass(frozen=True)
class Finding:
    property: str
    secrets: tuple[str, ...]
    rule: str | None
    defined_at: Location | None
    message: str
    code: str | None = None  # the check warning reporting the same thing, if there is one
    host: str | None = None
    other_rule: str | None = None
    other_defined_at: Location | None = None
    shared: tuple[str, ...] = ()  # scheme:port (or tcp:port) both rules reach
    lint_warning: bool | None = None  # does `check` also warn (code) about this one?

    def __str__(self) -> str:
        where = f"{_short(self.defined_at)}: " if self.defined_at else ""
        code = f" [{self.code}]" if self.code else ""
        return f"{where}{self.message}{code}"

    def as_dict(self) -> dict:
        return {"property": self.property, "secrets": list(self.secrets), "rule": self.rule,
                "defined_at": _loc(self.defined_at), "message": self.message, "code": self.code,
                "host": self.host, "other_rule": self.other_rule, "other_defined_at": _loc(self.other_defined_at),
                "shared": list(self.shared), "lint_warning": self.lint_warning}


@dataclass(frozen=True)
class Property:
    id: str
    statement: str
    enforced_by: tuple[str, ...]
    findings: tuple[Finding, ...]
    exceptions: tuple[str, ...] = ()  # legal exceptions, rule by rule (an allowance the rule says)

    @property
    def holds(self) -> bool:
        return not self.findings

    def as_dict(self) -> dict:
        return {"id": self.id, "holds": self.holds, "statement": self.statement,
                "enforced_by": list(self.enforced_by), "exceptions": list(self.exceptions),
                "findings": [f.as_dict() for f in self.findings]}


@dataclass
class SecretMap:
    source: str
    sha256: str
    sandbox: str | None  # the scope asked for (None: every sandbox)
    entries: list[Entry]
    properties: list[Property]

    @property
    def holds(self) -> bool:
        return all(p.holds for p in self.properties)

    def entry(self, name: str) -> Entry:
        return next(e for e in self.entries if e.name == name)

    def as_dict(self) -> dict:
        return {
            "version": SCHEMA_VERSION,
            "sandbox": self.sandbox,
            "holds": self.holds,
            "declared": [e.name for e in self.entries],
            "unused": [e.name for e in self.entries if e.status == "unused"],
            "ungranted": [e.name for e in self.entries if e.status == "ungranted"],
            "entries": [e.as_dict() for e in self.entries],
            "properties": [p.as_dict() for p in self.properties],
        }


def _loc(location: Location | None) -> dict | None:
    if location is None:
        return None
    return {"file": location.file, "line": location.line, "column": location.column}


def _short(location: Location | None) -> str:
    return "-" if location is None else f"{location.file}:{location.line}"


# --------------------------------------------------------------------------------------------
# building the map


def secret_map(policy: Policy, text: str | None = None, scope: Scope | None = None) -> SecretMap:
    """The map and the proof for a loaded policy. `text` (the policy's source) adds the locations of
    secret declarations and inject entries; `scope` limits it to the rules one sandbox is granted."""
    tree = _Tree(text, policy.source)
    scope = scope or Scope(None, None)
    bindings: dict[str, list[Binding]] = {name: [] for name in policy.secrets}
    referenced: dict[str, list[str]] = {name: [] for name in policy.secrets}
    for rule in policy.rules:
        for name in rule.secrets:
            referenced.setdefault(name, []).append(rule.id)
            if scope.grants(rule) and _granted_somewhere(policy, rule):
                bindings.setdefault(name, []).append(_binding(policy, rule, name, tree))
    entries = []
    for name in bindings:
        source = policy.secrets.get(name)
        where = {} if source is None else ({"env": source.env} if source.env else {"file": source.file})
        status = "bound" if bindings[name] else ("ungranted" if referenced.get(name) else "unused")
        entries.append(Entry(name, where, tree.key_location("secrets", name), tuple(bindings[name]), status,
                             tuple(referenced.get(name, ()))))
    all_bindings = [b for e in entries for b in e.bindings]
    properties = [
        _only_bound_rules(policy),
        _https_only(all_bindings),
        _exact_hosts_only(all_bindings),
        _no_unbound_overlap(policy, all_bindings, scope),
        _foreign_credentials_on(all_bindings),
        _inspected_only(all_bindings),
    ]
    return SecretMap(policy.source, policy.sha256, scope.sandbox, entries, properties)


def _granted_somewhere(policy: Policy, rule: Rule) -> bool:
    return policy.sandboxes is None or any(rule.id in s.rule_ids for s in policy.sandboxes)


def _sandboxes(policy: Policy, rule: Rule) -> tuple[str, ...] | None:
    if policy.sandboxes is None:
        return None
    return tuple(s.id for s in policy.sandboxes if policy.scope_for(sandbox_id=s.id).grants(rule))


def _kind(pattern: HostPattern) -> str:
    if pattern.kind == "wildcard":
        return "wildcard"
    if pattern.kind == "network":
        return "cidr"
    return "ip" if _ip(pattern.value) is not None else "name"


def _ip(value: str):
    try:
        return ipaddress.ip_address(value.strip("[]"))
    except ValueError:
        return None


def _probe(pattern: HostPattern) -> Host:
    """A host standing for the pattern in `credential_refusal`, which compares `host.value` with
    the rule's exact host values: `*.d` and a CIDR can never be one, so they stand for every
    non-exact host the pattern matches."""
    return Host(str(pattern), _ip(pattern.value) if pattern.kind == "exact" else None)


def template_text(template: Template) -> str:
    return "".join("${secrets." + v + "}" if kind == "secret" else v.replace("${", "$${") for kind, v in template.parts)


def _binding(policy: Policy, rule: Rule, secret: str, tree: "_Tree") -> Binding:
    hosts: list[HostDestination] = []
    ports: dict[str, tuple[int, ...]] = {}
    refused: list[Refused] = []
    candidate_ports = set(DEFAULT_PORTS.values()) | set(rule.ports or ())
    reached: set[str] = set()
    for pattern in rule.hosts:
        kind = _kind(pattern)
        ok_schemes = []
        for scheme in sorted(rule.schemes, key=lambda s: (s != "https", s)):
            refusal = credential_refusal(rule, scheme, _probe(pattern))
            if refusal is None:
                ok_schemes.append(scheme)
            else:
                refused.append(Refused(str(pattern), scheme, refusal.reason))
        if ok_schemes:
            allowed_by = "allow_wildcard_credentials" if kind in ("wildcard", "cidr") else None
            hosts.append(HostDestination(str(pattern), kind, allowed_by))
            reached.update(ok_schemes)
    for scheme in sorted(reached, key=lambda s: (s != "https", s)):
        ports[scheme] = tuple(sorted(p for p in candidate_ports if rule.allows_port(p, scheme)))
    methods = tuple(sorted(m for m in (rule.methods if rule.methods is not None else STANDARD_METHODS)
                           if rule.allows_method(m)))
    writes: list[Write] = []
    for j, injection in enumerate(rule.injections):
        if secret in injection.template.secrets:
            writes.append(Write("inject", injection.target, injection.name, template_text(injection.template),
                                tree.location("rules", rule.index, "inject", j)))
    # Placeholders: the injector swaps this sandbox's tokens for every secret of the rule.
    writes.append(Write("placeholder", "header", None))
    for name in sorted(rule.placeholders.query):
        writes.append(Write("placeholder", "query", name, None, tree.location("rules", rule.index, "placeholders", "query")))
    if rule.placeholders.path:
        writes.append(Write("placeholder", "path", None, None, tree.location("rules", rule.index, "placeholders", "path")))
    return Binding(secret, rule, rule.mode or policy.mode, _sandboxes(policy, rule), tuple(hosts), ports, methods,
                   rule.path_globs, tuple(writes), tuple(refused))


class _Tree:
    """Locations in the policy text, when there is one (the loader already checked the shapes)."""

    def __init__(self, text: str | None, source: str):
        self.root: Node | None = None
        if text is not None:
            try:
                self.root = parse(text, source)[0]
            except PolicyError:
                self.root = None

    def get(self, *keys) -> Node | None:
        return node_at(self.root, *keys)

    def location(self, *keys) -> Location | None:
        node = self.get(*keys)
        return node.location if node is not None else None

    def key_location(self, *keys) -> Location | None:
        parent = self.get(*keys[:-1])
        if parent is not None and isinstance(parent.value, dict) and keys[-1] in parent.key_locations:
            return parent.key_locations[keys[-1]]
        return None


# --------------------------------------------------------------------------------------------
# the properties


def _only_bound_rules(policy: Policy) -> Property:
    findings: list[Finding] = []
    for rule in policy.rules:
        names = tuple(rule.secrets)
        if policy.rules_by_id.get(rule.id) is not rule:
            other = policy.rules_by_id.get(rule.id)
            findings.append(Finding(
                "only-bound-rules", names, rule.id, rule.location,
                f"rule id {rule.id} names another rule in rules_by_id (rule #{other.index if other else '?'}): the "
                f"injector, which looks the deciding rule up by id, would write that rule's secrets"))
        referenced = tuple(dict.fromkeys(n for i in rule.injections for n in i.template.secrets))
        if set(referenced) != set(names):
            findings.append(Finding(
                "only-bound-rules", names, rule.id, rule.location,
                f"rule {rule.id}: its secrets ({', '.join(names) or 'none'}) are not what its inject templates "
                f"reference ({', '.join(referenced) or 'none'})"))
        for name in names:
            if name not in policy.secrets:
                findings.append(Finding("only-bound-rules", (name,), rule.id, rule.location,
                                        f"rule {rule.id} references {name}, which is not declared under secrets:"))
    rebuilt = HostIndex.build((pattern, rule.index) for rule in policy.rules for pattern in rule.hosts)
    if vars(rebuilt) != vars(policy.index):
        findings.append(Finding(
            "only-bound-rules", (), None, None,
            "the engine's host index is not the one the rules' hosts build: the engine could consider a rule "
            "for a host none of its patterns names"))
    return Property("only-bound-rules", PROPERTIES["only-bound-rules"], ENFORCED_BY["only-bound-rules"],
                    tuple(findings))


def _by_rule(bindings: list[Binding]) -> dict[str, list[Binding]]:
    out: dict[str, list[Binding]] = {}
    for b in bindings:
        out.setdefault(b.rule.id, []).append(b)
    return out


def _secrets_of(group: list[Binding]) -> tuple[str, ...]:
    return tuple(b.secret for b in group)


def _opt_in(group: list[Binding], wide: list[str], allowed: bool, name: str, covers: str, flag: str,
            refusal: str, cost: str, findings: list, exceptions: list) -> None:
    """A rule that injects secrets and reaches `wide` (plain schemes, broad hosts): a finding unless
    its `flag` opts in, else an exception the report names."""
    rule = group[0].rule
    secrets = ", ".join(_secrets_of(group))
    if wide and not allowed:
        findings.append(Finding(
            name, _secrets_of(group), rule.id, rule.location,
            f"rule {rule.id} injects {secrets} and {covers} {', '.join(wide)} without {flag} (the loader "
            f"refuses this policy; the engine would refuse such requests with {refusal})"))
    elif wide:
        exceptions.append(f"rule {rule.id} ({_short(rule.location)}): {', '.join(wide)} allowed by {flag}{cost}")


def _https_only(bindings: list[Binding]) -> Property:
    findings, exceptions = [], []
    for group in _by_rule(bindings).values():
        b = group[0]
        rule = b.rule
        plain = sorted(s for s in rule.schemes if s != "https")
        _opt_in(group, plain, rule.allow_plaintext_credentials, "https-only", "allows", "allow_plaintext_credentials",
                "plaintext_credentials", f": {', '.join(_secrets_of(group))} sent in the clear", findings, exceptions)
        beyond = [s for s in b.schemes if s != "https" and not rule.allow_plaintext_credentials]
        assert not beyond, (rule.id, beyond)  # credential_refusal refuses these whatever the loader did
    return Property("https-only", PROPERTIES["https-only"], ENFORCED_BY["https-only"], tuple(findings),
                    tuple(exceptions))


def _exact_hosts_only(bindings: list[Binding]) -> Property:
    findings, exceptions = [], []
    for group in _by_rule(bindings).values():
        b = group[0]
        rule = b.rule
        broad = [str(p) for p in rule.hosts if p.kind != "exact"]
        _opt_in(group, broad, rule.allow_wildcard_credentials, "exact-hosts-only", "covers",
                "allow_wildcard_credentials", "credential_host", "", findings, exceptions)
        beyond = [h.host for h in b.hosts if h.kind in ("wildcard", "cidr") and not rule.allow_wildcard_credentials]
        assert not beyond, (rule.id, beyond)  # credential_refusal refuses these whatever the loader did
    return Property("exact-hosts-only", PROPERTIES["exact-hosts-only"], ENFORCED_BY["exact-hosts-only"],
                    tuple(findings), tuple(exceptions))


def _intersect(a: HostPattern, b: HostPattern) -> bool:
    """Is there a host both patterns match?"""
    if a.kind == "network" and b.kind == "network":
        return a.network.version == b.network.version and a.network.overlaps(b.network)
    if b.kind == "network":
        a, b = b, a
    if a.kind == "network":
        if b.kind != "exact":
            return False
        ip = _ip(b.value)
        return ip is not None and ip.version == a.network.version and ip in a.network
    if a.kind == "exact" and b.kind == "exact":
        return a.value == b.value
    if b.kind == "exact":
        a, b = b, a
    if a.kind == "exact":  # b is a wildcard
        return _ip(a.value) is None and a.value.endswith("." + b.value)
    return a.value == b.value or a.value.endswith("." + b.value) or b.value.endswith("." + a.value)


def _reach(rule: Rule) -> set[str]:
    """scheme:port pairs a rule allows (tcp:port for raw TCP rules)."""
    if rule.protocol == "tcp":
        return {f"tcp:{p}" for p in rule.ports or ()}
    return {f"{s}:{p}" for s in rule.schemes
            for p in (set(DEFAULT_PORTS.values()) | set(rule.ports or ())) if rule.allows_port(p, s)}


def _no_unbound_overlap(policy: Policy, bindings: list[Binding], scope: Scope) -> Property:
    """Unbound rules are those granted (to the scope, and to some sandbox) that inject nothing."""
    unbound = [r for r in policy.rules if not r.injections and scope.grants(r) and _granted_somewhere(policy, r)]
    findings = []
    for rule_id, group in _by_rule(bindings).items():
        b = group[0]
        rule = b.rule
        bound_ports = {f"{s}:{p}" for s, ports in b.ports.items() for p in ports}
        bound_port_numbers = {p for ports in b.ports.values() for p in ports}
        for destination in b.hosts:
            pattern = next(p for p in rule.hosts if str(p) == destination.host)
            for other in unbound:
                hits = [q for q in other.hosts if _intersect(pattern, q)]
                if not hits:
                    continue
                reach = _reach(other)
                if other.protocol == "tcp":
                    shared = sorted(x for x in reach if int(x.split(":")[1]) in bound_port_numbers)
                else:
                    shared = sorted(reach & bound_ports)
                lint_reports = other.protocol == "http" and any(_pattern_covers(q, pattern) for q in hits)
                what = ("protocol: tcp, raw TCP" if other.protocol == "tcp" else
                        "inspect: false, relayed unread" if not other.inspect else "injects nothing")
                on = (f"on {', '.join(shared)}" if shared else
                      f"on other ports or schemes only ({', '.join(sorted(reach)) or 'none'})")
                findings.append(Finding(
                    "no-unbound-overlap", _secrets_of(group), rule.id, rule.location,
                    f"rule {rule.id} sends {', '.join(_secrets_of(group))} to {pattern}; rule {other.id} "
                    f"({_short(other.location)}, {what}) also reaches {', '.join(str(q) for q in hits)} {on}: "
                    f"there the sandbox can send its own key (foreign_credential is refused only on bound rules)",
                    "bound-host-also-unbound", str(pattern), other.id, other.location, tuple(shared), lint_reports))
    return Property("no-unbound-overlap", PROPERTIES["no-unbound-overlap"], ENFORCED_BY["no-unbound-overlap"],
                    tuple(findings))


def _foreign_credentials_on(bindings: list[Binding]) -> Property:
    findings = []
    for rule_id, group in _by_rule(bindings).items():
        rule = group[0].rule
        off = [k for k in ("headers", "query") if not getattr(rule.foreign_credentials, k)]
        if off:
            findings.append(Finding(
                "foreign-credentials-on", _secrets_of(group), rule.id, rule.location,
                f"rule {rule.id} (injects {', '.join(_secrets_of(group))}) has foreign_credentials."
                f"{' and .'.join(off)}: []: the sandbox's own key there is not refused, except under a look-alike "
                f"of a name the rule injects"))
    return Property("foreign-credentials-on", PROPERTIES["foreign-credentials-on"],
                    ENFORCED_BY["foreign-credentials-on"], tuple(findings))


def _inspected_only(bindings: list[Binding]) -> Property:
    findings = []
    for rule_id, group in _by_rule(bindings).items():
        rule = group[0].rule
        if not rule.inspect or rule.protocol != "http":
            what = "inspect: false" if not rule.inspect else f"protocol: {rule.protocol}"
            findings.append(Finding(
                "inspected-only", _secrets_of(group), rule.id, rule.location,
                f"rule {rule.id} injects {', '.join(_secrets_of(group))} but is {what} (the loader refuses this "
                f"policy; the gateway never sees a request there to inject into)"))
    return Property("inspected-only", PROPERTIES["inspected-only"], ENFORCED_BY["inspected-only"], tuple(findings))


# --------------------------------------------------------------------------------------------
# text, for a security team


def _url(scheme: str, host: HostDestination, ports: tuple[int, ...]) -> str:
    name = host.host
    if host.kind == "ip" and ":" in name:
        name = f"[{name}]"
    elif host.kind == "cidr":
        name = "{" + name + "}"
    port = str(ports[0]) if len(ports) == 1 else "{" + ",".join(str(p) for p in ports) + "}"
    return f"{scheme}://{name}:{port}"


_KIND_TEXT = {"name": "exact name", "ip": "IP literal, exact", "wildcard": "any name under it",
              "cidr": "any address in it"}


def render_text(m: SecretMap) -> str:
    lines = [f"secrets in {m.source} (sha256 {m.sha256[:16]}...)"
             + (f", for sandbox {m.sandbox}" if m.sandbox else "")
             + ": names and where they go only; no secret is read"]
    counts = {s: sum(1 for e in m.entries if e.status == s) for s in ("bound", "unused", "ungranted")}
    lines.append(f"{len(m.entries)} declared: {counts['bound']} carried by a rule, {counts['unused']} unused, "
                 f"{counts['ungranted']} on no granted rule")
    for e in m.entries:
        source = ", ".join(f"{k} {v}" for k, v in e.source.items())
        lines.append("")
        declared = f", declared at {_short(e.declared_at)}" if e.declared_at else ""
        lines.append(f"secret {e.name}  ({source}{declared})")
        if e.status == "unused":
            lines.append("  carried by no rule: no inject template references it [unused-secret]")
            continue
        if e.status == "ungranted":
            who = f"sandbox {m.sandbox}" if m.sandbox else "any sandbox"
            lines.append(f"  carried by no rule granted to {who}: referenced by {', '.join(e.referenced_by)}"
                         + (" [unused-rule]" if not m.sandbox else ""))
            continue
        rows: list[tuple[str, str, str, str]] = []
        for b in e.bindings:
            r = b.rule
            at = _short(r.location)

            def row(what: str, text: str) -> None:
                rows.append((r.id, at, what, text))

            for h in b.hosts:
                urls = "  ".join(_url(s, h, b.ports[s]) for s in b.schemes)
                allowance = f"; allowed by {h.allowed_by}" if h.allowed_by else ""
                row("to", f"{urls}  ({_KIND_TEXT[h.kind]}{allowance})")
            if r.allow_plaintext_credentials and "http" in b.schemes:
                row("plain", "http allowed by allow_plaintext_credentials: the value goes in the clear")
            standard = set(b.methods) == STANDARD_METHODS
            row("methods", ", ".join(b.methods) + (" (every standard method)" if standard and r.methods is None else ""))
            row("paths", ", ".join(b.paths) if b.paths is not None else "any path")
            for w in b.writes:
                row("written", w.describe() + (f"  ({_short(w.defined_at)})" if w.defined_at else ""))
            fc = r.foreign_credentials
            row("foreign", f"refuses the sandbox's own key in headers [{', '.join(fc.headers) or 'none'}], "
                           f"query [{', '.join(fc.query) or 'none'}], and look-alikes of what it injects")
            if b.sandboxes is None:
                row("granted", "every client (no sandboxes section)")
            else:
                extra = " (and every client no sandbox entry names)" if "default" in b.sandboxes else ""
                row("granted", (", ".join(b.sandboxes) or "no sandbox") + extra)
            if b.mode == "report":
                row("mode", "report: requests it allows carry the secret; requests it would deny are let "
                            "through (would_deny) with no credential")
            else:
                row("mode", "enforce")
            for x in b.refused:
                row("refused", f"{x.scheme} {x.host}: the engine refuses credentials ({x.reason})")
        widths = [max(len(row[i]) for row in rows + [("RULE", "DEFINED AT", "WHAT", "")]) for i in range(3)]
        header = ("RULE", "DEFINED AT", "WHAT", "")
        for cells in [header, *rows]:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(cells[:3], widths)) + "  " + cells[3])
    lines.append("")
    verdict = "holds" if m.holds else "does NOT hold: see the findings"
    lines.append(f"proof, for the policy as written: {verdict}")
    for p in m.properties:
        state = "holds" if p.holds else f"{len(p.findings)} finding{'s' if len(p.findings) != 1 else ''}"
        lines.append(f"  [{state}] {p.id}: {p.statement}")
        for x in p.exceptions:
            lines.append(f"      allowed: {x}")
        for f in p.findings:
            lines.append(f"      {f}")
    return "\n".join(line.rstrip() for line in lines) + "\n"
