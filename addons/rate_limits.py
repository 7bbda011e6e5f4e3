"""Rates and budgets per sandbox: the gateway's own defence (options) and the policy's `limits:`.

Gateway-wide (options, always on, whatever the policy says), one token bucket per sandbox (per
client address when the policy has no sandboxes section):
- new connections: over `egress_max_new_connections_per_second_per_sandbox` (burst
  `egress_new_connection_burst_per_sandbox`) a connection is closed right after accept, before any
  byte is read: audit `connection_rate_limited`, no status (like `too_many_connections`);
- requests: every request head a sandbox sends (allowed or denied; HTTP/1, HTTP/2 streams,
  WebSocket upgrades, CONNECT; in tunnels, transparent, on the proxy port) takes a token before any
  decision work (`RequestLimits.gate`); over `egress_max_requests_per_second_per_sandbox` (burst
  `egress_request_burst_per_sandbox`) it is answered 429 `rate_limited` with Retry-After, and
  nothing goes upstream. A 429 closes an HTTP/1 connection after the answer (addons/respond.py) and
  counts as a refused stream on HTTP/2 (addons/http2_server.py: a flood of them ends in GOAWAY), so a
  flooder must open new connections, which the connection rate bounds.

Policy `limits:` (gateway/policy.py `Limits`, a sandbox's and a rule's), over sliding windows
(gateway/ratelimit.py): requests per minute, upload and download bytes per hour, requests per
credential per minute. Decided at the request head, after the guards allowed it and before
anything goes upstream (`RequestLimits.check`, called by RequestGuard so that the request has one
audit line with its final verdict); request body bytes are counted as they arrive and a body that
would pass the upload budget is cut off before its end goes upstream; response bytes are counted
as they go to the client and, once the download budget is spent, the next request is refused (a
response under way is not cut off). Only requests the guards allowed count against `limits:` (report
mode's `would_deny` included): a refused request costs no policy budget (it does cost a token of the
gateway-wide request rate). Limits are never relaxed by report mode.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from mitmproxy import ctx, exceptions, http

from gateway.decision import Decision, verdict_fields
from gateway.engine import Engine
from gateway.options import (
    DEFAULT_CONNECTION_BURST,
    DEFAULT_CONNECTIONS_PER_SECOND,
    DEFAULT_DNS_QUERIES_PER_SECOND,
    DEFAULT_DNS_QUERY_BURST,
    DEFAULT_REQUEST_BURST,
    DEFAULT_REQUESTS_PER_SECOND,
)
from gateway.policy import LIMIT_KEYS, Policy, Scope
from gateway.ratelimit import BucketTable, Clock, Quotas, SlidingWindow, parse_rate

from .audit_fields import connection_fields, decision_fields, flow_fields
from .method_body import BODY_CHECK, CheckInFront
from .options import declare
from .respond import COUNTS_AS_RESET, flow_page, refusal_headers, replace_response
from .revocation import close_client
from .streaming import counting_stream
from .state import ClientSession, GatewayState

CHARGE = "egress_limits_charge"  # flow.metadata key: the windows this request's bytes count against
RESERVED = "egress_limits_reserved"  # flow.metadata key: response bytes counted at the head, not yet sent

# Defaults (README options table): a ceiling against floods, far above what a package install needs
# (pip keeps ~10 pooled connections per host, npm up to 15 sockets; a few hundred small requests a
# second at most), with bursts for a cold start. Not a fair share of a worker (the reference 2-core
# machine serves ~330 keep-alive HTTPS requests and ~77 new TLS tunnels a second per worker,
# docs/performance.md): deployments packing many sandboxes on few workers should lower them.


@dataclass
class Charge:
    """What an allowed request's bytes are counted against, and how metrics label them."""

    sandbox: str | None
    rule: str | None
    upload: list[tuple[Hashable, SlidingWindow]] = field(default_factory=list)
    download: list[tuple[Hashable, SlidingWindow]] = field(default_factory=list)


