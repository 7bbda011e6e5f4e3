"""Two small mitmproxy layers the gateway needs and mitmproxy does not have.

- `RefusalLayer` answers a connection the gateway will not inspect (raw TCP in a tunnel, h2c
  prior knowledge, TLS to the proxy port) with a short HTTP error and closes it, at once,
  without ever opening an upstream connection.
- `TargetFormHttpLayer` is mitmproxy's HttpLayer for the explicit proxy port, except that each
  request remembers the request target as sent. mitmproxy rewrites absolute-form targets to
  origin-form before any hook sees them, and derives a destination from the Host header for
  origin-form requests; the gateway needs to tell the two apart and to see the raw authority.
"""

from __future__ import annotations

from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http import HttpLayer, HttpStream, RequestHeaders

from gateway.decision import Decision

from .respond import raw_http_refusal

TARGET_FORM_ATTR = "_egress_target_form"  # "origin" | "absolute" | "authority" | "asterisk"
RAW_AUTHORITY_ATTR = "_egress_raw_authority"


class RefusalLayer(layer.Layer):
    def __init__(self, context, decision: Decision, speak_http: bool = True):
        super().__init__(context)
        self.decision = decision
        self.speak_http = speak_http
        self.refused = False

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if self.refused:
            return
        self.refused = True
        if self.speak_http:
            yield commands.SendData(self.context.client, raw_http_refusal(self.decision))
        yield commands.CloseConnection(self.context.client)


def target_form(request) -> str | None:
    return getattr(request, TARGET_FORM_ATTR, None)


def raw_authority(request) -> str | None:
    return getattr(request, RAW_AUTHORITY_ATTR, None)


class _TargetFormStream(HttpStream):
    def state_wait_for_request_headers(self, event: RequestHeaders) -> layer.CommandGenerator[None]:
        if isinstance(event, RequestHeaders):
            request = event.request
            authority = request.data.authority.decode("utf-8", "surrogateescape")
            if request.method == "CONNECT":
                form = "authority"
            elif request.data.path == b"*":
                form = "asterisk"
            elif authority and not (request.is_http2 or request.is_http3):
                form = "absolute"
            elif request.is_http2 or request.is_http3:
                form = "absolute" if authority else "origin"
            else:
                form = "origin"
            setattr(request, TARGET_FORM_ATTR, form)
            setattr(request, RAW_AUTHORITY_ATTR, authority)
        return (yield from super().state_wait_for_request_headers(event))


class TargetFormHttpLayer(HttpLayer):
    def make_stream(self, stream_id: int) -> layer.CommandGenerator[None]:
        ctx = self.context.fork()
        self.streams[stream_id] = _TargetFormStream(ctx, stream_id)
        yield from self.event_to_child(self.streams[stream_id], events.Start())
