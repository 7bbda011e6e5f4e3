"""Request bodies an origin may not read, and the upstream connections they can desynchronise.

An HTTP/1.1 connection's framing is only as good as both ends' reading of it. A `GET` with
`Content-Length: 87` is framed correctly by the gateway, but an origin that ignores bodies on GET
(many do, and CDN edges are shared by tenants) reads those 87 bytes as the next request on the
connection: a request naming a host the policy never allowed, arriving at the allowed host's
server (the CL.0 desync). Two rules close that family:

1. **No body where the method defines none.** GET, HEAD, OPTIONS, DELETE and TRACE carry no body
   unless the rule that allows them says `allow_body: true` (`body_refusal`). A request that
   declares one (any `Transfer-Encoding`, a `Content-Length` above 0) is refused at its head, before
   the upstream connection opens: 400 `unexpected_body`. An HTTP/2 request whose length is not
   declared (HEADERS without END_STREAM, no content-length) is judged when its DATA arrives: the
   first byte of body refuses it (`Framing.UNKNOWN`), and until then nothing of it goes upstream.
2. **An upstream HTTP/1 connection is reused only after an exchange that cannot have left bytes
   behind** (`UpstreamExchange`). Any request body at all (the origin may have ignored it: a POST to
   a static file is the classic), a response that arrived before the request body was sent (the
   origin stopped reading), an interim 1xx response (mitmproxy would take it for the final one):
   each ends the connection after its response, so whatever the origin reads next, its answer can
   never be handed to another request. HTTP/2 upstreams frame every stream, and mitmproxy already
   uses an HTTP/1 upstream of an HTTP/2 client for one request only.

Pure: the HTTP layers (addons/layers.py, addons/http1.py) drive it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

# Methods whose semantics define no request body (RFC 9110 sections 9.3.1-9.3.5, 9.3.7-9.3.8).
BODYLESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE", "TRACE", "CONNECT"})

# More interim (1xx) responses than this before the final one is a protocol error (502).
MAX_INTERIM_RESPONSES = 16


class Framing(enum.Enum):
    """What a request's head says about its body."""

    NONE = "none"  # no body: no Transfer-Encoding, Content-Length absent or 0, or END_STREAM
    DECLARED = "declared"  # a Transfer-Encoding, or a Content-Length above 0
    UNKNOWN = "unknown"  # HTTP/2 without END_STREAM or content-length: the DATA frames will say


def request_framing(headers: Iterable[tuple[str, str]], end_stream: bool | None = None) -> Framing:
    """The body a request head announces. `end_stream`: whether the head ended the message (None:
    not known, judged from the fields as HTTP/1 frames them)."""
    for name, value in headers:
        lower = name.lower()
        if lower == "transfer-encoding":
            return Framing.DECLARED
        # Every Content-Length counts (an origin may read any of them), and one that is not plainly
        # 0 is a body of some length. Also with END_STREAM: an HTTP/2 head that declares a length it
        # does not send would leave an HTTP/1 origin reading the next request's bytes as this body.
        if lower == "content-length" and not _is_zero(value):
            return Framing.DECLARED
    if end_stream or end_stream is None:
        return Framing.NONE
    return Framing.UNKNOWN


def _is_zero(value: str) -> bool:
    digits = value.strip()
    return digits.isascii() and digits.isdigit() and int(digits) == 0


def needs_allow_body(method: str, framing: Framing) -> bool:
    """Whether only a rule with `allow_body: true` may allow this request as far as its head shows."""
    return framing is Framing.DECLARED and method.upper() in BODYLESS_METHODS


def must_stay_empty(method: str, framing: Framing, allow_body: bool) -> bool:
    """Whether a request its rule allowed must still prove, as its DATA arrives, that it has no body."""
    return framing is Framing.UNKNOWN and method.upper() in BODYLESS_METHODS and not allow_body


def body_refusal_text(method: str, rule_id: str | None = None) -> str:
    where = f"rule {rule_id} does not set allow_body: true" if rule_id else "no rule sets allow_body: true"
    return (f"{method.upper()} defines no request body and {where}: an origin that ignores it would read it "
            "as the next request on the connection")


@dataclass
class UpstreamExchange:
    """One request and its response on an upstream HTTP/1 connection: what says the connection
    may not carry another request (sans-I/O; fed by the HTTP/1 client layer)."""

    body_bytes: int = 0
    body_framed: bool = False
    request_done: bool = False
    early_response: bool = False
    interim: int = 0

    def request_head(self, framing: Framing) -> None:
        self.body_framed = framing is not Framing.NONE

    def request_data(self, size: int) -> None:
        self.body_bytes += size

    def request_end(self) -> None:
        self.request_done = True

    def response_head(self, status: int) -> None:
        """An interim (1xx, not 101) or the final response's head arrived."""
        if 100 <= status < 200 and status != 101:
            self.interim += 1
        elif not self.request_done:
            self.early_response = True

    @property
    def too_many_interim(self) -> bool:
        return self.interim > MAX_INTERIM_RESPONSES

    def single_use_reason(self) -> str | None:
        """Why the connection must end after this exchange, or None when it may be reused."""
        if self.early_response:
            return "the response arrived before the request body was sent"
        if self.body_bytes or self.body_framed:
            return "the request had a body the origin may not have read"
        if self.interim:
            return "the origin sent an interim (1xx) response"
        return None
