"""Method overrides in request bodies: a form field or JSON key `_method` (gateway/methods/).

The head of a request is decided in `requestheaders`, before its body exists. A POST its rule
allows may still carry `_method=DELETE` in a form body, which Rails, Laravel, Symfony, Spring and
others execute as a DELETE. So every allowed request whose body a framework could read fields from
(urlencoded, multipart, JSON, or no Content-Type at all) gets a `BodyOverrideCheck` in its flow's
metadata, and the gateway's HTTP stream (addons/http_stream.py `GatewayHttpStream`) feeds it the body as
it arrives, before any of it is sent on:

- a **buffered** body (known length up to `stream_large_bodies`) is checked whole before the
  upstream connection is even opened: a refusal leaves no trace upstream;
- a **streamed** body (unknown length, or larger) is checked chunk by chunk, each chunk before it
  is sent on; while what has arrived ends inside an override field (its value not terminated yet),
  the last byte is held back, since only the end of the body can settle it. A refusal therefore
  always comes before the body is complete upstream: it resets the upstream stream (closes the
  HTTP/1 connection) and the origin never has a whole request to act on. The head and the start
  of the body did go upstream.

A body the scanner cannot read every way some framework might (a charset the gateway does not
know, a Content-Encoding that does not decode, a multipart header block past its cap; see
`BodyScanner.problem`) is refused the same way, `method_not_allowed`, saying it could not be
checked: failing closed, since what the origin makes of it is not knowable.

A refusal is 403 `method_not_allowed` to the client (or `method_forbidden` for TRACE/TRACK/CONNECT)
and one audit line, event `request_body`, with `method_override` saying which field. On a rule in
report mode the override is logged `would_deny` and the body goes on, except on a rule that injects
credentials: the credential is already in the request, and report mode never lets a credential go
with a request the allowlist refuses. A check that fails (a bug) refuses the body: 500
`internal_error`, like every other decision hook (fail closed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gateway.decision import Decision
from gateway.decompress import OverBudget, window_size
from gateway.methods import MAX_ELEMENTS, BodyScanner, BodyTooLarge, Override
from gateway.steps import run_steps

BODY_CHECK = "egress_body_check"  # flow.metadata key


def enforced_if_bound(decision: Decision, bound: bool) -> Decision:
    """A report-mode refusal of a body found after the head was allowed: on a rule that injects a
    credential the credential is already in the request, and report mode never lets a credential go
    with a request the allowlist refuses."""
    if not (decision.would_deny and bound):
        return decision
    return Decision(False, decision.reason, decision.message.removeprefix("report mode: ")
                    + " (report mode does not apply: the request carries the rule's credential)",
                    decision.rule, decision.notes)


class BodyOverrideCheck:
    """Fed the request body (`feed`, then `finish` at its end); returns the refusal to send, once."""

    def __init__(self, scanner: BodyScanner, judge: Callable[[list[Override]], Decision | None],
                 record: Callable[[Decision, list[Override]], None], bound: bool, rule: str | None = None,
                 stale: Callable[[], bool] = lambda: False):
        self.rule = rule  # the rule that allowed the head: refusals name it
        self.stale = stale  # True after a reload: what the body named so far is judged again
        self.found: list[Override] = []  # distinct, in order
        self._seen: dict[Override, None] = {}
        self.scanner = scanner
        self.judge = judge
        self.record = record
        self.bound = bound
        self.done = False

    def feed(self, data: bytes) -> Decision | None:
        return self.settle(run_steps(self.scan(data)))

    def finish(self) -> Decision | None:
        return self.settle(run_steps(self.scan(None)), last=True)

    def close(self) -> None:
        """The body is over: its decoders go (the check itself may live on with the flow)."""
        self.scanner.close()

    def trailers(self) -> Decision | None:
        """Trailer fields carry no `_method` a framework reads."""
        return None

    @property
    def pending(self) -> bool:
        """Whether the end of the body could still bring a refusal (see BodyScanner.pending)."""
        return not self.done and self.scanner.pending

    @property
    def decodes(self) -> bool:
        """Whether the body is decoded to be scanned: its decoder calls then run off the event
        loop (addons/decode_pool.py `drive`)."""
        return bool(self.scanner.decoders)

    def windows(self, first: bytes, grow: Callable[[int], bool]) -> int:
        """The memory its decoders keep for the whole body (gateway/decompress.py `window_size`):
        the outermost coding's from the body's first bytes, each inner one's the most it may be. A
        later zstd frame of the outermost coding that needs more asks `grow` first."""
        decoders = self.scanner.decoders
        sizes = [window_size(getattr(d, "coding", ""), first if i == 0 else b"") for i, d in enumerate(decoders)]
        if decoders and hasattr(decoders[0], "guard_window"):
            decoders[0].guard_window(sizes[0], grow)
        return sum(sizes)

    def scan(self, data: bytes | None):
        """The scanner's part of a step, `data` or the body's end (None), in steps
        (BodyScanner.feed_steps: each decoder call yielded for the caller to run); returns what it
        found, or the error it raised. It judges and records nothing: `settle` does, on the loop."""
        if self.done:
            return ("done", None)
        try:
            steps = self.scanner.feed_steps(data) if data is not None else self.scanner.finish_steps()
            return ("found", (yield from steps))
        except BodyTooLarge as exc:
            return ("too_large", exc)
        except OverBudget as exc:
            return ("over_budget", exc)
        except Exception as exc:
            return ("error", exc)

    def settle(self, outcome: tuple[str, object], last: bool = False) -> Decision | None:
        """Judge what a `scan` found: the refusal to send, once (None: the body goes on). `last`:
        the step was the body's end, so its decoders go."""
        try:
            return self._settle(outcome)
        finally:
            if last:
                self.scanner.close()

    def _settle(self, outcome: tuple[str, object]) -> Decision | None:
        kind, value = outcome
        if self.done or kind == "done":
            return None
        try:
            if kind == "error":
                raise value
            return self._judge(kind, value)
        except Exception as exc:  # fail closed: a body that could not be checked does not go on
            logging.getLogger("egress").error("egress gateway: the request body check failed", exc_info=exc)
            self.done = True
            refusal = Decision.deny("internal_error", "the gateway failed while checking the request body for "
                                                      "method overrides; its end was not sent", self.rule)
            try:
                self.record(refusal, [])
            except Exception:
                logging.getLogger("egress").exception("egress gateway: could not record a refusal")
            return refusal

    def _judge(self, kind: str, value) -> Decision | None:
        if kind == "over_budget":
            return self._refuse(Decision.deny(
                "buffer_budget", f"the compressed request body's decoders would keep more than the buffer budget "
                                 f"allows ({value}); its end was not sent", self.rule), [])
        if kind == "too_large":
            return self._refuse(Decision.deny(
                "request_too_large", f"the compressed request body decodes to too much to be checked for method "
                                     f"overrides ({value}); its end was not sent", self.rule), [])
        found = value
        if (why := self.scanner.problem) is not None:  # a body the gateway cannot read every way a server may
            return self._refuse(Decision.deny(
                "method_not_allowed", f"the request body could not be checked for method overrides: {why}; "
                                      f"its end was not sent", self.rule), found)
        new = [o for o in dict.fromkeys(found) if o not in self._seen]  # a repeat was judged already
        if new and len(self.found) + len(new) > MAX_ELEMENTS:  # as for a header: past 64, one naming none
            past = new[MAX_ELEMENTS - len(self.found)] if len(self.found) < MAX_ELEMENTS else new[0]
            new = new[:max(0, MAX_ELEMENTS - len(self.found))] + [Override(past.source, past.name, None)]
        self._seen.update(dict.fromkeys(new))
        self.found.extend(new)
        if not self.found or not (new or self.stale()):
            return None
        decision = self.judge(self.found)
        if decision is None:
            return None
        return self._refuse(enforced_if_bound(decision, self.bound), self.found)

    def refuse(self, decision: Decision) -> Decision | None:
        """Refuse the body for a reason of the stream's own (its decoders over the buffer budget),
        recorded like the check's own refusals; None if the check already ended."""
        if self.done:
            return None
        return self._refuse(decision, [])

    def _refuse(self, decision: Decision, found: list[Override]) -> Decision | None:
        self.done = True
        self.scanner.close()
        self.record(decision, found)
        return None if decision.allowed else decision


