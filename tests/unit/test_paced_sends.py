"""addons/http_stream.py `paced_sends`: a large body a stream sends in one event goes in SEND_PIECE
pieces with the sandbox's turn (a blocking EgressPaceHook) between two, the same bytes in the same
order; every other command, the replies to blocking ones and the generator's result pass through."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st
from mitmproxy.proxy import commands
from mitmproxy.proxy.layers.http import SendHttp
from mitmproxy.proxy.layers.http._events import RequestData, ResponseData, ResponseEndOfMessage
from mitmproxy.test import tflow

from addons import http_stream
from addons.fair_share import EgressPaceHook


class _Stream:
    flow = "the flow"


def _drive(generator):
    """Run a command generator as mitmproxy's layer does: a reply to each blocking command."""
    out, reply = [], None
    while True:
        try:
            command = generator.send(reply)
        except StopIteration as stop:
            return out, stop.value
        out.append(command)
        reply = f"reply to {len(out)}" if command.blocking else None


def _commands(body: bytes, kind=ResponseData):
    conn = tflow.tclient_conn()
    seen = []

    def inner():
        seen.append((yield commands.Log("before")))
        seen.append((yield EgressPaceHook("blocking before the body")))
        yield SendHttp(kind(1, body), conn)
        yield SendHttp(ResponseEndOfMessage(1), conn)
        return "done"

    out, result = _drive(http_stream.paced_sends(inner(), _Stream()))
    return out, result, seen


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 5 * http_stream.SEND_PIECE), st.sampled_from([RequestData, ResponseData]))
def test_a_body_goes_in_pieces_with_a_turn_between_two_and_the_same_bytes(size, kind):
    body = bytes(i % 251 for i in range(size))
    out, result, seen = _commands(body, kind)
    assert result == "done"
    assert seen == [None, "reply to 2"]  # a reply reaches the generator that asked
    sends = [c for c in out if isinstance(c, SendHttp) and isinstance(c.event, kind)]
    assert b"".join(c.event.data for c in sends) == body
    assert all(len(c.event.data) <= max(http_stream.SEND_PIECE, len(body)) for c in sends)
    if size > http_stream.SEND_PIECE:
        assert all(len(c.event.data) <= http_stream.SEND_PIECE for c in sends)
        assert len(sends) == -(-size // http_stream.SEND_PIECE)
        body_part = out[2:-1]  # after the log and the first hook, before the end of message
        assert [type(c) for c in body_part] == [SendHttp, EgressPaceHook] * (len(sends) - 1) + [SendHttp]
        assert all(h.flow == "the flow" for h in body_part if isinstance(h, EgressPaceHook))
    else:
        assert len(sends) == 1 and sends[0].event.data is body  # small: the very same command's data
    assert isinstance(out[-1].event, ResponseEndOfMessage)


def test_a_done_flow_lets_its_large_bodies_go_and_keeps_small_ones_and_upgrades():
    """A done flow sits in reference cycles until a full collection; its large bodies go at once."""
    flow = tflow.tflow(resp=True)
    flow.request.content = b"x" * http_stream.DROP_BODY_AT
    flow.response.content = b"y" * (http_stream.DROP_BODY_AT + 1)
    http_stream._drop_bodies(flow)
    assert flow.request.raw_content == b"" and flow.response.raw_content == b""

    small = tflow.tflow(resp=True)
    small.response.content = b"small"
    http_stream._drop_bodies(small)
    assert small.response.raw_content == b"small"

    upgraded = tflow.twebsocketflow()
    upgraded.response.content = b"z" * http_stream.DROP_BODY_AT
    http_stream._drop_bodies(upgraded)
    assert upgraded.response.raw_content == b"z" * http_stream.DROP_BODY_AT
    http_stream._drop_bodies(None)
