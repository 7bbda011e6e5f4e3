"""The checks an allowed request's body gets, planned when its head is allowed: the body arrives
later, in the gateway's HTTP stream (addons/http_stream.py GatewayHttpStream), which feeds it to them
before any of it goes on (addons/method_body.py says what each check refuses and why).

- a body a framework could read a `_method` field from: `BodyOverrideCheck`, judged by the rule
  that allows the head now (a reload mid-body judges anew);
- a GET/HEAD/OPTIONS/DELETE whose head left its body open, on a rule without `allow_body`:
  `EmptyBodyCheck`, and the body is held (never streamed) so that no byte of it goes on.

Also planned on a report-mode (would_deny) head: a body naming TRACE is refused in report mode
too, and any other override in it is recorded.
"""

from __future__ import annotations

from mitmproxy import ctx, http

from gateway import bodies, methods
from gateway.decision import Decision
from gateway.decompress import REQUEST_LIMIT, request_decoder
from gateway.engine import Engine, Pin, body_override_refusal

from .audit_fields import decision_fields
from .http_stream import HOLD_BODY
from .layers import end_stream
from .method_body import BODY_CHECK, BodyOverrideCheck, EmptyBodyCheck, enforced_if_bound
from .revocation import FACTS
from .state import GatewayState


def _header_pairs(request: http.Request) -> list[tuple[str, str]]:
    return [(k, v) for k, v in request.headers.items(multi=True)]


def plan(state: GatewayState, flow: http.HTTPFlow, decision: Decision, pin: Pin, engine: Engine, sent: dict,
         bound: bool) -> None:
    """Both checks, in the order the stream runs them. `sent`: the request's audit fields as the
    sandbox sent it; `bound`: a credential was injected (report mode then enforces)."""
    overrides = _override_check(state, flow, decision, pin, engine, sent, bound)
    _empty_body_check(state, flow, decision, pin, engine, sent, bound, overrides)


def _empty_body_check(state: GatewayState, flow: http.HTTPFlow, decision: Decision, pin: Pin, engine: Engine,
                      sent: dict, bound: bool, then: BodyOverrideCheck | None) -> None:
    """An allowed GET/HEAD/OPTIONS/DELETE whose head left its body open (HTTP/2 without
    END_STREAM or content-length) on a rule without allow_body: its body is held, and any byte
    of one refuses it (addons/method_body.py EmptyBodyCheck)."""
    rule = engine.rule(decision.rule)
    framing = bodies.request_framing(_header_pairs(flow.request), end_stream(flow.request))
    if rule is None or not bodies.must_stay_empty(flow.request.method, framing, rule.allow_body):
        return
    refusal = enforced_if_bound(engine.report(Decision.deny(
        "unexpected_body", bodies.body_refusal_text(flow.request.method, rule.id) + "; nothing of it was sent",
        rule.id)), bound)

    def record(refused: Decision, _found) -> None:
        state.record(event="request_body", **({k: v for k, v in sent.items() if k != "method_override"}
                                              | decision_fields(refused, pin)))

    flow.metadata[BODY_CHECK] = EmptyBodyCheck(refusal, record, then)
    flow.metadata[HOLD_BODY] = True


def _override_check(state: GatewayState, flow: http.HTTPFlow, decision: Decision, pin: Pin, engine: Engine,
                    sent: dict, bound: bool) -> BodyOverrideCheck | None:
    """An allowed request whose body a framework could read a `_method` field from: its body is
    checked as it arrives, before it goes on (addons/method_body.py). With no rule behind the
    decision (report mode's `no_rule`), only the overrides that are always refused count."""
    rule = engine.rule(decision.rule)
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
        return state.engine is not None and state.engine is not judged_by[0]

    def judge(found: list[methods.Override]) -> Decision | None:
        """Every override the body named so far, by the current policy: after a reload, by the
        rule that allows the head now (or the head's refusal, if none does)."""
        current, current_rule = state.engine or engine, rule
        if current is not engine and facts is not None:
            conn = state.connections.get(client)
            scope = state.scope_under(current.policy, conn) if conn else current.policy.scope_for(None)
            head = current.check_request(facts, scope)
            if not head.allowed:
                judged_by[0] = current
                return head
            current_rule = current.rule(head.rule)
        judged_by[0] = current
        refusal = body_override_refusal(current_rule, wire, found)
        return current.report(refusal) if refusal is not None else None

    def record(refusal: Decision, found: list[methods.Override]) -> None:
        fields = {k: v for k, v in sent.items() if k != "method_override"} | decision_fields(refusal, pin)
        fields["method_override"] = methods.described(found) or None
        state.record(event="request_body", **fields)

    check = flow.metadata[BODY_CHECK] = BodyOverrideCheck(scanner, judge, record, bound, decision.rule, stale)
    return check
