"""Fixtures shared by tests/unit's modules."""

from __future__ import annotations

import pytest


@pytest.fixture
def http_stream():
    """A gateway HTTP stream on a real layer, with mitmproxy's options loaded and a POST flow, as
    mitmproxy leaves it when its request head has been handled (tests drive its request body)."""
    from mitmproxy import connection, http
    from mitmproxy.addons import proxyserver
    from mitmproxy.proxy import context
    from mitmproxy.proxy.layers.http import HTTPMode
    from mitmproxy.test import taddons

    from addons.http_stream import GatewayHttpStream
    from addons.layers import GatewayHttpLayer

    with taddons.context(proxyserver.Proxyserver()) as tctx:
        client = connection.Client(peername=("127.0.0.9", 40000), sockname=("127.0.0.1", 8080),
                                   state=connection.ConnectionState.OPEN)
        layer_ = GatewayHttpLayer(context.Context(client, tctx.options), HTTPMode.regular, on_refusal=None)
        stream = GatewayHttpStream(layer_.context.fork(), 1)
        stream.flow = http.HTTPFlow(layer_.context.client, stream.context.server)
        stream.flow.request = http.Request.make("POST", "http://allowed.test/", b"")
        yield stream
