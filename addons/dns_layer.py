"""DNS mode's layer, bounded: mitmproxy's `DNSLayer` with what one sandbox sends held to a budget.

Review 35 found two ways for one sandbox to grow a worker without end through `--mode dns@`:
- mitmproxy keeps every query's flow in `DNSLayer.flows` (by query id, never pruned) for as long
  as the peer is active: 8 UDP ports at 900 queries a second grew a worker 84 -> 309 MiB in
  150 s. The gateway answers every query itself (addons/dns_guard.py; nothing is forwarded
  upstream), so a flow is dropped once its answer is sent.
- while a query's `dns_request` hook runs the layer is paused and queues whatever arrives, and the
  connection's readers read on: two TCP connections pipelining queries had 18.5 M queued in 60 s
  (+700 MiB), one UDP socket at 85 k a second +400 MiB, answered for 90 s after it stopped. Over
  TCP the read-ahead gate now holds the connection's readers (addons/read_ahead.py: TCP
  back-pressure). UDP has none, and mitmproxy_rs queues a UDP peer's datagrams without limit
  until they are read (src/network/udp.rs `ConnectionState.packets`), so a peer with
  MAX_QUEUED_QUERIES waiting is cut off instead: its connection is closed, which empties that
  queue and makes mitmproxy_rs drop what the same address and port send until they have been
  silent for 60 s (`UDP_TIMEOUT`). Refused `pipeline_too_large` (sent too far ahead of its
  answers), one audit line. A stub resolver sends a query or two at a time and retries.

Review 36 added: a TCP connection's queries are unpacked one at a time (a whole read was ~30 times
its bytes in query objects), nothing is handled once a connection is cut off (queued events are
replayed past `handle_event`), and a connection whose queries were refused for the sandbox's DNS
rate MAX_RATE_REFUSED_IN_A_ROW times in a row is cut off too (UDP or TCP).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable

from mitmproxy import dns
from mitmproxy.proxy import commands, events, layer
from mitmproxy.proxy.layers.dns import DNSLayer

from . import read_ahead

MAX_QUEUED_QUERIES = 256  # per UDP peer: what a resolver sends in a burst, far more than it retries
RATE_REFUSED_ATTR = "_egress_rate_refused"  # on a DNSFlow: refused for the sandbox's DNS rate (addons/dns_guard.py)
# Rate refusals in a row after which a connection is cut off. Not at the first: one socket a
# resolver keeps for all its queries (c-ares, Node's dns.resolve*) went unanswered for as long as it
# went on asking after one burst (review 36); a query answered in between starts the count again.
MAX_RATE_REFUSED_IN_A_ROW = 32
_LENGTH = struct.Struct("!H")


class GatewayDnsLayer(DNSLayer):
    dropped = 0  # UDP queries dropped because too many waited (set per instance once any is)
    cut_off = False  # the connection was closed (sent too far ahead, refused too often, malformed)
    refused_in_a_row = 0  # answers in a row refused for the sandbox's DNS rate
    on_cut_off: Callable[[object], None] | None = None  # (context) -> audits a UDP peer cut off for its backlog

    def handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        udp = self.context.client.transport_protocol == "udp"
        if udp and isinstance(event, events.DataReceived) and (self.cut_off or (
                self._paused is not None and len(self._paused_event_queue) >= MAX_QUEUED_QUERIES)):
            self.dropped += 1
            if not self.cut_off and self.on_cut_off is not None:
                self.on_cut_off(self.context)
            yield from self._cut()
            return
        yield from super().handle_event(event)
        if not udp:  # (a UDP peer's reader held at the gate would only move the queue elsewhere)
            read_ahead.settle(self)

    def handle_response(self, flow, msg) -> layer.CommandGenerator[None]:
        yield from super().handle_response(flow, msg)
        self._forget(flow)
        if not getattr(flow, RATE_REFUSED_ATTR, False):
            self.refused_in_a_row = 0
            return
        self.refused_in_a_row += 1
        if self.refused_in_a_row >= MAX_RATE_REFUSED_IN_A_ROW:
            yield from self._cut()

    def state_query(self, event: events.Event) -> layer.CommandGenerator[None]:
        """mitmproxy's, except that nothing is handled once the connection is cut off (events queued
        while a hook ran are replayed here, past `handle_event`), and that a TCP connection's
        queries are unpacked one at a time: mitmproxy unpacked a whole read at once, 3,449 query
        objects (~2 MB, 30 times the bytes) held while each one's hook ran, and handled every one
        of them after the connection was closed (review 36: 500 connections, 1.1 GiB)."""
        if self.cut_off:
            return
        if (isinstance(event, events.DataReceived) and event.connection is self.context.client
                and self.context.client.transport_protocol == "tcp"):
            self.req_buf.extend(event.data)
            while not self.cut_off and (msg := (yield from self._next_tcp_query())) is not None:
                flow = self.flows.get(msg.id)
                if flow is None:
                    flow = self.flows[msg.id] = dns.DNSFlow(self.context.client, self.context.server, live=True)
                yield from self.handle_request(flow, msg)
            return
        yield from super().state_query(event)

    def _next_tcp_query(self) -> layer.CommandGenerator[dns.DNSMessage | None]:
        """The next whole query in the connection's buffer, taken out of it; None while it is not
        whole, or (the connection closed) when it cannot be read, as mitmproxy closes it."""
        buf = self.req_buf
        if len(buf) < _LENGTH.size:
            return None
        (size,) = _LENGTH.unpack_from(buf)
        if size and len(buf) < _LENGTH.size + size:
            return None
        try:
            if not size:
                raise struct.error("Message length field cannot be zero")
            msg = dns.DNSMessage.unpack(bytes(buf[_LENGTH.size:_LENGTH.size + size]), timestamp=time.time())
        except struct.error as e:
            yield commands.Log(f"{self.context.client} sent an invalid message: {e}")
            yield commands.CloseConnection(self.context.client)
            self.cut_off = True
            self._handle_event = self.state_done
            return None
        del buf[:_LENGTH.size + size]
        return msg

    def _cut(self) -> layer.CommandGenerator[None]:
        """Close the client's connection, once: over UDP mitmproxy_rs then drops what the same address
        and port send until they have been silent for 60 s."""
        if not self.cut_off:
            self.cut_off = True
            yield commands.CloseConnection(self.context.client)

    def handle_error(self, flow, err: str) -> layer.CommandGenerator[None]:
        yield from super().handle_error(flow, err)
        self._forget(flow)

    def _forget(self, flow) -> None:
        """The query is answered: its flow goes (a later query with the same id gets a new one)."""
        if flow.request is not None and self.flows.get(flow.request.id) is flow:
            del self.flows[flow.request.id]


def install() -> None:
    """DNS mode's listeners make this layer instead of mitmproxy's."""
    from mitmproxy.proxy import mode_servers

    mode_servers.DnsInstance.make_top_layer = lambda self, context: GatewayDnsLayer(context)
