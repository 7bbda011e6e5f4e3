"""The checks that stand in front of the method-override check in a flow's BODY_CHECK slot (the
upload budget, addons/rate_limits.py `UploadCheck`; an empty body's refusal, addons/method_body.py
`EmptyBodyCheck`) hand on the whole interface: behind either, a compressed body is still decoded
on the decode pool, its decoders' windows asked for (to be charged), and its decoders dropped with
the stream. Before, they had only feed/finish: addons/http_stream.py `_checked` found no `decodes`
and decoded the body on the event loop, uncharged."""

from __future__ import annotations

import asyncio
import gzip

import pytest

from addons import decode_pool
from addons.method_body import BodyOverrideCheck, CheckInFront, EmptyBodyCheck
from addons.rate_limits import Charge, UploadCheck
from gateway.decision import Decision
from gateway.decompress import streaming_decoder
from gateway.methods import BodyScanner
from gateway.ratelimit import SlidingWindow

INTERFACE = ("feed", "finish", "trailers", "pending", "decodes", "windows", "scan", "settle", "refuse", "close")


class _Clock:
    def clock(self) -> float:
        return 1000.0


class _State:
    def __init__(self):
        self.usage = []
        self.connections = {}

    def count_usage(self, *args):
        self.usage.append(args)


class _Limits:
    def __init__(self):
        self.limiter = _Clock()
        self.state = _State()


def _override_check(recorded: list) -> BodyOverrideCheck:
    scanner = BodyScanner.for_headers([("Content-Type", "application/x-www-form-urlencoded"),
                                       ("Content-Encoding", "gzip")], streaming_decoder)
    return BodyOverrideCheck(scanner, judge=lambda found: Decision.deny("method_not_allowed", "no", "r"),
                             record=lambda decision, found: recorded.append(decision.reason), bound=False, rule="r")


def _upload(then, limit: int = 1_000_000) -> UploadCheck:
    charge = Charge("s", "r", upload=[(("sandbox", "s", "r", None, None, None), SlidingWindow(limit, 60.0, 1000.0))])
    check = UploadCheck(_Limits(), None, charge, then)
    check._record = lambda refusal: None  # (its audit line needs a flow: not what is tested here)
    return check


def _report_mode_empty(then) -> EmptyBodyCheck:
    would = Decision(True, "unexpected_body", "report mode: a body", "r", would_deny=True)
    return EmptyBodyCheck(would, record=lambda decision, found: None, then=then)


FRONTS = {"upload": _upload, "empty body (report mode)": _report_mode_empty,
          "both": lambda then: _upload(_report_mode_empty(then))}


@pytest.mark.parametrize("cls", [BodyOverrideCheck, EmptyBodyCheck, UploadCheck])
def test_every_check_of_the_slot_has_the_whole_interface(cls):
    assert [name for name in INTERFACE if not hasattr(cls, name)] == []


def _pooled(check, pieces) -> Decision | None:
    """What addons/http_stream.py `_checked` does for a body decoded to be scanned."""
    refusal = None
    for data in pieces:
        assert check.decodes
        step = decode_pool.DecodeSteps(check.scan(data))
        asyncio.run(decode_pool.DecodePool().egress_decode_steps(step))
        refusal = refusal or check.settle(step.result, last=data is None)
    return refusal


@pytest.mark.parametrize("front", list(FRONTS))
def test_behind_a_check_in_front_the_body_is_decoded_on_the_pool_and_refused(front):
    recorded = []
    check = FRONTS[front](_override_check(recorded))
    assert isinstance(check, CheckInFront) and check.decodes
    assert check.windows(gzip.compress(b"a=1"), lambda more: True) > 0  # its decoders' windows, to charge
    refusal = _pooled(check, [gzip.compress(b"_method=DELETE"), None])
    assert refusal is not None and refusal.reason == "method_not_allowed" and recorded == ["method_not_allowed"]


@pytest.mark.parametrize("front", list(FRONTS))
def test_behind_a_check_in_front_a_clean_body_passes_and_its_decoders_go(front):
    recorded = []
    inner = _override_check(recorded)
    check = FRONTS[front](inner)
    assert _pooled(check, [gzip.compress(b"a=1&b=2"), None]) is None and recorded == []
    closed = []
    inner.close = lambda: closed.append(True)  # (what addons/http_stream.py `_drop_decoders` reaches)
    check.close()
    assert closed == [True]


def test_the_upload_budget_refuses_on_the_pool_path_before_any_decoding():
    recorded = []
    inner = _override_check(recorded)
    check = _upload(inner, limit=10)
    body = gzip.compress(b"a=" + b"x" * 100)
    step = decode_pool.DecodeSteps(check.scan(body))
    asyncio.run(decode_pool.DecodePool().egress_decode_steps(step))
    refusal = check.settle(step.result)
    assert refusal is not None and refusal.reason == "upload_quota_exceeded"
    assert not check.decodes and check.scan(b"more") is not None  # refused: nothing more is checked
    assert recorded == []


def test_a_refusing_empty_body_check_decodes_nothing():
    refusal = Decision.deny("unexpected_body", "a body", "r")
    check = EmptyBodyCheck(refusal, record=lambda decision, found: None, then=None)
    assert not check.decodes
    assert check.feed(b"x") is refusal and check.feed(b"y") is None and check.finish() is None
