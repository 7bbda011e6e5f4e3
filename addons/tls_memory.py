"""What OpenSSL keeps per TLS connection: no buffers while idle, one copy of each leaf certificate and key.

Every intercepted tunnel is two TLS connections (the sandbox's, with a certificate the gateway issues,
and the gateway's own upstream), and a platform holds thousands of idle kept-alive tunnels per node.
Measured with heaptrack on 500 idle tunnels (docs/performance.md, "Memory per idle tunnel"), per
tunnel:

- **Write buffers** (~16 KiB each, 32 KiB a tunnel): `SSL_MODE_RELEASE_BUFFERS` frees OpenSSL's read
  and write buffers whenever they are empty and takes them again for the next record. Set once the
  handshake is done (as this module first did) it reached only the read side: OpenSSL (3.2 and later)
  hands the mode to the record layer that exists when it is set, and TLS 1.3 makes the write layer of
  the application keys during the handshake. So the mode is set as soon as mitmproxy's TlsConfig has
  made the connection (`tls_start_client`, `tls_start_server`), before any record.
- **The leaf certificate and key** (~11 KiB a tunnel): mitmproxy's TlsConfig hands each sandbox
  connection its certificate and private key as `cryptography` objects, and pyOpenSSL converts both
  into new OpenSSL objects for every connection (DER out and back in). The connection keeps them for
  its life, and the key's RSA blinding and Montgomery values are computed again for each. They are
  replaced, before the handshake, by one OpenSSL copy per certificate store entry: the same
  certificate and key, so the same handshake.
- **The memory BIOs** (~6 KiB a tunnel after the handshake; ~360 KiB a connection after one 256 KiB
  piece of a body): pyOpenSSL passes every TLS byte through two OpenSSL memory BIOs per connection,
  and a memory BIO keeps the capacity of the most it ever held at once (OpenSSL has no call that
  shrinks one): the handshake's flights (a ClientHello with a post-quantum key share, a certificate
  chain), then the largest piece sent (the gateway sends bodies in pieces of up to 256 KiB) or read
  (64 KiB), for the connection's whole life. So when the handshake is over, and after any piece of
  RENEW_AFTER bytes or more, the connection is given two new, empty ones if its own are both empty
  (`fresh_bios`; the old ones are freed): nothing is in them to lose, and OpenSSL hands the new ones to
  its record layers. Smaller pieces leave them alone (a few KiB at most is kept, and most requests
  renew nothing).

The first two are wrappers of TlsConfig's own hooks (tabled in addons/patches.py): the gateway's addons
run before mitmproxy's, and TlsConfig makes the connection in these hooks, so no addon hook sees it
between its making and its first record. The `tls_established_*` hooks still set the mode for a
connection some other addon made (mitmproxy leaves it alone then). The BIOs are renewed by a wrapper
of mitmproxy's `TLSLayer.receive_handshake_data` (also tabled): when it returns the handshake done,
mitmproxy has sent what the handshake left to send and read what came with its end (its
`tls_established_*` hooks run earlier, while the last flight is still in the BIO); and by wrappers of
`TLSLayer.send_data` and `receive_data`, which have read out what they wrote when they return.
"""

from __future__ import annotations

from collections import OrderedDict

from mitmproxy import tls
from OpenSSL import SSL, crypto

RENEW_AFTER = 4 * 1024  # a piece of data this large through a connection renews its memory BIOs after it
SHARED_CERTIFICATES = 256  # entries kept converted (mitmproxy's certificate store keeps 100 by default)

_lib = SSL._lib  # pyOpenSSL's OpenSSL binding (as mitmproxy's own tlsconfig uses it)
_ffi = SSL._ffi


def _release_buffers(conn: SSL.Connection | None) -> None:
    if conn is not None:
        _lib.SSL_set_mode(conn._ssl, _lib.SSL_MODE_RELEASE_BUFFERS)


def fresh_bios(conn: SSL.Connection) -> bool:
    """Give a pyOpenSSL memory-BIO connection two new, empty memory BIOs in place of its own, if both
    of its own are empty (else nothing changes: no byte is ever dropped); True if it was done.
    SSL_set_bio frees the old ones, with whatever capacity they had grown to."""
    into, out = conn._into_ssl, conn._from_ssl
    if into is None or out is None:  # a socket connection: no memory BIOs
        return False
    if _lib.BIO_get_mem_data(into, _ffi.NULL) or _lib.BIO_get_mem_data(out, _ffi.NULL):
        return False
    new_into = _lib.BIO_new(_lib.BIO_s_mem())
    new_out = _lib.BIO_new(_lib.BIO_s_mem())
    if new_into == _ffi.NULL or new_out == _ffi.NULL:  # out of memory: keep the old ones
        for bio in (new_into, new_out):
            if bio != _ffi.NULL:
                _lib.BIO_free(bio)
        return False
    _lib.SSL_set_bio(conn._ssl, new_into, new_out)
    conn._into_ssl, conn._from_ssl = new_into, new_out
    return True


