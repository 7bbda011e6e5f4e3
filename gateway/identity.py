"""Who a client connection is: the one place that turns a connection into the rules it may use.

Today a client is named by its source address alone (the policy's static `sandboxes:` table). A
connection may instead carry an `Identity` established by something stronger than its address (a
verified token, a registration from the platform); once set on the `ClientSession` it names the
sandbox for every later decision on that connection. Its `profile` is an entry of `sandboxes:`: the
envelope of rules and limits the policy file grants. An identity selects and may narrow that
envelope, never widen it.

A sandbox named by a token may also be registered by the platform under its token's `sub`, without
addresses (gateway/registry.py): the registration's grants then apply to its connections too.

Every decision asks `scope_of`, so live traffic, revocation and the audit agree on who is asking.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .hostnames import IPAddress
from .policy import NO_RULE, Policy, Scope
from .registry import Registry


@dataclass(frozen=True)
class Identity:
    """A connection's sandbox, established beyond its source address."""

    sandbox: str  # the id the audit names (a token's subject, a registration's id)
    profile: str  # the `sandboxes:` entry whose rules and limits apply
    via: str  # how it was established ("token", "registration"): audit and metrics
    rule_ids: frozenset[str] | None = None  # a narrowing of the profile's rules (None: all of them)


def scope_of(policy: Policy, address: IPAddress | None, identity: Identity | None = None,
             registry: Registry | None = None, now: float | None = None) -> Scope:
    """The rules a connection may use under `policy`: its identity's profile (narrowed, never
    widened); else the sandbox the platform registered for its source address (gateway/registry.py:
    the profile's rules plus the sandbox's grants, looked up now, so a deregistration or an expiry
    applies to the very next decision); else the static table by source address. A profile the
    policy no longer has (a reload removed it) grants no rule."""
    if identity is None:
        if registry:
            registered = registry.scope(policy, address, time.monotonic() if now is None else now)
            if registered is not None:
                return registered
        return policy.scope_for(address)
    entry = policy.sandboxes_by_id.get(identity.profile) if policy.sandboxes is not None else None
    if entry is None:
        return Scope(identity.sandbox, NO_RULE.rule_ids, None)
    rules = entry.rule_ids if identity.rule_ids is None else entry.rule_ids & identity.rule_ids
    if registry:
        registered = registry.scope_of_sandbox(policy, identity.sandbox, identity.profile,
                                               time.monotonic() if now is None else now)
        if registered is not None and registered.granted is not None:
            if identity.rule_ids is None:
                return registered
            # A narrowed token keeps its narrowing of the profile; what the platform granted this
            # sandbox is added, as it is to a sandbox named by its address.
            granted = registered.granted.rule_ids  # type: ignore[attr-defined]
            return Scope(identity.sandbox, rules | granted, entry.id, registered.granted)
    return Scope(identity.sandbox, rules, entry.id)
