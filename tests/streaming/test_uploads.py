"""Behaviour 6: request bodies of unknown length stream to the origin.

The client uploads piece by piece - HTTP/1.1 `Transfer-Encoding: chunked`, or HTTP/2 DATA frames
without a content-length - and sends piece n+1 only once the origin has acknowledged piece n:

- side channel: the origin reports every byte it receives (`Progress`) and the test waits for it;
- in band (HTTP/2): the origin answers at once and streams `{"ack": <bytes so far>}` lines, and the
  client reads the ack for piece n from the response before it sends piece n+1 (full duplex, the
  pattern of gRPC bidirectional calls and of agents' streaming tool uploads).

A gateway that buffers the request body until its end deadlocks, and the test fails naming the
piece that never reached the origin.
"""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from .clients import H1Client, H2Client, connect_proxy, connect_tunnel, ndjson_split, Events
from .conftest import RULE_KINDS, check_origin_saw, name
from .origins import WAIT, Progress, Route, Routes

pytestmark = pytest.mark.e2e

PIECES = [f"piece {n}: ".encode() + bytes([0x61 + n]) * 200 + b"\n" for n in range(1, 6)]


def recording_upload(routes: Routes) -> tuple[Route, Progress]:
    """The origin reads the body as it arrives, reporting every piece; answers with a digest at the end."""
    progress = Progress()

    def handler(exchange):
        for piece in exchange.body_pieces():
            progress.report(piece)
        body = b"".join(progress.pieces)
        answer = json.dumps({"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}).encode()
        exchange.start(200, [("Content-Type", "application/json"), ("Content-Length", str(len(answer)))], "length")
        exchange.write(answer)
        exchange.finish()

    return routes.add(handler, "up"), progress


def wait_origin_has(progress: Progress, total: int, n: int) -> None:
    if not progress.wait_bytes(total):
        raise AssertionError(
            f"upload piece {n} never reached the origin within {WAIT:g}s: the gateway buffered the request "
            f"body (the origin has {sum(map(len, progress.pieces))} of {total} bytes)")


def expected_answer() -> dict:
    body = b"".join(PIECES)
    return {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("mode", ["tunnel", "plain"])
def test_http11_chunked_upload_streams(gateway, routes, origins, mode, rule):
    route, progress = recording_upload(routes)
    host = name("h1", rule)
    if mode == "tunnel":
        client, target = H1Client(connect_tunnel(gateway, host, ["http/1.1"])), route.path
    else:
        client, target = H1Client(connect_proxy(gateway)), f"http://{host}{route.path}"
    try:
        client.send_request("POST", target, [("Host", host), ("Transfer-Encoding", "chunked"),
                                             ("Content-Type", "application/octet-stream")])
        total = 0
        for n, piece in enumerate(PIECES, 1):
            client.send_chunk(piece)
            total += len(piece)
            wait_origin_has(progress, total, n)
        client.send_chunk(b"")
        client.read_head()
        assert client.status == 200
        body = Events(client.read_some, lambda b: [b] if b else []).expect_end()
        assert json.loads(body) == expected_answer()
    finally:
        client.close()
    exchange = route.exchange
    assert exchange.header("content-length") is None, "the gateway turned the streamed upload into a sized one"
    check_origin_saw(exchange, rule)


@pytest.mark.parametrize("rule", RULE_KINDS)
@pytest.mark.parametrize("origin", ["h2", "h1"])
def test_http2_upload_without_length_streams(gateway, routes, origins, origin, rule):
    """h2 client, DATA frames and no content-length; to an h2 origin and to an HTTP/1.1 one (where
    the gateway must send it chunked)."""
    route, progress = recording_upload(routes)
    host = name(origin, rule)
    client = H2Client(connect_tunnel(gateway, host, ["h2"]))
    try:
        sid = client.request(host, route.path, "POST", [("content-type", "application/octet-stream")],
                             body=None, end_stream=False)
        total = 0
        for n, piece in enumerate(PIECES, 1):
            client.send_data(sid, piece)
            total += len(piece)
            wait_origin_has(progress, total, n)
        client.end_stream(sid)
        response = client.read_head(sid)
        assert response.status == 200
        client.wait_end(sid)
        assert json.loads(b"".join(response.frames)) == expected_answer()
    finally:
        client.close()
    exchange = route.exchange
    assert exchange.header("content-length") is None
    if origin == "h1":
        assert exchange.protocol == "HTTP/1.1"
        assert "chunked" in (exchange.header("transfer-encoding") or "").lower()
    check_origin_saw(exchange, rule)


def acking_upload(routes: Routes) -> Route:
    """The origin answers at once, then one `{"ack": bytes}` line per piece received."""

    def handler(exchange):
        exchange.start(200, [("Content-Type", "application/x-ndjson")], "chunked")
        total = 0
        for piece in exchange.body_pieces():
            total += len(piece)
            exchange.write(json.dumps({"ack": total}).encode() + b"\n")
        exchange.write(json.dumps({"done": total}).encode() + b"\n")
        exchange.finish()

    return routes.add(handler, "ack")


@pytest.mark.parametrize("rule", RULE_KINDS)
def test_http2_full_duplex_upload_acked_in_band(gateway, routes, origins, rule):
    route = acking_upload(routes)
    host = name("h2", rule)
    client = H2Client(connect_tunnel(gateway, host, ["h2"]))
    try:
        sid = client.request(host, route.path, "POST", [("content-type", "application/octet-stream")],
                             body=None, end_stream=False)
        client.read_head(sid, "the response headers (sent before the request body ended)")
        acks = Events(lambda deadline: client.read_some(sid, deadline), ndjson_split, "ack line")
        total, seen = 0, 0
        for n, piece in enumerate(PIECES, 1):
            client.send_data(sid, piece)
            total += len(piece)
            deadline = time.monotonic() + WAIT
            while True:  # the gateway may split a piece: wait for the ack that covers all of it
                seen += 1
                try:
                    line = acks.expect(seen, timeout=max(deadline - time.monotonic(), 0.001))
                except AssertionError as exc:
                    raise AssertionError(f"no ack for upload piece {n}: {exc}") from None
                if json.loads(line)["ack"] >= total:
                    break
        client.end_stream(sid)
        acks.expect(seen + 1, json.dumps({"done": total}).encode() + b"\n")
        acks.expect_end()
    finally:
        client.close()
    check_origin_saw(route.exchange, rule)
