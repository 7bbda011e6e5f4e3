"""The certificates the gateway shows sandboxes carry a P-256 key of their own, not the CA's key.

mitmproxy issues every leaf certificate for the CA's own public key (`certs.dummy_cert`:
`public_key(cacert.public_key())`) and hands the CA's private key to every sandbox connection, so
each new TLS connection signs its handshake (CertificateVerify) with the CA's RSA-2048 key. That
signature is the largest single item of the handshake the gateway serves: 0.95 ms of CPU for an
RSA-2048 server handshake against 0.37 ms with a P-256 key (pyOpenSSL, memory BIOs, this machine;
docs/performance.md "CPU per new connection"), on new connections that cost the worker 11-15 ms.

So each certificate store gets one P-256 key of its own, made at its first certificate, and the
certificates it issues are for that key: still issued and signed by the CA (its subject, its
Subject Key Identifier as the Authority Key Identifier, its key signing), with the same names,
extensions and validity as mitmproxy's. The CA key then signs certificates only, never a handshake.
Sandboxes trust the CA as before; every current TLS client accepts an ECDSA leaf under an RSA CA.
`egress_leaf_key: ca` keeps mitmproxy's behaviour (for a client that cannot do ECDSA).

How: `CertStore.get_cert` is wrapped so that, while it makes a new entry, the store's default key is
the leaf key (the entry's key) and `certs.dummy_cert` (wrapped too) signs with the CA key and puts
the leaf's public key in. Both are rows of addons/patches.py; tests/unit/test_leaf_keys.py pins the
source of the mitmproxy code they lean on. A CA without a Subject Key Identifier (mitmproxy's own
always has one) keeps mitmproxy's behaviour: its leaves' Authority Key Identifier would otherwise
be computed from the wrong key.
"""

from __future__ import annotations

import weakref

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from mitmproxy import certs, ctx, exceptions

from .options import declare

MODES = ("ecdsa-p256", "ca")
_mode = ["ecdsa-p256"]
_signing: list = [None]  # (CA key, leaf key) while CertStore.get_cert makes an entry
_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # CertStore -> its leaf key, or None
ORIGINALS: dict = {}  # mitmproxy's get_cert and dummy_cert, as found (tests pin their source)


class _Issuer:
    """The CA certificate as `dummy_cert` reads it (its subject and extensions), with the leaf's
    public key where dummy_cert takes the public key of the certificate it makes."""

    __slots__ = ("subject", "extensions", "_public")

    def __init__(self, ca: x509.Certificate, public) -> None:
        self.subject, self.extensions, self._public = ca.subject, ca.extensions, public

    def public_key(self):
        return self._public


def _leaf_key(store: certs.CertStore):
    """The store's leaf key (made once), or None where its CA has no Subject Key Identifier."""
    try:
        return _keys[store]
    except KeyError:
        pass
    try:
        store.default_ca._cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
        key = ec.generate_private_key(ec.SECP256R1())
    except x509.ExtensionNotFound:
        key = None
    _keys[store] = key
    return key


def install() -> None:
    store_class = certs.CertStore
    if getattr(store_class.get_cert, "_egress_leaf_key", False):
        return
    get_cert, dummy_cert = store_class.get_cert, certs.dummy_cert
    ORIGINALS.update(get_cert=get_cert, dummy_cert=dummy_cert)

    def leaf_get_cert(self, commonname, sans, organization=None, crl_url=None):
        leaf = _leaf_key(self) if _mode[0] == "ecdsa-p256" else None
        if leaf is None:
            return get_cert(self, commonname, sans, organization, crl_url)
        ca_key = self.default_privatekey
        _signing[0] = (ca_key, leaf)
        self.default_privatekey = leaf  # (what a new entry is given as its key; nothing else reads it here)
        try:
            return get_cert(self, commonname, sans, organization, crl_url)
        finally:
            self.default_privatekey = ca_key
            _signing[0] = None

    def leaf_dummy_cert(privkey, cacert, *args, **kwargs):
        signing = _signing[0]
        if signing is None or privkey is not signing[1]:
            return dummy_cert(privkey, cacert, *args, **kwargs)
        ca_key, leaf = signing
        return dummy_cert(ca_key, _Issuer(cacert, leaf.public_key()), *args, **kwargs)

    leaf_get_cert._egress_leaf_key = True
    store_class.get_cert = leaf_get_cert
    certs.dummy_cert = leaf_dummy_cert


class LeafKeys:
    def __init__(self) -> None:
        install()

    def load(self, loader) -> None:
        declare(loader, "egress_leaf_key")

    def configure(self, updated) -> None:
        if "egress_leaf_key" in updated:
            mode = ctx.options.egress_leaf_key
            if mode not in MODES:
                raise exceptions.OptionsError(f"egress_leaf_key: {mode!r} is not one of {', '.join(MODES)}")
            _mode[0] = mode
