"""The decision core: policy rules, address checks and pinning, with no proxy types in sight.

The connection's session (gateway/session.py) asks three things: `check_destination` when a
destination is first named (CONNECT, absolute URL), `admit_resolved` to check every address it
resolved to and pin one, and `check_request` for each request (method, path, scheme). Everything
here is deterministic given the policy and the addresses, which is what makes `explain` and
`replay` possible.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from .addresses import AddressGuard, AddressVerdict
from .decision import Decision
from . import bodies, methods
from .hostnames import Host, IPAddress, ip_host
from .paths import PathError, check_target, normalise_path
from .policy import DEFAULT_PORTS, EVERY_RULE, FORBIDDEN_METHODS, Policy, Rule, Scope
from .resolver import ResolveError, Resolver
from .secrets import SecretStore
from .tokens import TokenVerifier
from .dns_answer import DnsAnswer, dns_answer, dns_question


@dataclass(frozen=True)
class Pin:
    """Where a connection or request goes, fixed once: the canonical name and the address dialled."""

    host: Host
    port: int
    address: IPAddress
    addresses: tuple[IPAddress, ...]

    @property
    def sni(self) -> str | None:
        return None if self.host.is_ip else self.host.value


@dataclass(frozen=True, slots=True)
class RequestFacts:
    host: Host
    port: int
    scheme: str
    method: str
    target: str  # the request target as sent (origin-form path with query)
    # The request's header fields as sent, for method overrides (gateway/methods/); callers that
    # have none (explain without -H, replay, policy tests) judge the target's overrides only.
    headers: tuple[tuple[str, str], ...] = ()
    # What the head says about the body (gateway/bodies.py); None: read from `headers` as HTTP/1
    # frames them (live traffic passes what the wire said, with HTTP/2's END_STREAM).
    framing: bodies.Framing | None = None
    # Overrides known otherwise than from headers and target: replay's recorded query overrides
    # (the recorded path is capped and may have lost its query).
    recorded: tuple[methods.Override, ...] = ()
    # `overrides`, once found. Slots, not a dict: the facts live in the flow for as long as its
    # response streams (an SSE answer: minutes), and an instance dict was 144 bytes of each.
    _overrides: tuple[methods.Override, ...] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def overrides(self) -> tuple[methods.Override, ...]:
        """Found once per request."""
        found = self._overrides
        if found is None:
            found = tuple(dict.fromkeys(methods.overrides(self.headers, self.target) + self.recorded))
            object.__setattr__(self, "_overrides", found)  # (frozen: the cache is not a fact)
        return found

    @property
    def body(self) -> bodies.Framing:
        return self.framing if self.framing is not None else bodies.request_framing(self.headers)


# Denials that report mode turns into `would_deny` (the allowlist's own verdicts).
REPORTABLE_REASONS = frozenset(
    {"no_rule", "port_not_allowed", "scheme_not_allowed", "method_not_allowed", "path_not_allowed", "unexpected_body"}
)

# How far a candidate rule got before failing; the furthest one explains the denial best.
_STAGES = ("scheme_not_allowed", "port_not_allowed", "method_not_allowed", "path_not_allowed", "unexpected_body")


class Engine:
    def __init__(self, policy: Policy, guard: AddressGuard, resolver: Resolver):
        self.policy = policy
        self.guard = guard
        self.resolver = resolver
        # The policy's secrets travel with it: a reload swaps rules and secrets together.
        self.secrets = SecretStore(policy.secrets)
        # And its token verifier (policy identity: tokens:): a reload starts with an empty cache.
        self.tokens = TokenVerifier(policy.tokens, frozenset(policy.sandboxes_by_id)) if policy.tokens else None
        # Told how long each policy check took (kind, seconds), e.g. for a metrics histogram.
        self.timings: Callable[[str, float], None] | None = None
        # Transient rules of hosts grants by id (gateway/registry.py keeps them; GatewayState.install
        # shares its dict): `rule()` finds them where a policy rule id would be looked up.
        self.grant_rules: dict[str, Rule] = {}
        # Which install this engine was (GatewayState.install numbers them from 1; 0: never installed).
        # A connection records the generation that judged it, so a reload can tell what it must re-judge.
        self.generation = 0

    def rule(self, rule_id: str | None) -> Rule | None:
        """The rule a decision names: the policy's, or a hosts grant's transient rule."""
        if not rule_id:
            return None
        return self.policy.rules_by_id.get(rule_id) or self.grant_rules.get(rule_id)

    def _timed(self, kind: str, check: Callable[..., Decision], *args) -> Decision:
        if self.timings is None:
            return self._report(check(*args))
        started = time.perf_counter()
        try:
            return self._report(check(*args))
        finally:
            self.timings(kind, time.perf_counter() - started)

    def report(self, decision: Decision) -> Decision:
        """`_report`, for decisions made outside the engine's checks (a method override found in a
        request body after its head was allowed)."""
        return self._report(decision)

    def _report(self, decision: Decision) -> Decision:
        """Report mode: an allowlist denial is let through as `would_deny` when the rule that
        decided (or, with no rule involved, the policy) is in report mode. Address checks,
        pinning, malformed input and TRACE/TRACK are never relaxed."""
        if decision.allowed or decision.reason not in REPORTABLE_REASONS:
            return decision
        rule = self.policy.rules_by_id.get(decision.rule or "")
        mode = (rule.mode if rule is not None and rule.mode else None) or self.policy.mode
        if mode != "report":
            return decision
        return Decision(True, decision.reason, f"report mode: {decision.message}", decision.rule,
                        decision.notes, would_deny=True)

    @classmethod
    def build(
        cls,
        policy: Policy,
        self_addresses: Iterable[IPAddress] = (),
        listeners: Iterable[tuple[IPAddress, int]] = (),
        resolver: Resolver | None = None,
    ) -> "Engine":
        guard = AddressGuard(policy.deny_ranges, policy.allow_ranges).with_self(self_addresses, listeners)
        return cls(policy, guard, resolver or Resolver(policy.static_hosts))

    def _candidates(self, host: Host, scope: Scope, protocol: str = "http") -> tuple[list[Rule], list[str]]:
        """Rules covering the host that this client may use, and notes on those it may not."""
        found, notes = [], []
        for i in self.policy.index.candidates(host):
            rule = self.policy.rules[i]
            if rule.protocol != protocol:
                continue
            if scope.grants(rule):
                found.append(rule)
            else:
                notes.append(f"rule {rule.id}: not granted to sandbox {scope.sandbox or '(none)'}")
        granted = scope.granted
        if granted is not None and granted.rules:  # a registered sandbox's hosts grants: its own small index
            for i in granted.index.candidates(host):
                rule = granted.rules[i]
                if rule.protocol == protocol:
                    found.append(rule)
        return found, notes

    def check_destination(self, host: Host, port: int, scope: Scope = EVERY_RULE) -> Decision:
        """May anything at all be sent to host:port? (CONNECT, before the tunnel's contents are seen.)"""
        return self._timed("destination", self._check_destination, host, port, scope)

    def _check_destination(self, host: Host, port: int, scope: Scope) -> Decision:
        candidates, notes = self._candidates(host, scope)
        if not candidates:
            return Decision.deny("no_rule", f"no rule allows {host.authority(port)}{_for(scope)}", notes=notes)
        for rule in candidates:
            if rule.allows_port(port):
                return Decision.allow(rule.id, f"rule {rule.id} allows {host.authority(port)}{_by_grant(scope, rule)}")
        notes = [f"rule {r.id}: port {port} not in {_ports_text(r)}" for r in candidates]
        return Decision.deny("port_not_allowed", f"no rule allows port {port} on {host}", candidates[0].id, notes)

    def check_request(self, facts: RequestFacts, scope: Scope = EVERY_RULE) -> Decision:
        """May this request (method, path, scheme, port on a host) be sent?"""
        return self._timed("request", self._check_request, facts, scope)

    def _check_request(self, facts: RequestFacts, scope: Scope) -> Decision:
        method = facts.method.upper()
        if method in FORBIDDEN_METHODS:
            return Decision.deny("method_forbidden", f"{method} is always refused")
        overrides = facts.overrides
        if (never := methods.forbidden(overrides)) is not None:
            return Decision.deny("method_forbidden", f"{never.method} is always refused, also as a method override "
                                                     f"({never.where}) on {method}")
        try:
            check_target(facts.target)
            path = normalise_path(facts.target)
        except PathError as exc:
            return Decision.deny("bad_path", f"bad request path: {exc}")
        candidates, notes = self._candidates(facts.host, scope)
        where = f"{facts.scheme}://{facts.host.authority(facts.port)}"
        if not candidates:
            return Decision.deny("no_rule", f"no rule allows {where}{_for(scope)}", notes=notes)
        best_stage, best_rule, best_override = -1, candidates[0], None
        for rule in candidates:
            stage, why, override = _first_failure(rule, facts, method, path, overrides)
            if stage is None:
                return Decision.allow(rule.id, f"rule {rule.id} allows {method} {where}{path}{_with(overrides)}"
                                               f"{_by_grant(scope, rule)}")
            notes.append(f"rule {rule.id}: {why}")
            if stage > best_stage:
                best_stage, best_rule, best_override = stage, rule, override
        reason = _STAGES[best_stage]
        what = f"{method} {where}{path}"
        if best_override is not None:
            what += f" with the method override {best_override.describe()}"
        if reason == "unexpected_body":
            return Decision.deny(reason, f"no rule allows {what} with a body: "
                                         f"{bodies.body_refusal_text(method, best_rule.id)}", best_rule.id, notes)
        return Decision.deny(reason, f"no rule allows {what} ({reason.replace('_', ' ')})", best_rule.id, notes)

    def check_tcp(self, address: IPAddress, port: int, names: Iterable[str] = (), scope: Scope = EVERY_RULE) -> Decision:
        """Raw TCP (transparent mode): a `protocol: tcp` rule must name the address (or a CIDR holding
        it), or a name that the gateway's own DNS answered with this address for this client."""
        return self._timed("tcp", self._check_tcp, address, port, tuple(names), scope)

    def _check_tcp(self, address: IPAddress, port: int, names: tuple[str, ...], scope: Scope) -> Decision:
        where = f"tcp://{ip_host(address).authority(port)}"
        hosts = [ip_host(address)] + [Host(n) for n in names]
        candidates: list[Rule] = []
        notes: list[str] = []
        for host in hosts:
            found, skipped = self._candidates(host, scope, protocol="tcp")
            candidates += [r for r in found if r not in candidates]
            notes += skipped
        if not candidates:
            return Decision.deny("no_rule", f"no protocol: tcp rule allows {where}{_for(scope)}", notes=notes)
        for rule in candidates:
            if rule.ports is not None and port in rule.ports:
                return Decision.allow(rule.id, f"rule {rule.id} allows {where}")
        notes += [f"rule {r.id}: port {port} not in {_ports_text(r)}" for r in candidates]
        return Decision.deny("port_not_allowed", f"no protocol: tcp rule allows port {port}", candidates[0].id, notes)

    def tcp_decision(self, address: IPAddress, port: int, names: Iterable[str] = (),
                     scope: Scope = EVERY_RULE) -> Decision:
        """A raw TCP connection as the gateway relays it: `check_tcp`, then the deny list on the very
        address it dials (the layer guard asks for a new connection, revocation for an open one)."""
        decision = self.check_tcp(address, port, names, scope)
        if decision.allowed:
            verdict = self.guard.check(address, port)
            if not verdict.allowed:
                decision = Decision.deny(verdict.reason, verdict.describe(), decision.rule)
        return decision

    def passthrough_rule(self, decision: Decision) -> Rule | None:
        """The passthrough (inspect: false) rule behind an allowed destination, if that is what allowed
        it. A report-mode `would_deny` is never relayed unread: its requests must stay visible to be
        reported."""
        if not decision.allowed or decision.would_deny or not decision.rule:
            return None
        rule = self.policy.rules_by_id.get(decision.rule)
        return rule if rule is not None and not rule.inspect else None

    def original_destination_refusal(self, original: IPAddress, host: Host, addresses: Iterable[IPAddress],
                                     rule: str | None) -> Decision | None:
        """Transparent mode with `strict_original_destination`: the address the sandbox dialled must be
        one of the addresses the gateway pinned for the name (421 otherwise)."""
        addresses = tuple(addresses)
        if not self.policy.strict_original_destination or original in addresses:
            return None
        return Decision.deny("original_destination_mismatch",
                             f"the sandbox dialled {original} but {host} resolves to "
                             f"{', '.join(a.compressed for a in addresses)}", rule)

    async def answer_dns(self, raw_name: str, query_type: str, scope: Scope = EVERY_RULE) -> DnsAnswer:
        """DNS mode's answer (gateway/dns_answer.py decides): the name is looked up only when some
        rule this client may use covers it and the question is for its addresses."""
        question = dns_question(self.policy, raw_name, query_type, scope)
        if isinstance(question, DnsAnswer):
            return question
        return dns_answer(self, question, await self.resolved(question.host))

    def check_addresses(self, addresses: Iterable[IPAddress], port: int) -> list[AddressVerdict]:
        return [self.guard.check(a, port) for a in addresses]

    async def resolved(self, host: Host) -> Sequence[IPAddress] | ResolveError:
        """The resolver's answer for `host`, a failure included: what a sans-I/O walk is sent back."""
        try:
            return await self.resolver.resolve(host)
        except ResolveError as exc:
            return exc

    def admit_resolved(self, decision: Decision, host: Host, port: int,
                       resolved: Sequence[IPAddress] | ResolveError) -> tuple[Decision, Pin | None]:
        """After a policy check that let it through, `host`'s addresses (resolved by the caller:
        gateway/session.py asks for them, sans I/O) checked: the decision that stands (an address
        refusal wins) and the pin."""
        if not decision.allowed:
            return decision, None
        addresses, pin = self.pin_resolved(host, port, resolved)
        if not addresses.allowed or pin is None:
            return Decision.deny(addresses.reason, addresses.message, decision.rule, addresses.notes), None
        return decision, pin

    def pin_resolved(self, host: Host, port: int,
                     resolved: Sequence[IPAddress] | ResolveError) -> tuple[Decision, Pin | None]:
        """Every address `host` resolved to checked, and the one to dial chosen."""
        if isinstance(resolved, ResolveError):
            return Decision.deny("resolve_failed", str(resolved)), None
        if not resolved:  # (no resolver returns this; fail closed if one ever does)
            return Decision.deny("resolve_failed", f"{host} resolved to no address"), None
        refusal = self.address_refusal(host, resolved, port)
        if refusal is not None:
            return refusal, None
        return Decision.allow("", "addresses checked"), Pin(host, port, resolved[0], tuple(resolved))

    def address_refusal(self, host: Host, addresses: Iterable[IPAddress], port: int) -> Decision | None:
        """Every address of a destination against the deny list (and the gateway's own sockets): the
        refusal for the first one refused, or None. `pin_resolved` asks for a new destination,
        revocation for the addresses an open connection was pinned to."""
        verdicts = self.check_addresses(addresses, port)
        refused = [v for v in verdicts if not v.allowed]
        if not refused:
            return None
        first = refused[0]
        return Decision.deny(first.reason, f"{host} resolves to {first.describe()}", notes=[v.describe() for v in verdicts])


def _by_grant(scope: Scope, rule: Rule) -> str:
    """" (by grant G until T)" when the rule decides only because a grant added it to the scope."""
    granted = scope.granted
    if granted is None:
        return ""
    grant = granted.grant_of(rule.id)
    if grant is None:
        return ""
    until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(grant.expires_at))
    return f" (by grant {grant.id} of sandbox {grant.sandbox}, until {until})"


