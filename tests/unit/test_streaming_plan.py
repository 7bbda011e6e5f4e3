"""What streams and what is buffered (gateway/streaming.py), as a table."""

from __future__ import annotations

import pytest

from gateway.streaming import Plan, is_streaming_type, request_streams, response_plan

MB = 1024 * 1024


def plan(headers: dict[str, str], *, bound: bool, method: str = "GET", status: int = 200) -> Plan:
    return response_plan(method=method, status=status, headers=list(headers.items()), bound=bound,
                         buffer_limit=MB)[0]


@pytest.mark.parametrize("headers, unbound, bound", [
    ({"transfer-encoding": "chunked"}, Plan.STREAM, Plan.REDACT),
    ({}, Plan.STREAM, Plan.REDACT),  # read until close / HTTP/2 without content-length
    ({"content-length": "10"}, Plan.SIZED, Plan.REDACT),
    ({"content-type": "text/event-stream", "content-length": "10"}, Plan.STREAM, Plan.REDACT),
    ({"content-type": "application/grpc+proto"}, Plan.STREAM, Plan.REDACT),
    ({"content-type": "application/x-ndjson; charset=utf-8", "content-length": "5"}, Plan.STREAM, Plan.REDACT),
    ({"content-type": "multipart/x-mixed-replace; boundary=x", "content-length": "5"}, Plan.STREAM, Plan.REDACT),
    ({"content-encoding": "gzip", "content-length": "100"}, Plan.SIZED, Plan.DECODE_BUFFERED),
    ({"content-encoding": "gzip", "content-length": str(2 * MB)}, Plan.SIZED, Plan.DECODE_STREAM),
    ({"content-encoding": "br", "transfer-encoding": "chunked"}, Plan.STREAM, Plan.DECODE_STREAM),
    ({"content-encoding": "gzip", "content-type": "text/event-stream", "content-length": "10"},
     Plan.STREAM, Plan.DECODE_STREAM),
    ({"content-encoding": "identity"}, Plan.STREAM, Plan.REDACT),
    ({"content-encoding": "x-unknown"}, Plan.STREAM, Plan.REFUSE),
    ({"content-encoding": "gzip, br"}, Plan.STREAM, Plan.REFUSE),
    ({"transfer-encoding": "gzip, chunked"}, Plan.STREAM, Plan.REFUSE),
    ({"content-type": "application/grpc", "grpc-encoding": "gzip"}, Plan.STREAM, Plan.REFUSE),
    ({"content-type": "application/grpc", "grpc-encoding": "identity"}, Plan.STREAM, Plan.REDACT),
])
def test_response_plans(headers, unbound, bound):
    assert plan(headers, bound=False) is unbound
    assert plan(headers, bound=True) is bound


@pytest.mark.parametrize("method, status", [("HEAD", 200), ("GET", 204), ("GET", 304), ("GET", 103)])
def test_no_body_responses(method, status):
    assert plan({"transfer-encoding": "chunked"}, bound=True, method=method, status=status) is Plan.NO_BODY


def test_header_names_are_case_insensitive():
    assert plan({"Content-Encoding": "GZIP", "Content-Length": "5"}, bound=True) is Plan.DECODE_BUFFERED
    assert plan({"Content-Type": "Text/Event-Stream", "Content-Length": "5"}, bound=False) is Plan.STREAM


def test_streaming_types_are_matched_by_media_type_not_substring():
    assert is_streaming_type("application/grpc-web+proto")
    assert not is_streaming_type("application/json")
    assert not is_streaming_type("text/event-streamer")


def test_request_bodies_of_unknown_length_stream():
    assert request_streams([("Transfer-Encoding", "chunked")])
    assert request_streams([])  # HTTP/2 DATA without content-length
    assert not request_streams([("content-length", "12")])
