"""The certificate a sandbox sees through an inspected tunnel is for a P-256 key of the gateway's
own, issued by the gateway's CA (addons/leaf_keys.py): verified by Python's ssl and by curl against
the CA alone, with the names of the pin."""

from __future__ import annotations

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

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
