"""addons/http1_server.py: the request head's deadline (egress_head_timeout) is timed by a wakeup only
when a read leaves a head unfinished; a head that came whole in one read arms none (a pending wakeup
is a task, a future and a timer handle held for head_timeout on every kept-alive connection: issue 18).
The deadline itself is unchanged: from the head's first byte, whether the client trickles or goes
silent (tests/e2e/test_limits.py, tests/faults/test_limits_burst.py drive it end to end)."""

from __future__ import annotations

from mitmproxy import connection, options
from mitmproxy.proxy import commands, context, events

from addons.http1_server import GatewayHttp1Server

HEAD = b"GET http://a.test/ HTTP/1.1\r\nHost: a.test\r\n\r\n"


def _server(head_timeout: float = 30):
    client = connection.Client(peername=("127.0.0.9", 40000), sockname=("127.0.0.1", 8080),
                               state=connection.ConnectionState.OPEN)
    server = GatewayHttp1Server(context.Context(client, options.Options()), on_refusal=lambda *a, **k: None,
                                head_timeout=head_timeout)
    list(server.handle_event(events.Start()))
    return server, client


def _wakeups(cmds) -> list[commands.RequestWakeup]:
    return [c for c in cmds if isinstance(c, commands.RequestWakeup)]


def test_a_head_read_whole_arms_no_timer():
    server, client = _server()
    cmds = list(server.handle_event(events.DataReceived(client, HEAD)))
    assert _wakeups(cmds) == []
    assert server._head_started is None


def test_an_unfinished_head_arms_its_deadline_once():
    server, client = _server(head_timeout=30)
    first = _wakeups(server.handle_event(events.DataReceived(client, HEAD[:20])))
    assert len(first) == 1 and 29 < first[0].delay <= 30
    # more of the same head: the timer already runs, no second one
    assert _wakeups(server.handle_event(events.DataReceived(client, HEAD[20:30]))) == []
    # the rest: the head is read; the pending timer finds no head under way when it fires
    list(server.handle_event(events.DataReceived(client, HEAD[30:])))
    assert server._head_started is None


def test_no_timer_without_a_head_timeout():
    server, client = _server(head_timeout=0)
    assert _wakeups(server.handle_event(events.DataReceived(client, HEAD[:20]))) == []

