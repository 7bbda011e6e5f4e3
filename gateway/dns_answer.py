"""DNS mode's decision, sans I/O: what the gateway's resolver answers a sandbox, given the name and
(when it needs them) the name's addresses. The live DNS guard (`Engine.answer_dns`, which does the
one lookup) and `replay` (which knows the addresses an audit line recorded) both take it from here.

A name no rule this client may use covers is refused before any lookup, so data encoded in
`<secret>.attacker.example` never leaves the gateway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .decision import Decision
from .hostnames import Host, HostError, IPAddress, canonical_host
from .policy import Policy, Scope
from .resolver import ResolveError

ADDRESS_TYPES = {"A": 4, "AAAA": 6}
NODATA_TYPES = frozenset({"HTTPS", "SVCB"})  # answered empty for allowed names: no ECH keys, no hints


@dataclass(frozen=True)
class DnsAnswer:
    """What the gateway's DNS says: rcode (NOERROR, NXDOMAIN, REFUSED, SERVFAIL) and addresses."""

    rcode: str
    addresses: tuple[IPAddress, ...]
    decision: Decision
    name: str | None = None


@dataclass(frozen=True)
class DnsLookup:
    """The question is allowed so far and needs `host`'s addresses: look them up, then `dns_answer`."""

    host: Host
    rule: str
    query_type: str


def dns_question(policy: Policy, raw_name: str, query_type: str, scope: Scope) -> DnsAnswer | DnsLookup:
    """The answer that needs no lookup (a refusal, or HTTPS/SVCB answered empty), else the lookup to make."""
    try:
        host = canonical_host(raw_name)
    except HostError as exc:
        return DnsAnswer("NXDOMAIN", (), Decision.deny("bad_host", f"bad DNS name: {exc}"))
    if host.is_ip:
        return DnsAnswer("NXDOMAIN", (), Decision.deny("bad_host", "an IP address is not a DNS name"), host.value)
    covering = [policy.rules[i] for i in policy.index.candidates(host) if scope.grants(policy.rules[i])]
    if not covering:
        for_whom = f" for sandbox {scope.sandbox}" if scope.sandbox else ""
        return DnsAnswer("NXDOMAIN", (), Decision.deny("no_rule", f"no rule covers {host}{for_whom}"), host.value)
    rule = covering[0].id
    if query_type in NODATA_TYPES:
        return DnsAnswer("NOERROR", (), Decision.allow(rule, f"{query_type} answered empty"), host.value)
    if query_type not in ADDRESS_TYPES:
        return DnsAnswer("REFUSED", (), Decision.deny("dns_type_refused", f"{query_type} queries are refused"),
                         host.value)
    return DnsLookup(host, rule, query_type)


def dns_answer(engine, lookup: DnsLookup, resolved: Sequence[IPAddress] | ResolveError) -> DnsAnswer:
    """The answer once the name is resolved: every address checked against the engine's deny list
    (one refused: NXDOMAIN). An empty `resolved` checks nothing (replay, when no address is known)."""
    host, rule = lookup.host, lookup.rule
    if isinstance(resolved, ResolveError):
        return DnsAnswer("SERVFAIL", (), Decision.deny("resolve_failed", str(resolved), rule), host.value)
    refused = [v for v in engine.check_addresses(resolved, None) if not v.allowed]
    if refused:
        decision = Decision.deny(refused[0].reason, f"{host} resolves to {refused[0].describe()}", rule)
        return DnsAnswer("NXDOMAIN", (), decision, host.value)
    version = ADDRESS_TYPES[lookup.query_type]
    matching = tuple(a for a in resolved if a.version == version)
    return DnsAnswer("NOERROR", matching, Decision.allow(rule, f"rule {rule} covers {host}"), host.value)
