"""The control API's listener: HTTP/1.1 (keep-alive) on a unix socket or on HOST:PORT, from
threads of its own (like the metrics endpoint), so it answers however busy the proxy's loop is.

Who may talk to it, decided here:
- `unix:PATH`: whoever can connect to the socket. It is created mode 0600 (0660 with `group`),
  owned by the gateway's user, in a directory the operator controls; the principal is the peer's
  uid (`uid:N`, SO_PEERCRED), or a token's name when the request carries a valid token.
- `HOST:PORT`: every request needs `Authorization: Bearer TOKEN`, TOKEN one of the token file's;
  the principal is that token's name. No TLS here (a node-local listener: loopback or the pod
  network); put mTLS in front if the platform's network is not trusted.

Bounds: `MAX_CONNECTIONS` at once (more are answered 503 and closed), a request head within
http.server's limits (100 fields, 64 KiB lines), a body only with Content-Length and at most
`max_body` bytes (413), `TIMEOUT` seconds of silence per read. The service (gateway/control.py)
does the rest; this module knows only bytes and who sent them.
"""

from __future__ import annotations

import contextlib
import grp
import hmac
import json
import logging
import os
import socket
import stat
import struct
import threading
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from socketserver import TCPServer, ThreadingMixIn, UnixStreamServer
from urllib.parse import parse_qs, urlsplit

from .control import DEFAULT_SOCKET, ControlService, Reply
from .listen import parse_listen
from .ratelimit import retry_after_header

logger = logging.getLogger("egress")

MAX_CONNECTIONS = 64
MAX_PER_PEER = 8  # TCP connections at once from one peer address: one peer cannot take every slot
TIMEOUT = 10.0  # of silence per read, and in all from a request's first byte awaited to its body read
_TOKEN_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,62}$"


class ControlSpecError(ValueError):
    pass


def parse_spec(spec: str) -> tuple[str, object]:
    """`unix:PATH` (`unix` alone: DEFAULT_SOCKET) -> ("unix", path); `HOST:PORT` -> ("tcp", (ip, port))."""
    spec = spec.strip()
    if spec == "unix" or spec == "unix:":
        return "unix", DEFAULT_SOCKET
    if spec.startswith("unix:"):
        path = spec[5:]
        if not path.startswith("/"):
            raise ControlSpecError(f"{spec!r}: the socket path must be absolute")
        return "unix", path
    try:
        return "tcp", parse_listen(spec, forms="unix:PATH, HOST:PORT or [IPV6]:PORT")
    except ValueError as exc:
        raise ControlSpecError(str(exc)) from None


def read_tokens(path: str) -> dict[str, str]:
    """The token file: one `NAME:TOKEN` per line (`#` comments, blank lines ignored); a line of a
    bare TOKEN is named `token-N`. Tokens of fewer than 16 characters are refused. token -> name."""
    import re

    tokens: dict[str, str] = {}
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXO):
        raise ControlSpecError(f"{path}: the token file must not be readable by others (chmod 600)")
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, token = line.partition(":")
        if not sep:
            name, token = f"token-{n}", line
        name, token = name.strip(), token.strip()
        if not re.match(_TOKEN_NAME_RE, name):
            raise ControlSpecError(f"{path}:{n}: a principal name is letters, digits, '_.@-'")
        if len(token) < 16:
            raise ControlSpecError(f"{path}:{n}: a token must be at least 16 characters")
        tokens[token] = name
    if not tokens:
        raise ControlSpecError(f"{path}: no token in the file")
    return tokens


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "egress-gateway-control"
    sys_version = ""
    timeout = TIMEOUT

    def log_message(self, format, *args):  # noqa: A002  (every change is audited; no access log)
        pass

    def handle_one_request(self):
        """One request, read whole within TIMEOUT or the connection is cut (review 24: a byte every
        5 s kept 64 unauthenticated connections, every slot, for as long as their sender liked)."""
        self._deadline = threading.Timer(TIMEOUT, self._cut)
        self._deadline.daemon = True
        self._deadline.start()
        try:
            super().handle_one_request()
        finally:
            self._deadline.cancel()

    def _cut(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _principal(self) -> str | None:
        server: ControlServer = self.server.owner  # type: ignore[attr-defined]
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer ") and server.tokens:
            offered = auth[7:].strip().encode()
            name = None
            for token, who in server.tokens.items():  # compare with every token: no early exit to time
                if hmac.compare_digest(offered, token.encode()):
                    name = who
            if name is not None:
                return name
            return None
        if server.kind == "unix" and not auth:
            return server.peer_principal(self.connection)
        return None

    def _serve(self) -> None:
        server: ControlServer = self.server.owner  # type: ignore[attr-defined]
        service = server.service
        url = urlsplit(self.path)
        path = url.path
        principal = self._principal()
        if principal is None:
            self._reply(service.refuse(401, "unauthorized", "a valid bearer token is required", "anonymous", path))
            return
        if self.headers.get("Transfer-Encoding"):
            self._reply(service.refuse(411, "length_required", "send the body with Content-Length", principal, path))
            self.close_connection = True
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= service.limits.max_body:
            self._reply(service.refuse(413, "request_too_large", f"a body is at most {service.limits.max_body} "
                                                                 "bytes", principal, path))
            self.close_connection = True
            return
        body = self.rfile.read(length) if length else b""
        self._deadline.cancel()  # read whole: what the service takes is not the client's time
        try:
            query = parse_qs(url.query, keep_blank_values=True, max_num_fields=32)
        except ValueError:
            query = None
        if query is None:
            reply = service.refuse(400, "bad_request", "too many query fields", principal, path)
        else:
            try:
                reply = server.dispatch(self.command, path, query, body, principal)
            except Exception:
                logger.exception("egress gateway: the control API failed")
                reply = Reply(500, {"error": "internal_error", "message": "the gateway failed; nothing may have "
                                                                          "changed, or the change may be in force"})
        self._reply(reply)

    do_GET = do_POST = do_DELETE = do_PUT = do_PATCH = _serve

    def _reply(self, reply: Reply) -> None:
        data = json.dumps(reply.body, separators=(",", ":")).encode() + b"\n"
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        if reply.retry_after is not None:
            self.send_header("Retry-After", retry_after_header(reply.retry_after))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


class _Limited(ThreadingMixIn):
    daemon_threads = True
    block_on_close = False

    def process_request(self, request, client_address):
        peer = client_address[0] if isinstance(client_address, tuple) else None
        if not self.owner.take_peer(peer):  # type: ignore[attr-defined]
            self.shutdown_request(request)
            return
        if not self.owner.slots.acquire(blocking=False):  # type: ignore[attr-defined]
            self.owner.give_peer(peer)  # type: ignore[attr-defined]
            with contextlib.suppress(OSError):
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Content-Length: 57\r\nConnection: close\r\n\r\n"
                                b'{"error":"busy","message":"too many control connections"}')
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.owner.slots.release()  # type: ignore[attr-defined]
            self.owner.give_peer(client_address[0] if isinstance(client_address, tuple) else None)  # type: ignore[attr-defined]