class CheckInFront:
    """A check that stands in front of the method-override check in the BODY_CHECK slot (an upload
    budget, an empty body's refusal): it decides each piece of the body first (`front`), on the
    loop, and what it lets on goes to the check behind it (`then`). addons/http_stream.py `_checked`
    asks each check in front, then hands the piece to the scan behind them, which it drives itself:
    a body decoded to be scanned is decoded off the event loop and its decoders' windows charged
    to the buffer budget whatever stands in front (before, a check in front hid the scan's
    interface: behind it, a compressed body was decoded on the loop, uncharged). `feed` and
    `finish` do the same in one call, for callers with no decode pool."""

    then = None  # the check behind it, or None

    def front(self, data: bytes | None) -> Decision | None:
        """Its own decision on a piece of the body (None: the body's end): the refusal, or None."""
        raise NotImplementedError

    @property
    def stopped(self) -> bool:
        """It refused the body: nothing more is checked."""
        raise NotImplementedError

    def feed(self, data: bytes) -> Decision | None:
        if (refusal := self.front(data)) is not None:
            return refusal
        if self.stopped or self.then is None:
            return None
        return self.then.feed(data)

    def close(self) -> None:
        if self.then is not None and hasattr(self.then, "close"):
            self.then.close()


class EmptyBodyCheck(CheckInFront):
    """An HTTP/2 GET, HEAD, OPTIONS or DELETE whose head did not say whether a body follows
    (gateway/bodies.py `Framing.UNKNOWN`) and whose rule does not set allow_body: the body is held
    (never streamed) and its first byte refuses the request, 400 `unexpected_body`, before anything
    of it goes upstream. Same interface as `BodyOverrideCheck`, in the same metadata slot."""

    def __init__(self, refusal: Decision, record: Callable[[Decision, list[Override]], None],
                 then: BodyOverrideCheck | None = None):
        self.refusal = refusal
        self.record = record
        self.then = then  # a report-mode refusal lets the body on: it is still checked for overrides
        self.seen = False

    @property
    def stopped(self) -> bool:
        return self.seen and not self.refusal.allowed  # refused already: nothing more is read

    def front(self, data: bytes | None) -> Decision | None:
        if data and not self.seen:
            self.seen = True
            try:
                self.record(self.refusal, [])
            except Exception:
                logging.getLogger("egress").exception("egress gateway: could not record a refusal")
            if not self.refusal.allowed:
                return self.refusal
        return None

    def finish(self) -> Decision | None:
        if self.seen and not self.refusal.allowed:
            return None
        return self.then.finish() if self.then is not None else None

    def trailers(self) -> Decision | None:
        """Trailers with no DATA are a body too: translated to HTTP/1.1 they need chunked framing,
        and the trailer block after the last chunk is bytes an origin that ignores the body reads as
        the next request. They are not body bytes for the check behind (review 47: report mode fed
        it the word "trailers", which made `_method=GE` read as GETRAILERS, or a gzip body fail to
        decode)."""
        if (refusal := self.front(b"trailers")) is not None:
            return refusal
        if self.stopped or self.then is None:
            return None
        return self.then.trailers()

    @property
    def pending(self) -> bool:
        return self.then.pending if self.then is not None else False

