"""Contexts for driving the gateway's HTTP/2 layers directly in unit tests (sans I/O): what
mitmproxy's connection handler would give the layer, without a socket."""

from __future__ import annotations


def upstream_h2_context():
    """A layer context whose server is an open HTTP/2 upstream (origin.test:443), with mitmproxy's
    default options and a client on loopback."""
    from mitmproxy.addons import proxyserver
    from mitmproxy.connection import Client, ConnectionState, Server
    from mitmproxy.proxy.context import Context
    from mitmproxy.test import taddons

    with taddons.context(proxyserver.Proxyserver()) as tctx:
        options = tctx.options
    client = Client(peername=("127.0.0.1", 1), sockname=("127.0.0.1", 2), timestamp_start=0)
    context = Context(client, options)
    context.server = Server(address=("origin.test", 443))
    context.server.alpn, context.server.state = b"h2", ConnectionState.OPEN
    return context
