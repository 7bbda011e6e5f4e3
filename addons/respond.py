"""How refusals look on the wire: a status, a short body (text, or JSON: the policy's `refusals:`,
gateway/refusal_page.py), and machine-readable headers that are the same in every format.

Every writer takes the decision and its `Page`; `page_for` makes the page from the policy current
when the refusal is sent (a reload applies to the next refusal), the connection's pinned host and
sandbox, and the request's Accept header.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from mitmproxy import http

from gateway.decision import REASON_HEADER, RULE_HEADER, Decision
from gateway.proxyauth import CHALLENGES
from gateway.ratelimit import retry_after_header
from gateway.refusal_page import DEFAULT_STYLE, TEXT_TYPE, Page

from .state import GatewayState

# (layer context, decision, the request's Accept header or None) -> the page to send: what the
# gateway's own HTTP layers are given to word their refusals (addons/http_layer_maker.py HttpLayerMaker.page).
PageFor = Callable[[object, Decision, "str | None"], Page]


def default_page(decision: Decision) -> Page:
    """The page when no policy says otherwise: the gateway's text body."""
    return DEFAULT_STYLE.page(decision)


def accept_of(request) -> str | None:
    """A request's Accept header (its fields joined, as RFC 9110 5.3 allows), or None."""
    if request is None:
        return None
    values = request.headers.get_all("accept")
    return ", ".join(values) if values else None


def page_for(state: GatewayState, client_id: str | None, decision: Decision, accept: str | None = None,
             host: str | None = None) -> Page:
    """The page for a refusal under the policy installed now. `host`: the destination as the
    gateway parsed it, when the caller knows it; else the connection's pin, if it has one. Never
    raises: a refusal goes out in the default format rather than not at all."""
    try:
        engine = state.engine
        conn = state.connections.get(client_id) if client_id is not None else None
        if host is None and conn is not None and conn.tunnel is not None:
            host = conn.tunnel.host.value
        sandbox = state.scope(conn).sandbox if engine is not None and conn is not None else None
        style = engine.policy.refusals if engine is not None else DEFAULT_STYLE
        return style.page(decision, host, sandbox, accept)
    except Exception:
        logging.getLogger("egress").exception("egress gateway: could not word a refusal; the default is sent")
        return default_page(decision)


def flow_page(state: GatewayState, flow: http.HTTPFlow, decision: Decision, host: str | None = None) -> Page:
    """`page_for` a flow's refusal: its client and its request's Accept header."""
    client_id = flow.client_conn.id if flow.client_conn is not None else None
    return page_for(state, client_id, decision, accept_of(flow.request), host)


def refusal_headers(decision: Decision, content_type: str = TEXT_TYPE) -> dict[str, str]:
    headers = {"Content-Type": content_type, REASON_HEADER: decision.reason, "Cache-Control": "no-store"}
    if decision.rule:
        headers[RULE_HEADER] = decision.rule
    if decision.retry_after is not None:
        headers["Retry-After"] = retry_after_header(decision.retry_after)
    return headers


def challenge_fields(decision: Decision) -> list[tuple[str, str]]:
    """A 407's challenges (both schemes carry the token, gateway/proxyauth.py), one field each:
    every format a refusal goes out in needs them, or the client cannot authenticate."""
    return [("Proxy-Authenticate", challenge) for challenge in CHALLENGES] if decision.status == 407 else []


COUNTS_AS_RESET = "_egress_counts_as_reset"  # on a gateway-made response: the h2 server counts its stream


def refuse(flow: http.HTTPFlow, decision: Decision, page: Page) -> None:
    """Answer the flow from the gateway; the request is never sent upstream.

    A 429 (a rate or a budget) makes a flood cost its sender: on HTTP/1 the connection is closed after
    the answer (`Connection: close`), so each further request needs a new connection, which the
    connection rate bounds; on HTTP/2 the stream counts toward the connection's reset tracker
    (addons/http2_server.py `GatewayHttp2Server`), so a flood of them ends in GOAWAY. A 407 (the proxy
    credential) closes an HTTP/1 connection too: a connection's identity is decided once, and a client
    retries with its credential on a new one."""
    headers = refusal_headers(decision, page.content_type)
    h2 = flow.request is not None and (flow.request.is_http2 or flow.request.is_http3)
    if decision.status in (407, 429) and not h2:
        headers["Connection"] = "close"
    # A HEAD is answered without a body: one sent anyway was read as the next answer's status line
    # on a kept-alive HTTP/1 connection (review 35b: Python's http.client, BadStatusLine).
    head = flow.request is not None and flow.request.method.upper() == "HEAD"
    flow.response = http.Response.make(decision.status, b"" if head else page.body, headers)
    for name, value in challenge_fields(decision):
        flow.response.headers.add(name, value)
    if decision.status == 429:
        setattr(flow.response, COUNTS_AS_RESET, True)
    if flow.request is not None:
        # A streamed request body cannot coexist with a gateway-made response in mitmproxy.
        flow.request.stream = False
    flow.metadata["egress_decision"] = decision
    # When mitmproxy answers the request itself (its own validation failed first), the gateway's
    # HTTP/1 server words that answer with this decision.
    setattr(flow.request, "_egress_refusal", decision)


_REASON_PHRASES = {
    400: "Bad Request", 403: "Forbidden", 407: "Proxy Authentication Required", 408: "Request Timeout", 413: "Content Too Large",
    421: "Misdirected Request", 429: "Too Many Requests", 503: "Service Unavailable",
    431: "Request Header Fields Too Large", 500: "Internal Server Error", 502: "Bad Gateway",
}


def reason_phrase(status: int) -> str:
    return _REASON_PHRASES.get(status, "Error")


class _Replacement:
    """Stream callable that sends a fixed body instead of the upstream's (which is dropped)."""

    def __init__(self, body: bytes):
        self.body = body

    def __call__(self, chunk: bytes) -> bytes:
        body, self.body = self.body, b""
        return body


def replace_response(response: http.Response, decision: Decision, page: Page) -> None:
    """Turn a response whose head came from upstream into the gateway's refusal, once its hooks saw it:
    the head is replaced, and the upstream's body is still read (the connection stays usable) but
    dropped, the refusal's body sent in its place."""
    body = page.body
    response.status_code = decision.status
    response.reason = reason_phrase(decision.status)
    response.headers.clear()
    for name, value in refusal_headers(decision, page.content_type).items():
        response.headers[name] = value
    response.headers["Content-Length"] = str(len(body))
    response.stream = _Replacement(body)


def raw_http_refusal(decision: Decision, page: Page) -> bytes:
    """An HTTP/1.1 refusal as bytes, for connections refused before any HTTP parsing (or by the
    gateway's HTTP/1 server, which closes the connection after it)."""
    body = page.body
    head = [f"HTTP/1.1 {decision.status} {reason_phrase(decision.status)}"]
    head += [f"{k}: {v}" for k, v in refusal_headers(decision, page.content_type).items()]
    head += [f"{k}: {v}" for k, v in challenge_fields(decision)]
    head += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(head).encode("ascii") + body
