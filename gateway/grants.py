"""Grants: what the platform may add to a running sandbox, inside the envelope the policy declares.

A `sandboxes:` entry may say what may be granted to the sandboxes that use it as their profile
(`grantable:`): whole rules by id, and host patterns a grant may name (with the ports, schemes and
methods those may use), for at most `max_ttl`. The policy file is the envelope; the control API
(gateway/control.py) moves inside it. Two kinds of grant:

- a **rule grant** (`{rule: ID}`) adds one of the `grantable.rules` to the sandbox's rules: the
  scope's rule ids grow by one, and the rule is decided exactly as if the profile listed it;
- a **hosts grant** (`{hosts, ports, schemes, methods, paths}`) is compiled into a *transient*
  rule, id `grant:<GRANT ID>` (a colon, which no policy rule id may hold, so it can never shadow one),
  inspected, injecting nothing, without limits or `allow_body`. Its hosts must each lie within a
  `grantable.hosts` pattern (`within`), its ports, schemes and methods within the envelope's.

Both are only added to the rules a request may use: every other check (the deny list, pinning,
self-address, method overrides, bodies) applies to them as to any rule. A grant is re-checked
against the envelope of the policy in force whenever the sandbox's scope is rebuilt (after a
reload), so a grant the new policy no longer allows is inert at once (`envelope_refusal`).

Pure: no clock (the caller passes `now`), no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from .hostnames import HostError, canonical_host, is_ip_literal
from .matcher import HostIndex, HostPattern
from .paths import compile_glob
from .yamlsource import Location

GRANT_RULE_PREFIX = "grant:"
DEFAULT_MAX_TTL = 3600.0
MAX_TTL_CEILING = 7 * 24 * 3600.0  # a week: longer is a policy change, not a grant
DEFAULT_GRANT_PORTS = frozenset({443})
DEFAULT_GRANT_SCHEMES = frozenset({"https"})
MAX_GRANT_HOSTS = 32
MAX_GRANT_PATHS = 32
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*\Z")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


class GrantError(ValueError):
    """A grant outside the envelope, or malformed: `reason` is machine-readable (the API's)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def parse_duration(value: object) -> float:
    """Seconds from a number or text like `90s`, `30m`, `1h`, `1d`. ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or text like 30m, not a boolean")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION_RE.match(value)):
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    else:
        raise ValueError("a duration is a number of seconds or text like 90s, 30m, 1h, 1d")
    if not 0 < seconds <= MAX_TTL_CEILING:
        raise ValueError(f"must be more than 0 and at most {int(MAX_TTL_CEILING)} seconds (a week)")
    return seconds


@dataclass(frozen=True)
class Grantable:
    """A `grantable:` mapping: the envelope of every grant to a sandbox of this profile."""

    rules: frozenset[str] = frozenset()
    hosts: tuple[HostPattern, ...] = ()
    ports: frozenset[int] = DEFAULT_GRANT_PORTS
    schemes: frozenset[str] = DEFAULT_GRANT_SCHEMES
    methods: frozenset[str] | None = None  # None: the standard methods (as a rule without `methods`)
    max_ttl: float = DEFAULT_MAX_TTL


def within(inner: HostPattern, outer: HostPattern) -> bool:
    """Every host `inner` matches is matched by `outer`: `*.x.github.com` and `api.github.com` lie
    within `*.github.com`; `github.com` (the wildcard does not match its own domain) and `*.com` do
    not. Networks: a subnet (or an address) of the network."""
    if outer.kind == "exact":
        return inner.kind == "exact" and inner.value == outer.value
    if outer.kind == "wildcard":
        if inner.kind == "network" or is_ip_literal(inner.value):
            return False
        return inner.value.endswith("." + outer.value) or (inner.kind == "wildcard" and inner.value == outer.value)
    # outer is a network
    if inner.kind == "network":
        return inner.network.version == outer.network.version and inner.network.subnet_of(outer.network)
    if inner.kind == "exact":
        try:
            host = canonical_host(inner.value if ":" not in inner.value else f"[{inner.value}]")
        except HostError:
            return False
        return host.ip is not None and host.ip.version == outer.network.version and host.ip in outer.network
    return False


def parse_host_pattern(text: object) -> HostPattern:
    """A host pattern as the policy writes one (`api.x.com`, `*.x.com`, an address, a CIDR), or
    GrantError. The policy loader's own parser reports through its validator; this one raises."""
    from .addresses import parse_network

    if not isinstance(text, str) or not text.strip():
        raise GrantError("bad_grant", "a host pattern is a non-empty string")
    raw = text.strip()
    if raw in ("*", "*.", "*.*"):
        raise GrantError("bad_grant", f"{raw!r}: a wildcard needs a domain")
    if raw.startswith("*."):
        rest = raw[2:]
        if "*" in rest:
            raise GrantError("bad_grant", f"{raw!r}: only one leading '*.' is allowed")
        try:
            domain = canonical_host(rest)
        except HostError as exc:
            raise GrantError("bad_grant", f"{raw!r}: {exc}") from None
        if domain.is_ip:
            raise GrantError("bad_grant", f"{raw!r}: a wildcard cannot cover an IP address")
        return HostPattern.wildcard(domain.value)
    if "*" in raw:
        raise GrantError("bad_grant", f"{raw!r}: '*' is only allowed as a leading '*.' label")
    if "/" in raw:
        try:
            return HostPattern.cidr(parse_network(raw))
        except ValueError as exc:
            raise GrantError("bad_grant", f"{raw!r}: not a valid CIDR: {exc}") from None
    try:
        return HostPattern.exact(canonical_host(raw))
    except HostError as exc:
        raise GrantError("bad_grant", f"{raw!r}: {exc}") from None


@dataclass(frozen=True, slots=True)
class Grant:
    """One grant to one registered sandbox. `rule` for a rule grant; else the hosts grant's parts.
    `expires` is on the monotonic clock the registry is given (what decides); `expires_at` is the
    wall-clock time the API shows."""

    id: str
    sandbox: str
    expires: float
    expires_at: float
    by: str
    rule: str | None = None
    hosts: tuple[HostPattern, ...] = ()
    ports: frozenset[int] = frozenset()
    schemes: frozenset[str] = frozenset()
    methods: frozenset[str] | None = None
    paths: tuple[str, ...] | None = None

    @property
    def rule_id(self) -> str:
        """The rule a decision by this grant names: the granted rule, or the transient rule."""
        return self.rule if self.rule is not None else GRANT_RULE_PREFIX + self.id

    def describe(self) -> dict:
        """The grant as the API shows it (JSON)."""
        out: dict = {"id": self.id, "sandbox": self.sandbox, "expires_at": self.expires_at, "by": self.by,
                     "rule": self.rule_id}
        if self.rule is None:
            out |= {"hosts": [str(h) for h in self.hosts], "ports": sorted(self.ports),
                    "schemes": sorted(self.schemes), "methods": sorted(self.methods) if self.methods else None,
                    "paths": list(self.paths) if self.paths is not None else None}
        return out

    def to_op(self) -> dict:
        """What a worker needs to rebuild this grant (gateway/registry.py `Registry.apply`)."""
        return {"id": self.id, "sandbox": self.sandbox, "expires": self.expires, "expires_at": self.expires_at,
                "by": self.by, "rule": self.rule, "hosts": [str(h) for h in self.hosts], "ports": sorted(self.ports),
                "schemes": sorted(self.schemes), "methods": sorted(self.methods) if self.methods is not None else None,
                "paths": list(self.paths) if self.paths is not None else None}

    @classmethod
    def from_op(cls, op: dict) -> "Grant":
        return cls(op["id"], op["sandbox"], float(op["expires"]), float(op["expires_at"]), op["by"], op.get("rule"),
                   tuple(parse_host_pattern(h) for h in op.get("hosts") or ()), frozenset(op.get("ports") or ()),
                   frozenset(op.get("schemes") or ()),
                   frozenset(op["methods"]) if op.get("methods") is not None else None,
                   tuple(op["paths"]) if op.get("paths") is not None else None)


def _strings(value: object, what: str, limit: int) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise GrantError("bad_grant", f"{what} must be a list of non-empty strings")
    if len(value) > limit:
        raise GrantError("bad_grant", f"{what}: at most {limit} entries")
    return value


def build_grant(spec: dict, envelope: Grantable | None, rule_ids: Iterable[str], *, grant_id: str, sandbox: str,
                by: str, now: float, wall: float, standard_methods: frozenset[str]) -> Grant:
    """Check a grant request (`spec`, the API's JSON) against the profile's envelope and make the
    Grant; GrantError (`outside_envelope`, `bad_grant`) otherwise. `rule_ids`: the policy's rules."""
    if envelope is None:
        raise GrantError("outside_envelope", "this sandbox's profile declares no grantable: nothing may be granted")
    allowed_keys = {"rule", "hosts", "ports", "schemes", "methods", "paths", "ttl_seconds"}
    if unknown := sorted(set(spec) - allowed_keys):
        raise GrantError("bad_grant", f"unknown keys {unknown} (allowed: {sorted(allowed_keys)})")
    ttl_raw = spec.get("ttl_seconds", envelope.max_ttl)
    try:
        ttl = parse_duration(ttl_raw)
    except ValueError as exc:
        raise GrantError("bad_grant", f"ttl_seconds: {exc}") from None
    if ttl > envelope.max_ttl:
        raise GrantError("outside_envelope", f"ttl_seconds {ttl:g} is more than grantable.max_ttl "
                                             f"({envelope.max_ttl:g} s)")
    expires, expires_at = now + ttl, wall + ttl
    if ("rule" in spec) == ("hosts" in spec):
        raise GrantError("bad_grant", "a grant names either a rule ({rule: ID}) or hosts ({hosts: [...]})")
    if "rule" in spec:
        rule = spec["rule"]
        if extra := sorted(set(spec) - {"rule", "ttl_seconds"}):
            raise GrantError("bad_grant", f"a rule grant takes only rule and ttl_seconds, not {extra}")
        if not isinstance(rule, str) or rule not in set(rule_ids):
            raise GrantError("outside_envelope", f"{rule!r}: no rule of the policy has this id")
        if rule not in envelope.rules:
            raise GrantError("outside_envelope", f"rule {rule} is not in this profile's grantable.rules "
                                                 f"({', '.join(sorted(envelope.rules)) or 'none'})")
        return Grant(grant_id, sandbox, expires, expires_at, by, rule=rule)
    hosts = tuple(parse_host_pattern(h) for h in _strings(spec["hosts"], "hosts", MAX_GRANT_HOSTS))
    if not hosts:
        raise GrantError("bad_grant", "hosts must not be empty")
    for host in hosts:
        if not any(within(host, outer) for outer in envelope.hosts):
            raise GrantError("outside_envelope", f"host {host} is not within this profile's grantable.hosts "
                                                 f"({', '.join(str(h) for h in envelope.hosts) or 'none'})")
    ports = envelope.ports
    if "ports" in spec:
        raw = spec["ports"]
        if not isinstance(raw, list) or not raw or not all(type(p) is int and 1 <= p <= 65535 for p in raw):
            raise GrantError("bad_grant", "ports must be a non-empty list of port numbers")
        ports = frozenset(raw)
        if not ports <= envelope.ports:
            raise GrantError("outside_envelope", f"ports {sorted(ports - envelope.ports)} are not in grantable.ports "
                                                 f"{sorted(envelope.ports)}")
    schemes = envelope.schemes
    if "schemes" in spec:
        schemes = frozenset(_strings(spec["schemes"], "schemes", 2))
        if not schemes or not schemes <= envelope.schemes:
            raise GrantError("outside_envelope", f"schemes {sorted(schemes)} are not within grantable.schemes "
                                                 f"{sorted(envelope.schemes)}")
    envelope_methods = envelope.methods if envelope.methods is not None else standard_methods
    methods = envelope.methods
    if "methods" in spec:
        methods = frozenset(m.upper() for m in _strings(spec["methods"], "methods", 16))
        if not methods or not methods <= envelope_methods:
            raise GrantError("outside_envelope", f"methods {sorted(methods - envelope_methods)} are not within "
                                                 f"grantable.methods {sorted(envelope_methods)}")
    paths = None
    if "paths" in spec:
        paths = tuple(_strings(spec["paths"], "paths", MAX_GRANT_PATHS))
        for glob in paths:
            try:
                compile_glob(glob)
            except ValueError as exc:
                raise GrantError("bad_grant", f"paths: {glob!r}: {exc}") from None
    return Grant(grant_id, sandbox, expires, expires_at, by, hosts=hosts, ports=ports, schemes=schemes,
                 methods=methods, paths=paths)


def envelope_refusal(grant: Grant, envelope: Grantable | None, rule_ids) -> str | None:
    """Why `grant` is outside `envelope` (the policy in force may have changed since it was made),
    or None. The TTL is not re-checked: max_ttl bounds a grant when it is made."""
    if envelope is None:
        return "the profile declares no grantable"
    if grant.rule is not None:
        return None if grant.rule in envelope.rules and grant.rule in rule_ids else f"rule {grant.rule} not grantable"
    if not all(any(within(h, o) for o in envelope.hosts) for h in grant.hosts):
        return "a host is not within grantable.hosts"
    if not grant.ports <= envelope.ports or not grant.schemes <= envelope.schemes:
        return "ports or schemes not within the envelope"
    if envelope.methods is not None and (grant.methods is None or not grant.methods <= envelope.methods):
        return "methods not within grantable.methods"
    return None


@dataclass(frozen=True)
class GrantRules:
    """A sandbox's active grants, compiled for the engine: the policy rules they add (`rule_ids`)
    and the transient rules of its hosts grants with their own small host index (looked up per
    decision like the policy's: cost independent of how many grants any sandbox holds).
    `by_rule`: which grant stands behind a rule id (explain, audit)."""

    rule_ids: frozenset[str]
    rules: tuple = ()
    index: HostIndex = field(default_factory=HostIndex)
    by_rule: dict = field(default_factory=dict)

    def grant_of(self, rule_id: str | None) -> Grant | None:
        return self.by_rule.get(rule_id) if rule_id is not None else None


def transient_rule(grant: Grant, index: int):
    """The Rule a hosts grant is decided by (the engine's own checks: scheme, port, method, path)."""
    from .policy import Rule

    globs = patterns = None
    if grant.paths is not None:
        globs = grant.paths
        patterns = tuple(compile_glob(g) for g in grant.paths)
    return Rule(grant.rule_id, index, grant.hosts, grant.schemes, grant.ports, grant.methods, globs, patterns,
                Location(f"<grant {grant.id} of sandbox {grant.sandbox}>", 1, 1))


def compile_grants(grants: Iterable[Grant], own: frozenset[str] = frozenset()) -> GrantRules:
    """Active grants (already checked against the envelope) into GrantRules. `own`: the rules the
    profile grants anyway (a grant of one of those is no reason to name the grant in a decision)."""
    rule_ids: set[str] = set()
    rules = []
    by_rule: dict = {}
    for grant in grants:
        if grant.rule is not None:
            rule_ids.add(grant.rule)
            if grant.rule in own:
                continue
            current = by_rule.get(grant.rule)
            if current is None or current.expires < grant.expires:  # the longest-lived grant is shown
                by_rule[grant.rule] = grant
        else:
            rule = transient_rule(grant, len(rules))
            rules.append(rule)
            by_rule[rule.id] = grant
    index = HostIndex.build((pattern, rule.index) for rule in rules for pattern in rule.hosts) if rules else _EMPTY
    return GrantRules(frozenset(rule_ids), tuple(rules), index, by_rule)


_EMPTY = HostIndex()  # shared by every GrantRules without a hosts grant (never added to)
