"""The body of a response to a credential-bound request, redacted (addons/response_redaction.py
plans which way): streamed chunk by chunk through `BodyRedactor` (decoded on the fly when
compressed), or buffered and then decoded (`decode_buffered`) or redacted (`redact_buffered`) in
pieces, the sandbox's turn between two. Whatever a decoder keeps is charged to the stream's buffer
account (`BUFFER_ACCOUNT`, set by addons/http_stream.py).
"""

from __future__ import annotations

import functools
import logging
import weakref

from mitmproxy import ctx, http
from mitmproxy.utils import human

from gateway.decompress import DecodedTooLarge, OverBudget, decode_pieces, window_size
from gateway.redact import Redactor, StreamRedactor
from gateway.steps import run_steps

from . import decode_pool, fair_share

BUFFER_ACCOUNT = "egress_buffer_account"  # flow.metadata key: its stream's share of the buffer ledger (http_stream.py)


def body_size_limit() -> int | None:
    return human.parse_size(ctx.options.body_size_limit) if hasattr(ctx.options, "body_size_limit") else None


REDACT_SLICE = 256 * 1024  # bytes of a buffered body redacted per turn of the event loop


async def decode_buffered(flow: http.HTTPFlow, encoding: str, limit: int, redactor: Redactor) -> tuple[bytes, list[str]]:
    """A buffered compressed body decoded in pieces (gateway/decompress.py), each charged to the
    stream's buffer budget before it is kept, each decoded on a pool thread (addons/decode_pool.py),
    and redacted as it comes (StreamRedactor: a secret across two pieces is still caught whole), the
    sandbox's turn between two: a body that decodes to tens of MiB, a brotli window that takes 50 ms
    to fill, or 28 MiB of short lines that took 0.6 s to redact in one call (a fresh-eyes review),
    does not stall every other client of the worker while it does. The redacted body, and the
    names of the secrets it held."""
    account = flow.metadata.get(BUFFER_ACCOUNT)
    data = flow.response.raw_content or b""
    window = [window_size(encoding, data)]  # what the decoder keeps meanwhile: charged too
    if account is not None and not account.reserve(window[0]):
        raise OverBudget(f"the decoder's window ({window[0]} bytes) is over the buffer budget")

    def grow(more: int) -> bool:  # a later zstd frame's bigger window (runs on a pool thread: the ledger is plain counters)
        if account is not None and not account.reserve(more):
            return False
        window[0] += more
        return True

    try:
        out, hits = bytearray(), []
        stream = StreamRedactor(redactor, on_hit=hits.extend)
        async for piece in decode_pool.pieces(decode_pieces(encoding, data, limit, (window[0], grow))):
            if account is not None and not account.reserve(len(piece)):
                raise OverBudget(f"decoded body over the buffer budget after {len(out)} bytes")
            out += stream(piece)
        out += stream(b"")
        return bytes(out), hits
    finally:
        if account is not None:
            account.release(window[0])


async def redact_buffered(data: bytes, redactor: Redactor) -> tuple[bytes, list[str]]:
    """A buffered body redacted REDACT_SLICE bytes at a time, the sandbox's turn between two."""
    if len(data) <= REDACT_SLICE:
        return redactor.redact(data)
    out, hits = bytearray(), []
    stream = StreamRedactor(redactor, on_hit=hits.extend)
    for start in range(0, len(data), REDACT_SLICE):
        out += stream(data[start:start + REDACT_SLICE])
        await fair_share.current_turn()
    out += stream(b"")
    return bytes(out), hits


