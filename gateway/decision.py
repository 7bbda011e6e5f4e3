"""Decisions and the reason codes they carry.

Reason codes are the machine-readable half of every refusal: they go in the `X-Egress-Reason`
response header, the audit log and metric labels, so the set is closed and documented here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .refusal_page import DEFAULT_STYLE

REASON_HEADER = "X-Egress-Reason"
RULE_HEADER = "X-Egress-Rule"

# code -> (HTTP status, one-line meaning)
REASONS: dict[str, tuple[int, str]] = {
    "allowed": (200, "an allow rule matched"),
    # 403: the policy says no
    "no_rule": (403, "no rule allows this host"),
    "port_not_allowed": (403, "a rule covers this host, but not this port"),
    "scheme_not_allowed": (403, "a rule covers this host, but not this scheme"),
    "method_not_allowed": (403, "a rule covers this host, but not this method"),
    "path_not_allowed": (403, "a rule covers this host, but not this path"),
    "method_forbidden": (403, "TRACE and TRACK are always refused"),
    "denied_address": (403, "the host resolves to an address in the deny list"),
    "self_address": (403, "the destination is the gateway itself"),
    # 407: explicit mode's proxy credential (policy identity: tokens:, gateway/proxyauth.py); connection closed
    "proxy_auth_required": (407, "this gateway needs a signed token as the proxy password, and none was sent"),
    "token_expired": (407, "the proxy token has expired"),
    "token_invalid": (407, "the proxy credential is not a valid token for this gateway (malformed, bad signature, "
                           "wrong audience or issuer, algorithm not allowed, unknown key, not valid yet, or naming "
                           "a profile the policy does not have)"),
    "identity_changed": (407, "a request presented another proxy credential than the first one on its connection"),
    # 421: the sandbox restated its destination after it was pinned
    "sni_mismatch": (421, "the TLS SNI names another host than the pinned destination"),
    "sni_required": (421, "a passthrough (inspect: false) connection needs a TLS SNI naming its destination"),
    "ech_refused": (403, "Encrypted ClientHello hides the destination of a passthrough (inspect: false) connection"),
    "bad_client_hello": (400, "the TLS ClientHello is malformed, or ambiguous (repeated extensions or server names)"),
    "client_hello_too_large": (400, "the TLS ClientHello (or one of its records) is over egress_max_client_hello_bytes "
                                    "(connection closed)"),
    "client_hello_timeout": (408, "the TLS ClientHello did not arrive within egress_client_hello_timeout "
                                  "(connection closed)"),
    "host_mismatch": (421, "the Host header names another host than the pinned destination"),
    "authority_mismatch": (421, "the request authority names another host than the pinned destination"),
    # 400: malformed or not inspectable
    "bad_host": (400, "the destination host or port is malformed or ambiguous"),
    "bad_path": (400, "the request path cannot be normalised safely"),
    "bad_host_header": (400, "the Host header is missing, duplicated or malformed"),
    "bad_header": (400, "a header name or value is malformed"),
    "malformed_request": (400, "the request is malformed (framing, headers) and was not forwarded"),
    "unexpected_body": (400, "a GET, HEAD, OPTIONS or DELETE request carries a body and its rule does not set allow_body"),
    "host_url_mismatch": (400, "the Host header does not match the absolute URL"),
    "origin_form": (400, "a request to the proxy itself (origin-form) is not proxied"),
    "https_absolute_form": (400, "https:// URLs must be tunnelled with CONNECT"),
    "upgrade_refused": (400, "only 'Upgrade: websocket' is allowed"),
    "nested_connect": (400, "CONNECT inside a tunnel is refused"),
    "non_http": (400, "the bytes are not HTTP or TLS, so the gateway cannot inspect them"),
    "h2c_refused": (400, "cleartext HTTP/2 (h2c) is refused"),
    "unsolicited_upgrade": (502, "the upstream switched protocols without being asked"),
    # 5xx
    "original_destination_mismatch": (
        421, "the address the sandbox dialled is not one of the SNI name's addresses (strict mode)"
    ),
    "dns_type_refused": (400, "this DNS query type is refused"),
    "plaintext_credentials": (403, "credentials are never sent over plain http"),
    "credential_host": (403, "credentials go only to their rule's exact hosts"),
    "placeholder_misuse": (403, "a placeholder stands where it is never swapped (not a whole token, or a position "
                                "the rule does not allow); nothing was sent"),
    "foreign_credential": (403, "a rule that injects credentials carries no other: the request has a key of its own "
                                "in an auth header or query parameter; nothing was sent"),
    "secret_unavailable": (502, "a secret this request needs cannot be read; nothing was sent"),
    "undecodable_response": (502, "a compressed response could not be decoded to redact credentials"),
    "revoked": (403, "a policy reload no longer allows this open connection, which was closed (audit and metrics "
                     "only: no status is sent)"),
    "too_many_connections": (503, "the sandbox has too many connections open"),
    "too_many_streams": (503, "an HTTP/2 stream over the concurrent-stream limit was refused (RST_STREAM "
                              "REFUSED_STREAM: no status is sent)"),
    "reset_flood": (503, "the HTTP/2 client reset streams faster than the limit; the connection was closed "
                         "(GOAWAY ENHANCE_YOUR_CALM: no status is sent)"),
    "control_frame_flood": (503, "the HTTP/2 client sent more control frames (PING, SETTINGS, WINDOW_UPDATE, "
                                 "PRIORITY, unknown types, empty DATA) than the limit; the connection was closed "
                                 "(GOAWAY ENHANCE_YOUR_CALM: no status is sent)"),
    "small_frame_flood": (429, "the sandbox sent more small frames (HTTP/2 DATA frames, HTTP/1 chunks, WebSocket "
                               "frames and pings under egress_small_frame_bytes) than its per-second budget; the "
                               "connection was closed (HTTP/2 GOAWAY, WebSocket 1008, HTTP/1 429 if not answered yet)"),
    "buffer_budget": (503, "buffering this body would pass the connection's or the sandbox's buffer budget"),
    "connection_rate_limited": (503, "the sandbox opens new connections faster than the gateway allows; closed at "
                                     "accept (audit and metrics only: no status is sent)"),
    "rate_limited": (429, "the sandbox (or its rule) sends requests faster than the gateway or its policy limits "
                          "allow; nothing was sent (Retry-After says when to try again)"),
    "upload_quota_exceeded": (429, "the request body would pass the upload budget of the sandbox or rule (policy "
                                   "limits); refused at its head or cut off before its end went upstream"),
    "download_quota_exceeded": (429, "the download budget of the sandbox or rule (policy limits) is spent; nothing "
                                     "was sent"),
    "credential_rate_limited": (429, "the credential the rule injects was used more often than its policy limit "
                                     "allows; nothing was sent"),
    "request_head_timeout": (408, "the request head took too long to arrive"),
    "request_head_too_large": (431, "the request line and headers exceed the size limit (HTTP/2: a header block, "
                                    "encoded or decoded, passed egress_max_head_bytes; the connection was closed "
                                    "with GOAWAY ENHANCE_YOUR_CALM)"),
    "too_many_header_fields": (431, "the request head (or an HTTP/2 request's trailers) has more header fields than "
                                    "egress_max_header_fields; refused before any check or hook read it"),
    "chunk_line_too_large": (431, "an HTTP/1 chunk-size line (with its extensions) or trailer section passed "
                                  "egress_max_head_bytes; answered if the response had not started, then closed"),
    "pipeline_too_large": (431, "an HTTP/1 client sent more than twice egress_max_head_bytes ahead of a response "
                                "(pipelined); answered if the response had not started, then closed"),
    "websocket_message_too_large": (413, "a WebSocket message passed egress_max_websocket_message_bytes while "
                                          "reassembled; both sides closed with 1009 (audit and metrics only: no "
                                          "status is sent)"),
    "request_too_large": (413, "the request body exceeds body_size_limit"),
    "request_body_timeout": (408, "the request body stopped moving (no byte for egress_body_idle_timeout)"),
    "response_body_timeout": (504, "the upstream response body stopped moving; cut off if its head was sent"),
    "response_too_large": (502, "the upstream response exceeds body_size_limit (or its decoded budget), or its head "
                                "does: 256 KiB (HTTP/1), a 64 KiB HTTP/2 header block, more header or trailer "
                                "fields than egress_max_header_fields"),
    "upstream_failed": (502, "the upstream connection or TLS verification failed"),
    "resolve_failed": (502, "the host name could not be resolved"),
    "internal_error": (500, "the gateway failed while deciding; the request was refused"),
}


@dataclass
class Decision:
    allowed: bool
    reason: str
    message: str
    rule: str | None = None
    notes: list[str] = field(default_factory=list)
    would_deny: bool = False  # report mode: allowed, but the allowlist would have refused it
    retry_after: float | None = None  # a rate or budget refusal: seconds until it would pass (Retry-After)

    @property
    def verdict(self) -> str:
        """allow | deny | would_deny, as the audit log and metrics spell it."""
        return "would_deny" if self.would_deny else "allow" if self.allowed else "deny"

    @property
    def status(self) -> int:
        return REASONS[self.reason][0]

    @classmethod
    def allow(cls, rule: str, message: str = "allowed") -> "Decision":
        return cls(True, "allowed", message, rule)

    @classmethod
    def deny(cls, reason: str, message: str, rule: str | None = None, notes: list[str] | None = None,
             retry_after: float | None = None) -> "Decision":
        if reason not in REASONS:
            raise KeyError(f"unknown reason code {reason!r}")
        return cls(False, reason, message, rule, notes or [], retry_after=retry_after)

    def body(self) -> str:
        """The short text body of a refusal when the policy sets no `refusals:`: what happened,
        which reason and rule (worded, cleaned and bounded by gateway/refusal_page.py)."""
        return DEFAULT_STYLE.page(self).body.decode("utf-8")


def verdict_fields(decision: Decision, status_sent: bool = True) -> dict[str, object]:
    """The verdict keys of an audit line: `decision` (allow | deny | would_deny, `Decision.verdict`),
    `reason`, `status` (the refusal's HTTP status; null when the traffic was let through, report
    mode's would_deny included), `rule` and `message`.

    Every audit line that records a decision takes these keys from here and nowhere else, so what a
    line says is what the gateway did: a report-mode let-through is never written as `allow` (it once
    was, where transparent TLS and raw TCP lines spelled the verdict by hand). Event-only reasons
    that are not refusal codes (`redacted`, `policy_reloaded`, `policy_invalid`, a revocation's `cause`
    `passthrough_withdrawn`) have no status, and
    neither has a refusal no HTTP status could carry (`status_sent=False`: a connection closed at
    accept, a response cut off after its head was sent)."""
    status = None if decision.allowed or not status_sent else REASONS.get(decision.reason, (None,))[0]
    return {"decision": decision.verdict, "reason": decision.reason, "status": status, "rule": decision.rule,
            "message": decision.message}
