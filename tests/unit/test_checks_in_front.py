"""The checks that stand in front of the method-override check in a flow's BODY_CHECK slot (the
upload budget, addons/rate_limits.py `UploadCheck`; an empty body's refusal, addons/method_body.py
`EmptyBodyCheck`) decide each piece first, and the scan behind them is driven by the stream itself
(addons/http_stream.py `_checked`): a compressed body is decoded on the decode pool and its decoders'
windows charged to the buffer budget, whatever stands in front. Before 3775d03 a check in front hid
the scan (the body was decoded on the loop, uncharged); in 3775d03 the check in front passed the
scan's interface on but had no `rule`, so a refusal for windows over the budget crashed the stream
(review 47: an HTTP/2 GET's unexpected body went upstream unrefused, an upload hung)."""

from __future__ import annotations

import asyncio
import gzip

import brotli
import pytest

from addons import decode_pool
from addons.http_stream import EgressDecodeStepsHook
from addons.method_body import BodyOverrideCheck, CheckInFront, EmptyBodyCheck
from addons.rate_limits import Charge, UploadCheck
from gateway.decision import Decision
from gateway.decompress import streaming_decoder
from gateway.methods import BodyScanner
from gateway.ratelimit import SlidingWindow

FRONT_INTERFACE = ("front", "stopped", "then", "feed", "finish", "trailers", "pending", "close")
FORM = "application/x-www-form-urlencoded"


class _Clock:
    def clock(self) -> float:
        return 1000.0


class _State:
    def __init__(self):
        self.usage = []

    def count_usage(self, *args):
        self.usage.append(args)


class _Limits:
    def __init__(self):
        self.limiter = _Clock()
        self.state = _State()


class _Account:
    """The stream's account for its decoders' windows: room for `room` bytes."""

    def __init__(self, room: int):
        self.room = room
        self.asked: list[int] = []

    def reserve(self, n: int) -> bool:
        self.asked.append(n)
        if n > self.room:
            return False
        self.room -= n
        return True


def _override_check(recorded: list, coding: str = "gzip") -> BodyOverrideCheck:
    scanner = BodyScanner.for_headers([("Content-Type", FORM), ("Content-Encoding", coding)], streaming_decoder)
    return BodyOverrideCheck(scanner, judge=lambda found: Decision.deny("method_not_allowed", "no", "r"),
                             record=lambda decision, found: recorded.append(decision.reason), bound=False, rule="r")


def _upload(then, limit: int = 1_000_000) -> UploadCheck:
    charge = Charge("s", "r", upload=[(("sandbox", "s", "r", None, None, None), SlidingWindow(limit, 60.0, 1000.0))])
    check = UploadCheck(_Limits(), None, charge, then)
    check.recorded = []
    check._record = lambda refusal: check.recorded.append(refusal.reason)  # (its audit line needs a flow)
    return check


def _empty(then, report: bool, recorded: list) -> EmptyBodyCheck:
    refusal = (Decision(True, "unexpected_body", "report mode: a body", "r", would_deny=True) if report
               else Decision.deny("unexpected_body", "a body", "r"))
    return EmptyBodyCheck(refusal, record=lambda decision, found: recorded.append(decision.reason), then=then)


@pytest.fixture
def stream(http_stream):
    return http_stream


def _checked(stream, check, data, room: int = 64 * 1024 * 1024) -> tuple[Decision | None, list, _Account]:
    """Run `_checked` as the stream does: a decode step it yields is run on the decode pool."""
    account = _Account(room)
    if stream._windows is None:
        stream._new_account = lambda: account
    steps = stream._checked(check, data)
    hooks = []
    try:
        command = next(steps)
        while True:
            assert isinstance(command, EgressDecodeStepsHook)
            hooks.append(command)
            asyncio.run(decode_pool.DecodePool().egress_decode_steps(command.step))
            command = steps.send(None)
    except StopIteration as done:
        return done.value, hooks, account


@pytest.mark.parametrize("cls", [EmptyBodyCheck, UploadCheck])
def test_a_check_in_front_has_the_front_interface(cls):
    assert issubclass(cls, CheckInFront)
    assert [name for name in FRONT_INTERFACE if not hasattr(cls, name) and name != "then"] == []


FRONTS = {
    "upload": lambda then, recorded: _upload(then),
    "empty body (report mode)": lambda then, recorded: _empty(then, True, recorded),
    "both": lambda then, recorded: _upload(_empty(then, True, recorded)),
}


@pytest.mark.parametrize("front", list(FRONTS))
def test_behind_a_check_in_front_the_body_is_decoded_on_the_pool_and_its_windows_charged(stream, front):
    recorded = []
    check = FRONTS[front](_override_check(recorded), recorded)
    refusal, hooks, account = _checked(stream, check, gzip.compress(b"_method=DELETE"))
    assert refusal is None and len(hooks) == 1 and account.asked and account.asked[0] > 0
    refusal, hooks, _ = _checked(stream, check, None)  # the value ends with the body
    assert len(hooks) == 1 and refusal is not None and refusal.reason == "method_not_allowed"
    assert recorded[-1] == "method_not_allowed"


@pytest.mark.parametrize("front", list(FRONTS))
def test_behind_a_check_in_front_decoders_over_the_budget_are_refused_not_crashed(stream, front):
    recorded = []
    check = FRONTS[front](_override_check(recorded, "br"), recorded)
    body = brotli.compress(b"a=1&b=2", lgwin=24)  # a 16 MiB window
    refusal, hooks, account = _checked(stream, check, body, room=4 * 1024 * 1024)
    assert refusal is not None and refusal.reason == "buffer_budget" and refusal.rule == "r", refusal
    assert hooks == [] and recorded[-1] == "buffer_budget"


def test_an_unexpected_body_is_refused_before_its_decoders_are_charged(stream):
    recorded = []
    check = _empty(_override_check(recorded, "br"), False, recorded)
    refusal, hooks, account = _checked(stream, check, brotli.compress(b"a=1", lgwin=24), room=4 * 1024 * 1024)
    assert refusal is not None and refusal.reason == "unexpected_body"
    assert hooks == [] and account.asked == [] and recorded == ["unexpected_body"]
    assert _checked(stream, check, b"more")[0] is None and recorded == ["unexpected_body"]  # refused once


def test_the_upload_budget_refuses_before_any_window_or_decoding(stream):
    recorded = []
    check = _upload(_override_check(recorded), limit=10)
    refusal, hooks, account = _checked(stream, check, gzip.compress(b"a=" + b"x" * 100))
    assert refusal is not None and refusal.reason == "upload_quota_exceeded"
    assert hooks == [] and account.asked == [] and recorded == [] and check.recorded == ["upload_quota_exceeded"]
    assert _checked(stream, check, b"more")[0] is None  # refused: nothing more is checked


def test_trailers_behind_a_report_mode_empty_body_are_not_body_bytes():
    """Review 47: the word "trailers" was fed to the scan behind, so `_method=GE` read as GETRAILERS."""
    recorded = []
    inner = _override_check(recorded, "identity")
    check = _empty(inner, True, recorded)
    assert check.feed(b"a=1&_method=GE") is None
    assert check.trailers() is None
    refusal = check.finish()
    assert recorded[0] == "unexpected_body"
    assert refusal is not None and [o.method for o in inner.found] == ["GE"]


def test_a_refusing_empty_body_check_refuses_once():
    recorded = []
    check = _empty(None, False, recorded)
    assert check.feed(b"x").reason == "unexpected_body" and check.feed(b"y") is None and check.finish() is None
    assert recorded == ["unexpected_body"]
