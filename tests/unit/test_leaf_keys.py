"""addons/leaf_keys.py: the certificates shown to sandboxes are for a P-256 key of the store's own,
issued and signed by the CA as mitmproxy issues them; `egress_leaf_key: ca` gives mitmproxy's own.
A real certificate store and a real TLS handshake (pyOpenSSL over memory BIOs), no mocks."""

from __future__ import annotations

import hashlib
import inspect
import threading

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from mitmproxy import certs
from OpenSSL import SSL

from addons import leaf_keys

# The mitmproxy 12.3 code this module leans on: dummy_cert reads only subject, extensions and
# public_key() of the CA certificate it is given, and get_cert gives a new entry
# `self.default_privatekey`. An upgrade that changes either fails here (and at the version check).
PINNED_SHA256 = {
    "dummy_cert": "872deb71633ad693750673518141d9f4e637897db08e9e504fdfb5919208eec4",
    "get_cert": "27b572900de29d3246ce943563f5ca014fbc377a51cf265107d44999b6c50eac",
}


@pytest.fixture
def store(tmp_path):
    leaf_keys.install()
    leaf_keys._mode[0] = "ecdsa-p256"
    yield certs.CertStore.from_store(tmp_path, "mitmproxy", 2048)
    leaf_keys._mode[0] = "ecdsa-p256"


def _dns(name: str) -> x509.GeneralNames:
    return x509.GeneralNames([x509.DNSName(name)])


def test_a_new_certificate_is_for_the_store_s_p256_key_and_issued_by_the_ca(store):
    entry = store.get_cert("api.example.test", _dns("api.example.test"))
    leaf = entry.cert.to_cryptography()
    ca = store.default_ca.to_cryptography()
    assert isinstance(entry.privatekey, ec.EllipticCurvePrivateKey)
    assert entry.privatekey.curve.name == "secp256r1"
    assert leaf.public_key().public_numbers() == entry.privatekey.public_key().public_numbers()
    assert leaf.issuer == ca.subject
    ca.public_key().verify(leaf.signature, leaf.tbs_certificate_bytes, padding.PKCS1v15(),
                           leaf.signature_hash_algorithm)  # signed by the CA's key
    aki = leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ski.digest
    assert leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName) == ["api.example.test"]
    assert store.default_privatekey is not entry.privatekey  # the CA key stays the store's
    assert isinstance(store.default_privatekey, rsa.RSAPrivateKey)


def test_one_leaf_key_per_store_and_the_cache_still_works(store, tmp_path):
    a = store.get_cert("a.test", _dns("a.test"))
    b = store.get_cert("b.test", _dns("b.test"))
    assert a.privatekey is b.privatekey
    assert store.get_cert("a.test", _dns("a.test")) is a  # cached, not issued again
    other = certs.CertStore.from_store(tmp_path / "other", "mitmproxy", 2048)
    assert other.get_cert("a.test", _dns("a.test")).privatekey is not a.privatekey


def test_the_store_s_expiry_still_drops_old_entries(store, monkeypatch):
    monkeypatch.setattr(store, "STORE_CAP", 3)
    first = store.get_cert("first.test", _dns("first.test"))
    for i in range(5):
        store.get_cert(f"n{i}.test", _dns(f"n{i}.test"))
    assert first not in store.certs.values()
    assert len(store.certs) <= 4


def test_ca_mode_issues_as_mitmproxy_does(store):
    leaf_keys._mode[0] = "ca"
    entry = store.get_cert("ca-mode.test", _dns("ca-mode.test"))
    assert entry.privatekey is store.default_privatekey
    assert entry.cert.to_cryptography().public_key().public_numbers() == \
        store.default_ca.to_cryptography().public_key().public_numbers()


