"""Connection layers that answer a client without HTTP under them (addons/layer_guard.py puts them on).

- `RefusalLayer` answers a connection the gateway will not inspect (raw TCP in a tunnel, h2c
  prior knowledge, TLS to the proxy port) with a short HTTP error and closes it, at once,
  without ever opening an upstream connection.
- `HoldLayer` holds a connection's first bytes until the layer guard settles on a layer, and
  refuses it when that takes too long.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.http import HttpStream

from gateway.decision import Decision

from gateway.refusal_page import Page

from .respond import default_page, raw_http_refusal


def in_tunnel(context) -> bool:
    """Whether the layer runs inside a CONNECT tunnel (an HTTP stream holds it). There mitmproxy's
    HttpStream carries no half-close: any close of the client becomes a full one."""
    return any(isinstance(parent, HttpStream) for parent in context.layers)


class RefusalLayer(layer.Layer):
    """Refuses a connection at once: an HTTP error (or `farewell`, raw bytes such as a TLS alert),
    then close.

    With a farewell the close is a lingering one: FIN first, the client's bytes read and thrown away
    until it closes or LINGER seconds pass, then the full close. Closing at once while a client is
    still sending (a multi-MiB ClientHello) makes the kernel answer with a reset, which may destroy
    the alert before the client reads it, and which a stateful firewall may drop (seen with the
    transparent test topology: the client then never learned the connection was gone).

    Inside a CONNECT tunnel mitmproxy's HttpStream turns any close of the client into a full one
    (half-closes are not carried through HTTP), so there the FIN is not sent first: the farewell
    goes out, the client's bytes are read and dropped for up to LINGER seconds (or until it
    closes), then the full close. A TLS client closes on the fatal alert itself."""

    LINGER = 2.0

    def __init__(self, context, decision: Decision, speak_http: bool = True, farewell: bytes = b"",
                 page: Page | None = None):
        super().__init__(context)
        self.decision = decision
        self.page = page  # the HTTP answer's body as the policy words it (None: the default text body)
        self.speak_http = speak_http
        self.farewell = farewell
        self.refused = False
        self._linger: commands.RequestWakeup | None = None

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if self.refused:
            if self._linger is not None and (
                    (isinstance(event, events.Wakeup) and event.command is self._linger)
                    or (isinstance(event, events.ConnectionClosed) and event.connection == self.context.client)):
                self._linger = None
                yield commands.CloseConnection(self.context.client)
            return
        self.refused = True
        if self.speak_http:
            page = self.page if self.page is not None else default_page(self.decision)
            yield commands.SendData(self.context.client, raw_http_refusal(self.decision, page))
        elif self.farewell:
            yield commands.SendData(self.context.client, self.farewell)
            if not in_tunnel(self.context):
                yield commands.CloseTcpConnection(self.context.client, half_close=True)
            self._linger = commands.RequestWakeup(self.LINGER)
            yield self._linger
            return
        yield commands.CloseConnection(self.context.client)


TLS_ALERT_HANDSHAKE_FAILURE = b"\x15\x03\x03\x00\x02\x02\x28"  # fatal handshake_failure (RFC 8446 6)
# What a decided hold keeps for the rest of its connection: shared empties instead of its own.
_NOTHING_HELD = b""
_NO_EVENTS: tuple = ()
_NO_TIMERS: frozenset = frozenset()
_NO_DEADLINE: tuple = ()


class HoldLayer(layer.Layer):
    """mitmproxy's NextLayer with a deadline: holds a connection's first client bytes until the
    layer guard settles on a layer, and refuses it when that takes too long, even if the client has
    gone silent (NextLayer waits for bytes forever: only `tcp_timeout` ends it).

    `feed(hold, chunk)` is told each new chunk (never the whole buffer again: a reader fed
    incrementally stays linear) and may set `hold.layer`, and `hold.replay` to the bytes the new
    layer is given (by default those kept in `hold.held`); `expire(hold)` sets a refusal layer when
    the deadline passes. Like NextLayer, it is not on the layer stack; unlike it, it stays in the
    event path (one check per event) so that its own timers never reach the layers under it.

    `data_follows`: the maker holds client bytes that mitmproxy's NextLayer replays right after
    Start; the deadline's timer then waits for them and is armed only if they leave the hold
    undecided. A ClientHello that came whole arms none (a timer is a task, a future and a timer
    handle that lived on for the whole timeout on every tunnel: issue 18). Any other event than that
    Start arms it, as does every event of a hold made without bytes. Once decided, the hold lets go
    of its callbacks and of the bytes it replayed (what they captured: the ClientHello's reader)."""

    def __init__(self, context, feed: Callable[["HoldLayer", bytes], None],
                 expire: Callable[["HoldLayer"], None], timeout: float, data_follows: bool = False):
        super().__init__(context)
        self.context.layers.remove(self)
        self.layer: layer.Layer | None = None
        self.feed: Callable[["HoldLayer", bytes], None] | None = feed
        self.expire: Callable[["HoldLayer"], None] | None = expire
        self._data_follows = data_follows
        self.held = bytearray()  # bytes the feed keeps for a decision on the whole (a first line)
        self.replay: bytes | None = None
        self.started = time.monotonic()
        self.timeout = 0.0
        self.events: list[events.Event] = []  # held non-data events (Start) to replay
        self._timers: set[commands.RequestWakeup] = set()
        self._deadline: list[commands.RequestWakeup] = []
        self.deadline(timeout)

    def deadline(self, timeout: float) -> None:
        """(Re)set the deadline, counted from the first byte."""
        self.timeout = timeout
        if timeout:
            wakeup = commands.RequestWakeup(max(0.0, timeout - (time.monotonic() - self.started)))
            self._timers.add(wakeup)
            self._deadline.append(wakeup)

    def data_client(self) -> bytes:
        return bytes(self.held)

    def handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Wakeup) and event.command in self._timers:
            self._timers.discard(event.command)
            if self.layer is None and self.timeout:
                if time.monotonic() - self.started >= self.timeout:
                    self._call(self.expire)
                    yield from self._decided()
                else:  # woken early: wait for the rest
                    self.deadline(self.timeout)
                    while self._deadline:
                        yield self._deadline.pop(0)
            return
        if self.layer is not None:
            yield from self.layer.handle_event(event)
            return
        data = isinstance(event, events.DataReceived) and event.connection == self.context.client
        waiting = self._data_follows and isinstance(event, events.Start)  # the bytes come next: not timed yet
        if not data and not waiting:
            yield from self._arm()
        if data:
            self._data_follows = False
            self._call(self.feed, event.data)
            yield from self._decided()
        elif isinstance(event, events.ConnectionClosed) and event.connection == self.context.client:
            yield commands.CloseConnection(self.context.client)  # as NextLayer does
        else:
            self.events.append(event)
        if not waiting:
            yield from self._arm()  # undecided: the deadline (a feed may have moved it); decided: none is needed

    def _arm(self) -> layer.CommandGenerator[None]:
        if self.layer is None:
            while self._deadline:
                yield self._deadline.pop(0)
        elif self._timers is not _NO_TIMERS:
            self._timers.difference_update(self._deadline)
            self._deadline.clear()
            if not self._timers:  # decided, no timer out: its containers go (a hold lives as long as its connection)
                self._timers, self._deadline = _NO_TIMERS, _NO_DEADLINE

    def _call(self, callback, *args) -> None:
        """Fail closed: a callback that raises leaves the connection refused, never undecided."""
        try:
            callback(self, *args)
        except Exception as exc:
            logging.getLogger("egress.failclosed").error(
                "egress gateway: holding the first bytes failed closed: %s", type(exc).__name__, exc_info=exc)
            self.layer = RefusalLayer(self.context, Decision.deny(
                "internal_error", "the gateway failed while reading the first bytes"), False)

    def _decided(self) -> layer.CommandGenerator[None]:
        if self.layer is None:
            return
        replay = bytes(self.held) if self.replay is None else self.replay
        self.held = _NOTHING_HELD
        self.replay = None
        self.feed = self.expire = None  # (a hold calls neither once decided)
        held, self.events = self.events, _NO_EVENTS
        for event in held:
            yield from self.layer.handle_event(event)
        if replay:
            yield from self.layer.handle_event(events.DataReceived(self.context.client, replay))

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:  # pragma: no cover
        yield from self.handle_event(event)
