"""Upstreams for the credential tests: an httpbin-like HTTPS server that echoes (and leaks) what it got.

One `EchoUpstream` serves TLS (HTTP/1.1 only) on address:443 for a set of names, records every
request like tests.support.upstream.RecordingUpstream (headers in order, SNI, TCP connections) and
answers by path:

- `/v1/anything...`  JSON echo of method, path, query, headers and body, plus every credential-ish
  value it received (header values, the part after `Bearer `/`token `, query values) re-encoded as
  raw, base64, base64url, hex (both cases), URL-encoded and inside a Basic credential;
- `/v1/error`        401 that puts the token in the error body and in WWW-Authenticate;
- `/v1/headers`      200 that sets response headers holding the token in several encodings;
- `/v1/stream`       a large body with the token (in several forms) straddling every write boundary,
                     `?size=N&chunk=C&te=cl|chunked`;
- `/v1/gzip`         the echo, compressed with `?enc=gzip|deflate|br|zstd|x-unknown|broken-gzip`,
                     optionally padded with `?pad=N` incompressible bytes (to exceed 1 MB compressed);
- `/v1/encoded`      the token URL-encoded the way urllib's defaults do it (`quote(token)` keeps `/`);
- `/v1/redirect`     302 to `?to=URL`;
- `/v1/reason`       401 with the token in the HTTP/1.1 reason phrase;
- `/v1/ws`           a WebSocket echo (wsproto) that answers every message with the token in it (a text
                     and a binary message), pings with the token as payload when asked ("ping please") and
                     closes with the token in the close reason when asked ("close please").

The "token" is whatever the request carried in Authorization (after the scheme word), else in
X-Api-Key, else in the `api_key` query parameter; `/v1/headers` falls back to `fallback_token` (so
an unbound host can leak a value it knows by itself in response headers).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import http.server
import json
import os
import ssl
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, quote, quote_plus, urlsplit

from tests.support.fence import AcceptFence

WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


@dataclass
class Seen:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    sni: str | None

    def header_all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]

    @property
    def host(self) -> str | None:
        values = self.header_all("host")
        return values[0] if values else None

    def everything(self) -> str:
        """Everything the upstream got, as one string (to count occurrences of a value)."""
        head = "\n".join(f"{k}: {v}" for k, v in self.headers)
        return f"{self.method} {self.path}\n{head}\n\n" + self.body.decode("utf-8", "surrogateescape")


def encodings(value: str) -> dict[str, str]:
    """The encodings an upstream might echo a credential in (computed here, not by the gateway)."""
    raw = value.encode()
    return {
        "raw": value,
        "base64": base64.b64encode(raw).decode(),
        "base64url": base64.urlsafe_b64encode(raw).decode().rstrip("="),
        "hex": raw.hex(),
        "HEX": raw.hex().upper(),
        "urlencoded": quote(value, safe=""),
        "urlencoded_plus": quote_plus(value),
        "basic": base64.b64encode(b"x-access-token:" + raw).decode(),
        "basic_offset1": base64.b64encode(b"u:" + raw + b":x").decode(),
        "basic_offset2": base64.b64encode(b"ab:" + raw).decode(),
        "in_blob": base64.b64encode(b"\x00" + raw + b"\x00\x01").decode(),
    }


def stream_body(size: int, chunk: int, token: str) -> tuple[bytes, list[tuple[int, int]]]:
    """A `size`-byte body of dots with a form of `token` straddling every multiple of `chunk`
    (half across, and one byte across on either side); returns the body and the (start, end)
    ranges of what was planted."""
    forms = [v.encode() for k, v in encodings(token).items() if k in ("raw", "base64", "base64url", "hex", "HEX",
                                                                     "urlencoded")]
    body = bytearray(b"." * size)
    ranges: list[tuple[int, int]] = []
    k = 1
    while (k + 1) * chunk < size:
        form = forms[k % len(forms)]
        split = (len(form) // 2, 1, len(form) - 1)[k % 3]
        start = k * chunk - split
        body[start:start + len(form)] = form
        ranges.append((start, start + len(form)))
        k += 1
    return bytes(body), ranges


_NOISE = b"!#$(),.:;<>?@[]^{|}~*"


_BOMB: list[bytes] = []


def brotli_bomb(size: int = 96 << 20) -> bytes:
    """Brotli of `size` zero bytes (made once, in 1 MiB steps: the zeros are never held whole)."""
    if not _BOMB:
        import brotli

        compressor, zeros, out = brotli.Compressor(quality=5), bytes(1 << 20), []
        for _ in range(size >> 20):
            out.append(compressor.process(zeros))
        out.append(compressor.finish())
        _BOMB.append(b"".join(out))
    return _BOMB[0]


_BOMBS: dict[tuple[str, int], bytes] = {}


def bomb(encoding: str, size: int = 96 << 20) -> bytes:
    """`size` zero bytes in `encoding` (br, gzip, deflate, zstd), made once, 1 MiB at a time."""
    if encoding == "br":
        return brotli_bomb(size)
    if (encoding, size) not in _BOMBS:
        import zlib

        zeros, out = bytes(1 << 20), []
        if encoding == "zstd":
            try:
                from backports import zstd
            except ImportError:  # Python 3.14+
                from compression import zstd  # type: ignore[no-redef]
            compressor = zstd.ZstdCompressor()
            out = [compressor.compress(zeros) for _ in range(size >> 20)] + [compressor.flush()]
        else:
            compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
            out = [compressor.compress(zeros) for _ in range(size >> 20)] + [compressor.flush()]
        _BOMBS[encoding, size] = b"".join(out)
    return _BOMBS[encoding, size]


def incompressible(n: int) -> bytes:
    """Random punctuation: compresses poorly (about 4.4 bits a byte) and never looks like base64 or hex."""
    return bytes(_NOISE[b % len(_NOISE)] for b in os.urandom(n))


@dataclass
class EchoUpstream:
    name: str
    host: str
    port: int
    cert: Path
    key: Path
    fallback_token: str | None = None
    requests: list[Seen] = field(default_factory=list)
    connections: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        # Notified whenever what the recorder has seen changes (a connection accepted, a request
        # recorded, a connection's handler finished): tests wait on these events, never on sleeps.
        self._changed = threading.Condition(self._lock)
        self._in_flight: set[object] = set()  # connections accepted since reset() whose handler runs
        self._fence = AcceptFence()
        upstream = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                seen = Seen(self.command, self.path, list(self.headers.items()), body,
                            getattr(self.connection, "egress_sni", None))
                with upstream._changed:
                    # Only a connection accepted since reset() records: a request an earlier test's
                    # connection sends late (a streamed head, parsed after the reset) is that test's.
                    if getattr(self.connection, "egress_token", None) in upstream._in_flight:
                        upstream.requests.append(seen)
                    upstream._changed.notify_all()
                route = urlsplit(self.path).path
                for prefix, handler in (("/v1/anything", self.anything), ("/v1/error", self.error),
                                        ("/v1/headers", self.leak_headers), ("/v1/stream", self.stream),
                                        ("/v1/gzip", self.compressed), ("/v1/redirect", self.redirect),
                                        ("/v1/ws", self.websocket), ("/v1/encoded", self.encoded),
                                        ("/v1/reason", self.reason), ("/v1/trailers", self.trailers),
                                        ("/v1/badhead", self.bad_head), ("/v1/escaped", self.escaped),
                                        ("/v1/te-gzip", self.te_gzip), ("/v1/bomb", self.bomb)):
                    if route.startswith(prefix):
                        return handler(seen)
                return self.anything(seen)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = do_PATCH = _handle

            # --- helpers

            def query(self) -> dict[str, str]:
                return dict(parse_qsl(urlsplit(self.path).query, keep_blank_values=True))

            def token(self, seen: Seen, fallback: bool = False) -> str:
                auth = seen.header_all("authorization")
                if auth:
                    return auth[0].split(" ", 1)[-1]
                key = seen.header_all("x-api-key")
                if key:
                    return key[0]
                query = self.query()
                if "api_key" in query:
                    return query["api_key"]
                return (upstream.fallback_token if fallback else None) or "no-token-at-all"

            def send(self, status: int, body: bytes, headers: list[tuple[str, str]] = (),
                     content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def echo_document(self, seen: Seen) -> bytes:
                candidates: dict[str, str] = {}
                for k, v in seen.headers:
                    candidates[f"header:{k}"] = v
                    if " " in v:
                        candidates[f"header:{k}:credential"] = v.split(" ", 1)[1]
                for k, v in parse_qsl(urlsplit(seen.path).query, keep_blank_values=True):
                    candidates[f"query:{k}"] = v
                candidates["token"] = self.token(seen)
                document = {
                    "method": seen.method,
                    "url": f"https://{seen.host}{seen.path}",
                    "raw_query": urlsplit(seen.path).query,
                    "args": dict(parse_qsl(urlsplit(seen.path).query, keep_blank_values=True)),
                    "headers": [[k, v] for k, v in seen.headers],
                    "data": seen.body.decode("utf-8", "replace"),
                    "data_base64": base64.b64encode(seen.body).decode(),
                    "echoed": {k: encodings(v) for k, v in candidates.items() if len(v) >= 8},
                }
                return json.dumps(document, indent=1).encode()

            # --- routes

            def anything(self, seen: Seen) -> None:
                self.send(200, self.echo_document(seen))

            def error(self, seen: Seen) -> None:
                token = self.token(seen)
                forms = encodings(token)
                body = (f"401 Unauthorized: the token {token!s} is not valid here.\n"
                        f"debug: basic={forms['basic']} b64={forms['base64']} b64url={forms['base64url']}\n"
                        f"hex={forms['hex']} HEX={forms['HEX']} url={forms['urlencoded']}\n").encode()
                self.send(401, body, [("WWW-Authenticate", f'Bearer error="invalid_token", token="{token}"'),
                                      ("X-Debug-Token", forms["base64"])], content_type="text/plain")

            def leak_headers(self, seen: Seen) -> None:
                token = self.token(seen, fallback=True)
                forms = encodings(token)
                headers = [
                    ("X-Echo-Token", token),
                    ("X-Echo-Base64", forms["base64"]),
                    ("X-Echo-Base64url", forms["base64url"]),
                    ("X-Echo-Hex", forms["hex"]),
                    ("X-Echo-Hex", forms["HEX"]),  # a duplicate header name
                    ("Set-Cookie", f"session={forms['urlencoded']}; Secure"),
                    ("Location", f"https://elsewhere.example/cb?token={forms['urlencoded_plus']}"),
                    ("X-Basic", f"Basic {forms['basic']}"),
                ]
                self.send(200, b"headers only\n", headers, content_type="text/plain")

            def stream(self, seen: Seen) -> None:
                query = self.query()
                size, chunk = int(query.get("size", 3_000_000)), int(query.get("chunk", 65536))
                chunked = query.get("te") == "chunked"
                body, _ = stream_body(size, chunk, self.token(seen))
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                else:
                    self.send_header("Content-Length", str(size))
                self.end_headers()
                self.wfile.flush()
                for start in range(0, size, chunk):
                    piece = body[start:start + chunk]
                    if chunked:
                        self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                    else:
                        self.wfile.write(piece)
                    self.wfile.flush()
                    time.sleep(0.003)  # pacing, not synchronisation: every write its own read at the gateway
                if chunked:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()

            def compressed(self, seen: Seen) -> None:
                query = self.query()
                enc = query.get("enc", "gzip")
                token = self.token(seen)
                plain = self.echo_document(seen)
                pad = int(query.get("pad", 0))
                if pad:
                    forms = encodings(token)
                    plain = (plain + b"\n" + incompressible(pad // 2) + b"\n" + forms["raw"].encode() + b" "
                             + forms["base64"].encode() + b"\n" + incompressible(pad // 2) + b"\nend "
                             + forms["hex"].encode() + b"\n")
                if enc == "gzip":
                    data = gzip.compress(plain)
                elif enc == "deflate":
                    data = zlib.compress(plain)
                elif enc == "br":
                    import brotli
                    data = brotli.compress(plain)
                elif enc == "broken-gzip":
                    enc, data = "gzip", b"\x1f\x8b\x08\x00garbage" + plain
                else:  # an encoding nobody knows: the body is the plain echo
                    data = plain
                self.send(200, data, [("Content-Encoding", enc), ("X-Plain-Length", str(len(plain)))])

            def encoded(self, seen: Seen) -> None:
                token = self.token(seen)
                style = self.query().get("style", "quote")
                value = {"quote": quote(token), "quote_plus": quote_plus(token, safe="/")}[style]
                self.send(200, f"your token, {style}: {value}\n".encode(), content_type="text/plain")

            def reason(self, seen: Seen) -> None:
                body = b"see the status line\n"
                self.send_response(401, f"Invalid token {self.token(seen)}")
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def trailers(self, seen: Seen) -> None:
                """A chunked SSE-like body whose trailer fields quote the token (gRPC puts its status
                message there)."""
                token = self.token(seen)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Trailer", "X-Echo, Grpc-Message")
                self.end_headers()
                event = b"data: {\"ok\": true}\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                extra = (b"Connection: close\r\nContent-Length: 5\r\nHost: other.test\r\n"
                         if self.query().get("forbidden") else b"")
                self.wfile.write(b"0\r\nX-Echo: %s\r\nGrpc-Message: bad token %s\r\n%s\r\n"
                                 % (token.encode(), quote(token, safe="").encode(), extra))
                self.close_connection = True

            def bad_head(self, seen: Seen) -> None:
                """A response head mitmproxy cannot parse, quoting the token (?kind=nocolon|te|short)."""
                token = self.token(seen).encode()
                kind = self.query().get("kind", "nocolon")
                heads = {
                    "nocolon": b"HTTP/1.1 200 OK\r\nX-Echo " + token + b"\r\nContent-Length: 0\r\n\r\n",
                    "te": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: " + token + b"\r\n\r\n",
                    "short": b"HTTP/1.1 200 OK\r\nX-Echo: " + token,
                    "status": b"HTTP/1.1 2x0 " + token + b"\r\n\r\n",
                }
                self.wfile.write(heads[kind])
                self.wfile.flush()
                self.close_connection = True

            def escaped(self, seen: Seen) -> None:
                """The token the way frameworks escape a string they echo (?style=...)."""
                import html as html_module

                token = self.token(seen)
                style = self.query().get("style", "php-json")
                encoders = {
                    "php-json": lambda t: json.dumps({"token": t}).replace("/", "\\/"),
                    # System.Text.Json's default encoder escapes HTML-sensitive characters and '+'.
                    "dotnet-json": lambda t: json.dumps({"token": t}).translate(
                        {ord(c): f"\\u{ord(c):04X}" for c in "+&'<>`"}),
                    "html": lambda t: f"<p>{html_module.escape(t)}</p>",
                    "go-html": lambda t: "<p>" + html_module.escape(t).replace("+", "&#43;") + "</p>",
                    "upper-hex": lambda t: t.encode().hex().upper(),
                    "mixed-hex": lambda t: "".join(c.upper() if i % 3 else c for i, c in enumerate(t.encode().hex())),
                    "lower-percent": lambda t: "".join(c.lower() if "%" in quote(t, safe="") else c
                                                       for c in quote(t, safe="")),
                    "utf16": None,
                    "mime": lambda t: base64.encodebytes(b"prefix:" + t.encode() + b":suffix" * 20).decode(),
                }
                if style == "utf16":
                    body = json.dumps({"token": token}).encode("utf-16")
                    return self.send(200, body, content_type="application/json; charset=utf-16")
                self.send(200, encoders[style](token).encode(), content_type="text/plain")

            def bomb(self, seen: Seen) -> None:
                """A few hundred bytes of brotli that decode to 96 MiB (?te=cl|chunked; ?enc=gzip,
                deflate or zstd for the same zeros in another coding)."""
                encoding = self.query().get("enc", "br")
                data = bomb(encoding, int(self.query().get("mib", 96)) << 20)  # ?mib=N: N MiB of zeros
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Encoding", encoding)
                if self.query().get("te") == "chunked":
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
                else:
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                self.close_connection = True

            def te_gzip(self, seen: Seen) -> None:
                """`Transfer-Encoding: gzip, chunked`: the gzip layer is a transfer-coding, which the
                redactor must not be handed undecoded."""
                data = gzip.compress(f"token={self.token(seen)}".encode())
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Transfer-Encoding", "gzip, chunked")
                self.end_headers()
                self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
                self.close_connection = True

            def redirect(self, seen: Seen) -> None:
                target = self.query().get("to", "/v1/anything")
                self.send(302, b"see elsewhere\n", [("Location", target)], content_type="text/plain")

            def websocket(self, seen: Seen) -> None:
                from wsproto.connection import Connection, ConnectionType
                from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage

                key = self.headers.get("Sec-WebSocket-Key", "")
                accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
                token = self.token(seen)
                self.send_response(101)
                self.send_header("Upgrade", "websocket")
                self.send_header("Connection", "Upgrade")
                self.send_header("Sec-WebSocket-Accept", accept)
                self.end_headers()
                self.wfile.flush()
                ws = Connection(ConnectionType.SERVER)
                sock = self.connection
                sock.settimeout(5)
                pending = ""
                try:
                    while True:
                        data = sock.recv(65536)
                        if not data:
                            break
                        ws.receive_data(data)
                        out = b""
                        for event in ws.events():
                            if isinstance(event, (TextMessage, BytesMessage)):
                                pending += event.data if isinstance(event, TextMessage) else event.data.decode()
                                if not event.message_finished:
                                    continue
                                if pending == "ping please":
                                    sock.sendall(ws.send(Ping(payload=f"ping {token}".encode())))
                                    pending = ""
                                    continue
                                if pending == "close please":
                                    sock.sendall(ws.send(CloseConnection(code=4001, reason=f"bad token {token}")))
                                    pending = ""
                                    continue
                                forms = encodings(token)
                                reply = (f"you said {pending!r}; your token is {token}; "
                                         f"b64 {forms['base64']}; hex {forms['hex']}; basic {forms['basic']}")
                                pending = ""
                                out += ws.send(TextMessage(data=reply))
                                out += ws.send(BytesMessage(data=b"binary " + token.encode()))
                            elif isinstance(event, CloseConnection):
                                out += ws.send(event.response())
                                sock.sendall(out)
                                return
                        if out:
                            sock.sendall(out)
                except Exception:  # a closed socket, or wsproto refusing to answer a close it started
                    pass
                finally:
                    self.close_connection = True

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

            def get_request(self):
                sock, addr = super().get_request()
                if upstream._fence.claims(sock, addr):  # settle()'s own connection: not counted
                    raise OSError("settle probe")  # socketserver drops the request
                token = object()
                with upstream._changed:
                    upstream.connections += 1
                    upstream._in_flight.add(token)
                    upstream._changed.notify_all()
                sock.settimeout(5)
                holder = {}

                def remember_sni(ssl_sock, server_name, ctx):
                    holder["sni"] = server_name

                upstream._tls.sni_callback = remember_sni
                try:
                    sock = upstream._tls.wrap_socket(sock, server_side=True)
                except BaseException:
                    upstream._finished(token)
                    raise
                sock.egress_sni = holder.get("sni")
                sock.egress_token = token
                sock.settimeout(None)
                return sock, addr

            def process_request_thread(self, request, client_address):
                try:
                    super().process_request_thread(request, client_address)
                finally:  # the handler is done with this connection (it closed, or the peer did)
                    upstream._finished(getattr(request, "egress_token", None))

            def handle_error(self, request, client_address):  # TLS resets etc.: quiet
                pass

        self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._tls.load_cert_chain(str(self.cert), str(self.key))
        self._tls.set_alpn_protocols(["http/1.1"])
        self._server = Server((self.host, self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset(self) -> None:
        with self._changed:
            self.requests.clear()
            self.connections = 0
            self._in_flight.clear()  # connections of earlier tests no longer count for settled
            self._changed.notify_all()

    def _finished(self, token: object) -> None:
        with self._changed:
            self._in_flight.discard(token)
            self._changed.notify_all()

    @property
    def changed(self) -> threading.Condition:
        """Notified at every change of what this origin has seen: wait on it with
        `tests.support.waiting.wait_for(predicate, cond=origin.changed)`."""
        return self._changed

    def settle(self, timeout: float = 5.0) -> None:
        """A fence (tests.support.fence): every connection that reached this origin before the call
        has been counted once this returns."""
        self._fence.settle((self.host, self.port), timeout)

    @property
    def settled(self) -> bool:
        """Every connection accepted since reset() has been handled to its end: whatever
        reached this origin is recorded."""
        return not self._in_flight

    @property
    def touched(self) -> bool:
        return self.connections > 0 or bool(self.requests)

    def for_host(self, name: str) -> list[Seen]:
        return [r for r in self.requests if (r.host or "").split(":")[0].lower() == name]

