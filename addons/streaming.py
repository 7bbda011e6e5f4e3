"""Bodies stream from their first byte, and HTTP/2 is spoken to every client that offers it.

mitmproxy streams a body only when its declared length is above `stream_large_bodies`; a chunked
or open-ended body (server-sent events, gRPC, NDJSON, a long poll) is buffered until it ends, so an
agent reading a model's answer gets nothing until the answer is complete. Here every allowed
response of an unbound flow streams (bound flows are planned by ResponseRedactor, through the
redactor), and every allowed request body of unknown length streams upstream. What streams and why
is decided in gateway/streaming.py.

HTTP/2: mitmproxy lets the client's ALPN order decide when no upstream connection exists yet (the
gateway connects lazily), and httpx lists http/1.1 first inside a proxy tunnel. A client that
offers h2 gets h2; mitmproxy translates to HTTP/1.1 when the upstream does not speak it.
"""

from __future__ import annotations

from collections.abc import Callable

from mitmproxy import ctx, http, tls

from gateway.streaming import Plan, forbidden_trailers, request_streams, response_plan

from . import h2_backpressure, http1
from .credentials import BOUND
from .http_stream import HOLD_BODY


def _allowed(flow: http.HTTPFlow) -> bool:
    decision = flow.metadata.get("egress_decision")
    return decision is not None and decision.allowed


class BodyStreaming:
    def __init__(self) -> None:
        http1.install()  # empty pieces, trailers and translated framing on HTTP/1 upstreams
        h2_backpressure.install()  # an HTTP/2 client that reads slowly slows its upstreams down

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or not _allowed(flow) or flow.request.stream or HOLD_BODY in flow.metadata:
            return
        if request_streams(flow.request.headers.items(multi=True)):
            flow.request.stream = True

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        if response is None or response.stream or BOUND in flow.metadata or not _allowed(flow):
            return
        plan, _ = response_plan(method=flow.request.method, status=response.status_code,
                                headers=response.headers.items(multi=True), bound=False, buffer_limit=None)
        if plan is Plan.STREAM:
            response.stream = True


    def response(self, flow: http.HTTPFlow) -> None:
        """Trailers go out after this hook: none may carry framing or routing fields, whichever
        protocol the client speaks (on HTTP/2 they make the message malformed)."""
        trailers = flow.response.trailers if flow.response is not None else None
        if trailers:
            for name in forbidden_trailers(list(dict.fromkeys(trailers.keys()))):
                trailers.pop(name, None)


class Http2Preference:
    def tls_clienthello(self, data: tls.ClientHelloData) -> None:
        if data.ignore_connection or not ctx.options.http2:
            return
        if b"h2" in (data.client_hello.alpn_protocols or []):
            # Read by mitmproxy's ALPN selection for the client handshake; the negotiated value
            # replaces it when the handshake completes.
            data.context.client.alpn = b"h2"


def counting_stream(inner, count: Callable[[int], None]):
    """A body stream callable that tells `count` how many bytes `inner` (True: pass-through) passes
    on: the metrics' relayed bytes and the download budget both count this way."""
    def stream(data: bytes):
        out = data if inner is True else inner(data)
        if isinstance(out, (bytes, bytearray)):
            count(len(out))
            return out
        out = list(out)
        count(sum(len(chunk) for chunk in out))
        return out
    return stream