class _Unix(_Limited, UnixStreamServer):
    pass


class _TCP(_Limited, TCPServer):
    allow_reuse_address = True


class ControlServer:
    """The listener; `dispatch(method, path, query, body, principal) -> Reply` runs the service
    where its registry lives (in the caller's thread, or on the proxy's event loop)."""

    def __init__(self, spec: str, service: ControlService, dispatch=None, tokens: dict[str, str] | None = None,
                 group: str | None = None):
        self.kind, where = parse_spec(spec)
        self.service = service
        self.dispatch = dispatch or service.handle
        self.tokens = tokens or {}
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._peers: dict[str, int] = {}  # TCP peer address -> connections open (MAX_PER_PEER)
        self._peers_lock = threading.Lock()
        self.path: str | None = None
        self.address: tuple | None = None
        if self.kind == "tcp":
            if not self.tokens:
                raise ControlSpecError("a control API on HOST:PORT needs --control-token-file")
            ip, port = where

            class Server(_TCP):
                address_family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
            self.server = Server((str(ip), port), _Handler, bind_and_activate=True)
            self.address = (ip, self.server.server_address[1])
        else:
            self.path = str(where)
            self.server = self._bind_unix(self.path, group)
        self.server.owner = self  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                       name="egress-control", daemon=True)

    @staticmethod
    def _bind_unix(path: str, group: str | None) -> _Unix:
        """Bind with a umask that leaves no moment at which others could connect; a stale socket
        (from a crash) is replaced, anything else at the path is refused."""
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode):
                raise ControlSpecError(f"{path} exists and is not a socket")
            os.unlink(path)
        old = os.umask(0o177 if group is None else 0o117)
        try:
            server = _Unix(path, _Handler, bind_and_activate=True)
        finally:
            os.umask(old)
        if group is not None:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
            os.chmod(path, 0o660)
        return server

    @staticmethod
    def peer_principal(sock: socket.socket) -> str:
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _pid, uid, _gid = struct.unpack("3i", creds)
            return f"uid:{uid}"
        except OSError:
            return "uid:?"

    @property
    def where(self) -> str:
        if self.path is not None:
            return f"unix:{self.path}"
        ip, port = self.address
        return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"

    def take_peer(self, peer: str | None) -> bool:
        """Count a connection of `peer` (a TCP address; None: a unix socket's, not counted); False
        when it already has MAX_PER_PEER open."""
        if peer is None:
            return True
        with self._peers_lock:
            if self._peers.get(peer, 0) >= MAX_PER_PEER:
                return False
            self._peers[peer] = self._peers.get(peer, 0) + 1
            return True

    def give_peer(self, peer: str | None) -> None:
        if peer is None:
            return
        with self._peers_lock:
            left = self._peers.get(peer, 0) - 1
            if left > 0:
                self._peers[peer] = left
            else:
                self._peers.pop(peer, None)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
