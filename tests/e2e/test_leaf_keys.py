"""The certificate a sandbox sees through an inspected tunnel is for a P-256 key of the gateway's
own, issued by the gateway's CA (addons/leaf_keys.py): verified by Python's ssl and by curl against
the CA alone, with the names of the pin."""

from __future__ import annotations

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from tests.support.waiting import value_when
from tests.e2e.helpers import (  # noqa: F401  (fixtures are used by name)
    curl,
    gateway,
    get,
    tls_tunnel,
)


def test_the_sandbox_gets_an_ecdsa_certificate_issued_by_the_gateway_ca(gateway, upstreams):
    with tls_tunnel(gateway, "allowed.test:443") as tls:  # (start_tls verifies the chain against the CA)
        leaf = x509.load_der_x509_certificate(tls.sock.getpeercert(binary_form=True))
        assert get(tls, "/leaf", "allowed.test").status == 200
    ca = x509.load_pem_x509_certificate(gateway.ca_cert.read_bytes())
    assert isinstance(leaf.public_key(), ec.EllipticCurvePublicKey)
    assert leaf.public_key().curve.name == "secp256r1"
    assert leaf.issuer == ca.subject
    assert leaf.public_key().public_numbers() != getattr(ca.public_key(), "public_numbers", lambda: None)()
    assert "allowed.test" in leaf.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)


def test_curl_verifies_the_ecdsa_certificate_against_the_gateway_ca(gateway, upstreams):
    result = curl(gateway, "https://allowed.test/leaf-curl")
    assert result.status == 200, result


def test_a_client_without_ecdsa_fails_and_the_log_says_what_to_change_once(gateway, upstreams):
    """An RSA-only client cannot use the P-256 certificate ("no shared cipher" in mitmproxy's log,
    which reads like a trust problem): the gateway logs once that `egress_leaf_key=ca` is the fix."""
    import subprocess

    command = ["openssl", "s_client", "-proxy", f"{gateway.host}:{gateway.port}", "-connect", "allowed.test:443",
               "-servername", "allowed.test", "-tls1_3", "-sigalgs", "rsa_pss_rsae_sha256:rsa_pss_pss_sha256"]
    for _ in range(2):
        done = subprocess.run(command, input=b"", capture_output=True, timeout=20)
        assert b"no peer certificate available" in done.stdout, done.stdout[-500:]
    hint = "--set egress_leaf_key=ca"
    value_when(lambda: gateway.log().count(hint), lambda n: n >= 1, 5)
    assert gateway.log().count(hint) == 1, gateway.log()[-2000:]
