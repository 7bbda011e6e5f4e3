"""The streaming group's events and names, shared by its origin, its client and its report: an SSE event
shaped like a model API's, stamped with the time it is written."""

from __future__ import annotations

import re
import time

try:  # HTTP/2 (a dependency of mitmproxy, so normally present); without it the h2 configurations are skipped
    import h2.config
    import h2.connection
    import h2.events
    import h2.exceptions
except ImportError:  # pragma: no cover - reported as a skip
    h2 = None

from lib.names import ORIGIN_NAME, SMALL_PATH  # noqa: F401  (re-exported to the origin and client)

SECRET_ENV = "EGRESS_BENCH_SSE_KEY"
SECRET_LENGTH = 108
EVENT_TEXT = b"Sure, here is "  # pads every event to 140 bytes
SSE_HEADERS = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
PROTOCOLS = {"h1": ("http/1.1", "HTTP/1.1"), "h2": ("h2", "HTTP/2")}
KINDS = {"direct": "direct (no proxy)", "unbound": "gateway, unbound rule", "bound": "gateway, credential-bound rule"}
LATENCY_KEYS = ("direct_h1", "unbound_h1", "bound_h1", "direct_h2", "unbound_h2", "bound_h2")


def sse_event(seq: int) -> bytes:
    """One event, stamped with the time it is written (call it right before the write)."""
    return (b'data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"' + EVENT_TEXT
            + b'"},"seq":%06d,"t":%020d}\n\n' % (seq, time.monotonic_ns()))


EVENT_BYTES = len(sse_event(0))


def label(key: str) -> str:
    kind, proto = key.rsplit("_", 1)
    return f"{PROTOCOLS[proto][1]}, {KINDS[kind]}"


class StreamError(Exception):
    pass


_EVENT_RE = re.compile(rb'^data: \{.*"seq":(\d+),"t":(\d+)\}$', re.S)


def parse_event(event: bytes) -> tuple[int, int]:
    m = _EVENT_RE.match(event)
    if not m:
        raise StreamError(f"not an event of the origin: {event[:80]!r}")
    return int(m.group(1)), int(m.group(2))
