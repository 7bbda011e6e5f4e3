"""addons/http_stream.py: a request body's check (method overrides, upload budget, empty body) goes
once the body has passed it to its end, with its decoders, instead of living on in the flow's
metadata for as long as the response lasts (an SSE answer: minutes, ~2 KB a stream of scanner state
and closures). A refused body's check stays (its refusal is the flow's answer)."""

from __future__ import annotations

import pytest
from mitmproxy.proxy.layers.http._events import RequestData, RequestEndOfMessage

from addons.method_body import BODY_CHECK
from gateway.decision import Decision


class Check:
    """The BODY_CHECK interface, recording; `refusal` is what the body's end answers."""

    decodes = False
    pending = False

    def __init__(self, refusal: Decision | None = None):
        self.refusal = refusal
        self.closed = False
        self.fed = []

    def feed(self, data):
        self.fed.append(data)
        return None

    def finish(self):
        return self.refusal

    def trailers(self):
        return None

    def close(self):
        self.closed = True


@pytest.fixture
def stream(http_stream):
    http_stream.flow.metadata["egress_decision"] = Decision(True, "allowed", "", "r")
    return http_stream


def _receiving(stream, streamed: bool) -> None:
    """The stream as mitmproxy leaves it to receive its request body: streamed on, or buffered."""
    if streamed:
        stream.flow.request.stream = True
        stream.client_state = stream.state_stream_request_body
    else:
        stream.client_state = stream.state_consume_request_body


def _drive(stream, *events) -> list:
    commands = []
    for event in events:
        for command in stream.handle_event(event):
            commands.append(command)
            break  # (the first command a step yields is as far as these tests go: a hook or a send)
    return commands


@pytest.mark.parametrize("streamed", [False, True], ids=["buffered", "streamed"])
def test_a_body_that_passed_its_check_lets_the_check_go(stream, streamed):
    check = stream.flow.metadata[BODY_CHECK] = Check()
    _receiving(stream, streamed)
    _drive(stream, RequestData(1, b"a=1"), RequestEndOfMessage(1))
    assert check.fed == [b"a=1"]
    assert BODY_CHECK not in stream.flow.metadata and check.closed


@pytest.mark.parametrize("streamed", [False, True], ids=["buffered", "streamed"])
def test_a_refused_body_keeps_its_check(stream, streamed):
    refusal = Decision.deny("method_not_allowed", "a `_method` field", "r")
    check = stream.flow.metadata[BODY_CHECK] = Check(refusal)
    _receiving(stream, streamed)
    _drive(stream, RequestData(1, b"_method=DELETE"), RequestEndOfMessage(1))
    assert stream.flow.metadata.get(BODY_CHECK) is check
