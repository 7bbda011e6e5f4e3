"""Credentials: one verdict for a request head under its rule's credentials, before anything is
injected. The proxy (addons/credentials.py), `explain` and `replay` all ask `credential_verdict`, so
the refusals `plaintext_credentials`, `credential_host`, `placeholder_misuse` and
`foreign_credential` cannot be spelled three ways; `secret_unavailable` is spelled here too, though
only the proxy reads secrets.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import foreign, placeholders
from .decision import Decision
from .hostnames import Host
from .policy import Rule


@dataclass(frozen=True)
class CredentialVerdict:
    """What a rule's credentials make of a request its rules let through."""

    decision: Decision  # the decision that stands
    check: "BoundCheck | None" = None  # the sandbox's side: swaps planned, where a refusal points
    inject: bool = False  # the rule's secrets go into the request (read them, swap, inject)


def credential_verdict(rule: Rule | None, decision: Decision, scheme: str, host: Host, headers, target: str,
                       tokens) -> CredentialVerdict:
    """The decision for a request head (its `headers` and `target` as the sandbox sent them) once the
    rule `decision` names has had its say on credentials. Report mode's would_deny injects nothing,
    and lets nothing of the sandbox's own through under an injected name (`swap=False`)."""
    if rule is None or not rule.secrets or not decision.allowed:
        return CredentialVerdict(decision)
    if decision.would_deny:
        check = check_bound_request(rule, headers, target, tokens, swap=False)
        return CredentialVerdict(check.refusal or decision, check)
    if refusal := credential_refusal(rule, scheme, host):
        return CredentialVerdict(refusal)
    check = check_bound_request(rule, headers, target, tokens)
    if check.refusal is not None:
        return CredentialVerdict(check.refusal, check)
    return CredentialVerdict(decision, check, inject=True)


def secret_unavailable(rule: Rule, name: str) -> Decision:
    """A secret the request needs cannot be read: nothing is sent (the why goes to the operator's log)."""
    return Decision.deny("secret_unavailable", f"secret {name!r} is unavailable; nothing was sent", rule.id)


def credential_refusal(rule: Rule, scheme: str, host: Host) -> Decision | None:
    """The checks before a rule's credentials go into a request: never over plain http, and only to
    the rule's exact hosts, unless the rule says otherwise. (Part of `credential_verdict`.)"""
    if not rule.secrets:
        return None
    if scheme != "https" and not rule.allow_plaintext_credentials:
        return Decision.deny("plaintext_credentials",
                             f"rule {rule.id} injects credentials, which never go over plain http", rule.id)
    exact = {p.value for p in rule.hosts if p.kind == "exact"}
    if host.value not in exact and not rule.allow_wildcard_credentials:
        return Decision.deny("credential_host", f"rule {rule.id} binds credentials to its exact hosts only", rule.id)
    return None


@dataclass(frozen=True)
class BoundCheck:
    """What a request on a rule bound to secrets may carry (see `check_bound_request`)."""

    refusal: Decision | None
    swaps: placeholders.Swaps
    location: str | None = None  # where the refusal points: "header X-Api-Key", "path", ... (never a value)
    audit_target: str | None = None  # the target for the audit line, when it must differ (foreign values blanked)


def check_bound_request(rule: Rule, headers, target: str, tokens, swap: bool = True) -> BoundCheck:
    """The sandbox's side of a bound request, before anything is injected: every placeholder stands
    where the rule swaps it (403 `placeholder_misuse` otherwise), and no credential but the
    platform's is on it (403 `foreign_credential`). `tokens` maps this sandbox's placeholders for
    the rule's secrets to secret names. `swap=False` (report mode's would_deny: nothing is swapped
    or injected, so what the sandbox sent under an injected name goes as it is) checks foreign
    credentials only. Part of `credential_verdict`."""
    injected_headers = frozenset(i.name.lower() for i in rule.injections if i.target == "header")
    injected_query = frozenset(i.name for i in rule.injections if i.target == "query")
    swaps = placeholders.Swaps()
    if swap:
        planned = placeholders.plan(headers, target, tokens, rule.placeholders, rule.id, injected_headers,
                                    injected_query)
        if isinstance(planned, placeholders.Misuse):
            message = (f"placeholder in the {planned.location} refused: {planned.why}; rule {rule.id} swaps "
                       f"placeholders only as {rule.placeholders.describe()}; nothing was sent")
            return BoundCheck(Decision.deny("placeholder_misuse", message, rule.id), swaps, planned.location)
        swaps = planned
    where = foreign.find(headers, target, rule.foreign_credentials, tokens, rule.placeholders.query,
                         injected_headers, injected_query, replaced=swap)
    if where is not None:
        message = (f"rule {rule.id} sends only the platform's credential, and this request carries another "
                   f"one in the {where}; nothing was sent")
        scrubbed = foreign.scrub_target(target, rule.foreign_credentials, injected_query)
        return BoundCheck(Decision.deny("foreign_credential", message, rule.id), swaps, where,
                          scrubbed if scrubbed != target else None)
    return BoundCheck(None, swaps)
