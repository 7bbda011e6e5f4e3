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

import logging
import threading
import weakref

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from mitmproxy import certs, ctx, exceptions

from .options import declare

MODES = ("ecdsa-p256", "ca")
_mode = ["ecdsa-p256"]
_signing: list = [None]  # (CA key, leaf key) while CertStore.get_cert makes an entry
_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # CertStore -> (its CA key, leaf key or None)
# One get_cert at a time in the leaf path: it swaps the store's default key for the call, and two
# threads interleaved would leave the leaf key in the CA key's place for good (review 44; nothing
# in the gateway calls get_cert from a thread, but a host of the addon might).
_issuing = threading.Lock()
# Hostile input and failed handshakes are the sandbox's to repeat: the hint is logged once.
_HANDSHAKE_HINTS = ("no shared cipher", "no suitable signature algorithm", "no suitable sigalg")
logger = logging.getLogger("egress")
ORIGINALS: dict = {}  # mitmproxy's get_cert and dummy_cert, as found (tests pin their source)


class _Issuer:
    """The CA certificate as `dummy_cert` reads it (its subject and extensions), with the leaf's
    public key where dummy_cert takes the public key of the certificate it makes."""

    __slots__ = ("subject", "extensions", "_public")

    def __init__(self, ca: x509.Certificate, public) -> None:
        self.subject, self.extensions, self._public = ca.subject, ca.extensions, public

    def public_key(self):
        return self._public


def _keys_of(store: certs.CertStore) -> tuple:
    """(the store's CA key, its leaf key or None), made once: None where its CA has no Subject Key
    Identifier. The CA key is the one the store had when first asked, what every call restores."""
    try:
        return _keys[store]
    except KeyError:
        pass
    try:
        store.default_ca._cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
        leaf = ec.generate_private_key(ec.SECP256R1())
    except x509.ExtensionNotFound:
        leaf = None
    keys = _keys[store] = (store.default_privatekey, leaf)
    return keys


def install() -> None:
    store_class = certs.CertStore
    if getattr(store_class.get_cert, "_egress_leaf_key", False):
        return
    get_cert, dummy_cert = store_class.get_cert, certs.dummy_cert
    ORIGINALS.update(get_cert=get_cert, dummy_cert=dummy_cert)

    def leaf_get_cert(self, commonname, sans, organization=None, crl_url=None):
        if _mode[0] != "ecdsa-p256":
            return get_cert(self, commonname, sans, organization, crl_url)
        with _issuing:
            ca_key, leaf = _keys_of(self)
            if leaf is None:
                return get_cert(self, commonname, sans, organization, crl_url)
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
    """The addon: the wrappers installed as it is made, `egress_leaf_key` declared and followed,
    and the hint for a client that cannot use an ECDSA certificate."""

    def __init__(self) -> None:
        install()

    def load(self, loader) -> None:
        declare(loader, "egress_leaf_key")

    def configure(self, updated) -> None:
        if "egress_leaf_key" in updated:
            mode = ctx.options.egress_leaf_key
            if mode not in MODES:
                raise exceptions.OptionsError(f"egress_leaf_key: {mode!r} is not one of {', '.join(MODES)}")
            if mode != _mode[0]:
                _mode[0] = mode
                tlsconfig = ctx.master.addons.get("tlsconfig") if getattr(ctx, "master", None) is not None else None
                store = getattr(tlsconfig, "certstore", None)
                if store is not None:
                    forget_issued(store)

    def tls_failed_client(self, data) -> None:
        """A client that cannot use an ECDSA certificate fails with "no shared cipher", which reads
        like a trust problem: say once what to change (review 44)."""
        global _hinted
        error = str(getattr(data.conn, "error", "") or "")
        if _hinted or _mode[0] != "ecdsa-p256" or not any(hint in error for hint in _HANDSHAKE_HINTS):
            return
        _hinted = True
        logger.warning("egress gateway: a client's TLS handshake failed (%s); it may not accept the ECDSA "
                       "certificates the gateway issues: --set egress_leaf_key=ca issues them for the CA's "
                       "own key (this hint is logged once)", error[:200])


_hinted = False


def forget_issued(store: certs.CertStore) -> None:
    """The mode changed while running: the certificates issued for the other key go from the
    store, so that every name gets one for the key now asked for (an operator's own `certs`,
    with keys of their own, stay)."""
    ca_key, leaf = _keys.get(store, (store.default_privatekey, None))
    issued = {id(ca_key), id(leaf)} if leaf is not None else {id(ca_key)}
    store.certs = {name: entry for name, entry in store.certs.items() if id(entry.privatekey) not in issued}
    store.expire_queue = [entry for entry in store.expire_queue if id(entry.privatekey) not in issued]
