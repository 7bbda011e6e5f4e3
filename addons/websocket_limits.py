"""Memory and work a WebSocket may make the gateway spend.

mitmproxy's WebsocketLayer reassembles each message whole (`frame_buf`) before its hook runs, with
no bound: an endless fragmented message (FIN=0 frames) grew a worker by 500 MiB in 5 s. And it
keeps every message it relayed in `flow.websocket.messages` for the life of the connection: a
stream of ordinary 1 MiB messages grew it without end. Neither was refused or audited.

Here the layer (wrapped once, like addons/websocket_redaction.py's) relays with its own
`relay_messages` (mitmproxy 12.3's, bounded):
- a message being reassembled past `egress_max_websocket_message_bytes` closes both sides with
  1009 (message too big) and one audit line, `websocket_message_too_large`; the size is a running
  total, and wsproto hands frame payloads over as they arrive, so what is held stays within the
  budget plus one read;
- every frame and ping the client sends under `egress_small_frame_bytes` takes a token from its
  sandbox's small-frame bucket (addons/frame_limits.py); when none is left, both sides are closed
  with 1008 (policy violation) and one audit line, `small_frame_flood`;
- the message being reassembled, from either side, is charged to the client's connection and
  sandbox in the buffer ledger (gateway/budget.py) as its pieces arrive; a piece that finds no
  room closes both sides with 1009 and one audit line, `buffer_budget` (20 connections each
  holding an unfinished 15 MiB message took 306 MiB, past the 128 MiB sandbox budget);
- after each message only that message is kept (every addon's `websocket_message` hook has seen
  it by then: the redactor, rate limits, metrics read `messages[-1]`), and its content only while
  small: a relayed message of DROP_CONTENT_AT bytes or more keeps its type and size, not its bytes.
"""

from __future__ import annotations

import functools
import logging
import time

from mitmproxy import ctx, http, websocket
from mitmproxy.proxy import events
from wsproto.frame_protocol import Opcode

from gateway.decision import Decision
from gateway.options import DEFAULT_MAX_MESSAGE_BYTES

from . import frame_limits, read_ahead
from .audit_fields import connection_fields, decision_fields
from .options import declare
from .state import GatewayState

MESSAGE_TOO_BIG = 1009  # RFC 6455 close codes
MESSAGE_POLICY = 1008
SMALL_FRAGMENT = 4000  # mitmproxy's Fragmentizer.FRAGMENT_SIZE
DROP_CONTENT_AT = 64 * 1024  # a relayed message this large is not kept (addons/http_stream.py DROP_BODY_AT)


class WebsocketLimits:
    def __init__(self, state: GatewayState):
        self.state = state
        install(self._refused, self._taker, state.buffer_account)
        read_ahead.install()

    def load(self, loader):
        declare(loader, "egress_max_websocket_message_bytes")

    def _refused(self, flow: http.HTTPFlow, reason: str, message: str, size: int) -> None:
        decision = Decision.deny(reason, message)
        allowed_by = flow.metadata.get("egress_decision")
        if allowed_by is not None and getattr(allowed_by, "rule", None):
            decision = Decision.deny(decision.reason, decision.message, allowed_by.rule)
        try:
            conn = self.state.connections.get(flow.client_conn.id)
            scope = self.state.scope(conn) if self.state.engine else None
            fields = {"frames": size} if reason == "small_frame_flood" else {"size": size}
            self.state.record(event="websocket", **connection_fields(conn, scope.sandbox if scope else None),
                              **(decision_fields(decision, conn.tunnel if conn else None,
                                                 flow.request.pretty_host, flow.request.port)
                                 | {"status": None}),
                              method=flow.request.method, path=flow.request.path, **fields)
        except Exception:  # the close goes ahead whatever the audit did
            logging.getLogger("egress").exception("egress gateway: could not record a WebSocket refusal")

    def client_disconnected(self, client) -> None:
        read_ahead.release(client)

    def _taker(self, flow: http.HTTPFlow):
        """`frame_limits.take` bound to the sandbox of the flow's client."""
        try:
            key = self.state.sandbox_key(self.state.connections.get(flow.client_conn.id))
        except Exception:  # fail closed: metered under one key shared by every client without one
            key = "unknown"
        return functools.partial(frame_limits.take, key)


