"""Every HTTP request, before any upstream byte: the head read into plain values and judged by the
connection's session (gateway/session.py ClientSession.request_head: restated destinations, header
sanity, the rules, and the pin), then credentials, rate limits, the audit line, and the body checks it plans (addons/body_checks.py).
Only a request that passed everything admits its (address, port) for the upstream guard. What an
upstream answers with 101 is addons/upgrade_guard.py's.
"""

from __future__ import annotations

from mitmproxy import http

from gateway import methods
from gateway.decision import Decision, verdict_fields
from gateway.engine import RequestFacts
from gateway.session import RequestHead, Step
from gateway.hopbyhop import forwardable, without_proxy_credentials

from . import body_checks, proxy_auth
from .audit_fields import decision_fields, fallback_fields, flow_fields
from .credentials import CredentialInjector
from .failclosed import fail_closed
from .layers import end_stream, raw_authority, target_form
from .respond import flow_page, refuse
from .session_driver import drive
from .revocation import FACTS, GENERATION, REGISTRY_SEQ
from .state import GatewayState


def _deny_on_error(self: "RequestGuard", flow: http.HTTPFlow, error: Exception) -> None:
    decision = Decision.deny("internal_error", "the gateway failed while deciding this request")
    refuse(flow, decision, flow_page(self.state, flow, decision))
    self.state.record(event="request", **fallback_fields(self.state, flow.client_conn), **verdict_fields(decision))


def _header_pairs(request: http.Request) -> list[tuple[str, str]]:
    return [(k, v) for k, v in request.headers.items(multi=True)]


def _head(flow: http.HTTPFlow) -> RequestHead:
    """What the session judges: the head as the sandbox sent it, in plain values."""
    request = flow.request
    return RequestHead(
        method=request.method, scheme=request.scheme, path=request.path, http_version=request.http_version,
        headers=tuple(_header_pairs(request)),
        authority=request.data.authority.decode("utf-8", "surrogateescape"),
        raw_authority=raw_authority(request), form=target_form(request), end_stream=end_stream(request),
        malformed=flow.error.msg if flow.error is not None else None)


def _drop_hop_by_hop(request: http.Request) -> None:
    """TE, Keep-Alive, Proxy-Connection and what Connection nominates stay on the sandbox's hop
    (gateway/hopbyhop.py says which and why)."""
    fields = forwardable(request.headers.fields, http2=request.is_http2 or request.is_http3)
    if fields is not None:
        request.headers.fields = tuple(fields)


def _drop_proxy_credentials(request: http.Request) -> None:
    """The sandbox's Proxy-Authorization (its proxy token) was for the gateway: never sent upstream."""
    fields = without_proxy_credentials(request.headers.fields)
    if fields is not None:
        request.headers.fields = tuple(fields)


def _origin_form(request: http.Request) -> None:
    """An HTTP/1 request goes upstream in origin-form (`GET /path`), whatever form the sandbox
    sent it in: the destination is the gateway's, and an absolute-form authority (inside a tunnel,
    in transparent mode) would restate it to the upstream, which may route by it (RFC 9112 3.2.2
    lets it prevail over Host). mitmproxy does this only for the explicit proxy port. HTTP/2's
    :authority stays (it is the Host of HTTP/2, checked like Host); a CONNECT keeps its target.
    A request with no Host (HTTP/1.0) gets the authority, checked against the pin, as its Host:
    without it the upstream was told no host at all (review 31)."""
    if request.method != "CONNECT" and not (request.is_http2 or request.is_http3) and request.data.authority:
        if "host" not in request.headers:
            request.headers.insert(0, "Host", request.data.authority.decode("utf-8", "surrogateescape"))
        request.authority = ""


class RequestGuard:
    def __init__(self, state: GatewayState):
        self.state = state
        self.credentials = CredentialInjector(state)

    @fail_closed(_deny_on_error)
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        conn = self.state.connection(flow.client_conn.id, flow.client_conn.peername)
        engine = self.state.require_engine()  # once: the whole request is judged by one policy
        registry_seq = self.state.registry.seq  # the registry the scope below is taken from
        # An absolute-form request is addressed to the proxy: its credential first (addons/proxy_auth.py).
        refused, auth_fields = proxy_auth.check(flow, conn, engine, self.state)
        scope = self.state.scope_under(engine.policy, conn)
        if refused is not None:
            step = Step(refused)
        elif (gated := self.state.gate(conn, scope)) is not None:  # before any decision work
            step = Step(gated)
        else:
            step = await drive(conn.request_head(_head(flow), engine, scope), engine, self.state,
                               flow.client_conn.id, conn)
        if step.facts is not None:
            flow.metadata[FACTS] = step.facts
        if step.upstream is not None:
            flow.request.data.host, flow.request.data.port = step.upstream
        decision, pin, destination = step.decision, step.pin, (step.host, step.port)
        # What the sandbox sent, read before any credential is injected or swapped in.
        sent = flow_fields(flow, conn, scope.sandbox)
        facts = flow.metadata.get(FACTS)  # the overrides the decision found (once), if it got that far
        found = facts.overrides if isinstance(facts, RequestFacts) else \
            methods.overrides(_header_pairs(flow.request), flow.request.path)
        overrides = methods.described(found)
        if overrides:
            sent["method_override"] = overrides  # the methods the request names besides its own
        injected: list[str] = []
        if decision.allowed and pin is not None:
            _drop_hop_by_hop(flow.request)  # before injecting: nothing the gateway sets can be nominated
            decision, injected = self.credentials.apply(flow, decision, scope, pin, engine)
        if decision.allowed and pin is not None:
            for limiter in self.state.request_limiters:  # rates and budgets (addons/rate_limits.py)
                if (limited := limiter(flow, decision, scope, engine, injected)) is not None:
                    decision, injected = limited, []  # refused: nothing injected goes anywhere
                    break
        fields = sent | decision_fields(decision, pin, *destination) | auth_fields
        if injected:
            fields["injected"] = injected
        fields.update(self.credentials.audit_fields(flow))  # placeholder_misuse, foreign_credential
        self.state.record(event="request", **fields)
        if not decision.allowed or pin is None:
            refuse(flow, decision, flow_page(self.state, flow, decision, pin.host.value if pin else step.host))
            return
        _drop_proxy_credentials(flow.request)  # after the credential verdict: never upstream
        _origin_form(flow.request)
        conn.admit(pin.address.compressed, pin.port, pin.sni if flow.request.scheme == "https" else None)
        flow.metadata["egress_decision"] = decision
        flow.metadata["egress_pin"] = pin
        flow.metadata[GENERATION] = engine.generation  # with FACTS: what a WebSocket is judged again by
        flow.metadata[REGISTRY_SEQ] = registry_seq  # a registry change during the decision: judged again
        # Also on a report-mode (would_deny) head: a body naming TRACE is refused in report mode too,
        # and any other override in it is recorded.
        body_checks.plan(self.state, flow, decision, pin, engine, sent, bound=bool(injected))