def _describe(key: Hashable) -> str:
    kind, sandbox, rule, secret, name, _profile = key  # type: ignore[misc]
    if kind == "sandbox":
        where = f"sandbox {sandbox}" + (f" credential {secret}" if secret else "")
    elif kind == "credential":
        where = f"credential {secret} (every rule and sandbox together)"
    else:
        where = f"rule {rule}" + (f" for sandbox {sandbox}" if sandbox else "")
    return f"{where} limits.{name}"


def limit_of(policy: Policy, key: Hashable) -> int | None:
    """The limit `key` has under `policy`, or None when the policy no longer has it (a reload). A
    window is a sandbox's (its id: what the audit names) and its limit its profile's (the
    `sandboxes:` entry: the sandbox's own, or the one its token named)."""
    kind, sandbox, rule_id, secret, name, profile = key  # type: ignore[misc]
    if kind == "sandbox":
        found = policy.sandboxes_by_id.get(profile)
        if found is None or (secret is not None and secret not in policy.secrets):
            return None
        return getattr(found.limits, name)
    if kind == "credential":  # shared by the rules: kept while any rule injecting it has the limit
        limits = [getattr(r.limits, name) for r in policy.rules_by_id.values()
                  if secret in r.secrets and getattr(r.limits, name) is not None]
        return min(limits) if limits else None
    rule = policy.rules_by_id.get(rule_id)
    if rule is None:
        return None
    if sandbox is None:
        return getattr(rule.limits, name) if policy.sandboxes is None else None
    found = policy.sandboxes_by_id.get(profile)
    if found is None or rule_id not in found.rule_ids:
        return None
    return getattr(rule.limits, name)


class Limiter:
    """The state every class here shares: the buckets, the windows, the clock."""

    def __init__(self, state: GatewayState, clock: Clock = time.monotonic):
        self.state = state
        self.clock = clock
        self.requests = BucketTable(DEFAULT_REQUESTS_PER_SECOND, DEFAULT_REQUEST_BURST, clock=clock)
        self.connections = BucketTable(DEFAULT_CONNECTIONS_PER_SECOND, DEFAULT_CONNECTION_BURST, clock=clock)
        self.dns_queries = BucketTable(DEFAULT_DNS_QUERIES_PER_SECOND, DEFAULT_DNS_QUERY_BURST, clock=clock)
        # A sandbox's windows are grouped by its id, so a deregistered one's go at once (bounded memory).
        self.quotas = Quotas(clock, group=lambda key: key[1])
        state.install_listeners.append(self._on_install)
        state.registry_listeners.append(self._on_registry_change)

    def key(self, conn: ClientSession, scope: Scope | None = None) -> str:
        """Like addons/limits.py: the sandbox, or the client address without a sandboxes section."""
        return self.state.sandbox_key(conn, scope)

    def _on_install(self, engine: Engine) -> None:
        """A reload keeps the counters whose (sandbox, rule, credential, key) the new policy still
        has, under its new limits; the others go."""
        policy = engine.policy
        self.quotas.keep(lambda key: limit_of(policy, key))  # (a key names its profile)

    def _on_registry_change(self, change) -> None:
        """A sandbox registered by address is gone: its windows go (bounded memory; the same id
        registered again starts at 0). Not one named by its token (a registration without addresses,
        or connections whose token names it open now): the token, not the registration, names it, and
        it goes on counting in the same windows (review 26: closing its connections around the TTL
        reset its quotas); the Quotas table's own bound and sweep keep those."""
        if (change.op == "deregister" and change.removed and change.addresses
                and not self.state.by_sandbox.get(change.sandbox)):
            self.quotas.drop_group(change.sandbox)

    def windows(self, policy: Policy, scope: Scope, rule_id: str | None, injected: list[str]):
        """(key, window, LIMIT_KEYS name) for every policy limit on this request: its sandbox's, then its
        rule's (a credential limit once per injected secret). Windows are made on first use, per
        sandbox (scope.sandbox: a token's subject too), with the limits of its profile (scope.profile);
        since tokens name sandboxes, traffic can make new ones: Quotas bounds them."""
        sandbox, profile = scope.sandbox, scope.profile
        rule = policy.rules_by_id.get(rule_id or "")
        sets = []
        own = policy.sandbox_limits(scope.profile)
        if own:
            sets.append((own, ("sandbox", sandbox, None)))
        if rule is not None and rule.limits:
            sets.append((rule.limits, ("rule", sandbox, rule.id)))
        out = []
        for limits, (kind, sid, rid) in sets:
            for name, limit in limits.items():
                period = LIMIT_KEYS[name][0]
                if name == "requests_per_credential_per_minute":
                    for secret in injected:
                        if kind == "rule":
                            # One counter per secret, shared by every rule that injects it and every
                            # sandbox: the credential's own quota at the provider. Each rule checks
                            # its own limit against that shared count.
                            key = ("credential", None, None, secret, name, None)
                        else:
                            key = (kind, sid, None, secret, name, profile)
                        out.append((key, self.quotas.window(key, limit, period), name))
                else:
                    key = (kind, sid, rid, None, name, profile)
                    out.append((key, self.quotas.window(key, limit, period), name))
        return out