def _on_characters(content: bytes, fragments: list[int]) -> list[int]:
    """Fragment sizes for a text message that cut it only between UTF-8 characters: mitmproxy's
    Fragmentizer decodes each fragment on its own (errors="replace"), so a character split across
    two fragments came out as U+FFFD. The sizes asked for (the client's, or none: mitmproxy's
    4,000-byte ones) are kept where they fall between characters and moved back to the character's
    start where they do not."""
    total = len(content)
    if fragments and sum(fragments) == total:
        cuts, at = [], 0
        for size in fragments[:-1]:
            at += size
            cuts.append(at)
    else:
        cuts = list(range(SMALL_FRAGMENT, total, SMALL_FRAGMENT))
    sizes, start = [], 0
    for cut in cuts:
        while start < cut < total and content[cut] & 0xC0 == 0x80:  # a continuation byte: not a start
            cut -= 1
        if cut > start:
            sizes.append(cut - start)
            start = cut
    sizes.append(total - start)
    return sizes


def _sized(total: int) -> list[int]:
    """mitmproxy's own fragments for a message of `total` bytes: 4,000 bytes each."""
    sizes = [SMALL_FRAGMENT] * (total // SMALL_FRAGMENT)
    if total % SMALL_FRAGMENT or not sizes:
        sizes.append(total % SMALL_FRAGMENT)
    return sizes


class _Reassembly:
    """The message one side is sending: its pieces (joined once, at its end), its size so far,
    the size of the frame under way and of the frames before it."""

    __slots__ = ("pieces", "size", "frame_size", "fragments", "account")

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.size = 0
        self.frame_size = 0
        self.fragments: list[int] = []
        self.account = None  # its share of the buffer ledger (gateway/budget.py Account), once charged

    @classmethod
    def of(cls, ws) -> "_Reassembly":
        found = getattr(ws, "_egress_reassembly", None)
        if found is None:
            found = ws._egress_reassembly = cls()
        return found

    def add(self, piece: bytes) -> bool:
        """Keep the piece; False (and nothing kept) when the buffer ledger has no room for it."""
        if piece:
            if self.account is not None and not self.account.reserve(len(piece)):
                return False
            self.pieces.append(piece)
            self.size += len(piece)
            self.frame_size += len(piece)
        return True

    def frame_done(self) -> None:
        self.fragments.append(self.frame_size)
        self.frame_size = 0

    def take(self) -> tuple[bytes, list[int]]:
        """The whole message and its fragments' sizes; the reassembly starts again empty. Many
        fragments smaller than mitmproxy's own (4,000 bytes) come back as none: the message is sent
        on in mitmproxy's fragments."""
        content = b"".join(self.pieces)
        fragments = self.fragments
        self.pieces, self.size, self.frame_size, self.fragments = [], 0, 0, []
        if self.account is not None:
            self.account.release()  # the message goes to the hooks and on (one at a time per side)
        if len(fragments) > 1 + len(content) // SMALL_FRAGMENT:
            fragments = []
        return content, fragments


def _limit() -> int:
    try:
        return max(int(ctx.options.egress_max_websocket_message_bytes), 0)
    except (AttributeError, KeyError, ValueError):
        return DEFAULT_MAX_MESSAGE_BYTES


def install(on_refused, taker, account_for=None) -> None:
    """Wrap mitmproxy's WebsocketLayer (the class the HTTP stream makes, whatever wrapped it before)."""
    from mitmproxy.proxy import commands
    from mitmproxy.proxy.layers import websocket as ws_module
    import wsproto.connection
    import wsproto.events

    if getattr(ws_module.WebsocketLayer, "_egress_bounded", False):
        ws_module.WebsocketLayer._egress_on_refused = staticmethod(on_refused)
        ws_module.WebsocketLayer._egress_taker = staticmethod(taker)
        ws_module.WebsocketLayer._egress_account_for = staticmethod(account_for)
        return

    class BoundedWebsocketLayer(ws_module.WebsocketLayer):
        _egress_bounded = True
        _egress_on_refused = staticmethod(on_refused)
        _egress_taker = staticmethod(taker)
        _egress_account_for = staticmethod(account_for)  # context -> a new Account (None: not charged)
        _egress_take = None  # the client's sandbox bucket (frame_limits.take bound to its key), once known

        def handle_event(self, event):
            yield from super().handle_event(event)
            read_ahead.settle(self)  # what arrives while a message's hook runs waits in the socket

        @ws_module.expect(events.DataReceived, events.ConnectionClosed, ws_module.WebSocketMessageInjected)
        def relay_messages(self, event):
            """mitmproxy 12.3's relay_messages, with what it lacks for hostile peers:
            - the size of the message being reassembled is a running total per side, checked
              against the limit as each piece arrives (summing `frame_buf` on every event was
              quadratic in its fragments), and its pieces are joined once, at its end;
            - each frame or ping from the client under egress_small_frame_bytes takes a token from
              its sandbox's small-frame bucket (addons/frame_limits.py); none left: close 1008;
            - a message sent in many small fragments goes on in mitmproxy's 4,000-byte fragments,
              not fragment for fragment (1-byte continuation frames were relayed one by one);
            - pings and pongs are not logged (one log line each, 123,000 for one flood);
            - after the hooks, only the last message is kept in `flow.websocket.messages`."""
            if isinstance(event, events.ConnectionEvent):
                from_client = event.connection == self.context.client
                injected = False
            else:
                from_client = event.message.from_client
                injected = True
            src_ws, dst_ws = (self.client_ws, self.server_ws) if from_client else (self.server_ws, self.client_ws)
            reading = _Reassembly.of(src_ws)
            if reading.account is None and self._egress_account_for is not None:
                try:
                    reading.account = self._egress_account_for(self.context)
                except Exception:  # fail closed: a side that cannot be charged holds nothing
                    logging.getLogger("egress").exception("egress gateway: no buffer account for a WebSocket")
                    yield from self._over_budget(from_client, 0)
                    return

            if isinstance(event, events.DataReceived):
                src_ws.receive_data(event.data)
            elif isinstance(event, events.ConnectionClosed):
                src_ws.receive_data(None)
            else:
                fragmentizer = ws_module.Fragmentizer([], event.message.type == Opcode.TEXT)
                src_ws._events.extend(fragmentizer(event.message.content))

            metered = from_client and not injected
            limit = _limit()
            for ws_event in src_ws.events():
                if isinstance(ws_event, wsproto.events.Message):
                    piece = ws_event.data.encode() if isinstance(ws_event.data, str) else ws_event.data
                    if not reading.add(piece):
                        yield from self._over_budget(from_client, reading.size + len(piece))
                        return
                    if limit and reading.size > limit:
                        yield from self._too_large(from_client, reading.size, limit)
                        return
                    if ws_event.frame_finished:
                        # A whole message is judged by its size, a fragment of one by its own.
                        size, cost = ((reading.size, frame_limits.MESSAGE_COST) if ws_event.message_finished
                                      else (reading.frame_size, frame_limits.FRAME_COST))
                        if metered and not self._egress_small(size, cost):
                            yield from self._flood()
                            return
                        reading.frame_done()
                    if ws_event.message_finished:
                        is_text = isinstance(ws_event.data, str)
                        content, fragments = reading.take()
                        message = websocket.WebSocketMessage(Opcode.TEXT if is_text else Opcode.BINARY,
                                                             from_client, content, injected=injected)
                        self.flow.websocket.messages.append(message)
                        yield ws_module.WebsocketMessageHook(self.flow)
                        messages = self.flow.websocket.messages
                        if len(messages) > 1:
                            del messages[:-1]  # every hook has seen them; only the last is kept
                        if not message.dropped:
                            # Cut as the sender did where the hooks left the size alone (else in
                            # mitmproxy's 4,000-byte pieces), and a text only between characters.
                            out = message.content
                            if len(out) != len(content):
                                fragments = []
                            fragmentizer = ws_module.Fragmentizer([], is_text)
                            fragmentizer.fragment_lengths = _on_characters(out, fragments) if is_text else (
                                fragments or _sized(len(out)))
                            for msg in fragmentizer(out):
                                yield dst_ws.send2(msg)
                        if len(message.content) >= DROP_CONTENT_AT:
                            message.content = b""  # sent (or dropped): a large one is not kept
                        content = out = None
                        if self._handle_event != self.relay_messages:
                            return  # closed meanwhile
                elif isinstance(ws_event, (wsproto.events.Ping, wsproto.events.Pong)):
                    if metered and not self._egress_small(len(ws_event.payload), frame_limits.PING_COST):
                        yield from self._flood()
                        return
                    yield dst_ws.send2(ws_event)
                elif isinstance(ws_event, wsproto.events.CloseConnection):
                    self.flow.websocket.timestamp_end = time.time()
                    self.flow.websocket.closed_by_client = from_client
                    self.flow.websocket.close_code = ws_event.code
                    self.flow.websocket.close_reason = ws_event.reason
                    for ws in (self.server_ws, self.client_ws):
                        if ws.state in (wsproto.connection.ConnectionState.OPEN,
                                        wsproto.connection.ConnectionState.REMOTE_CLOSING):
                            yield ws.send2(ws_event)
                        yield commands.CloseConnection(ws.conn)
                    self._egress_release()
                    yield ws_module.WebsocketEndHook(self.flow)
                    self.flow.live = False
                    self._handle_event = self.done
                else:  # pragma: no cover
                    raise AssertionError(f"Unexpected WebSocket event: {ws_event}")

        def _egress_small(self, size: int, cost: int) -> bool:
            """A client frame of `size` payload bytes: False when it is small and its sandbox's
            bucket has not `cost` tokens left."""
            if not frame_limits.small(size):
                return True
            self._egress_small_frames = getattr(self, "_egress_small_frames", 0) + 1
            take = self._egress_take
            if take is None:
                take = self._egress_take = self._egress_taker(self.flow)
            return take(cost)

        def _flood(self):
            yield from self._close(True, MESSAGE_POLICY, "too many small frames", "small_frame_flood",
                                   f"{frame_limits.describe()}; closed with {MESSAGE_POLICY}",
                                   getattr(self, "_egress_small_frames", 0))

        def _too_large(self, from_client: bool, size: int, limit: int):
            yield from self._close(from_client, MESSAGE_TOO_BIG, "message too big", "websocket_message_too_large",
                                   f"a WebSocket message from the {'client' if from_client else 'upstream'} "
                                   f"passed {limit} bytes; closed with {MESSAGE_TOO_BIG}", size)

        def _over_budget(self, from_client: bool, size: int):
            yield from self._close(from_client, MESSAGE_TOO_BIG, "message too big", "buffer_budget",
                                   f"a WebSocket message from the {'client' if from_client else 'upstream'} being "
                                   f"reassembled would pass the connection's or the sandbox's buffer budget; closed "
                                   f"with {MESSAGE_TOO_BIG}", size)

        def _egress_release(self):
            """The connection ends: what its reassemblies held goes back to the ledger."""
            for ws in (self.client_ws, self.server_ws):
                reading = _Reassembly.of(ws)
                reading.take()
                if reading.account is not None:
                    reading.account.close()
                ws.frame_buf = [b""]

        def _close(self, from_client: bool, code: int, reason_text: str, reason: str, message: str, size: int):
            self._egress_release()
            try:
                self._egress_on_refused(self.flow, reason, message, size)
            except Exception:
                logging.getLogger("egress").exception("egress gateway: WebSocket refusal hook failed")
            websocket_data = self.flow.websocket
            websocket_data.timestamp_end = time.time()
            websocket_data.closed_by_client = from_client
            websocket_data.close_code = code
            websocket_data.close_reason = reason_text
            close = wsproto.events.CloseConnection(code=code, reason=reason_text)
            for ws in (self.server_ws, self.client_ws):
                if ws.state is wsproto.connection.ConnectionState.OPEN:
                    yield ws.send2(close)
                yield commands.CloseConnection(ws.conn)
            yield ws_module.WebsocketEndHook(self.flow)
            self.flow.live = False
            self._handle_event = self.done

    ws_module.WebsocketLayer = BoundedWebsocketLayer
