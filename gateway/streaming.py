"""What the gateway does with a message body: stream it, or buffer it whole. Pure: the adapters
(addons/streaming.py, addons/response_redaction.py) read headers and apply the plan.

A proxy that buffers a body of unknown length (a server-sent-event stream, a gRPC stream, a
long-poll answer) holds every event until the origin finishes, which for an agent reading a model's
answer is the same as not answering. So every body of unknown length, and every event-stream content
type whatever its declared length, streams from its first byte. Buffering is left only where it is
bounded and buys something: a small body of known length (mitmproxy buffers up to
`stream_large_bodies`, so an upstream reset half-way through is still a clean 502), and on a
credential-bound flow a small, known-length, compressed body, decoded whole so that one that does
not decode becomes a 502 instead of a cut-off stream. Everything else on a bound flow streams through
the redactor (decoded on the fly when compressed).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

# Content types whose bodies are open-ended event streams: streamed even when a length is declared
# (and, on bound flows, decoded on the fly rather than buffered).
STREAMING_TYPES = (
    "text/event-stream",
    "application/grpc",  # and application/grpc+proto, application/grpc-web...
    "application/x-ndjson",
    "application/ndjson",
    "application/jsonl",
    "application/x-jsonlines",
    "application/stream+json",
    "multipart/x-mixed-replace",
)

# Content-Encodings the gateway can decode (gateway/decompress.py), buffered or on the fly.
DECODABLE = frozenset({"gzip", "x-gzip", "deflate", "br", "zstd"})


class Plan(enum.Enum):
    NO_BODY = "no_body"              # HEAD, 1xx, 204, 304: nothing to stream
    STREAM = "stream"                # relay as it comes (unbound, length unknown or an event stream)
    SIZED = "sized"                  # unbound, known length: buffered up to stream_large_bodies, streamed above
    REDACT = "redact"                # bound, identity: stream through the redactor
    DECODE_STREAM = "decode_stream"  # bound, compressed: decode on the fly, then redact
    DECODE_BUFFERED = "decode_buffered"  # bound, compressed, small and known length: decode whole
    REFUSE = "refuse"                # bound, and the gateway cannot read the body to redact it


def is_streaming_type(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return any(media == t or media.startswith(t + "+") or media.startswith(t + "-") for t in STREAMING_TYPES)


def codings(value: str) -> list[str]:
    """A comma-separated coding list (Content-Encoding, Transfer-Encoding), lower case, no empties."""
    return [c.strip().lower() for c in value.split(",") if c.strip()]


def response_plan(*, method: str, status: int, headers: Iterable[tuple[str, str]], bound: bool,
                  buffer_limit: int | None) -> tuple[Plan, str]:
    """The plan for a response body, and why (for a refusal's message).

    `headers` are the response's (name, value) pairs as received; `buffer_limit` is the largest
    body the gateway may buffer (mitmproxy's stream_large_bodies), None for no limit."""
    if method.upper() == "HEAD" or 100 <= status < 200 or status in (204, 304):
        return Plan.NO_BODY, "no body"
    fields: dict[str, list[str]] = {}
    for name, value in headers:
        fields.setdefault(name.lower(), []).append(value)
    lengths = fields.get("content-length", [])
    known_length = len(lengths) == 1 and lengths[0].strip().isdigit()
    streaming = is_streaming_type(fields.get("content-type", [""])[0])
    if not bound:
        # A small body of known length arrives at once anyway; buffered, a reset half-way through
        # can still become a clean 502 instead of a cut-off response.
        return (Plan.SIZED, "known length") if known_length and not streaming else (Plan.STREAM, "unbounded")
    transfer = codings(",".join(fields.get("transfer-encoding", [])))
    if any(c != "chunked" for c in transfer):
        # `Transfer-Encoding: gzip, chunked` would hand the redactor compressed bytes.
        return Plan.REFUSE, f"the response uses Transfer-Encoding {', '.join(transfer)[:60]!r}"
    grpc = [c for c in codings(",".join(fields.get("grpc-encoding", []))) if c != "identity"]
    if grpc:
        # gRPC compresses message by message inside the body: the redactor would see compressed bytes.
        return Plan.REFUSE, f"the response uses grpc-encoding {', '.join(grpc)[:60]!r}"
    encoding = codings(",".join(fields.get("content-encoding", [])))
    encoding = [c for c in encoding if c != "identity"]
    if not encoding:
        return Plan.REDACT, "identity"
    if len(encoding) > 1 or encoding[0] not in DECODABLE:
        return Plan.REFUSE, f"the response uses Content-Encoding {', '.join(encoding)[:60]!r}"
    if (not streaming and not transfer and known_length
            and (buffer_limit is None or int(lengths[0]) <= buffer_limit)):
        return Plan.DECODE_BUFFERED, encoding[0]
    return Plan.DECODE_STREAM, encoding[0]


def request_streams(headers: Iterable[tuple[str, str]]) -> bool:
    """Whether a request body is streamed upstream: every body of unknown length (chunked, or HTTP/2
    DATA without content-length). Known-length bodies below stream_large_bodies stay buffered:
    mitmproxy sends them in one piece, and larger ones it streams by itself."""
    return not any(name.lower() == "content-length" for name, _ in headers)


# Fields that must not travel as trailers (RFC 9110 section 6.5.1, RFC 9113 section 8.2.2):
# framing, routing, connection control, authentication, content metadata.
FORBIDDEN_TRAILERS = frozenset({
    "transfer-encoding", "content-length", "host", "connection", "keep-alive", "te", "trailer", "upgrade",
    "proxy-connection", "proxy-authorization", "proxy-authenticate", "authorization", "set-cookie", "cookie",
    "content-encoding", "content-type", "content-range", "cache-control", "expect", "max-forwards", "pragma",
    "range", "www-authenticate", "age", "expires", "date", "location", "retry-after", "vary", "warning",
})


def forbidden_trailers(names: Iterable[str]) -> list[str]:
    """The trailer field names that must be dropped (pseudo-headers included)."""
    return [n for n in names if n.lower() in FORBIDDEN_TRAILERS or n.startswith(":")]