def _rate(text: str, name: str) -> float:
    """A rate option (a string option, since mitmproxy's --set parses no floats): gateway/ratelimit.py
    `parse_rate`."""
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise exceptions.OptionsError(f"{name}: {exc}") from None


def _configure_bucket(table: BucketTable, updated: set[str], rate_option: str, burst_option: str) -> None:
    """Set a bucket table from its rate and burst options, when either of them changed."""
    if not updated & {rate_option, burst_option}:
        return
    rate = _rate(getattr(ctx.options, rate_option), rate_option)
    burst = getattr(ctx.options, burst_option)
    if burst < 0:
        raise exceptions.OptionsError(f"{burst_option} must be >= 0")
    table.configure(rate, burst)


class ConnectionRate:
    """New connections per second per sandbox: over the bucket, closed at accept."""

    def __init__(self, limiter: Limiter):
        self.limiter = limiter
        self.state = limiter.state

    def load(self, loader):
        declare(
            loader,
            "egress_max_new_connections_per_second_per_sandbox",
            "egress_new_connection_burst_per_sandbox",
        )

    def configure(self, updated: set[str]):
        _configure_bucket(self.limiter.connections, updated, "egress_max_new_connections_per_second_per_sandbox",
                          "egress_new_connection_burst_per_sandbox")

    def client_connected(self, client):
        if client.error:
            return  # refused already (too_many_connections)
        if client.transport_protocol == "udp":
            return  # DNS mode: every query may come from a new source port; not a connection to count
        try:
            conn = self.state.connection(client.id, client.peername)
            key = self.limiter.key(conn)
            wait = self.limiter.connections.take(key)
        except Exception:  # fail closed: a connection the gateway could not count is not served
            logging.getLogger("egress").exception("egress gateway: the connection rate check failed")
            client.error = "egress gateway: internal error"
            return
        if not wait:
            return
        table = self.limiter.connections
        client.error = "egress gateway: new connections too fast"
        refusal = Decision.deny(
            "connection_rate_limited", f"more than {table.rate:g} new connections a second for {key} "
            f"(burst {table.burst:g}); closed at accept", retry_after=wait)
        self.state.record(event="connection", **connection_fields(conn, self.state.scope(conn).sandbox if self.state.engine else None),
                          **verdict_fields(refusal, status_sent=False))


