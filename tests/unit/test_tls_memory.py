"""addons/tls_memory.py: the TLS connections mitmproxy's TlsConfig makes release their buffers from the
first record on, and the sandbox's share one OpenSSL copy of each leaf certificate and key, with the
handshake unchanged: the certificate the sandbox sees is the one for the name it asked, signed by the
gateway's CA, and a key that does not match the certificate is refused."""

from __future__ import annotations

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from mitmproxy import connection, tls
from mitmproxy.addons.tlsconfig import TlsConfig
from mitmproxy.proxy import context
from mitmproxy.test import taddons
from OpenSSL import SSL

from addons import tls_memory
from addons.tls_memory import ReleaseTlsBuffers, SharedIdentities

_lib = SSL._lib


def _mode(conn: SSL.Connection) -> int:
    return _lib.SSL_set_mode(conn._ssl, 0)  # (SSL_CTRL_MODE ors its argument in and returns the mode)


@pytest.fixture
def tlsconfig(tmp_path):
    ReleaseTlsBuffers()  # installs the wrappers
    addon = TlsConfig()
    with taddons.context(addon) as tctx:
        tctx.configure(addon, confdir=str(tmp_path))
        yield addon, tctx


def _client_start(options, sni: str) -> tls.TlsData:
    client = connection.Client(peername=("127.0.0.9", 40000), sockname=("127.0.0.1", 8080), sni=sni)
    ctx = context.Context(client, options)
    return tls.TlsData(client, context=ctx)


def _handshake(server: SSL.Connection, ca_path: str, sni: str) -> x509.Certificate:
    client_ctx = SSL.Context(SSL.TLS_CLIENT_METHOD)
    client_ctx.load_verify_locations(ca_path)
    client_ctx.set_verify(SSL.VERIFY_PEER, lambda *args: args[-1])
    client = SSL.Connection(client_ctx, None)
    client.set_tlsext_host_name(sni.encode())
    client.set_connect_state()
    done = {"client": False, "server": False}
    for _ in range(20):
        for name, conn, peer in (("client", client, server), ("server", server, client)):
            if not done[name]:
                try:
                    conn.do_handshake()
                    done[name] = True
                except SSL.WantReadError:
                    pass
            try:
                data = conn.bio_read(65536)
            except SSL.WantReadError:
                data = b""
            if data:
                peer.bio_write(data)
        if all(done.values()):
            break
    assert all(done.values())
    # application data both ways after the handshake (buffers released and taken again)
    client.sendall(b"ping")
    server.bio_write(client.bio_read(65536))
    assert server.recv(100) == b"ping"
    server.sendall(b"pong")
    client.bio_write(server.bio_read(65536))
    assert client.recv(100) == b"pong"
    return client.get_peer_certificate(as_cryptography=True)


def test_sandbox_connections_release_buffers_and_share_the_certificate_and_key(tlsconfig, tmp_path):
    addon, tctx = tlsconfig
    first, second, other = (_client_start(tctx.options, sni) for sni in ("a.test", "a.test", "b.test"))
    for start in (first, second, other):
        addon.tls_start_client(start)
        assert _mode(start.ssl_conn) & _lib.SSL_MODE_RELEASE_BUFFERS
    cert = lambda start: _lib.SSL_get_certificate(start.ssl_conn._ssl)  # noqa: E731
    assert cert(first) == cert(second)  # one OpenSSL certificate for both
    assert cert(first) != cert(other)  # each name its own
    ca = str(tmp_path / "mitmproxy-ca-cert.pem")
    for start, name in ((first, "a.test"), (second, "a.test"), (other, "b.test")):
        seen = _handshake(start.ssl_conn, ca, name)
        names = seen.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert name in names.get_values_for_type(x509.DNSName)


def test_upstream_connections_release_buffers(tlsconfig):
    addon, tctx = tlsconfig
    server = connection.Server(address=("upstream.test", 443), sni="upstream.test")
    start = _client_start(tctx.options, "upstream.test")
    data = tls.TlsData(server, context=start.context)
    addon.tls_start_server(data)
    assert _mode(data.ssl_conn) & _lib.SSL_MODE_RELEASE_BUFFERS


def test_a_connection_another_addon_made_is_left_as_it_was_made(tlsconfig):
    addon, tctx = tlsconfig
    start = _client_start(tctx.options, "a.test")
    made = SSL.Connection(SSL.Context(SSL.TLS_SERVER_METHOD), None)
    start.ssl_conn = made
    addon.tls_start_client(start)
    assert start.ssl_conn is made
    assert _lib.SSL_get_certificate(made._ssl) == SSL._ffi.NULL
    assert not _mode(made) & _lib.SSL_MODE_RELEASE_BUFFERS


def test_a_key_that_does_not_match_the_certificate_is_refused(tlsconfig):
    addon, tctx = tlsconfig
    start = _client_start(tctx.options, "a.test")
    addon.tls_start_client(start)
    entry = addon.get_cert(start.context)

    class Mismatched:  # the certificate, and another key of its type
        cert = entry.cert
        privatekey = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    with pytest.raises(SSL.Error):
        SharedIdentities().apply(start.ssl_conn, Mismatched)


def test_the_shared_copies_are_bounded():
    shared = SharedIdentities(size=2)
    keys = [ec.generate_private_key(ec.SECP256R1()) for _ in range(3)]
    first = shared.key(keys[0])
    assert shared.key(keys[0]) is first
    shared.key(keys[1])
    shared.key(keys[2])
    assert len(shared._keys) == 2
    assert shared.key(keys[0]) is not first  # dropped, converted again


def test_installed_once():
    tls_memory.install()
    wrapped = TlsConfig.tls_start_client
    tls_memory.install()
    assert TlsConfig.tls_start_client is wrapped
