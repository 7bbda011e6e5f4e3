"""DNS mode (`--mode dns@HOST:PORT`): the sandbox's resolver, which only knows allowed names.

A/AAAA questions for names some rule (granted to this client) covers get the gateway's own
checked addresses; every other name gets NXDOMAIN without being looked up anywhere (so data
encoded in `<secret>.attacker.example` never leaves); HTTPS/SVCB for allowed names are answered
empty (no ECH keys, no address hints); other types are REFUSED. Every query gets an answer here,
so mitmproxy's built-in resolver (which would forward unknown types upstream) never acts.
"""

from __future__ import annotations

import ipaddress
import logging

from mitmproxy import dns
from mitmproxy.net.dns import classes, op_codes, response_codes, types

from gateway.decision import Decision, verdict_fields

from . import dns_layer
from .audit_fields import connection_fields
from .failclosed import fail_closed
from .state import GatewayState

ANSWER_TTL_SECONDS = 60
RCODES = {
    "NXDOMAIN": response_codes.NXDOMAIN,
    "REFUSED": response_codes.REFUSED,
    "SERVFAIL": response_codes.SERVFAIL,
}


def _servfail_on_error(self, flow: dns.DNSFlow, error: Exception) -> None:
    flow.response = flow.request.fail(response_codes.SERVFAIL)


class DnsGuard:
    def __init__(self, state: GatewayState):
        self.state = state
        dns_layer.install()  # answered queries forgotten, what waits bounded (review 35)
        dns_layer.GatewayDnsLayer.on_cut_off = self._cut_off

    def _cut_off(self, context) -> None:
        """A UDP peer sent too far ahead of its answers and was cut off (addons/dns_layer.py)."""
        try:
            client = context.client
            conn = self.state.connection(client.id, client.peername, "dns")
            scope = self.state.scope(conn)
            self._audit(conn, scope, None, "?", Decision.deny(
                "pipeline_too_large", f"more than {dns_layer.MAX_QUEUED_QUERIES} DNS queries were sent ahead of their "
                                      f"answers; this address and port are not answered until silent for 60 s"))
        except Exception:  # the audit cannot be written: the cut-off stands
            logging.getLogger("egress").exception("egress gateway: could not record a DNS cut-off")

    @fail_closed(_servfail_on_error)
    async def dns_request(self, flow: dns.DNSFlow) -> None:
        request = flow.request
        conn = self.state.connection(flow.client_conn.id, flow.client_conn.peername, "dns")
        scope = self.state.scope(conn)
        question = request.question
        if (refusal := self.state.dns_gate(conn, scope)) is not None:
            # Every query takes a token from the sandbox's DNS bucket (addons/rate_limits.py), a
            # malformed or odd one too (review 36: class CH queries took none): at the rate one
            # port's flood was answered (~700 a second), one audit line each rotated every sandbox's
            # history away in under an hour (review 35). Refused; a connection refused so
            # MAX_RATE_REFUSED_IN_A_ROW times in a row is cut off (addons/dns_layer.py).
            flow.response = request.fail(response_codes.REFUSED)
            setattr(flow, dns_layer.RATE_REFUSED_ATTR, True)
            name = question.name[:253] if question is not None else None
            self._audit(conn, scope, name, types.to_str(question.type) if question is not None else "?", refusal)
            return
        if not request.query or request.op_code != op_codes.QUERY or question is None or question.class_ != classes.IN:
            flow.response = request.fail(response_codes.REFUSED)
            self._audit(conn, scope, None, "?", Decision.deny("dns_type_refused", "not a single IN query"))
            return
        query_type = types.to_str(question.type)
        engine = self.state.require_engine()
        answer = await engine.answer_dns(question.name, query_type, scope)
        if answer.rcode == "NOERROR":
            records = [
                dns.ResourceRecord.A(question.name, a, ttl=ANSWER_TTL_SECONDS)
                if isinstance(a, ipaddress.IPv4Address)
                else dns.ResourceRecord.AAAA(question.name, a, ttl=ANSWER_TTL_SECONDS)
                for a in answer.addresses
            ]
            flow.response = request.succeed(records)
            if conn.address is not None and answer.name and answer.addresses:
                # Kept in the sandbox's own part of the memory: a full memory evicts the answers of
                # whoever holds the most, never another sandbox's first (gateway/dnsmemory.py).
                self.state.dns_memory.remember(conn.address, answer.name, answer.addresses,
                                               owner=self.state.sandbox_key(conn, scope))
        else:
            flow.response = request.fail(RCODES[answer.rcode])
        self._audit(
            conn, scope, answer.name or question.name[:253], query_type, answer.decision,
            ",".join(a.compressed for a in answer.addresses) or None, answer.rcode,
        )

    def _audit(self, conn, scope, name, query_type, decision: Decision, addresses=None, rcode="REFUSED"):
        # A DNS answer has no HTTP status: the rcode says what the sandbox got.
        self.state.record(
            event="dns", **connection_fields(conn, scope.sandbox), **verdict_fields(decision, status_sent=False),
            host=name, address=addresses, dns_type=query_type, rcode=rcode,
        )