class RequestLimits:
    """Requests per second per sandbox (the defence) and the policy's `limits:` at the request head,
    and the upload budget on the body as it arrives."""

    def __init__(self, limiter: Limiter):
        self.limiter = limiter
        self.state = limiter.state
        self.state.request_limiters.append(self.check)
        self.state.request_gates.append(self.gate)
        self.state.dns_gates.append(self.dns_gate)

    def load(self, loader):
        declare(loader, "egress_max_requests_per_second_per_sandbox", "egress_request_burst_per_sandbox",
                "egress_max_dns_queries_per_second_per_sandbox", "egress_dns_query_burst_per_sandbox")

    def configure(self, updated: set[str]):
        _configure_bucket(self.limiter.requests, updated, "egress_max_requests_per_second_per_sandbox",
                          "egress_request_burst_per_sandbox")
        _configure_bucket(self.limiter.dns_queries, updated, "egress_max_dns_queries_per_second_per_sandbox",
                          "egress_dns_query_burst_per_sandbox")

    def dns_gate(self, conn: ClientSession, scope: Scope) -> Decision | None:
        """Called by addons/dns_guard.py for every DNS-mode query: a token from the sandbox's DNS
        bucket, or `rate_limited` (review 35: one UDP port's flood, each answer an audit line)."""
        key = self.limiter.key(conn, scope)
        if wait := self.limiter.dns_queries.take(key):
            table = self.limiter.dns_queries
            return Decision.deny("rate_limited", f"more than {table.rate:g} DNS queries a second for {key} "
                                 f"(burst {table.burst:g}); refused, and the connection closed", retry_after=wait)
        return None

    def gate(self, conn: ClientSession, scope: Scope) -> Decision | None:
        """Called by RequestGuard and ConnectGuard for every request head and CONNECT, allowed or
        not, before any decision work: a token from the sandbox's bucket, or 429 `rate_limited`. A
        sandbox sending requests the rules deny spends its own budget, not the other sandboxes' share
        of the worker."""
        key = self.limiter.key(conn, scope)
        if wait := self.limiter.requests.take(key):
            table = self.limiter.requests
            return Decision.deny("rate_limited", f"more than {table.rate:g} requests a second for {key} "
                                 f"(burst {table.burst:g}); nothing was sent, and the connection is closed "
                                 f"(HTTP/1)", retry_after=wait)
        return None

    def check(self, flow: http.HTTPFlow, decision: Decision, scope: Scope, engine: Engine,
              injected: list[str]) -> Decision | None:
        """Called by RequestGuard for an allowed request, before its audit line: a refusal, or None
        (then the request is charged). An exception here refuses the request (RequestGuard fails closed)."""
        limiter = self.limiter
        windows = limiter.windows(engine.policy, scope, decision.rule, injected)
        if not windows:
            return None
        now = limiter.clock()
        declared = _declared_length(flow.request)
        counted: list[SlidingWindow] = []
        charge = Charge(scope.sandbox, decision.rule)
        for key_, window, name in windows:
            if name in ("requests_per_minute", "requests_per_credential_per_minute"):
                if not window.fits(1, now):
                    reason = "rate_limited" if name == "requests_per_minute" else "credential_rate_limited"
                    return Decision.deny(reason, f"{_describe(key_)} is {window.limit} (used up); nothing was sent",
                                         decision.rule, retry_after=window.retry_after(1, now))
                counted.append(window)
            elif name == "download_bytes_per_hour":
                if not window.fits(1, now):
                    return Decision.deny("download_quota_exceeded",
                                         f"{_describe(key_)} is {window.limit} bytes (spent); nothing was sent",
                                         decision.rule, retry_after=window.retry_after(1, now))
                charge.download.append((key_, window))
            else:  # upload_bytes_per_hour
                if declared and not window.fits(declared, now):
                    return Decision.deny("upload_quota_exceeded",
                                         f"the request body ({declared} bytes) is more than is left of "
                                         f"{_describe(key_)} ({window.remaining(now)} of {window.limit} bytes); "
                                         f"nothing was sent", decision.rule,
                                         retry_after=window.retry_after(declared, now))
                charge.upload.append((key_, window))
        for window in counted:  # only once every limit passed: a refused request costs nothing
            window.add(1, now)
        if charge.upload or charge.download:
            flow.metadata[CHARGE] = charge
        return None

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        """After RequestGuard planned the body's checks: the upload budget goes first in line."""
        charge = flow.metadata.get(CHARGE)
        if charge is None or not charge.upload or flow.response is not None:
            return
        flow.metadata[BODY_CHECK] = UploadCheck(self, flow, charge, flow.metadata.get(BODY_CHECK))


def _declared_length(request: http.Request) -> int:
    values = request.headers.get_all("content-length")
    if len(values) != 1 or not values[0].strip().isdigit():
        return 0  # none, or malformed (refused elsewhere): counted as it streams
    return int(values[0].strip())


