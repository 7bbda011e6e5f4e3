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

    class Mismatched:  # the certificate, and another key of its type (P-256 once addons/leaf_keys.py is
        cert = entry.cert  # installed: OpenSSL puts a key of another type in another slot, no error)
        privatekey = (ec.generate_private_key(entry.privatekey.curve)
                      if isinstance(entry.privatekey, ec.EllipticCurvePrivateKey)
                      else rsa.generate_private_key(public_exponent=65537, key_size=2048))

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


def _pair(tlsconfig) -> tuple[SSL.Connection, SSL.Connection]:
    """A sandbox connection as TlsConfig makes it, and a pyOpenSSL client for it, both on memory BIOs."""
    addon, tctx = tlsconfig
    start = _client_start(tctx.options, "a.test")
    addon.tls_start_client(start)
    client = SSL.Connection(SSL.Context(SSL.TLS_CLIENT_METHOD), None)
    client.set_tlsext_host_name(b"a.test")
    client.set_connect_state()
    return start.ssl_conn, client


def _pump(frm: SSL.Connection, to: SSL.Connection) -> None:
    try:
        to.bio_write(frm.bio_read(1 << 20))
    except SSL.WantReadError:
        pass


def _shake(server: SSL.Connection, client: SSL.Connection) -> None:
    for _ in range(10):
        for conn in (client, server):
            try:
                conn.do_handshake()
            except SSL.WantReadError:
                pass
        _pump(client, server)
        _pump(server, client)
    for conn in (client, server):
        conn.do_handshake()  # (raises if either is not done)
        try:
            conn.recv(1)  # what came after the handshake (TLS 1.3 tickets) is read, as mitmproxy does
        except SSL.WantReadError:
            pass


def _bios(conn: SSL.Connection):
    return conn._into_ssl, conn._from_ssl


def test_a_connection_whose_bios_are_empty_gets_fresh_ones_and_goes_on(tlsconfig):
    server, client = _pair(tlsconfig)
    _shake(server, client)
    for conn in (server, client):
        old = _bios(conn)
        assert tls_memory.fresh_bios(conn)
        assert not set(old) & set(_bios(conn))  # (the old ones were freed by SSL_set_bio)
    # OpenSSL reads and writes through the new ones, both ways
    client.sendall(b"ping")
    _pump(client, server)
    assert server.recv(100) == b"ping"
    server.sendall(b"pong")
    _pump(server, client)
    assert client.recv(100) == b"pong"


def test_a_bio_with_bytes_in_it_is_kept(tlsconfig):
    server, client = _pair(tlsconfig)
    _shake(server, client)
    client.sendall(b"not sent yet")  # in the client's outgoing BIO
    before = _bios(client)
    assert not tls_memory.fresh_bios(client)
    assert _bios(client) == before
    _pump(client, server)
    assert not tls_memory.fresh_bios(server)  # in the server's incoming BIO, not read yet
    assert server.recv(100) == b"not sent yet"
    assert tls_memory.fresh_bios(server)  # read: now it can go


def _drive(steps, client: SSL.Connection):
    """Run a TLS layer's generator as mitmproxy would: what it sends goes to `client`."""
    from mitmproxy.proxy import commands

    try:
        while True:
            command = steps.send(None)
            if isinstance(command, commands.SendData):
                client.bio_write(command.data)
    except StopIteration as stop:
        return stop.value


def _layer_after_handshake(tlsconfig):
    """mitmproxy's TLS layer of a sandbox connection, its handshake driven to the end as mitmproxy's
    layer drives it, and the client; and the layer's BIOs as they were before the handshake."""
    from mitmproxy.proxy.layers.tls import ClientTLSLayer, TLSLayer

    server, client = _pair(tlsconfig)
    addon, tctx = tlsconfig
    ctx = _client_start(tctx.options, "a.test").context
    ctx.layers = ["the layer under it (a proxy mode's)"]
    layer = ClientTLSLayer(ctx)
    layer.tls = server
    server.set_accept_state()
    before = _bios(server)
    for _ in range(10):
        try:
            client.do_handshake()
        except SSL.WantReadError:
            pass
        try:
            data = client.bio_read(1 << 20)
        except SSL.WantReadError:
            data = b""
        # (TLSLayer's: ClientTLSLayer's own would parse a ClientHello first, and then call it)
        done, err = _drive(TLSLayer.receive_handshake_data(layer, data), client)
        assert err is None
        if done:
            client.do_handshake()
            return layer, client, before
    raise AssertionError("no handshake")


def test_mitmproxy_s_tls_layer_renews_the_bios_when_its_handshake_is_done(tlsconfig):
    """What the handshake left to send (TLS 1.3 tickets) was sent first: the client reads on."""
    layer, client, before = _layer_after_handshake(tlsconfig)
    assert not set(before) & set(_bios(layer.tls))
    client.sendall(b"GET / HTTP/1.1\r\n\r\n")
    _pump(client, layer.tls)
    assert layer.tls.recv(100) == b"GET / HTTP/1.1\r\n\r\n"


def _malloc_in_use() -> int:
    import ctypes

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]
    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = Mallinfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def test_a_large_piece_sent_or_read_does_not_leave_its_buffers_behind(tlsconfig):
    """A memory BIO keeps the capacity of the most it held: a 256 KiB piece of a body sent to the
    sandbox left ~360 KiB on the connection for its whole life. After a piece of RENEW_AFTER bytes
    or more, the BIOs are new; after a smaller one they are left alone."""
    layer, client, _ = _layer_after_handshake(tlsconfig)
    small = _bios(layer.tls)
    _drive(layer.send_data(b"s" * 100), client)
    assert _bios(layer.tls) == small
    assert client.recv(1000) == b"s" * 100

    in_use = _malloc_in_use()
    _drive(layer.send_data(b"x" * 256 * 1024), client)
    assert not set(small) & set(_bios(layer.tls))
    received = bytearray()
    while len(received) < 256 * 1024:
        received += client.recv(1 << 20)
    assert received == b"x" * 256 * 1024
    del received
    assert tls_memory.fresh_bios(client)  # (the client's own BIO grew as much: not what is measured)
    assert _malloc_in_use() - in_use < 64 * 1024  # (~360 KiB more when the layer's BIOs were kept)

    sent = _bios(layer.tls)
    client.sendall(b"y" * 64 * 1024)
    _drive(layer.receive_data(client.bio_read(1 << 20)), client)  # (its child layer gets the bytes)
    assert not set(sent) & set(_bios(layer.tls))
