"""Per-connection HTTP/2 budgets, as plain state machines (no I/O, no mitmproxy): the gateway's
HTTP/2 server (addons/http2_server.py `GatewayHttp2Server`) feeds them what the client does and acts on
their answers.

- `ResetTracker`: streams reset on one connection (by the client's RST_STREAM, or refused by the
  gateway) in a sliding window. Over the threshold the connection is closed with GOAWAY
  ENHANCE_YOUR_CALM: the CVE-2023-44487 "rapid reset" class, where a client opens and cancels
  streams faster than a server can drop the work each one started. The default, 200 in 10 s, is
  in the range others chose: nginx (1.25.3) refuses new streams past 2 x max_concurrent_streams
  per read; Go's x/net/http2 closes with ENHANCE_YOUR_CALM once more than 4 x MaxConcurrentStreams
  handlers wait (`too_many_early_resets`); Envoy (1.27.1) closes a connection once more than 50%
  of at least 500 streams were reset within 1 s of opening; Node.js rate-limits incoming
  RST_STREAM with a token bucket of 1,000 (burst) and 33 per second. A browser or an agent that
  cancels a request now and then stays far below it.
- `RefusalAggregator`: one audit line per connection per interval and reason for refusals that a
  client can provoke at will (a refused stream costs it one HEADERS frame): the first in each
  interval is written at once, the rest are counted and written as one line with `repeated`.
- `ControlFrameTracker`: frames that carry no request (PING, SETTINGS, PRIORITY, frames of an
  unknown type, empty DATA without END_STREAM, WINDOW_UPDATE beyond what the gateway's own DATA
  explains) in a sliding window; over the threshold the connection is closed with GOAWAY
  ENHANCE_YOUR_CALM (`control_frame_flood`). Each costs mitmproxy tens of microseconds and an
  unknown one a log line, with no request to refuse: 546,075 nine-byte frames in 3 s burned
  27.7 s of CPU and stalled other sandboxes for 6-30 s. The default, 1,000 in 10 s, follows
  Node.js (`maxSessionInvalidFrames` 1,000) and Envoy (`max_outbound_control_frames` 1,000,
  `max_inbound_window_update_frames_per_data_frame_sent` 10); nginx closes a connection whose
  bytes are more than 8 x its payload bytes + 1 MiB ("http2 flood detected"). A browser sends a
  handful (SETTINGS, a WINDOW_UPDATE, a few PRIORITY and PING frames) per connection; the
  WINDOW_UPDATEs a reading client sends for its downloads are earned by the DATA frames it got.
- `BufferLedger`: request-body bytes held in memory per connection (bodies mitmproxy buffers until
  their end, and bytes queued for a stream whose head is still being decided). A stream whose next
  DATA frame would take the sum past the budget is refused instead of the sum growing.
- `Backlog`: the events parsed from a client's reads and not handled yet, in order, handled a step
  of the event loop at a time (so many new requests a step, and no more once the step's time is
  spent), with the body bytes they carry, which are charged to the buffer budget while they wait;
  past the budget the streams whose DATA waits are taken out of it, heaviest first, and refused.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

DEFAULT_MAX_CONCURRENT_STREAMS = 100  # what h2 (and so mitmproxy) advertised; nginx 128, Go 250
DEFAULT_MAX_RESETS = 200
DEFAULT_RESET_WINDOW = 10.0  # seconds
DEFAULT_MAX_BUFFERED_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_CONTROL_FRAMES = 1000
CONTROL_WINDOW = 10.0  # seconds
WINDOW_UPDATES_PER_DATA_FRAME = 2  # one for the stream, one for the connection
AGGREGATE_INTERVAL = 1.0  # seconds: at most one audit line per connection, reason and interval


class ResetTracker:
    """Counts resets over the last `window` seconds; `note` answers whether the limit is passed.

    Memory is O(limit): only the last `limit` timestamps matter to a sliding window of `limit`."""

    def __init__(self, limit: int = DEFAULT_MAX_RESETS, window: float = DEFAULT_RESET_WINDOW):
        self.limit = max(0, int(limit))
        self.window = float(window)
        self._times: collections.deque[float] = collections.deque(maxlen=self.limit + 1 if self.limit else 1)
        self.total = 0

    def note(self, now: float) -> bool:
        """One more reset at `now` (monotonic seconds). True: more than `limit` in `window`."""
        self.total += 1
        if not self.limit:  # 0: no limit
            return False
        self._times.append(now)
        return len(self._times) > self.limit and now - self._times[0] <= self.window

    def recent(self, now: float) -> int:
        return sum(1 for t in self._times if now - t <= self.window)


class ControlFrameTracker:
    """Frames that carry no request, per connection. `control(now)` counts one; `window_update(now)`
    counts one only when the DATA frames sent so far (`data_sent()`) do not explain it. Both answer
    whether the limit (`limit` in `window` seconds; 0: none) is passed."""

    def __init__(self, limit: int = DEFAULT_MAX_CONTROL_FRAMES, window: float = CONTROL_WINDOW):
        self.window_frames = ResetTracker(limit, window)
        self.credit = 0

    @property
    def limit(self) -> int:
        return self.window_frames.limit

    @property
    def total(self) -> int:
        return self.window_frames.total

    def data_sent(self, frames: int = 1) -> None:
        self.credit += WINDOW_UPDATES_PER_DATA_FRAME * frames

    def control(self, now: float) -> bool:
        return self.window_frames.note(now)

    def window_update(self, now: float) -> bool:
        if self.credit > 0:
            self.credit -= 1
            return False
        return self.control(now)


@dataclass
class _Pending:
    started: float
    suppressed: int = 0


class RefusalAggregator:
    """Which refusals get their own audit line. `note(reason, now)` returns the count the line
    written now stands for (1 plus what was held back from the previous interval), or None when
    this one is only counted; `flush()` returns what is still held back (at connection close)."""

    def __init__(self, interval: float = AGGREGATE_INTERVAL):
        self.interval = interval
        self._pending: dict[str, _Pending] = {}

    def note(self, reason: str, now: float) -> int | None:
        pending = self._pending.get(reason)
        if pending is not None and now - pending.started < self.interval:
            pending.suppressed += 1
            return None
        held = pending.suppressed if pending is not None else 0
        self._pending[reason] = _Pending(now)
        return 1 + held

    def due(self, now: float) -> dict[str, int]:
        """Held-back counts whose interval has ended (to write on a timer), removed from here."""
        out = {}
        for reason, pending in list(self._pending.items()):
            if now - pending.started >= self.interval:
                if pending.suppressed:
                    out[reason] = pending.suppressed
                del self._pending[reason]
        return out

    @property
    def held_back(self) -> bool:
        """Whether some refusal is counted but not written yet."""
        return any(p.suppressed for p in self._pending.values())

    def flush(self) -> dict[str, int]:
        out = {reason: p.suppressed for reason, p in self._pending.items() if p.suppressed}
        self._pending.clear()
        return out


@dataclass
class BufferLedger:
    """Bytes held per stream, against one budget for the connection (0: no budget). O(1) a call:
    it is asked for every DATA frame (review 15: a sum over the streams, and a sweep of them, per
    frame made 9,000 one-byte frames over 100 streams cost the loop ~1.3 s)."""

    budget: int = DEFAULT_MAX_BUFFERED_BYTES
    held: dict[int, int] = field(default_factory=dict)
    total: int = 0

    def admit(self, stream_id: int, size: int) -> bool:
        """Hold `size` more bytes for the stream if the budget allows; False (nothing held) if not."""
        if self.budget and self.total + size > self.budget:
            return False
        self.held[stream_id] = self.held.get(stream_id, 0) + size
        self.total += size
        return True

    def release(self, stream_id: int) -> None:
        self.total -= self.held.pop(stream_id, 0)


class Backlog:
    """Events parsed and not handled yet, in order. `step()` hands them out one at a time, each
    taken off as it goes, and ends the step once `streams_per_step` of them opened a request, or
    once `step_seconds` were spent in it (checked after each event is handled: a request is
    decided then, ~0.3-1 ms; a DATA frame costs tens of µs), while events are left for a later step. `bytes` is what `size` says the
    waiting events carry (their DATA). `opens(event)`: whether the event opens a request."""

    def __init__(self, size: Callable[[object], int], opens: Callable[[object], bool],
                 streams_per_step: int, step_seconds: float, clock: Callable[[], float] = time.perf_counter):
        self._events: collections.deque = collections.deque()
        self._size, self._opens, self._clock = size, opens, clock
        self.streams_per_step = streams_per_step
        self.step_seconds = step_seconds
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator:
        return iter(self._events)

    def extend(self, events: Iterable) -> None:
        events = list(events)
        self._events.extend(events)
        self.bytes += sum(self._size(e) for e in events)

    def clear(self) -> None:
        self._events.clear()
        self.bytes = 0

    def take_heaviest(self, need: int, stream: Callable[[object], int | None]) -> list[tuple[int, list]]:
        """Take out the streams whose waiting events carry the most bytes, heaviest first, until
        at least `need` bytes are gone (or no stream carries any): each with its events, which
        keep their order, as do the rest. One pass to weigh and one to take, whatever the number
        of streams taken (review 15: `heaviest` then `take_stream` per stream was quadratic,
        1.9 s for 20,000 events of 300 streams)."""
        carried: dict[int, int] = {}
        for event in self._events:
            if (size := self._size(event)) and (stream_id := stream(event)):
                carried[stream_id] = carried.get(stream_id, 0) + size
        chosen: dict[int, list] = {}
        gone = 0
        for stream_id in sorted(carried, key=carried.__getitem__, reverse=True):
            if gone >= need:
                break
            chosen[stream_id] = []
            gone += carried[stream_id]
        if not chosen:
            return []
        kept: collections.deque = collections.deque()
        for event in self._events:
            taken = chosen.get(stream(event))
            (kept if taken is None else taken).append(event)
        self._events = kept
        self.bytes -= gone
        return list(chosen.items())

    def step(self) -> Iterator:
        opened = 0
        began = self._clock()
        while self._events:
            event = self._events.popleft()
            self.bytes -= self._size(event)
            yield event
            if self._opens(event):
                opened += 1
                if self._events and opened >= self.streams_per_step:
                    return
            # After every event, not only requests: a read of ~6,500 one-byte DATA frames
            # rotating over streams (nothing merged them) was one step of ~1 s (review 15).
            if self._events and self._clock() - began >= self.step_seconds:
                return
