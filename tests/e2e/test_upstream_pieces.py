"""An upstream that answers in tiny pieces (review 32): its 1-byte chunks are merged per read and
parsed at most about a millisecond per step of the loop, the rest at a wakeup and behind the
connection's read-ahead gate (addons/http1.py, addons/read_ahead.py). Whatever the slicing, the
body arrives whole and in order, also when the upstream closes right after its last chunk (the
part left unparsed is read before the close is)."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import ScriptedUpstream, connect_proxy, extra_static_hosts, get

CHUNKS = 200_000
BODY = bytes(i % 251 for i in range(CHUNKS))
ANSWER = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
          + b"".join(b"1\r\n%c\r\n" % byte for byte in BODY) + b"0\r\n\r\n")


class ClosingAtOnce(ScriptedUpstream):
    HOLD = 0.0  # closes as soon as its answer is written


@pytest.mark.parametrize("origin_class", [ScriptedUpstream, ClosingAtOnce], ids=["held open", "closed at once"])
def test_a_body_of_one_byte_chunks_arrives_whole(start_gateway, upstreams, origin_class):
    origin = origin_class(f"{upstreams.block}.60", ANSWER)
    try:
        gateway = start_gateway(f"""
            - id: tiny
              hosts: [tiny.test]
              schemes: [http]
              ports: [{origin.port}]
            """, extra=extra_static_hosts({"tiny.test": origin.host}))
        with connect_proxy(gateway) as conn:
            response = get(conn, f"http://tiny.test:{origin.port}/pieces", f"tiny.test:{origin.port}")
        assert response.status == 200
        assert len(response.body) == CHUNKS and response.body == BODY
    finally:
        origin.stop()