class UploadCheck(CheckInFront):
    """Counts the request body against the upload windows as it arrives, before each chunk goes on;
    the chunk that would pass a budget refuses the body (429 upload_quota_exceeded) and nothing of it
    is sent. Then hands the chunk to the body check that was there (method overrides, empty bodies).
    Same interface as addons/method_body.py `BodyOverrideCheck`."""

    def __init__(self, limits: RequestLimits, flow: http.HTTPFlow, charge: Charge, then):
        self.limits = limits
        self.flow = flow
        self.charge = charge
        self.then = then
        self.refused = False

    @property
    def stopped(self) -> bool:
        return self.refused

    def front(self, data: bytes | None) -> Decision | None:
        if self.refused or not data:
            return None
        try:
            return self._count(data)
        except Exception:  # fail closed: a body that could not be counted does not go on
            logging.getLogger("egress").exception("egress gateway: the upload budget check failed")
            self.refused = True
            refusal = Decision.deny("internal_error", "the gateway failed while counting the request body against "
                                    "its upload budget; its end was not sent", self.charge.rule)
            self._record(refusal)
            return refusal

    def _count(self, data: bytes) -> Decision | None:
        if data:
            limiter = self.limits.limiter
            now = limiter.clock()
            for key, window in self.charge.upload:
                if not window.fits(len(data), now):
                    self.refused = True
                    refusal = Decision.deny(
                        "upload_quota_exceeded", f"the request body passed {_describe(key)} ({window.limit} bytes); "
                        f"its end was not sent", self.charge.rule, retry_after=window.retry_after(len(data), now))
                    self._record(refusal)
                    return refusal
            for _key, window in self.charge.upload:
                window.add(len(data), now)
            self.limits.state.count_usage(self.charge.sandbox, self.charge.rule, "upload", len(data))
        return None

    def finish(self) -> Decision | None:
        if self.refused:
            return None
        return self.then.finish() if self.then is not None else None

    def trailers(self) -> Decision | None:
        if self.refused:
            return None
        return self.then.trailers() if self.then is not None else None

    @property
    def pending(self) -> bool:
        return not self.refused and self.then is not None and self.then.pending

    def _record(self, refusal: Decision) -> None:
        try:
            state = self.limits.state
            conn = state.connections.get(self.flow.client_conn.id)
            fields = flow_fields(self.flow, conn, self.charge.sandbox)
            pin = self.flow.metadata.get("egress_pin")
            state.record(event="request_body", **(fields | decision_fields(refusal, pin)))
        except Exception:
            logging.getLogger("egress").exception("egress gateway: could not record a refusal")