def test_a_ca_without_a_subject_key_identifier_keeps_mitmproxy_s_way(store):
    """Its leaves' Authority Key Identifier would be computed from the leaf key: not done."""
    from cryptography.hazmat.primitives.asymmetric import rsa as rsa_keys
    import datetime
    key = rsa_keys.generate_private_key(65537, 2048)
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "no-ski CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ca = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
          .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(key, hashes.SHA256()))
    plain = certs.CertStore(key, certs.Cert(ca), None, b"", store.dhparams)
    entry = plain.get_cert("x.test", _dns("x.test"))
    assert entry.privatekey is key


def test_a_real_handshake_with_the_leaf_verifies_against_the_ca(store, tmp_path):
    entry = store.get_cert("hs.test", _dns("hs.test"))
    server = SSL.Context(SSL.TLS_SERVER_METHOD)
    server.use_certificate(entry.cert.to_pyopenssl())
    server.use_privatekey(entry.privatekey)
    server.check_privatekey()
    client = SSL.Context(SSL.TLS_CLIENT_METHOD)
    client.set_verify(SSL.VERIFY_PEER)
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(store.default_ca.to_pem())
    client.load_verify_locations(str(ca_file))
    s, c = SSL.Connection(server), SSL.Connection(client)
    s.set_accept_state()
    c.set_connect_state()
    c.set_tlsext_host_name(b"hs.test")
    done = set()
    for _ in range(10):  # flights back and forth until both ends are done
        for one, other in ((c, s), (s, c)):
            try:
                one.do_handshake()
                done.add(one)
            except SSL.WantReadError:
                pass
            try:
                other.bio_write(one.bio_read(65536))
            except SSL.WantReadError:
                pass
        if len(done) == 2:
            break
    assert len(done) == 2
    peer = c.get_peer_certificate(as_cryptography=True)
    assert isinstance(peer.public_key(), ec.EllipticCurvePublicKey)


@pytest.mark.parametrize("name", sorted(PINNED_SHA256))
def test_the_mitmproxy_code_leant_on_is_the_tested_one(name):
    leaf_keys.install()
    digest = hashlib.sha256(inspect.getsource(leaf_keys.ORIGINALS[name]).encode()).hexdigest()
    assert digest == PINNED_SHA256[name], f"{name} changed in this mitmproxy: check addons/leaf_keys.py, then re-pin"


def test_threads_issuing_at_once_never_leave_the_ca_key_swapped_out(store):
    """Review 44: two threads in get_cert at once made one restore the leaf key as the CA key, and
    every later certificate was signed with the leaf key. One issues at a time now."""
    ca_key = store.default_privatekey
    errors: list[BaseException] = []

    def issue(n: int) -> None:
        try:
            for i in range(40):
                store.get_cert(f"t{n}-{i}.test", _dns(f"t{n}-{i}.test"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=issue, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert store.default_privatekey is ca_key
    ca = store.default_ca.to_cryptography()
    for entry in store.certs.values():
        leaf = entry.cert.to_cryptography()
        assert leaf.public_key().public_numbers() == entry.privatekey.public_key().public_numbers()
        ca.public_key().verify(leaf.signature, leaf.tbs_certificate_bytes, padding.PKCS1v15(),
                               leaf.signature_hash_algorithm)


def test_a_mode_changed_while_running_reissues_every_name_for_the_new_key(store):
    """Review 44: names cached under the old mode kept their old key until pushed out."""
    before = store.get_cert("cached.test", _dns("cached.test"))
    assert isinstance(before.privatekey, ec.EllipticCurvePrivateKey)
    leaf_keys._mode[0] = "ca"
    leaf_keys.forget_issued(store)
    after = store.get_cert("cached.test", _dns("cached.test"))
    assert after.privatekey is store.default_privatekey and after is not before
    assert before not in store.expire_queue
    leaf_keys._mode[0] = "ecdsa-p256"
    leaf_keys.forget_issued(store)
    again = store.get_cert("cached.test", _dns("cached.test"))
    assert isinstance(again.privatekey, ec.EllipticCurvePrivateKey)
