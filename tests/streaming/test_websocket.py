"""Behaviour 8: a WebSocket through the proxy still works once every body of unknown length
streams: an echo (wsproto on both sides) through a CONNECT tunnel and as a plain `ws://` upgrade
through the explicit proxy, each message sent only after the previous echo came back."""

from __future__ import annotations

import time

import pytest

from .clients import Buffered, H1Client, connect_proxy, connect_tunnel, ws_key
from .conftest import check_origin_saw, name
from .origins import WAIT, websocket_echo

pytestmark = pytest.mark.e2e


class WsClient:
    def __init__(self, sock, host: str, target: str):
        from wsproto.connection import Connection, ConnectionType

        self.http = H1Client(sock)
        self.http.send_request("GET", target, [("Host", host), ("Upgrade", "websocket"), ("Connection", "Upgrade"),
                                               ("Sec-WebSocket-Key", ws_key()), ("Sec-WebSocket-Version", "13")])
        self.http.read_head("the 101 answer")
        assert self.http.status == 101, (self.http.status, self.http.headers)
        self.conn: Buffered = self.http.conn
        self.ws = Connection(ConnectionType.CLIENT)
        if self.conn.buf:
            self.ws.receive_data(self.conn.buf)
            self.conn.buf = b""
        self.pending: list = []

    def send_text(self, text: str) -> None:
        from wsproto.events import TextMessage

        self.conn.sock.sendall(self.ws.send(TextMessage(data=text)))

    def receive_text(self, n: int) -> str:
        from wsproto.events import CloseConnection, TextMessage

        deadline = time.monotonic() + WAIT
        text = ""
        while True:
            for event in self.ws.events():
                if isinstance(event, TextMessage):
                    text += event.data
                    if event.message_finished:
                        return text
                elif isinstance(event, CloseConnection):
                    raise AssertionError(f"the WebSocket closed ({event.code} {event.reason!r}) before echo {n}")
            try:
                if not self.conn.fill(deadline):
                    raise AssertionError(f"the connection closed before echo {n}")
            except TimeoutError:
                raise AssertionError(f"echo {n} never reached the client within {WAIT:g}s") from None
            self.ws.receive_data(self.conn.buf)
            self.conn.buf = b""

    def close(self) -> None:
        from wsproto.events import CloseConnection

        try:
            self.conn.sock.sendall(self.ws.send(CloseConnection(code=1000)))
        except Exception:
            pass
        self.http.close()


@pytest.mark.parametrize("mode,rule", [("tunnel", "unbound"), ("tunnel", "bound"), ("plain", "unbound")])
def test_websocket_echo(gateway, routes, origins, mode, rule):
    route = websocket_echo(routes)
    host = name("h1", rule)
    if mode == "tunnel":
        client = WsClient(connect_tunnel(gateway, host, ["http/1.1"]), host, route.path)
    else:
        client = WsClient(connect_proxy(gateway), host, f"http://{host}{route.path}")
    try:
        for n in range(1, 4):
            client.send_text(f"message {n}")
            assert client.receive_text(n) == f"echo: message {n}"
    finally:
        client.close()
    check_origin_saw(route.exchange, rule)
