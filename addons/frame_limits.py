"""Small frames a sandbox sends: one token bucket per sandbox for the units a protocol lets a client
make as small as it likes.

Every other budget counts bytes, messages or control frames, and each tiny unit passes all of them,
yet costs the gateway a fixed amount of work however few bytes it carries: an HTTP/2 DATA frame of
one byte, an HTTP/1 chunk of one byte, a WebSocket frame or message of one byte, a WebSocket ping.
A fresh-eyes review measured what that buys an attacker on one worker: 588,000 one-byte HTTP/2
DATA frames in 3.6 s cost 12.6 s of CPU; 620,000 one-byte chunks, and 590,000 WebSocket pings in
2 s, each served no other sandbox's request for the duration (30 s for the pings).

Here each such unit from a sandbox whose payload is under `egress_small_frame_bytes` takes tokens
(by what it costs: FRAME_COST and the rest below) from its sandbox's bucket (`egress_max_small_frames_per_second_per_sandbox`, burst
`egress_small_frame_burst_per_sandbox`); a unit that finds the bucket empty ends the connection
that carried it, with one audit line, `small_frame_flood`: HTTP/2 GOAWAY ENHANCE_YOUR_CALM,
WebSocket close 1008 to both sides, HTTP/1 429 (or the connection cut, once the answer started).
Units of that size or more are free: their cost is proportionate to their bytes, like any upload.
The layers also merge what one read brought (HTTP/1 chunks, a stream's HTTP/2 DATA frames, a
WebSocket message's fragments), so a legitimate client that writes small pieces costs one event per
read past the parser, not one per piece.

Upstreams are not metered: the policy chose them, and their framing (an SSE or market-data stream
of small events) is what the sandbox asked for.
"""

from __future__ import annotations

from collections.abc import Hashable

from mitmproxy import ctx, exceptions

from gateway.options import DEFAULT_SMALL_FRAMES_PER_SECOND, DEFAULT_SMALL_FRAME_BURST, DEFAULT_SMALL_FRAME_BYTES
from gateway.ratelimit import BucketTable, parse_rate

from .options import declare

# A token is about 15 µs of a worker's time, measured per unit on one worker: an HTTP/1 chunk or a
# WebSocket continuation frame ~15 µs, an HTTP/2 DATA frame ~30 µs, a WebSocket ping ~150 µs (relayed,
# and its pong relayed back), a whole WebSocket message ~600 µs (every addon's websocket_message
# hook, then its own frame upstream).
FRAME_COST = 1
H2_FRAME_COST = 2
PING_COST = 10
MESSAGE_COST = 40

_table = BucketTable(DEFAULT_SMALL_FRAMES_PER_SECOND, DEFAULT_SMALL_FRAME_BURST)
_small_bytes = DEFAULT_SMALL_FRAME_BYTES


def small(size: int) -> bool:
    """Whether a unit of `size` payload bytes is metered."""
    return size < _small_bytes


def take(key: Hashable, count: int = 1) -> bool:
    """Take `count` tokens for the sandbox `key`: False when its bucket is empty (the unit that
    asked ends its connection). Never fails open on a bad key: a key is only hashed."""
    return not _table.take(key, count)


def describe() -> str:
    return (f"more than {_table.rate:g} frames under {_small_bytes} bytes a second from one sandbox "
            f"(burst {_table.burst:g})")


class FrameLimits:
    """Declares the options; the layers (addons/http1_server.py, addons/http2_server.py,
    addons/websocket_limits.py) ask `take`."""

    def load(self, loader) -> None:
        declare(
            loader,
            "egress_max_small_frames_per_second_per_sandbox",
            "egress_small_frame_burst_per_sandbox",
            "egress_small_frame_bytes",
        )

    def configure(self, updated: set[str]) -> None:
        global _small_bytes
        names = {"egress_max_small_frames_per_second_per_sandbox", "egress_small_frame_burst_per_sandbox"}
        if updated & names:
            try:
                rate = parse_rate(ctx.options.egress_max_small_frames_per_second_per_sandbox)
            except ValueError as exc:
                raise exceptions.OptionsError(f"egress_max_small_frames_per_second_per_sandbox: {exc}") from None
            burst = ctx.options.egress_small_frame_burst_per_sandbox
            if burst < 0:
                raise exceptions.OptionsError("egress_small_frame_burst_per_sandbox must be >= 0")
            _table.configure(rate, burst)
        if "egress_small_frame_bytes" in updated:
            if ctx.options.egress_small_frame_bytes < 0:
                raise exceptions.OptionsError("egress_small_frame_bytes must be >= 0")
            _small_bytes = ctx.options.egress_small_frame_bytes
