"""Platform-held credentials: injected into approved requests, redacted from everything that
comes back.

`CredentialInjector.apply` runs inside the request guard, after every check passed and before the
audit line is written: it sets the rule's `inject` headers/query parameters (replacing whatever
the sandbox sent under those names, in any spelling), and swaps this sandbox's placeholders for
the real values, only for the secrets the matched rule is bound to. A secret that cannot be read
fails the request (502, naming the secret) instead of forwarding it without the credential.

`ResponseRedactor` replaces every form of every secret in response headers, bodies (streamed
chunk by chunk, or decoded first when the upstream compressed them) and WebSocket messages of
requests that carried a credential, and in response headers of all requests.
"""

from __future__ import annotations

from mitmproxy import http

from gateway.credentials import placeholder
from gateway.decision import Decision
from gateway.engine import Engine, Pin
from gateway.policy import Rule, Scope
from gateway.redact import Redactor, StreamRedactor
from gateway.secrets import SecretUnavailable

from .failclosed import fail_closed
from .state import GatewayState

BOUND = "egress_bound"  # flow.metadata key: names of the secrets this request carried


class CredentialInjector:
    def __init__(self, state: GatewayState):
        self.state = state

    def apply(self, flow: http.HTTPFlow, decision: Decision, scope: Scope, pin: Pin,
              engine: Engine) -> tuple[Decision, list[str]]:
        """Inject and swap for the allowed request; returns (decision, secret names used).

        A would_deny request (report mode) is let through without any credential."""
        rule: Rule | None = engine.policy.rules_by_id.get(decision.rule or "")
        if rule is None or not rule.secrets or decision.would_deny:
            return decision, []
        request = flow.request
        if request.scheme != "https" and not rule.allow_plaintext_credentials:
            return Decision.deny("plaintext_credentials", f"rule {rule.id} injects credentials, which never go over plain http", rule.id), []
        exact_hosts = {p.value for p in rule.hosts if p.kind == "exact"}
        if pin.host.value not in exact_hosts and not rule.allow_wildcard_credentials:
            return Decision.deny("credential_host", f"rule {rule.id} binds credentials to its exact hosts only", rule.id), []
        try:
            values = engine.secrets.values(rule.secrets)
        except SecretUnavailable as exc:
            return Decision.deny("secret_unavailable", str(exc), rule.id), []
        used: list[str] = []
        for injection in rule.injections:
            rendered = injection.template.render(values)
            if injection.target == "header":
                request.headers.pop(injection.name, None)  # every spelling, every duplicate
                request.headers[injection.name] = rendered
            else:
                request.query.set_all(injection.name, [rendered])
            used.extend(n for n in injection.template.secrets if n not in used)
        key = self.state.placeholder_key
        if key is not None:
            for name in rule.secrets:
                token = placeholder(key, name, scope.sandbox)
                if _swap(request, token, values[name]) and name not in used:
                    used.append(name)
        flow.metadata[BOUND] = used
        return decision, used


def _swap(request: http.Request, token: str, value: str) -> bool:
    swapped = False
    for name, header_value in list(request.headers.items(multi=True)):
        if token in header_value:
            values = [v.replace(token, value) for v in request.headers.get_all(name)]
            request.headers.set_all(name, values)
            swapped = True
    if token in request.path:
        request.path = request.path.replace(token, value)
        swapped = True
    return swapped


def _kill_on_error(self, flow, *rest, error: Exception) -> None:
    flow.kill()


class ResponseRedactor:
    def __init__(self, state: GatewayState):
        self.state = state
        self._redactor: Redactor | None = None
        self._generation = (None, -1)

    def redactor(self) -> Redactor | None:
        store = self.state.engine.secrets if self.state.engine is not None else None
        if store is None or not store.sources:
            return None
        store.known_values()  # refresh file-backed values (cheap: one stat each)
        key = (id(store), store.generation)
        if self._redactor is None or key != self._generation:
            self._redactor = Redactor(store.known_values())
            self._generation = key
        return self._redactor

    def _count(self, flow, hits: list[str], where: str) -> None:
        for name in dict.fromkeys(hits):
            self.state.record(event="redaction", secret=name, decision="allow", reason="redacted",
                              message=f"secret {name} redacted from the response {where}",
                              host=flow.request.pretty_host if flow.request else None)

    @fail_closed(_kill_on_error)
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        redactor = self.redactor()
        if redactor is None or flow.response is None:
            return
        hits: list[str] = []
        for name, value in list(flow.response.headers.items(multi=True)):
            clean, found = redactor.redact_text(value)
            if found:
                hits += found
                values = [redactor.redact_text(v)[0] for v in flow.response.headers.get_all(name)]
                flow.response.headers.set_all(name, values)
        if hits:
            self._count(flow, hits, "headers")
        if BOUND not in flow.metadata:
            return
        encoding = flow.response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            flow.response.stream = False  # buffer, decode and redact in `response`
        else:
            flow.response.stream = StreamRedactor(redactor, on_hit=lambda found: self._count(flow, found, "body"))

    @fail_closed(_kill_on_error)
    def response(self, flow: http.HTTPFlow) -> None:
        if BOUND not in flow.metadata or flow.response is None or flow.response.stream:
            return
        redactor = self.redactor()
        if redactor is None:
            return
        try:
            flow.response.decode(strict=True)
        except ValueError:
            decision = Decision.deny("undecodable_response", "a compressed response to a credential-bound "
                                     "request could not be decoded for redaction")
            flow.response = http.Response.make(502, decision.body(), {"X-Egress-Reason": decision.reason})
            return
        body = flow.response.raw_content or b""
        clean, hits = redactor.redact(body)
        if hits:
            flow.response.content = clean
            self._count(flow, hits, "body")

    @fail_closed(_kill_on_error)
    def websocket_message(self, flow: http.HTTPFlow) -> None:
        if BOUND not in flow.metadata or flow.websocket is None:
            return
        redactor = self.redactor()
        message = flow.websocket.messages[-1]
        if redactor is None or message.from_client:
            return
        clean, hits = redactor.redact(message.content)
        if hits:
            message.content = clean
            self._count(flow, hits, "WebSocket message")