class DownloadMeter:
    """Response bytes of a request with a download budget, counted as they go to the client (after
    BodyStreaming and the redactor decided how the response travels).

    - A response that declares its length (Content-Length) reserves it at its head: over what is
      left of a budget it is refused there, 429 `download_quota_exceeded`, and none of its body goes
      to the sandbox (the upstream's is read and dropped); otherwise the length is counted at once,
      so that parallel responses cannot all pass a head check that only their bodies would fail.
    - A body of unknown length (chunked, or decoded for redaction) is counted as it streams and not
      cut off: the overshoot is at most what such responses in flight at once carry after the budget
      is spent (bounded by the sandbox's concurrent connections x HTTP/2 streams x body_size_limit).
    - A WebSocket message to the sandbox that would pass the budget is dropped and both sockets closed.
    Once a budget is spent, the next request is refused at its head (RequestLimits)."""

    def __init__(self, limiter: Limiter):
        self.limiter = limiter
        self.state = limiter.state

    def _count(self, flow: http.HTTPFlow, charge: Charge, n: int) -> None:
        if n <= 0:
            return
        reserved = flow.metadata.get(RESERVED, 0)  # counted at the head already
        extra = max(0, n - reserved)
        flow.metadata[RESERVED] = max(0, reserved - n)
        if extra:
            now = self.limiter.clock()
            for _key, window in charge.download:
                window.add(extra, now)
        self.state.count_usage(charge.sandbox, charge.rule, "download", n)

    @staticmethod
    def _from_upstream(flow: http.HTTPFlow) -> bool:
        """A response an upstream sent (not a refusal the gateway made after the head was allowed)."""
        return flow.response is not None and flow.server_conn.timestamp_start is not None

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        charge = flow.metadata.get(CHARGE)
        if charge is None or not charge.download or not self._from_upstream(flow):
            return
        declared = _declared_response_length(flow)
        if declared:
            now = self.limiter.clock()
            for key, window in charge.download:
                if not window.fits(declared, now):
                    self._refuse(flow, charge, Decision.deny(
                        "download_quota_exceeded", f"the response ({declared} bytes) is more than is left of "
                        f"{_describe(key)} ({window.remaining(now)} of {window.limit} bytes); none of it was sent",
                        charge.rule, retry_after=window.retry_after(declared, now)))
                    return
            for _key, window in charge.download:
                window.add(declared, now)
            flow.metadata[RESERVED] = declared
        if flow.response.stream:
            flow.response.stream = counting_stream(flow.response.stream, lambda n: self._count(flow, charge, n))
            flow.metadata[CHARGE + "_streamed"] = True

    def _refuse(self, flow: http.HTTPFlow, charge: Charge, decision: Decision) -> None:
        """Replace the response's head with the refusal; its body is read from upstream and dropped."""
        response = flow.response
        replace_response(response, decision, flow_page(self.state, flow, decision))
        if not (flow.request.is_http2 or flow.request.is_http3):
            response.headers["Connection"] = "close"  # like every 429 (addons/respond.py refuse)
        setattr(response, COUNTS_AS_RESET, True)
        flow.metadata[CHARGE + "_streamed"] = True  # nothing of it counts
        conn = self.state.connections.get(flow.client_conn.id)
        self.state.record(event="response", **(flow_fields(flow, conn, charge.sandbox)
                                               | decision_fields(decision, flow.metadata.get("egress_pin"))))

    def response(self, flow: http.HTTPFlow) -> None:
        charge = flow.metadata.get(CHARGE)
        if (charge is None or not charge.download or not self._from_upstream(flow)
                or flow.metadata.get(CHARGE + "_streamed")):
            return
        self._count(flow, charge, len(flow.response.raw_content or b""))

    def websocket_message(self, flow: http.HTTPFlow) -> None:
        """WebSocket messages count too: from the sandbox against the upload budget, to it against the
        download budget; a message that would pass either is dropped and the WebSocket closed (both
        sockets: killing the flow alone leaves them open)."""
        charge = flow.metadata.get(CHARGE)
        if charge is None or flow.websocket is None or not flow.websocket.messages:
            return
        message = flow.websocket.messages[-1]
        size = len(message.content)
        windows = charge.upload if message.from_client else charge.download
        reason = "upload_quota_exceeded" if message.from_client else "download_quota_exceeded"
        event = "request_body" if message.from_client else "response"
        now = self.limiter.clock()
        for key, window in windows:
            if not window.fits(size, now):
                message.drop()
                refusal = Decision.deny(reason, f"a WebSocket message passed {_describe(key)} "
                                        f"({window.limit} bytes); dropped, the WebSocket closed", charge.rule,
                                        retry_after=window.retry_after(size, now))
                conn = self.state.connections.get(flow.client_conn.id)
                self.state.record(event=event, **(flow_fields(flow, conn, charge.sandbox)
                                                  | decision_fields(refusal, flow.metadata.get("egress_pin"))))
                flow.kill()
                close_client(flow.client_conn.id)
                return
        for _key, window in windows:
            window.add(size, now)
        if windows:
            self.state.count_usage(charge.sandbox, charge.rule, "upload" if message.from_client else "download", size)


def _declared_response_length(flow: http.HTTPFlow) -> int:
    """The body length a response declares, 0 when it has none or no body goes to the client."""
    if flow.request.method.upper() == "HEAD" or flow.response.status_code in (204, 304) \
            or flow.response.status_code < 200:
        return 0
    values = flow.response.headers.get_all("content-length")
    if len(values) != 1 or not values[0].strip().isdigit():
        return 0
    return int(values[0].strip())
