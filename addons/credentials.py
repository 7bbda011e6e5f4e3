"""Platform-held credentials, injected into approved requests.

`CredentialInjector.apply` runs inside the request guard, after every check passed and before the
audit line is written: it sets the rule's `inject` headers/query parameters (replacing whatever
the sandbox sent under those names, in any spelling), and swaps this sandbox's placeholders for
the real values, only for the secrets the matched rule is bound to. A secret that cannot be read
fails the request (502, naming the secret) instead of forwarding it without the credential. The
request is marked bound (`BOUND`): what comes back is redacted (addons/response_redaction.py).
"""

from __future__ import annotations

import logging

from mitmproxy import http

from gateway.credentials import placeholder
from gateway.decision import Decision
from gateway.credential_checks import BoundCheck, credential_verdict, secret_unavailable
from gateway.engine import Engine, Pin
from gateway.policy import Rule, Scope
from gateway.secrets import SecretUnavailable

from .state import GatewayState

BOUND = "egress_bound"  # flow.metadata key: names of the secrets this request carried


class CredentialInjector:
    AUDIT = "egress_credential_audit"  # flow.metadata key: audit fields of a refusal (audit_fields)

    def __init__(self, state: GatewayState):
        self.state = state

    def apply(self, flow: http.HTTPFlow, decision: Decision, scope: Scope, pin: Pin,
              engine: Engine) -> tuple[Decision, list[str]]:
        """Inject and swap for the allowed request; returns (decision, secret names used).

        Before anything is injected, the sandbox's own request must have its placeholders only
        where the rule swaps them and carry no credential but the platform's
        (gateway/credential_checks.credential_verdict). A would_deny request (report mode) is let through
        without any credential, and never with one of the sandbox's own."""
        rule: Rule | None = engine.policy.rules_by_id.get(decision.rule or "")
        if rule is None or not rule.secrets:
            return decision, []
        request = flow.request
        headers = list(request.headers.items(multi=True))
        verdict = credential_verdict(rule, decision, request.scheme, pin.host, headers, request.path,
                                     self._placeholders(rule, scope))
        if not verdict.inject:
            if verdict.check is not None and verdict.check.refusal is not None:
                self._refused(flow, verdict.check)
            return verdict.decision, []
        check = verdict.check
        try:
            values = engine.secrets.values(rule.secrets)
        except SecretUnavailable as exc:
            # The why (a path, an env variable) goes to the operator's log; the sandbox learns the name only.
            logging.getLogger("egress").warning("egress gateway: %s", exc)
            return secret_unavailable(rule, exc.name), []
        _swap(request, check, values)
        used: list[str] = []
        for injection in rule.injections:
            rendered = injection.template.render(values)
            if injection.target == "header":
                request.headers.pop(injection.name, None)  # every spelling, every duplicate
                request.headers[injection.name] = rendered
            else:
                request.query.set_all(injection.name, [rendered])
            used.extend(n for n in injection.template.secrets if n not in used)
        used.extend(n for n in check.swaps.secrets if n not in used)
        # Ask for an uncompressed answer: the response is redacted on its way back, and identity
        # bodies stream through the redactor without decoding.
        request.headers["Accept-Encoding"] = "identity"
        if request.headers.get("content-type", "").lower().startswith("application/grpc"):
            # gRPC compresses message by message only when the client accepts it (grpc-encoding on a
            # bound response is refused: gateway/streaming.py).
            request.headers["grpc-accept-encoding"] = "identity"
        flow.metadata[BOUND] = used
        # Whatever happens to the store from now on (a rotation, a reload), the response to this
        # request is redacted for exactly these values.
        self.state.secret_memory.pin(flow.id, {name: values[name] for name in rule.secrets})
        return decision, used

    def _placeholders(self, rule: Rule, scope: Scope) -> dict[str, str]:
        """This sandbox's placeholders for the rule's secrets: placeholder -> secret name."""
        key = self.state.placeholder_key
        if key is None:
            return {}
        return {placeholder(key, name, scope.sandbox): name for name in rule.secrets}

    def _refused(self, flow: http.HTTPFlow, check: BoundCheck) -> None:
        audit = {"location": check.location}
        if check.audit_target is not None:
            audit["path"] = check.audit_target  # the sandbox's own credential is not logged either
        flow.metadata[self.AUDIT] = audit

    def audit_fields(self, flow: http.HTTPFlow) -> dict:
        """Extra audit fields of a placeholder_misuse or foreign_credential refusal: `location`
        (where, never a value) and the path with foreign credential values blanked."""
        return flow.metadata.pop(self.AUDIT, {})


def _swap(request: http.Request, check: BoundCheck, values: dict[str, str]) -> None:
    """Make the swaps gateway/placeholders.py planned on the sandbox's request as sent: header
    values by position (raw), then the request target (secrets percent-encoded). Runs before the
    rule's injections, which replace their own headers and parameters whole."""
    swaps = check.swaps
    if swaps.headers:
        fields = list(request.headers.fields)
        for index in swaps.headers:
            fields[index] = (fields[index][0], swaps.header_value(index, values).encode("utf-8", "surrogateescape"))
        request.headers.fields = tuple(fields)
    if swaps.target is not None:
        request.path = swaps.new_target(values)
