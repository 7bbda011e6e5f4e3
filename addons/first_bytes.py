"""A connection's first bytes held until they can be judged, within a deadline: a partial first
line, record header or HTTP/2 preface (egress_head_timeout), or a TLS ClientHello, read whole
within egress_max_client_hello_bytes and egress_client_hello_timeout before mitmproxy's TLS layer
or the TLS guard (and so any rule lookup) sees it. The layer guard (addons/layer_guard.py) judges
them; this module only holds them and refuses what is too slow, too large or malformed.
"""

from __future__ import annotations

from collections.abc import Callable

from mitmproxy import ctx
from mitmproxy.proxy import layer
from mitmproxy.tls import ClientHello

from gateway.clienthello import COMPLETE, NEED_MORE, TOO_LARGE, ClientHelloReader

from .refusal_layers import TLS_ALERT_HANDSHAKE_FAILURE, HoldLayer

Refuse = Callable[..., None]  # (nextlayer or hold, reason, message, speak_http=, farewell=)


class FirstBytes:
    def __init__(self, judge: Callable[[HoldLayer], None], refuse: Refuse):
        self.judge, self.refuse = judge, refuse

    def wait(self, nextlayer: layer.NextLayer | HoldLayer) -> None:
        """No decision yet: the first bytes are held (at most the layer guard's MAX_FIRST_LINE:
        it decides past that) and judged again as more arrive. A client that takes longer than
        egress_head_timeout to send its first line is refused (slowloris), by a timer: also when
        it has gone silent."""
        if isinstance(nextlayer, HoldLayer):
            return
        tls_like = nextlayer.data_client()[:1] == b"\x16"  # a TLS record header in pieces: the hello's clock
        timeout = ctx.options.egress_client_hello_timeout if tls_like else ctx.options.egress_head_timeout
        nextlayer.layer = HoldLayer(nextlayer.context, self._feed, self._expired, float(timeout),
                                    data_follows=bool(nextlayer.data_client()))

    def _feed(self, hold: HoldLayer, chunk: bytes) -> None:
        hold.held += chunk
        self.judge(hold)

    def _expired(self, hold: HoldLayer) -> None:
        if hold.held[:1] == b"\x16":
            self.refuse(hold, "client_hello_timeout", f"the TLS ClientHello took more than {hold.timeout:g}s "
                        "to arrive", speak_http=False, farewell=TLS_ALERT_HANDSHAKE_FAILURE)
        else:
            self.refuse(hold, "request_head_timeout", f"the first line took more than {hold.timeout:g}s to arrive")

    def client_hello(self, nextlayer: layer.NextLayer | HoldLayer, data: bytes,
                     then: Callable[[HoldLayer, ClientHello], None]) -> None:
        """TLS: nothing above this sees the ClientHello until it is whole, within
        egress_max_client_hello_bytes and egress_client_hello_timeout (gateway/clienthello.py reads
        it in linear time and refuses a declared length over the budget from its header, before
        buffering it). Then mitmproxy's TLS layers get it at once, in as few records as TLS allows,
        and parse it once; `then` picks those layers (or a passthrough relay)."""
        reader = ClientHelloReader(ctx.options.egress_max_client_hello_bytes)
        timeout = float(ctx.options.egress_client_hello_timeout)
        refuse = self.refuse

        def feed(hold: HoldLayer, chunk: bytes) -> None:
            verdict = reader.feed(chunk)
            if verdict == NEED_MORE:
                return
            if verdict == COMPLETE:
                try:
                    hello = ClientHello(reader.hello[4:])
                    hello.sni, hello.alpn_protocols, list(hello.extensions)  # parsed lazily: fail here, if at all
                except Exception:
                    refuse(hold, "bad_client_hello", "the TLS ClientHello cannot be parsed", speak_http=False,
                           farewell=TLS_ALERT_HANDSHAKE_FAILURE)
                    return
                hold.replay = reader.canonical()
                then(hold, hello)
            elif verdict == TOO_LARGE:
                refuse(hold, "client_hello_too_large", reader.error, speak_http=False,
                       farewell=TLS_ALERT_HANDSHAKE_FAILURE)
            else:
                refuse(hold, "bad_client_hello", f"malformed TLS ClientHello: {reader.error}",
                       speak_http=False, farewell=TLS_ALERT_HANDSHAKE_FAILURE)

        def expire(hold: HoldLayer) -> None:
            refuse(hold, "client_hello_timeout", f"the TLS ClientHello took more than {timeout:g}s "
                   "to arrive", speak_http=False, farewell=TLS_ALERT_HANDSHAKE_FAILURE)

        if isinstance(nextlayer, HoldLayer):  # held as a first line so far (a TLS record header in pieces)
            hold = nextlayer
            hold.feed, hold.expire = feed, expire
            hold.held = bytearray()
            hold.deadline(timeout)
            feed(hold, data)
        else:  # mitmproxy's NextLayer replays what it holds (data included) into the new layer
            nextlayer.layer = HoldLayer(nextlayer.context, feed, expire, timeout, data_follows=bool(data))
