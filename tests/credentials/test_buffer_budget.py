"""A credential-bound response that must be decoded whole for redaction is charged to the buffer
budget (gateway/budget.py) piece by piece: over it, 503 `buffer_budget`, never a larger buffer
(issue 15). The gateway here is a second one on the shared credentials policy, with a small budget."""

from __future__ import annotations

import socket

import pytest

from tests.support.waiting import wait_for

from .clients import connect, read_to_end, tls_to
from .conftest import another_gateway
from .servers import bomb


@pytest.fixture(scope="module")
def small_budget(cred, tmp_path_factory, pki):
    gateway = another_gateway(cred, tmp_path_factory.mktemp("budget") / "gw", pki,
                              ["--set", "egress_max_buffered_bytes_per_connection=4194304"])
    yield gateway
    gateway.stop()


def _exchange(gateway, path: str) -> bytes:
    with tls_to(gateway, "echo.test", timeout=20) as tls:
        tls.send(f"GET {path} HTTP/1.1\r\nHost: echo.test\r\nConnection: close\r\n\r\n".encode())
        return read_to_end(tls.sock)


@pytest.mark.parametrize("enc", ["br", "gzip", "zstd", "deflate"])
def test_a_bound_response_decoded_whole_stops_at_the_buffer_budget(small_budget, enc):
    """96 MiB of zeros, small compressed: decoded whole it would reach the 16 MiB ratio grace; the
    4 MiB budget stops it first, with 503 buffer_budget."""
    bomb(enc)
    received = _exchange(small_budget, f"/v1/bomb?te=cl&enc={enc}")
    assert received.startswith(b"HTTP/1.1 503") and b"buffer_budget" in received, received[:300]
    assert any(e.get("reason") == "buffer_budget" for e in small_budget.audit()[-5:])


def test_a_small_bound_response_still_decodes_within_the_budget(small_budget):
    received = _exchange(small_budget, "/v1/gzip?enc=gzip")
    assert received.startswith(b"HTTP/1.1 200"), received[:300]


@pytest.fixture(scope="module")
def sandbox_budget(cred, tmp_path_factory, pki):
    gateway = another_gateway(cred, tmp_path_factory.mktemp("budget-sandbox") / "gw", pki,
                              ["--set", "egress_max_buffered_bytes_per_sandbox=25165824"])
    yield gateway
    gateway.stop()


def _answer(gateway, path: str) -> bytes:
    """What the sandbox gets for `path`: the response in its tunnel, or the CONNECT's own refusal
    (a tunnel's head is charged too: with the sandbox's budget spent, the CONNECT is refused)."""
    conn, answer = connect(gateway, "echo.test:443", timeout=20)
    conn.sock.close()
    if answer.status != 200:
        return b"HTTP/1.1 %d %s\r\n\r\n" % (answer.status, answer.reason.encode()) + answer.body
    return _exchange(gateway, path)


def _status_line(tls) -> bytes:
    """The first line of a response, and nothing much past it: the rest stays with the gateway."""
    line = b""
    while b"\r\n" not in line:
        piece = tls.sock.recv(64)
        if not piece:
            break
        line += piece
    return line


def test_a_response_the_client_does_not_read_stays_charged_until_it_is_sent(sandbox_budget):
    """A bound response decoded whole was charged until its stream completed, but it then sat in
    the transport's write buffer: clients that never read held a gigabyte with the ledger at zero,
    and more were served. Now what waits for the client stays charged: with the sandbox's 24 MiB
    held by unread 12 MiB responses, the next whole decode gets 503 buffer_budget; once they are
    read, it is served again. The unread ones are made one at a time, each until its answer has
    begun (decoded, charged, being written): six decoded at once would share the budget out
    between them and all get 503, holding nothing."""
    held, refusal = [], b""
    try:
        for _ in range(6):
            tls = tls_to(sandbox_budget, "echo.test", timeout=20)
            tls.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel takes little of it
            tls.send(b"GET /v1/bomb?te=cl&enc=gzip&mib=12 HTTP/1.1\r\nHost: echo.test\r\n\r\n")
            status = _status_line(tls)
            if not status.startswith(b"HTTP/1.1 200"):
                refusal = status
                tls.close()
                break
            held.append(tls)
        assert held and refusal.startswith(b"HTTP/1.1 503"), (len(held), refusal)
        received = _answer(sandbox_budget, "/v1/bomb?te=cl&enc=gzip&mib=12")
        assert received.startswith(b"HTTP/1.1 503") and b"buffer_budget" in received, received[:300]
    finally:
        for tls in held:
            tls.close()
    # The closed connections give their charge back.
    wait_for(lambda: _answer(sandbox_budget, "/v1/bomb?te=cl&enc=gzip&mib=12").startswith(b"HTTP/1.1 200"), 30.0,
             "a whole decode served once the unread responses are gone")


def _post_form(gateway, body: bytes, encoding: str) -> bytes:
    with tls_to(gateway, "echo.test", timeout=20) as tls:
        tls.send(b"POST /v1/echo HTTP/1.1\r\nHost: echo.test\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                 b"Content-Encoding: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                 % (encoding.encode(), len(body)) + body)
        received = b""
        while piece := tls.sock.recv(65536):
            received += piece
    return received


def test_a_compressed_request_body_whose_decoder_window_passes_the_budget_is_refused(small_budget):
    """A request body's decoders keep the window the sandbox chose (52 bytes of brotli can ask for
    16 MiB) for as long as the body lasts; it is charged first, and past the 4 MiB connection
    budget the body is refused before its decoder exists."""
    import brotli

    received = _post_form(small_budget, brotli.compress(b"a=1", lgwin=24), "br")
    assert received.startswith(b"HTTP/1.1 503") and b"buffer_budget" in received, received[:300]
    assert any(e.get("reason") == "buffer_budget" and e.get("event") == "request_body" for e in small_budget.audit()[-5:])
    received = _post_form(small_budget, brotli.compress(b"a=1", lgwin=18), "br")  # a 256 KiB window fits
    assert b"buffer_budget" not in received[:2000] and received.startswith(b"HTTP/1.1 "), received[:300]


def test_a_compressed_request_body_s_later_zstd_frame_is_charged_too(small_budget):
    """A 2-byte zstd frame first (charged 2 bytes), then one that asks for an 8 MiB window: the
    second is charged before its decoder exists, and past the 4 MiB budget the body is refused."""
    try:
        from backports import zstd
    except ImportError:  # Python 3.14+
        from compression import zstd  # type: ignore[no-redef]
    big = zstd.ZstdCompressor(options={zstd.CompressionParameter.window_log: 23})
    body = zstd.compress(b"a=1") + big.compress(b"b=2&" * 1000) + big.flush()
    received = _post_form(small_budget, body, "zstd")
    assert received.startswith(b"HTTP/1.1 503") and b"buffer_budget" in received, received[:300]
