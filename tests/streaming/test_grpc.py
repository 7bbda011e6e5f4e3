"""Behaviour 7: gRPC with grpcio through the proxy (channel option `grpc.http_proxy`, TLS to the
origin trusting the gateway's CA): a server-streaming call paced by the client, and a
bidirectional call where the client sends message n+1 only after reply n; status, details and
trailing metadata intact, OK and not OK. The origin is a real grpcio server (generic handlers, raw
bytes: no protoc)."""

from __future__ import annotations

import concurrent.futures
import queue

import pytest

from .conftest import RULE_KINDS, check_origin_saw, name
from .origins import GRPC_SERVICE, WAIT

grpc = pytest.importorskip("grpc")

pytestmark = pytest.mark.e2e


@pytest.fixture
def channel_for(gateway, origins):
    if origins.grpc is None:
        pytest.skip("grpcio is not installed")
    opened = []

    def open_channel(host: str):
        credentials = grpc.ssl_channel_credentials(root_certificates=gateway.ca_cert.read_bytes())
        channel = grpc.secure_channel(f"{host}:443", credentials, options=[
            ("grpc.http_proxy", gateway.proxy_url),
            ("grpc.enable_retries", 0),
        ])
        opened.append(channel)
        return channel

    yield open_channel
    for channel in opened:
        channel.close()


class Reader:
    """`next()` on a grpc response iterator, bounded: a reply that does not come fails the test."""

    def __init__(self, call):
        self.call = call
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def next(self, n: int, what: str = "reply") -> bytes:
        future = self.pool.submit(next, self.call, None)
        try:
            reply = future.result(timeout=WAIT)
        except concurrent.futures.TimeoutError:
            self.call.cancel()
            raise AssertionError(f"gRPC {what} {n} never reached the client within {WAIT:g}s: "
                                 "the gateway buffered the stream") from None
        if reply is None:
            raise AssertionError(f"the call ended before {what} {n}: {self.call.code()} {self.call.details()!r}")
        return reply

    def end(self) -> None:
        future = self.pool.submit(next, self.call, None)
        try:
            extra = future.result(timeout=WAIT)
        except concurrent.futures.TimeoutError:
            self.call.cancel()
            raise AssertionError(f"the call did not end within {WAIT:g}s") from None
        except grpc.RpcError:
            extra = None  # a non-OK status ends the iterator with the error: checked by the caller
        assert extra is None, f"an unexpected extra reply {extra!r}"

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


STATUSES = {
    "ok": None,
    "error": ("RESOURCE_EXHAUSTED", "quota: step 3 of 3 used up"),
}


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("status", list(STATUSES))
def test_server_streaming_call(gateway, channel_for, origins, routes, status, rule):
    lock = routes.lockstep("grpc-watch")
    replies = [f"update {n}".encode() * 8 for n in range(1, 4)]

    def watch(request, context):
        for n, reply in enumerate(replies, 1):
            yield reply
            if not lock.wait(n):
                return
        context.set_trailing_metadata((("x-watch-end", "3"),))
        if STATUSES[status] is not None:
            code, details = STATUSES[status]
            context.abort(grpc.StatusCode[code], details)

    token = origins.grpc.on_watch(watch)
    channel = channel_for(name("grpc", rule))
    method = channel.unary_stream(f"/{GRPC_SERVICE}/Watch")
    call = method(token, timeout=4 * WAIT, metadata=(("x-client", "streaming-suite"),))
    reader = Reader(call)
    try:
        for n, expected in enumerate(replies, 1):
            assert reader.next(n) == expected
            lock.ack(n)
        reader.end()
    finally:
        reader.close()
    expected_code = grpc.StatusCode.OK if STATUSES[status] is None else grpc.StatusCode[STATUSES[status][0]]
    assert call.code() == expected_code, (call.code(), call.details())
    if STATUSES[status] is not None:
        assert call.details() == STATUSES[status][1]
    assert ("x-watch-end", "3") in [(k, v) for k, v in call.trailing_metadata()], call.trailing_metadata()
    method_name, metadata = origins.grpc.calls[-1]
    assert method_name == "Watch" and ("x-client", "streaming-suite") in metadata
    check_origin_saw(metadata, rule)
    assert_through(gateway, name("grpc", rule))


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("status", list(STATUSES))
def test_bidirectional_call(gateway, channel_for, origins, status, rule):
    outgoing: queue.Queue = queue.Queue()

    def requests():
        while True:
            try:
                message = outgoing.get(timeout=3 * WAIT)
            except queue.Empty:
                return
            if message is None:
                return
            yield message

    channel = channel_for(name("grpc", rule))
    method = channel.stream_stream(f"/{GRPC_SERVICE}/Chat")
    call = method(requests(), timeout=4 * WAIT)
    reader = Reader(call)
    messages = [f"message {n}".encode() for n in range(1, 5)]
    try:
        for n, message in enumerate(messages, 1):
            outgoing.put(message)  # message n+1 goes only after reply n came back
            assert reader.next(n) == b"reply:" + message
        if STATUSES[status] is None:
            outgoing.put(None)
        else:
            code, details = STATUSES[status]
            outgoing.put(f"close:{code}:{details}".encode())
        reader.end()
    finally:
        outgoing.put(None)
        reader.close()
    if STATUSES[status] is None:
        assert call.code() == grpc.StatusCode.OK, (call.code(), call.details())
    else:
        assert call.code() == grpc.StatusCode[STATUSES[status][0]], (call.code(), call.details())
        assert call.details() == STATUSES[status][1]
        assert ("x-chat-end", "bye") in [(k, v) for k, v in call.trailing_metadata()], call.trailing_metadata()
    method_name, metadata = origins.grpc.calls[-1]
    assert method_name == "Chat"
    check_origin_saw(metadata, rule)
    assert_through(gateway, name("grpc", rule))


def assert_through(gateway, host: str) -> None:
    """grpcio really used the proxy: the gateway decided a request to the host."""
    lines = [line for line in gateway.audit() if line.get("event") == "request" and line.get("host") == host]
    assert lines and all(line.get("decision") == "allow" for line in lines), lines
