"""The decision core: policy rules, address checks and pinning, with no proxy types in sight.

The proxy adapters call three things: `check_destination` when a destination is first named
(CONNECT, absolute URL), `pin` to resolve it and check every address, and `check_request` for
each request (method, path, scheme). Everything here is deterministic given the policy and the
resolver, which is what makes `explain` and replay possible.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .addresses import AddressGuard, AddressVerdict
from .decision import Decision
from .hostnames import Host, IPAddress
from .paths import PathError, normalise_path
from .policy import DEFAULT_PORTS, FORBIDDEN_METHODS, Policy, Rule
from .resolver import ResolveError, Resolver


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


@dataclass(frozen=True)
class RequestFacts:
    host: Host
    port: int
    scheme: str
    method: str
    target: str  # the request target as sent (origin-form path with query)


# How far a candidate rule got before failing; the furthest one explains the denial best.
_STAGES = ("scheme_not_allowed", "port_not_allowed", "method_not_allowed", "path_not_allowed")


class Engine:
    def __init__(self, policy: Policy, guard: AddressGuard, resolver: Resolver):
        self.policy = policy
        self.guard = guard
        self.resolver = resolver

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

    def _candidates(self, host: Host) -> list[Rule]:
        return [self.policy.rules[i] for i in self.policy.index.candidates(host)]

    def check_destination(self, host: Host, port: int) -> Decision:
        """May anything at all be sent to host:port? (CONNECT, before the tunnel's contents are seen.)"""
        candidates = self._candidates(host)
        if not candidates:
            return Decision.deny("no_rule", f"no rule allows {host.authority(port)}")
        for rule in candidates:
            if rule.allows_port(port):
                return Decision.allow(rule.id, f"rule {rule.id} allows {host.authority(port)}")
        notes = [f"rule {r.id}: port {port} not in {_ports_text(r)}" for r in candidates]
        return Decision.deny("port_not_allowed", f"no rule allows port {port} on {host}", candidates[0].id, notes)

    def check_request(self, facts: RequestFacts) -> Decision:
        method = facts.method.upper()
        if method in FORBIDDEN_METHODS:
            return Decision.deny("method_forbidden", f"{method} is always refused")
        try:
            path = normalise_path(facts.target)
        except PathError as exc:
            return Decision.deny("bad_path", f"bad request path: {exc}")
        candidates = self._candidates(facts.host)
        where = f"{facts.scheme}://{facts.host.authority(facts.port)}"
        if not candidates:
            return Decision.deny("no_rule", f"no rule allows {where}")
        best_stage, best_rule = -1, candidates[0]
        notes: list[str] = []
        for rule in candidates:
            stage, why = _first_failure(rule, facts, method, path)
            if stage is None:
                return Decision.allow(rule.id, f"rule {rule.id} allows {method} {where}{path}")
            notes.append(f"rule {rule.id}: {why}")
            if stage > best_stage:
                best_stage, best_rule = stage, rule
        reason = _STAGES[best_stage]
        return Decision.deny(reason, f"no rule allows {method} {where}{path} ({reason.replace('_', ' ')})", best_rule.id, notes)

    def check_addresses(self, addresses: Iterable[IPAddress], port: int) -> list[AddressVerdict]:
        return [self.guard.check(a, port) for a in addresses]

    async def pin(self, host: Host, port: int) -> tuple[Decision, Pin | None]:
        """Resolve once, check every address, choose the one to dial."""
        try:
            addresses = await self.resolver.resolve(host)
        except ResolveError as exc:
            return Decision.deny("resolve_failed", str(exc)), None
        verdicts = self.check_addresses(addresses, port)
        refused = [v for v in verdicts if not v.allowed]
        if refused:
            first = refused[0]
            return (
                Decision.deny(first.reason, f"{host} resolves to {first.describe()}", notes=[v.describe() for v in verdicts]),
                None,
            )
        return Decision.allow("", "addresses checked"), Pin(host, port, addresses[0], tuple(addresses))


def _ports_text(rule: Rule) -> str:
    if rule.ports is not None:
        return "[" + ", ".join(str(p) for p in sorted(rule.ports)) + "]"
    return "[" + ", ".join(str(DEFAULT_PORTS[s]) for s in sorted(rule.schemes)) + "] (scheme defaults)"


def _first_failure(rule: Rule, facts: RequestFacts, method: str, path: str) -> tuple[int | None, str]:
    if facts.scheme not in rule.schemes:
        return 0, f"scheme {facts.scheme} not in [{', '.join(sorted(rule.schemes))}]"
    if not rule.allows_port(facts.port, facts.scheme):
        return 1, f"port {facts.port} not in {_ports_text(rule)}"
    if not rule.allows_method(method):
        allowed = "standard methods" if rule.methods is None else ", ".join(sorted(rule.methods))
        return 2, f"method {method} not in [{allowed}]"
    if not rule.allows_path(path):
        return 3, f"path {path} matches none of [{', '.join(rule.path_globs or ())}]"
    return None, ""