class BodyRedactor:
    """Stream callable of a bound response body: decode it on the fly when it is compressed (within
    its budget, gateway/decompress.py), then redact it. Any failure (a body that does not decode,
    one over its decoded budget, an error in the redactor) cuts the body off and kills the flow:
    its headers are out, so no 502 is possible any more, and the client sees a broken response,
    never undecoded or unredacted bytes. The failure is audited with its reason."""

    def __init__(self, flow: http.HTTPFlow, redactor: StreamRedactor, decoder=None, on_failure=None,
                 encoding: str = ""):
        # The flow holds this as its stream callable: a strong reference back was a cycle that kept
        # a cut-off stream's decoder (a 16 MiB brotli window) until a full collection.
        self._flow = weakref.ref(flow)
        self.decoder = decoder
        self.encoding = encoding
        self._window: int | None = None  # the decoder's window, charged to the stream's buffer account
        self.redactor = redactor
        self.on_failure = on_failure
        self.failed = False
        self._ready: list[bytes] | None = None

    @property
    def decodes(self) -> bool:
        """Whether its chunks are decoded: the stream (addons/http_stream.py) then has `steps` driven
        off the loop (addons/decode_pool.py) and hands their output on through `ready`."""
        return self.decoder is not None and not self.failed

    def ready(self, pieces: list[bytes] | None) -> None:
        """What `steps` made for the next call (None: nobody drove it, so the body is cut off)."""
        self._ready = pieces if pieces is not None else [self._fail(RuntimeError("decode step not run"))]

    def __call__(self, chunk: bytes):
        if self._ready is not None:
            ready, self._ready = self._ready, None
            return ready
        if self.failed:
            return b""
        if self.decoder is None:
            try:
                return self.redactor(chunk)
            except Exception as exc:
                return self._fail(exc)
        return run_steps(self.steps(chunk))

    def steps(self, chunk: bytes):
        """The redacted output of one compressed chunk (b"": the body's end), sans I/O: each decoder
        call yielded for the caller to run (a pool thread: one brotli call may fill a 16 MiB
        window), the redaction of what it made done here. What a chunk decodes to is never held
        whole (up to RATIO_GRACE for a bomb) beyond the output of this one chunk."""
        out: list[bytes] = []
        if self.failed:
            return out
        try:
            if self._window is None:
                self._charge_window(chunk)
            if chunk:
                pieces = self.decoder.pieces(chunk)
                while (piece := (yield functools.partial(next, pieces, None))) is not None:
                    if piece:
                        out.append(self.redactor(piece))
            else:
                tail = yield self.decoder.flush
                out.append(self.redactor(tail) + self.redactor(b"") if tail else self.redactor(b""))
                self.drop_decoder()  # the body is over: its window goes now
        except Exception as exc:
            out.append(self._fail(exc))
        return out

    def _charge_window(self, first: bytes) -> None:
        """The decoder keeps a window the sender chose (up to 16 MiB of brotli) for the whole
        stream: charged to the stream's buffer account from its first bytes, before it decodes."""
        self._window = window_size(self.encoding, first)
        flow = self._flow()
        account = flow.metadata.get(BUFFER_ACCOUNT) if flow is not None else None
        if account is not None and not account.reserve(self._window):
            self._window = 0
            raise OverBudget(f"the decoder's window ({window_size(self.encoding, first)} bytes) is over the buffer budget")
        self.decoder.guard_window(self._window, self._grow_window)

    def _grow_window(self, more: int) -> bool:
        """A later zstd frame's bigger window, charged before its decoder is made."""
        flow = self._flow()
        account = flow.metadata.get(BUFFER_ACCOUNT) if flow is not None else None
        if account is not None and not account.reserve(more):
            return False
        self._window += more
        return True

    def drop_decoder(self) -> None:
        """The body is over, cut off or refused (also called by the stream when it ends,
        addons/http_stream.py): the decoder and its window go, and its charge with them."""
        if self.decoder is not None:
            self.decoder.close()  # (its window goes even if a step still holds the decoder)
        self.decoder = None
        flow = self._flow()
        account = flow.metadata.get(BUFFER_ACCOUNT) if flow is not None else None
        if account is not None and self._window:
            account.release(self._window)
        self._window = 0

    def _fail(self, exc: Exception) -> bytes:
        self.failed = True
        self.drop_decoder()
        too_large = isinstance(exc, DecodedTooLarge)
        reason = ("buffer_budget" if isinstance(exc, OverBudget) else
                  "response_too_large" if too_large else "undecodable_response")
        logging.getLogger("egress").warning(
            "egress gateway: the response to a credential-bound request was cut off (%s)",
            {"buffer_budget": "the decoder's window is over the buffer budget",
             "response_too_large": "decoded body over its budget"}.get(reason, type(exc).__name__))
        flow = self._flow()
        if flow is not None:
            if self.on_failure is not None:
                self.on_failure(flow, reason)
            flow.kill()
        return b""
