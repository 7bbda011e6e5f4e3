"""A credential-bound response that must be decoded whole for redaction is charged to the buffer
budget (gateway/budget.py) piece by piece: over it, 503 `buffer_budget`, never a larger buffer
(issue 15). The gateway here is a second one on the shared credentials policy, with a small budget."""

from __future__ import annotations

import pytest

from tests.support.gateway import GatewayProcess

from .clients import tls_to
from .conftest import ENV, SECRETS
from .servers import bomb


@pytest.fixture(scope="module")
def small_budget(cred, tmp_path_factory, pki):
    patch = pytest.MonkeyPatch()
    try:
        for name, var in ENV.items():
            patch.setenv(var, SECRETS[name])
        gateway = GatewayProcess(cred.policy, tmp_path_factory.mktemp("budget") / "gw", upstream_ca=pki.ca_cert,
                                 extra_args=["--set", "egress_max_buffered_bytes_per_connection=4194304"])
        gateway.start()
    finally:
        patch.undo()
    yield gateway
    gateway.stop()


def _exchange(gateway, path: str) -> bytes:
    with tls_to(gateway, "echo.test", timeout=20) as tls:
        tls.send(f"GET {path} HTTP/1.1\r\nHost: echo.test\r\nConnection: close\r\n\r\n".encode())
        received = b""
        while True:
            try:
                piece = tls.sock.recv(1 << 20)
            except OSError:
                break
            if not piece:
                break
            received += piece
    return received


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
