"""Tests only (tests/e2e/test_crash_close.py): put on the PYTHONPATH of a gateway the test starts,
with EGRESS_TEST_CRASH=1, this makes the gateway's HTTP stream raise where the traffic asks. Two
places: at the head of a request that has an `x-egress-test-crash` header, and at a piece of a
response body that holds the bytes `EGRESS-TEST-CRASH`. The product never loads it. It stands in
for a bug in a layer: the test checks what the gateway does with the connection around it."""

import os
import sys

if os.environ.get("EGRESS_TEST_CRASH") == "1" and "gateway" in sys.orig_argv:
    from mitmproxy.proxy.layers.http._events import RequestHeaders, ResponseData

    from addons.http_stream import GatewayHttpStream

    _original = GatewayHttpStream.handle_event

    def _handle_event(self, event):
        if isinstance(event, RequestHeaders) and "x-egress-test-crash" in event.request.headers:
            raise RuntimeError("injected by the test: the stream raised at a request head")
        if isinstance(event, ResponseData) and b"EGRESS-TEST-CRASH" in event.data:
            raise RuntimeError("injected by the test: the stream raised at a piece of a response")
        return _original(self, event)

    GatewayHttpStream.handle_event = _handle_event
