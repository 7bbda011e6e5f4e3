"""Every HTTP request, before any upstream byte: the head read into plain values and judged by the
connection's session (gateway/session.py ClientSession.request_head: restated destinations, header
sanity, the rules, and the pin), then credentials, rate limits, the audit line, and the body checks.
Only a request that passed everything admits its (address, port) for the upstream guard.
"""

from __future__ import annotations

from mitmproxy import ctx, http

from gateway import bodies, methods
from gateway.decision import Decision, verdict_fields
from gateway.decompress import REQUEST_LIMIT, request_decoder
from gateway.engine import Engine, Pin, RequestFacts, body_override_refusal
from gateway.session import RequestHead, Step
from gateway.hopbyhop import forwardable

from .audit_fields import decision_fields, fallback_fields, flow_fields
from .credentials import CredentialInjector
from .failclosed import fail_closed
from .layers import end_stream, raw_authority, target_form
from .method_body import BODY_CHECK, BodyOverrideCheck, EmptyBodyCheck, enforced_if_bound
from .respond import refuse
from .session_driver import drive
from .revocation import FACTS, GENERATION
from .state import GatewayState


HOLD_BODY = "egress_hold_body"  # flow.metadata key: the request body is buffered, never streamed


def _deny_on_error(self: "RequestGuard", flow: http.HTTPFlow, error: Exception) -> None:
    decision = Decision.deny("internal_error", "the gateway failed while deciding this request")
    refuse(flow, decision)
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


class RequestGuard:
    def __init__(self, state: GatewayState):
        self.state = state
        self.credentials = CredentialInjector(state)

    @fail_closed(_deny_on_error)
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        conn = self.state.connection(flow.client_conn.id, flow.client_conn.peername)
        engine = self.state.require_engine()  # once: the whole request is judged by one policy
        scope = engine.policy.scope_for(conn.address)
        if (gated := self.state.gate(conn, scope)) is not None:  # before any decision work
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
        fields = sent | decision_fields(decision, pin, *destination)
        if injected:
            fields["injected"] = injected
        fields.update(self.credentials.audit_fields(flow))  # placeholder_misuse, foreign_credential
        self.state.record(event="request", **fields)
        if not decision.allowed or pin is None:
            refuse(flow, decision)
            return
        conn.admitted[(pin.address.compressed, pin.port)] = pin.sni if flow.request.scheme == "https" else None
        flow.metadata["egress_decision"] = decision
        flow.metadata["egress_pin"] = pin
        flow.metadata[GENERATION] = engine.generation  # with FACTS: what a WebSocket is judged again by
        # Also on a report-mode (would_deny) head: a body naming TRACE is refused in report mode too,
        # and any other override in it is recorded.
        overrides_check = self._check_body(flow, decision, pin, engine, sent, bool(injected))
        self._hold_empty_body(flow, decision, pin, engine, sent, bool(injected), overrides_check)

    def _hold_empty_body(self, flow: http.HTTPFlow, decision: Decision, pin: Pin, engine: Engine, sent: dict,
                         bound: bool, then: BodyOverrideCheck | None) -> None:
        """An allowed GET/HEAD/OPTIONS/DELETE whose head left its body open (HTTP/2 without
        END_STREAM or content-length) on a rule without allow_body: its body is held, and any byte
        of one refuses it (addons/method_body.py EmptyBodyCheck)."""
        rule = engine.policy.rules_by_id.get(decision.rule or "")
        framing = bodies.request_framing(_header_pairs(flow.request), end_stream(flow.request))
        if rule is None or not bodies.must_stay_empty(flow.request.method, framing, rule.allow_body):
            return
        refusal = enforced_if_bound(engine.report(Decision.deny(
            "unexpected_body", bodies.body_refusal_text(flow.request.method, rule.id) + "; nothing of it was sent",
            rule.id)), bound)

        def record(refused: Decision, _found) -> None:
            self.state.record(event="request_body", **({k: v for k, v in sent.items() if k != "method_override"}
                                                      | decision_fields(refused, pin)))

        flow.metadata[BODY_CHECK] = EmptyBodyCheck(refusal, record, then)
        flow.metadata[HOLD_BODY] = True

    def _check_body(self, flow: http.HTTPFlow, decision: Decision, pin: Pin, engine: Engine, sent: dict,
                    bound: bool) -> BodyOverrideCheck | None:
        """An allowed request whose body a framework could read a `_method` field from: its body is
        checked as it arrives, before it goes on (addons/method_body.py). With no rule behind the
        decision (report mode's `no_rule`), only the overrides that are always refused count."""
        rule = engine.policy.rules_by_id.get(decision.rule or "")
        limit = max(int(getattr(ctx.options, "egress_max_decoded_request_bytes", REQUEST_LIMIT)), 0) or None
        scanner = methods.BodyScanner.for_headers(_header_pairs(flow.request),
                                                  lambda coding: request_decoder(coding, limit))
        if scanner is None:
            return None
        wire = flow.request.method
        facts = flow.metadata.get(FACTS)
        client = flow.client_conn.id
        judged_by = [engine]  # the engine of the last judgement: a reload mid-body judges anew

        def stale() -> bool:
            return self.state.engine is not None and self.state.engine is not judged_by[0]

        def judge(found: list[methods.Override]) -> Decision | None:
            """Every override the body named so far, by the current policy: after a reload, by the
            rule that allows the head now (or the head's refusal, if none does)."""
            current, current_rule = self.state.engine or engine, rule
            if current is not engine and facts is not None:
                conn = self.state.connections.get(client)
                head = current.check_request(facts, current.policy.scope_for(conn.address if conn else None))
                if not head.allowed:
                    judged_by[0] = current
                    return head
                current_rule = current.policy.rules_by_id.get(head.rule or "")
            judged_by[0] = current
            refusal = body_override_refusal(current_rule, wire, found)
            return current.report(refusal) if refusal is not None else None

        def record(refusal: Decision, found: list[methods.Override]) -> None:
            fields = {k: v for k, v in sent.items() if k != "method_override"} | decision_fields(refusal, pin)
            fields["method_override"] = methods.described(found) or None
            self.state.record(event="request_body", **fields)

        check = flow.metadata[BODY_CHECK] = BodyOverrideCheck(scanner, judge, record, bound, decision.rule, stale)
        return check

    @fail_closed(lambda self, flow, error: flow.kill())
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        if response is None or response.status_code != 101:
            return
        asked = flow.request.headers.get("upgrade", "").strip().lower()
        answered = response.headers.get("upgrade", "").strip().lower()
        if asked == "websocket" and answered == "websocket":
            return
        conn = self.state.connections.get(flow.client_conn.id)
        decision = Decision.deny("unsolicited_upgrade", f"upstream answered 101 with Upgrade {answered[:40]!r}")
        pin = flow.metadata.get("egress_pin") or (conn.tunnel if conn else None)
        fields = flow_fields(flow, conn, self.state.scope(conn).sandbox) | decision_fields(decision, pin)
        self.state.record(event="response", **fields)
        flow.kill()