class SharedIdentities:
    """One pyOpenSSL certificate per certificate store entry's certificate, one key per private key:
    what every connection presenting them is given. Bounded (least recently used go); what goes is
    freed once the last connection using it is."""

    def __init__(self, size: int = SHARED_CERTIFICATES) -> None:
        self.size = size
        # id() of the cryptography object -> (that object, kept alive so that the id stays its own; the
        # pyOpenSSL copy)
        self._certs: OrderedDict[int, tuple[object, crypto.X509]] = OrderedDict()
        self._keys: OrderedDict[int, tuple[object, crypto.PKey]] = OrderedDict()

    def _get(self, table: OrderedDict, original, convert):
        key = id(original)
        found = table.get(key)
        if found is not None and found[0] is original:
            table.move_to_end(key)
            return found[1]
        converted = convert(original)
        table[key] = (original, converted)
        while len(table) > self.size:
            table.popitem(last=False)
        return converted

    def certificate(self, cert) -> crypto.X509:
        return self._get(self._certs, cert, crypto.X509.from_cryptography)

    def key(self, key) -> crypto.PKey:
        return self._get(self._keys, key, crypto.PKey.from_cryptography_key)

    def apply(self, conn: SSL.Connection, entry) -> None:
        """Give `conn` the shared copies of `entry`'s certificate and key (what it was given already,
        as copies of its own): the per-connection copies are freed."""
        cert = self.certificate(entry.cert.to_cryptography())
        key = self.key(entry.privatekey)
        # OpenSSL checks each against the other as it is set (a mismatch raises, nothing is weakened)
        if not _lib.SSL_use_certificate(conn._ssl, cert._x509):
            SSL._raise_current_error()
        if not _lib.SSL_use_PrivateKey(conn._ssl, key._pkey):
            SSL._raise_current_error()


SHARED = SharedIdentities()


def install() -> None:
    """Wrap TlsConfig's tls_start_client and tls_start_server (mitmproxy 12.3): the connection they make
    releases its buffers from its first record on; the sandbox's is given the shared certificate and key."""
    from mitmproxy.addons.tlsconfig import TlsConfig

    if getattr(TlsConfig.tls_start_client, "_egress_tls_memory", False):
        return
    start_client, start_server = TlsConfig.tls_start_client, TlsConfig.tls_start_server

    def tls_start_client(self, tls_start: tls.TlsData) -> None:
        made = tls_start.ssl_conn is None
        start_client(self, tls_start)
        if made and tls_start.ssl_conn is not None and not tls_start.is_dtls:
            _release_buffers(tls_start.ssl_conn)
            # the entry TlsConfig just used (its certificate store's, looked up again: no new certificate)
            SHARED.apply(tls_start.ssl_conn, self.get_cert(tls_start.context))

    def tls_start_server(self, tls_start: tls.TlsData) -> None:
        made = tls_start.ssl_conn is None
        start_server(self, tls_start)
        if made and not tls_start.is_dtls:
            _release_buffers(tls_start.ssl_conn)

    tls_start_client._egress_tls_memory = True
    TlsConfig.tls_start_client = tls_start_client
    TlsConfig.tls_start_server = tls_start_server
    _renew_bios()


def _renew_bios() -> None:
    """Wrap mitmproxy's TLSLayer.receive_handshake_data, send_data and receive_data (12.3): a TCP
    connection gets fresh memory BIOs when its handshake is done and after each large piece of data
    (see the module's docstring)."""
    from mitmproxy.proxy.layers.tls import TLSLayer

    receive_handshake_data, send_data, receive_data = (
        TLSLayer.receive_handshake_data, TLSLayer.send_data, TLSLayer.receive_data)

    def renew(layer) -> None:
        if layer.tls is not None and layer.conn.transport_protocol == "tcp":
            fresh_bios(layer.tls)

    def receive_handshake_data_then_fresh_bios(self, data: bytes):
        done, err = yield from receive_handshake_data(self, data)
        if done and not err:
            renew(self)
        return done, err

    def send_data_then_fresh_bios(self, data: bytes):
        yield from send_data(self, data)
        if len(data) >= RENEW_AFTER:
            renew(self)

    def receive_data_then_fresh_bios(self, data: bytes):
        yield from receive_data(self, data)
        if len(data) >= RENEW_AFTER:
            renew(self)

    TLSLayer.receive_handshake_data = receive_handshake_data_then_fresh_bios
    TLSLayer.send_data = send_data_then_fresh_bios
    TLSLayer.receive_data = receive_data_then_fresh_bios


class ReleaseTlsBuffers:
    def __init__(self) -> None:
        install()

    def tls_established_client(self, data: tls.TlsData) -> None:
        if not data.is_dtls:
            _release_buffers(data.ssl_conn)

    def tls_established_server(self, data: tls.TlsData) -> None:
        if not data.is_dtls:
            _release_buffers(data.ssl_conn)
