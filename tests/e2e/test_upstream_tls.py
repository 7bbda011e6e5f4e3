"""Spec 7: upstream TLS is always verified, against the pinned name, and `ssl_insecure` cannot
switch that off. A gateway that does not trust the upstreams' CA answers 502 and sends no request."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import (  # noqa: F401  (fixtures are used by name)
    curl,
    fresh_upstreams,
    gateway,
    get,
    shared_gateway,
    tls_tunnel,
)
from bench.lib.pki import TestPKI

RULES = """
- id: allowed
  hosts: [allowed.test]
"""


@pytest.fixture(scope="module")
def foreign_ca(tmp_path_factory):
    """A CA that signed none of the upstream certificates."""
    return TestPKI(tmp_path_factory.mktemp("foreign-pki")).ca_cert


@pytest.fixture(scope="module", params=["verify", "ssl_insecure=true"])
def distrustful_gateway(request, tmp_path_factory, upstreams, pki, foreign_ca):
    args = ["--set", "ssl_insecure=true"] if request.param != "verify" else []
    process = shared_gateway(tmp_path_factory, upstreams, pki, RULES, args=args, upstream_ca=foreign_ca,
                             name="distrustful")
    yield process
    process.stop()


def test_untrusted_upstream_certificate_is_502(distrustful_gateway, upstreams):
    with tls_tunnel(distrustful_gateway, "allowed.test:443") as tls:
        response = get(tls, "/secret", "allowed.test")
    assert response.status == 502, response.text
    assert "upstream allowed.test" not in response.text
    assert "certificate" in response.text.lower(), response.text
    assert upstreams.tls["allowed.test"].requests == []  # the handshake failed: no request was sent
    if "ssl_insecure=true" in distrustful_gateway.extra_args:
        assert "ignoring ssl_insecure" in distrustful_gateway.log()  # and the gateway says so


def test_untrusted_upstream_certificate_is_502_with_curl(distrustful_gateway, upstreams):
    result = curl(distrustful_gateway, "https://allowed.test/secret")
    assert result.status == 502, result
    assert upstreams.tls["allowed.test"].requests == []


def test_upstream_certificate_is_checked_against_the_pinned_name(gateway, upstreams):
    """alias.test resolves (static_hosts) to allowed.test's server, whose certificate does not name
    alias.test: verifying against the pinned name fails, whatever address it resolved to."""
    with tls_tunnel(gateway, "alias.test:443") as tls:
        response = get(tls, "/alias", "alias.test")
    assert response.status == 502, response.text
    assert upstreams.tls["allowed.test"].requests == []
    # and the control: the same server under its own name works
    with tls_tunnel(gateway, "allowed.test:443") as tls:
        assert get(tls, "/own-name", "allowed.test").status == 200
