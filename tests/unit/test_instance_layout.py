"""addons/instance_layout.py: per-connection classes learn their attribute names before a burst of
instances, so that names set late in a connection's life stay inline instead of giving every
instance a dict of its own (CPython 3.12's shared keys lose room with every instance made)."""

from __future__ import annotations

import gc

from mitmproxy import connection, options
from mitmproxy.proxy import context
from mitmproxy.proxy.layer import NextLayer

from addons import instance_layout
from addons.instance_layout import SHARED_KEYS_MAX, attribute_names, teach
from addons.layers import GatewayHttpStream

instance_layout.install()


def _has_own_dict(obj) -> bool:
    """Whether `obj`'s attributes live in a dict of its own (found among its referents; reading
    __dict__ would make one)."""
    return any(type(r) is dict and r and all(type(k) is str and getattr(obj, k, r) is v for k, v in r.items())
               for r in gc.get_referents(obj))


def _burst(cls, late: dict) -> list:
    """40 instances made first, then each given the `late` attributes, as a burst of connections does."""
    made = [cls() for _ in range(40)]
    for obj in made:
        for name, value in late.items():
            setattr(obj, name, value)
    return made


def _fresh_class():
    class Connectionish:
        def __init__(self):
            self.early = 1

        def later(self):
            self.flow = self.account = self.queued = None
    return Connectionish


def test_names_set_late_in_a_burst_give_every_instance_a_dict_unless_taught():
    late = {"flow": 2, "account": 3, "queued": 4}
    untaught = _fresh_class()
    assert all(_has_own_dict(obj) for obj in _burst(untaught, late))  # what CPython 3.12 does
    taught = _fresh_class()
    assert attribute_names(taught) == ["account", "early", "flow", "queued"]
    assert teach(taught, attribute_names(taught))
    made = _burst(taught, late)
    assert not any(_has_own_dict(obj) for obj in made)
    assert [(o.early, o.flow, o.account, o.queued) for o in made] == [(1, 2, 3, 4)] * 40


def test_a_class_with_more_names_than_the_shared_keys_hold_is_left_alone():
    assert not teach(_fresh_class(), [f"name{i}" for i in range(SHARED_KEYS_MAX + 1)])


def _context():
    client = connection.Client(peername=("127.0.0.9", 40000), sockname=("127.0.0.1", 8080),
                               state=connection.ConnectionState.OPEN)
    return context.Context(client, options.Options())


def test_the_gateway_s_streams_and_mitmproxy_s_next_layers_keep_their_attributes_inline():
    ctx = _context()
    streams = [GatewayHttpStream(ctx.fork(), 1) for _ in range(40)]
    for stream in streams:  # what a stream gets over its life (addons/layers.py, addons/http_stream.py)
        stream.on_refusal, stream.body_limits, stream.mode = None, None, None
        stream.flow, stream._account, stream._head_account, stream._queued = None, None, None, {}
        stream._streamed_response, stream._request_moved, stream._response_moved = 1, 1.0, 1.0
    assert not any(_has_own_dict(stream) for stream in streams)
    layers = [NextLayer(ctx.fork()) for _ in range(40)]
    for layer in layers:  # what a next layer gets when its child is decided
        layer.layer, layer.handle_event, layer._handle_event, layer._handle = None, None, None, None
    assert not any(_has_own_dict(layer) for layer in layers)
