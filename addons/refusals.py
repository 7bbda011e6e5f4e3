"""How the gateway's own layers word and record a refusal (shared by addons/http1_server.py,
addons/http2_server.py and addons/http_stream.py; how it looks on the wire: addons/respond.py).

- `OnRefusal`: the listener's callback that audits a refusal and returns it redacted; `_report`
  calls it, failing open to the decision itself when the audit cannot be written.
- `protocol_error_decision`: an error mitmproxy raised on a stream, in the gateway's words.
- `REFUSAL_ATTR`: a request's (or an error event's) refusal, already audited, for errors
  mitmproxy sends itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from mitmproxy.proxy.layers.http._events import ErrorCode

from gateway.decision import Decision
from gateway.failure import failure_detail

REFUSAL_ATTR = "_egress_refusal"  # a request's refusal decision, for errors mitmproxy sends itself
# (context, decision, request, method, *, status_sent=True, **audit fields)
OnRefusal = Callable[..., "Decision | None"]

_ERROR_REASONS = {
    ErrorCode.CONNECT_FAILED: ("upstream_failed", "the upstream connection failed"),
    ErrorCode.GENERIC_SERVER_ERROR: ("upstream_failed", "the upstream failed"),
    ErrorCode.RESPONSE_VALIDATION_FAILED: ("upstream_failed", "the upstream response was invalid"),
    ErrorCode.RESPONSE_TOO_LARGE: ("response_too_large", "the upstream response is too large"),
    ErrorCode.REQUEST_TOO_LARGE: ("request_too_large", "the request body is too large"),
    ErrorCode.DESTINATION_UNKNOWN: ("bad_host_header", "the request names no destination"),
    ErrorCode.GENERIC_CLIENT_ERROR: ("malformed_request", "the request is malformed"),
    ErrorCode.REQUEST_VALIDATION_FAILED: ("malformed_request", "the request is malformed"),
}


# The error addons/limits.py gives an upstream connection over a socket budget at `server_connect`.
UPSTREAM_OVER_BUDGET = "egress gateway: too many upstream connections"


def protocol_error_decision(event) -> Decision:
    """The gateway's words for an error mitmproxy raised on a stream: the reason by error code, and
    its text with every byte it quotes withheld (gateway/failure.py). An upstream connection the
    socket budget did not dial is the sandbox's `too_many_connections` (503), not a failed upstream."""
    message = event.message or ""
    if event.code == ErrorCode.CONNECT_FAILED and UPSTREAM_OVER_BUDGET in message:
        _, _, which = message.partition(UPSTREAM_OVER_BUDGET + ": ")
        return Decision.deny("too_many_connections", "no upstream connection: " + (
            which or "the sandbox holds its cap of them, or its share of the worker's sockets"))
    reason, what = _ERROR_REASONS[event.code]
    return Decision.deny(reason, f"{what}: {failure_detail(event.message)}")


def _report(on_refusal: OnRefusal, context, decision: Decision, request=None, method: str | None = None,
            status_sent: bool = True) -> Decision:
    """Audit a refusal; returns the decision to send (its message redacted by the listener).
    `status_sent`: False for a message cut off after its head went out (no refusal status)."""
    try:
        method = method or getattr(request, "method", None)
        if not status_sent:
            return on_refusal(context, decision, request, method, status_sent=False) or decision
        return on_refusal(context, decision, request, method) or decision
    except Exception:  # e.g. the audit disk is full: the refusal still goes out
        logging.getLogger("egress").exception("egress gateway: could not record a refusal")
        return decision


def _too_many_fields(count: int, limit: int, section: str = "header") -> Decision:
    return Decision.deny("too_many_header_fields", f"the request's {section} section has {count} fields, "
                                                   f"more than egress_max_header_fields ({limit})")
