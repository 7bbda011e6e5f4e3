"""Upstreams only the red-team suite needs: TLS servers with bad certificates (expired, for another
name, self-signed), and a reflecting upstream that echoes the credential it received in the places
a response carries data outside its header values and body (trailers, an informational 1xx
response, a header *name*).

Both record like tests.support.upstream.RecordingUpstream: TCP connections and request heads.
"""

from __future__ import annotations

import base64
from pathlib import Path

from bench.lib.pki import TestPKI
from tests.support.certificates import issue_cert
from tests.support.tcp_origin import TcpOrigin, read_head, server_tls
from tests.support.upstream import RecordingUpstream


def bad_certificate(pki: TestPKI, kind: str, name: str, address: str) -> tuple[Path, Path]:
    """A server certificate for `name` that fails verification in one way only:
    `expired` (signed by the test CA, validity ended yesterday), `wrongname` (signed by the test CA
    for another name and no IP) or `selfsigned` (right name, its own issuer)."""
    if kind == "wrongname":
        return pki.issue(["someone-else.test"], [], stem=f"redteam-{kind}")
    if kind not in ("expired", "selfsigned"):
        raise ValueError(kind)
    return issue_cert(pki, pki.directory, f"redteam-{kind}", [name], [address],
                      expired=kind == "expired", self_signed=kind == "selfsigned")


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
