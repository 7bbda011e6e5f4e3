"""Upstreams only the red-team suite needs: TLS servers with bad certificates (expired, for another
name, self-signed), and a reflecting upstream that echoes the credential it received in the places
a response carries data outside its header values and body (trailers, an informational 1xx
response, a header *name*).

Both record like tests.support.upstream.RecordingUpstream: TCP connections and request heads.
"""

from __future__ import annotations

import base64
import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bench.lib.pki import TestPKI
from tests.support.tcp_origin import TcpOrigin, read_head, server_tls
from tests.support.upstream import RecordingUpstream


def _write(cert: x509.Certificate, key, directory: Path, stem: str) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def bad_certificate(pki: TestPKI, kind: str, name: str, address: str) -> tuple[Path, Path]:
    """A server certificate for `name` that fails verification in one way only:
    `expired` (signed by the test CA, validity ended yesterday), `wrongname` (signed by the test CA
    for another name and no IP) or `selfsigned` (right name, its own issuer)."""
    if kind == "wrongname":
        return pki.issue(["someone-else.test"], [], stem=f"redteam-{kind}")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    if kind == "expired":
        issuer, signer = pki._cert.subject, pki._key  # the CA the gateway trusts
        before, after = now - datetime.timedelta(days=30), now - datetime.timedelta(days=1)
    elif kind == "selfsigned":
        issuer, signer = subject, key
        before, after = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=2)
    else:
        raise ValueError(kind)
    import ipaddress

    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(before)
        .not_valid_after(after)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name),
                                                    x509.IPAddress(ipaddress.ip_address(address))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(signer, hashes.SHA256())
    )
    return _write(cert, key, pki.directory, f"redteam-{kind}")


def bad_tls_upstream(pki: TestPKI, kind: str, name: str, address: str) -> RecordingUpstream:
    cert, key = bad_certificate(pki, kind, name, address)
    return RecordingUpstream(name, address, 443, cert, key)


class ReflectingUpstream(TcpOrigin):
    """TLS on address:443. Reads a request head, takes the credential from `Authorization:
    Bearer X` and answers by path:

    - `/trailer`      chunked 200 whose trailer `X-Token` holds the credential
    - `/early-hints`  `103 Early Hints` with the credential in a Link header, then a 200
    - `/header-name`  a 200 with a header whose *name* carries the credential in base64url and hex
    - anything else   200 "ok"
    """

    timeout = 5.0

    def __init__(self, name: str, host: str, cert: Path, key: Path, port: int = 443):
        self.name = name
        super().__init__(host, port, server_tls(cert, key, ["http/1.1"]))

    @property
    def heads(self) -> list[bytes]:
        return self.recorder.entries

    def handle(self, tls, number: int) -> None:
        got = read_head(tls)
        if got is None:
            return
        head = got[0]
        self.recorder.add(head)
        lines = head.decode("latin-1").split("\r\n")
        path = lines[0].split(" ")[1]
        token = "no-token"
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "authorization":
                token = value.strip().split(" ", 1)[-1]
        tls.sendall(self.answer(path, token))
        tls.recv(1)  # let the gateway read everything before we close

    @staticmethod
    def answer(path: str, token: str) -> bytes:
        raw = token.encode()
        if path.startswith("/trailer"):
            return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Token\r\n"
                    b"Content-Type: text/plain\r\n\r\n5\r\nhello\r\n0\r\nX-Token: " + raw + b"\r\n\r\n")
        if path.startswith("/early-hints"):
            return (b"HTTP/1.1 103 Early Hints\r\nLink: </style.css?t=" + raw + b">; rel=preload\r\n\r\n"
                    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok")
        if path.startswith("/header-name"):
            b64url = base64.urlsafe_b64encode(raw).rstrip(b"=")
            return (b"HTTP/1.1 200 OK\r\nX-" + b64url + b": 1\r\nX-" + raw.hex().encode() + b": 2\r\n"
                    b"Content-Length: 2\r\nContent-Type: text/plain\r\n\r\nok")
        return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"

    @property
    def touched(self) -> bool:
        return self.connections > 0 or bool(self.heads)

    @property
    def requests(self) -> list[bytes]:
        return self.heads