def _for(scope: Scope) -> str:
    return f" for sandbox {scope.sandbox}" if scope.sandbox else ""


def _ports_text(rule: Rule) -> str:
    if rule.ports is not None:
        return "[" + ", ".join(str(p) for p in sorted(rule.ports)) + "]"
    return "[" + ", ".join(str(DEFAULT_PORTS[s]) for s in sorted(rule.schemes)) + "] (scheme defaults)"


def _with(overrides: tuple[methods.Override, ...]) -> str:
    if not overrides:
        return ""
    return " (method override " + ", ".join(methods.described(overrides)) + ")"


def _first_failure(rule: Rule, facts: RequestFacts, method: str, path: str,
                   overrides: tuple[methods.Override, ...] = ()) -> tuple[int | None, str, methods.Override | None]:
    """How far `rule` gets with this request: (stage it fails at, why, the override that failed it),
    or (None, "", None) when it allows it. The method stage checks the wire method and then every
    method an override names (gateway/methods/): each must be one the rule allows."""
    if facts.scheme not in rule.schemes:
        return 0, f"scheme {facts.scheme} not in [{', '.join(sorted(rule.schemes))}]", None
    if not rule.allows_port(facts.port, facts.scheme):
        return 1, f"port {facts.port} not in {_ports_text(rule)}", None
    allowed = "standard methods" if rule.methods is None else ", ".join(sorted(rule.methods))
    if not rule.allows_method(method):
        return 2, f"method {method} not in [{allowed}]", None
    if (override := methods.refused(overrides, rule.allows_method)) is not None:
        return 2, f"method override {override.describe()} not in [{allowed}]", override
    if not rule.allows_path(path):
        return 3, f"path {path} matches none of [{', '.join(rule.path_globs or ())}]", None
    if not rule.allow_body and bodies.needs_allow_body(method, facts.body):
        return 4, f"{method} with a body, and allow_body is not set", None
    return None, "", None


def body_override_refusal(rule: Rule | None, method: str, found: list[methods.Override]) -> Decision | None:
    """A method override in the body of a request `rule` allowed by its head
    (gateway/methods/scanner.py BodyScanner): refused when it names a method the rule does not allow, or TRACE/TRACK/CONNECT
    (those also when no rule was involved: a report-mode `no_rule`)."""
    if (never := methods.forbidden(found)) is not None:
        return Decision.deny("method_forbidden", f"the request body names {never.method} as a method override "
                                                 f"({never.where}), which is always refused; its end was not sent",
                             rule.id if rule is not None else None)
    if rule is None or (override := methods.refused(found, rule.allows_method)) is None:
        return None
    allowed = "standard methods" if rule.methods is None else ", ".join(sorted(rule.methods))
    return Decision.deny("method_not_allowed", f"rule {rule.id} allows {method.upper()} here, but the request body "
                                               f"names the method override {override.describe()}, not in [{allowed}]; "
                                               "its end was not sent", rule.id)
