"""addons/layers.py: a stream whose client gives up after its request is done and before an answer
tells its upstream connection so. When none was opened (the gateway answered the request itself,
or the connection is still the placeholder a request starts with), mitmproxy's HTTP layer looked it
up, found nothing and crashed the client connection (KeyError, "mitmproxy has crashed!", seen in
tests/fuzz/test_front_door_fuzz.py). The event goes nowhere instead; a connection the layer does
hold still gets it."""

from __future__ import annotations

import pytest
from mitmproxy import connection, http, options
from mitmproxy.proxy import commands, context
from mitmproxy.proxy.layers.http import HTTPMode, SendHttp
from mitmproxy.proxy.layers.http._events import ErrorCode, RequestProtocolError

from addons.layers import GatewayHttpLayer
from addons.http_stream import GatewayHttpStream


def _context(server_address):
    client = connection.Client(peername=("127.0.0.9", 40000), sockname=("127.0.0.1", 8080),
                               state=connection.ConnectionState.OPEN)
    ctx = context.Context(client, options.Options())
    ctx.server = connection.Server(address=server_address)
    return ctx


def _stream_waiting_for_its_answer(layer_: GatewayHttpLayer) -> GatewayHttpStream:
    """A stream whose request is done and whose answer has not begun, as mitmproxy leaves it."""
    stream = GatewayHttpStream(layer_.context.fork(), 1)
    stream.flow = http.HTTPFlow(layer_.context.client, stream.context.server)
    stream.flow.request = http.Request.make("GET", "http://allowed.test/")
    stream.client_state = stream.state_done
    stream.server_state = stream.state_wait_for_response_headers
    layer_.streams[1] = stream
    return stream


@pytest.mark.parametrize("mode, address", [(HTTPMode.regular, None), (HTTPMode.transparent, ("10.0.0.1", 80))],
                         ids=["explicit placeholder", "transparent destination not dialled"])
def test_a_client_error_for_an_upstream_never_opened_goes_nowhere(mode, address):
    layer_ = GatewayHttpLayer(_context(address), mode, on_refusal=None)
    stream = _stream_waiting_for_its_answer(layer_)
    gone = RequestProtocolError(1, "client disconnected", ErrorCode.CLIENT_DISCONNECTED)
    emitted = list(layer_.event_to_child(stream, gone))  # raised KeyError before
    assert not [c for c in emitted if isinstance(c, (commands.OpenConnection, commands.SendData))]
    assert stream.context.server not in layer_.connections


class Recording:
    def __init__(self):
        self.events = []

    def handle_event(self, event):
        self.events.append(event)
        return iter(())


def test_a_connection_the_layer_holds_still_hears_of_it():
    layer_ = GatewayHttpLayer(_context(None), HTTPMode.regular, on_refusal=None)
    upstream = connection.Server(address=("127.0.0.1", 9))
    layer_.connections[upstream] = held = Recording()
    gone = RequestProtocolError(1, "client disconnected", ErrorCode.CLIENT_DISCONNECTED)

    class Child:
        @staticmethod
        def handle_event(event):
            yield SendHttp(gone, upstream)

    list(layer_.event_to_child(Child, gone))
    assert held.events == [gone]


def test_only_upstream_connections_are_looked_up_leniently():
    layer_ = GatewayHttpLayer(_context(None), HTTPMode.regular, on_refusal=None)
    with pytest.raises(KeyError):
        layer_.connections[connection.Client(peername=("127.0.0.8", 1), sockname=("127.0.0.1", 2))]


def test_ended_upstreams_are_kept_in_a_set_only_while_one_waits_to_be_dropped():
    """Issue 18: a set per HTTP layer (two a tunnel) for the upstreams that closed and are not yet
    dropped, empty for nearly all of a connection's life: the shared empty one until one closes."""
    from mitmproxy.proxy import events

    from addons import layers

    layer_ = GatewayHttpLayer(_context(None), HTTPMode.regular, on_refusal=None)
    assert layer_._ended is layers._NONE_ENDED
    upstream = connection.Server(address=("127.0.0.1", 9))
    upstream.state = connection.ConnectionState.CLOSED
    layer_.connections[upstream] = held = Recording()
    stream = _stream_waiting_for_its_answer(layer_)
    stream.context.server = upstream  # a stream still names it: kept
    list(layer_._handle_event(events.ConnectionClosed(upstream)))
    assert layer_._ended == {upstream} and upstream in layer_.connections
    del layer_.streams[1]
    layer_._forget_ended()
    assert layer_._ended is layers._NONE_ENDED and upstream not in layer_.connections
    assert held.events  # (it heard of its close)
