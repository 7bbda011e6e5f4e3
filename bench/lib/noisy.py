"""Sandbox A attacks, sandbox B times a simple HTTPS request, both through one gateway (issue 15).

The world of the noisy-neighbour benchmark (bench/noisy.py: B's latency and the gateway's RSS
during each attack) and test (tests/load/test_noisy_neighbour.py: each attack ends in its documented
refusal while B keeps being served). Everything is on loopback: the gateway listens on 127.0.0.1,
the origin on `<block>.<origin octet>:443`, and the two sandboxes are two source addresses the
clients bind to, each its own entry of the policy's `sandboxes`:

- `attacker` (sandbox A) may use `open` (origin.noisy, GET and POST) and `bound` (bound.noisy, a
  rule that injects the platform's key, so its responses are decoded and redacted);
- `victim` (sandbox B) may use `open`.

Each attack is a function of the world that runs until the gateway refuses it (or the attacker's
own bound is reached) and says what the attacker saw. None of them sleeps to synchronise: they read
until the gateway answers, resets or closes.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .gateway_process import GatewayProcess
from .http1_wire import read_head, read_request
from .pki import TestPKI

ORIGIN_NAME = "origin.noisy"
VICTIM_NAME = "b.noisy"  # B's origin: its own process, so that B never queues behind A's requests there
BOUND_NAME = "bound.noisy"
ACCOMPLICES = 3  # sandboxes that attack with A (`connection_bursts`), each a policy entry of its own
SECRET_ENV = "EGRESS_NOISY_KEY"
SECRET_VALUE = "sk-noisy-Platform7Key6Yy5"
TIMEOUT = 30.0

_BOMB: dict[int, bytes] = {}


def brotli_bomb(size: int) -> bytes:
    """Brotli of `size` zero bytes at the largest window a content coding allows (lgwin 24: each
    decoder call that fills it costs ~50 ms, what the default lgwin 22's 14 ms understated), made
    once in 1 MiB steps (the zeros are never held whole)."""
    if size not in _BOMB:
        import brotli

        compressor, zeros, out = brotli.Compressor(quality=5, lgwin=24), bytes(1 << 20), []
        for _ in range(size >> 20):
            out.append(compressor.process(zeros))
        out.append(compressor.finish())
        _BOMB[size] = b"".join(out)
    return _BOMB[size]


class Origin:
    """Keep-alive TLS HTTP/1.1 origin for both names, in a process of its own (so that neither the
    attacker's threads nor B's share its interpreter lock: B's latency is the gateway's, not this
    process's): `/ok` is 200 `ok`; `/bomb` is a brotli bomb of `bomb_size` bytes with its (small)
    Content-Length, `/bomb-chunked` the same chunked (a bound response then decodes as it streams);
    `/lines` is LINES_SIZE of short text lines in brotli, within every budget (~30:1); `/pieces` is
    PIECES one-byte chunks, then a close; anything else is 200 `ok` after reading the body."""

    def __init__(self, address: str, cert: Path, key: Path, bomb_size: int):
        self._process = _child("origin", address, str(cert), str(key), str(bomb_size))
        line = self._process.stdout.readline()  # (a large bomb is compressed before the origin listens)
        if line.strip() != b"ready":
            self.stop()
            raise RuntimeError(f"the noisy origin did not start: {line!r}")

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(TIMEOUT)


def _child(*args: str) -> subprocess.Popen:
    """This module run as a process of its own (see the end of the file)."""
    root = Path(__file__).resolve().parents[2]
    return subprocess.Popen([sys.executable, "-m", "bench.lib.noisy", *args], cwd=root,
                            env=dict(os.environ, PYTHONPATH=str(root)), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)


LINES_SIZE = 20 << 20  # decoded size of /lines: under the 32 MiB a connection may buffer


def lines_body() -> bytes:
    """A legitimate-looking compressed response that is costly to redact: many short lines."""
    import brotli

    text = b"".join(b"row %09d value=ok\n" % i for i in range(LINES_SIZE // 24))  # ~1 MB compressed, ~25:1
    return brotli.compress(text, quality=5, lgwin=22)


def _origin_main(address: str, cert: str, key: str, bomb_size: int) -> None:
    bomb = brotli_bomb(bomb_size)
    lines = lines_body() if bomb_size else b""
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    tls.set_alpn_protocols(["http/1.1"])
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, 443))
    listener.listen(512)
    print("ready", flush=True)
    while True:
        raw, _ = listener.accept()
        threading.Thread(target=_origin_handle, args=(raw, tls, bomb, lines), daemon=True).start()


PIECES = 2_000_000  # 1-byte chunks of /pieces (12 MB on the wire)


def _send_pieces(conn) -> None:
    """A chunked answer of PIECES one-byte chunks, written as fast as the gateway reads (an upstream
    the sandbox picks; review 32), then the connection closes."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                 b"Connection: close\r\n\r\n")
    batch = b"1\r\nx\r\n" * 10_000
    for _ in range(PIECES // 10_000):
        conn.sendall(batch)
    conn.sendall(b"0\r\n\r\n")


def _origin_handle(raw: socket.socket, tls: ssl.SSLContext, bomb: bytes, lines_br: bytes = b"") -> None:
    try:
        raw.settimeout(TIMEOUT)
        # As real origins do: with Nagle on, the response waited behind the unacknowledged TLS
        # session tickets for the gateway's delayed ACK, 40 ms of every baseline request.
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = tls.wrap_socket(raw, server_side=True)
        buf = b""
        while (request := read_request(conn, buf)) is not None:
            lines, buf = request
            path = lines[0].split(b" ")[1].split(b"?")[0].decode("ascii", "replace")
            if path in ("/bomb", "/lines"):
                body = bomb if path == "/bomb" else lines_br
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Encoding: br\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body)
            elif path == "/pieces":
                _send_pieces(conn)
                return
            elif path == "/bomb-chunked":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Encoding: br\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(bomb) + bomb + b"\r\n0\r\n\r\n")
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    except (OSError, ssl.SSLError, ValueError, IndexError):
        pass
    finally:
        raw.close()


@dataclass
class World:
    gateway: GatewayProcess
    origin: Origin
    attacker: str  # sandbox A's source address
    victim: str  # sandbox B's source address
    victim_origin: Origin
    others: tuple[str, ...] = ()  # the source addresses of A's accomplices, sandboxes of their own

    def stop(self) -> None:
        self.gateway.stop()
        self.origin.stop()
        self.victim_origin.stop()

    def rss_kib(self) -> int:
        return _status_kib(self.gateway.process.pid, "VmRSS")

    def audit_lines(self, source: str) -> list[dict]:
        return [e for e in self.gateway.audit() if str(e.get("client", "")).startswith(source + ":")]


def policy_text(origin_address: str, attacker: str, victim: str, victim_origin: str,
                others: tuple[str, ...] = ()) -> str:
    accomplices = "".join(f"  - id: accomplice-{i}\n    source_ips: [{address}/32]\n    rules: [open]\n"
                          for i, address in enumerate(others, 1))
    return f"""version: 1
network:
  allow_ip_ranges: [127.0.0.0/8]
resolver:
  static_hosts:
    {ORIGIN_NAME}: [{origin_address}]
    {BOUND_NAME}: [{origin_address}]
    {VICTIM_NAME}: [{victim_origin}]
secrets:
  noisy_key: {{env: {SECRET_ENV}}}
sandboxes:
  - id: attacker
    source_ips: [{attacker}/32]
    rules: [open, bound]
  - id: victim
    source_ips: [{victim}/32]
    rules: [open]
{accomplices}rules:
  - id: open
    hosts: [{ORIGIN_NAME}, {VICTIM_NAME}]
    methods: [GET, POST]
  - id: bound
    hosts: [{BOUND_NAME}]
    inject:
      - header: X-Api-Key
        value: "${{secrets.noisy_key}}"
"""


def make_world(workdir: Path, block: str, args: list[str] = (), bomb_size: int = 300 << 20,
               octets: tuple[int, int, int, int] = (250, 251, 252, 253)) -> World:
    """A's origin at <block>.<octets[0]>, attacker at .<octets[1]>, victim at .<octets[2]>, B's
    origin at .<octets[3]>; A's ACCOMPLICES accomplices at the ACCOMPLICES octets below .<octets[1]>."""
    origin_address, attacker, victim, victim_origin = (f"{block}.{o}" for o in octets)
    others = tuple(f"{block}.{octets[1] - 10 - i}" for i in range(ACCOMPLICES))
    pki = TestPKI(workdir / "pki")
    cert, key = pki.issue([ORIGIN_NAME, BOUND_NAME, VICTIM_NAME], [origin_address, victim_origin], stem="noisy-origin")
    origin = Origin(origin_address, cert, key, bomb_size)
    try:
        theirs = Origin(victim_origin, cert, key, 0)
    except Exception:
        origin.stop()
        raise
    policy = workdir / "noisy.yaml"
    policy.write_text(policy_text(origin_address, attacker, victim, victim_origin, others))
    os.environ[SECRET_ENV] = SECRET_VALUE  # the gateway's environment (GatewayProcess copies os.environ)
    gateway = GatewayProcess(policy, workdir / "gateway", upstream_ca=pki.ca_cert, extra_args=list(args))
    try:
        gateway.start()
    except Exception:
        origin.stop()
        theirs.stop()
        raise
    return World(gateway, origin, attacker, victim, theirs, others)


# --- clients --------------------------------------------------------------------------------------


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def connect(world: World, source: str, authority: str, timeout: float = TIMEOUT) -> socket.socket:
    """A CONNECT tunnel from `source`; raises unless the gateway answers 200."""
    return _tunnel(world.gateway.host, world.gateway.port, source, authority, timeout)


def _tunnel(host: str, port: int, source: str, authority: str, timeout: float = TIMEOUT) -> socket.socket:
    sock = socket.socket()
    sock.settimeout(timeout)
    try:
        sock.bind((source, 0))
        sock.connect((host, port))
        sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        try:
            answer, _ = read_head(sock, size=4096)
        except EOFError as closed:
            raise ConnectionError(f"CONNECT {authority}: closed after {closed.args[0]!r}") from None
        if not answer.startswith(b"HTTP/1.1 200"):
            raise ConnectionError(f"CONNECT {authority}: {answer[:200]!r}")
    except BaseException:
        sock.close()
        raise
    return sock


def tls_tunnel(world: World, source: str, name: str, alpn: str = "http/1.1", timeout: float = TIMEOUT) -> ssl.SSLSocket:
    sock = connect(world, source, f"{name}:443", timeout)
    context = ssl.create_default_context(cafile=str(world.gateway.ca_cert))
    context.set_alpn_protocols([alpn])
    return context.wrap_socket(sock, server_hostname=name)


def _tunnel_when_allowed(world: World, alpn: str, timeout: float = TIMEOUT) -> ssl.SSLSocket:
    """The attacker's next tunnel, after its own earlier rounds drained its request bucket: a 429 on
    the CONNECT is waited out (Retry-After), as any client does, until `timeout`. The flood being
    measured is what goes inside the tunnel; without the wait, a slow machine saw the round's
    CONNECT refused instead (a flaky refusal of the wrong kind)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return tls_tunnel(world, world.attacker, ORIGIN_NAME, alpn=alpn)
        except ConnectionError as exc:
            if " 429 " not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(1.0)  # Retry-After: 1 (the client's own pacing, not synchronisation)


def read_response(tls: ssl.SSLSocket, limit: int = 1 << 20) -> tuple[int, dict[str, str], int]:
    """(status, headers, body bytes read) of one HTTP/1.1 response; reads a Content-Length body
    (at most `limit` bytes kept) or, without one, until close."""
    try:
        head, body = read_head(tls)
    except EOFError as closed:
        raise ConnectionError(f"closed before a response head: {closed.args[0][:200]!r}") from None
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        length = int(headers["content-length"])
        got = len(body)
        while got < length:
            piece = tls.recv(min(65536, length - got))
            if not piece:
                break
            got += len(piece)
        return status, headers, got
    got = len(body)
    while True:
        try:
            piece = tls.recv(1 << 20)
        except (OSError, ssl.SSLError):
            break
        if not piece:
            break
        got += len(piece)
    return status, headers, got


def victim_request(world: World) -> tuple[float, int]:
    """Sandbox B's simple request, the way an agent's curl makes it: a fresh CONNECT tunnel, TLS,
    one GET, close. Returns (seconds, status)."""
    return _timed_request(world.gateway.host, world.gateway.port, str(world.gateway.ca_cert), world.victim)


def _timed_request(host: str, port: int, ca_cert: str, source: str) -> tuple[float, int]:
    started = time.perf_counter()
    sock = _tunnel(host, port, source, f"{VICTIM_NAME}:443")
    try:
        context = ssl.create_default_context(cafile=ca_cert)
        context.set_alpn_protocols(["http/1.1"])
        with context.wrap_socket(sock, server_hostname=VICTIM_NAME) as tls:
            tls.sendall(f"GET /ok HTTP/1.1\r\nHost: {VICTIM_NAME}\r\nConnection: close\r\n\r\n".encode())
            status, _, _ = read_response(tls)
    finally:
        sock.close()
    return time.perf_counter() - started, status


class Victim:
    """Sandbox B, timing its simple request over and over until `stop()`, at most one every `pace`
    seconds (0: back to back; B has rate limits of its own too). B runs in a process of its own, as
    a sandbox does: in the attacker's process it waited for the interpreter lock behind the
    attacker's threads, and its latency said more about them than about the gateway."""

    def __init__(self, world: World, pace: float = 0.0, want: int | None = None, keepalive: bool = False):
        gateway = world.gateway
        self._args = ("victim", gateway.host, str(gateway.port), str(gateway.ca_cert), world.victim, str(pace),
                      "keepalive" if keepalive else "fresh")
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self.samples: list[tuple[float, int]] = []
        self.errors: list[str] = []
        self.first = threading.Event()  # set once a request completed (B is running)
        self._want = want
        self.enough = threading.Event()  # set once `want` samples (or an error) came

    def start(self) -> "Victim":
        self._process = _child(*self._args)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            kind, _, value = line.decode().rstrip("\n").partition(" ")
            if kind == "sample":
                seconds, status = value.split()
                self.samples.append((float(seconds), int(status)))
                self.first.set()
            else:
                self.errors.append(value)
            if self.errors or (self._want is not None and len(self.samples) >= self._want):
                self.enough.set()
        self.enough.set()  # B's process ended

    def stop(self) -> "Victim":
        """B finishes the request it is making, then exits."""
        self._process.stdin.close()
        try:
            self._process.wait(TIMEOUT * 2)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(TIMEOUT)
        return self


class _KeptAlive:
    """B's other way of asking: one tunnel and TLS session kept alive, a GET timed on it each time
    (what an agent's SDK does between two calls to the same API); a new one if it is lost."""

    def __init__(self, host: str, port: int, ca_cert: str, source: str):
        self.args, self.tls = (host, port, ca_cert, source), None

    def __call__(self) -> tuple[float, int]:
        host, port, ca_cert, source = self.args
        if self.tls is None:
            context = ssl.create_default_context(cafile=ca_cert)
            context.set_alpn_protocols(["http/1.1"])
            self.tls = context.wrap_socket(_tunnel(host, port, source, f"{VICTIM_NAME}:443"), server_hostname=VICTIM_NAME)
        started = time.perf_counter()
        try:
            self.tls.sendall(f"GET /ok HTTP/1.1\r\nHost: {VICTIM_NAME}\r\n\r\n".encode())
            status, _, _ = read_response(self.tls)
        except BaseException:
            self.tls.close()
            self.tls = None
            raise
        return time.perf_counter() - started, status


def _victim_main(host: str, port: int, ca_cert: str, source: str, pace: float, mode: str = "fresh") -> None:
    halt = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), halt.set()), daemon=True).start()  # EOF: stop
    kept = _KeptAlive(host, port, ca_cert, source) if mode == "keepalive" else None
    while not halt.is_set():
        started = time.monotonic()
        try:
            seconds, status = kept() if kept is not None else _timed_request(host, port, ca_cert, source)
            print(f"sample {seconds!r} {status}", flush=True)
        except (OSError, ssl.SSLError, ValueError) as exc:
            print("error " + f"{type(exc).__name__}: {exc}"[:300].replace("\n", " "), flush=True)
        if pace:
            halt.wait(max(0.0, pace - (time.monotonic() - started)))


def victim_samples(world: World, count: int, pace: float = 0.0, keepalive: bool = False) -> list[tuple[float, int]]:
    """`count` of B's requests with nothing else running (B's baseline), from B's own process and
    at B's pace, like the ones during an attack."""
    victim = Victim(world, pace, want=count, keepalive=keepalive).start()
    victim.enough.wait(TIMEOUT * 4)
    samples = victim.stop().samples
    if victim.errors:
        raise ConnectionError(f"B failed alone: {victim.errors[:3]}")
    return samples[:count]


class RssSampler(threading.Thread):
    """The gateway's peak RSS while an attack runs (sampled every 10 ms: a peak between two samples
    is missed, so VmHWM, the kernel's own high-water mark, is read too for a run that starts fresh)."""

    def __init__(self, world: World):
        super().__init__(daemon=True)
        self.world = world
        self.peak = world.rss_kib()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.01):
            try:
                self.peak = max(self.peak, self.world.rss_kib())
            except (OSError, ValueError):
                return

    def stop(self) -> int:
        self._halt.set()
        self.join(5)
        return self.peak


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(samples: list[tuple[float, int]]) -> dict:
    times = [s for s, _ in samples]
    return {"requests": len(samples), "ok": sum(1 for _, status in samples if status == 200),
            "p50_ms": percentile(times, 0.5) * 1000, "p99_ms": percentile(times, 0.99) * 1000,
            "mean_ms": (statistics.fmean(times) * 1000) if times else float("nan")}


# --- attacks --------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What the attacker saw."""

    attack: str
    statuses: dict[int, int] = field(default_factory=dict)  # HTTP status -> count
    resets: int = 0  # h2 streams the gateway reset
    goaway: int | None = None  # the GOAWAY error code, if one came
    closed: bool = False  # the gateway closed the attacker's connection
    sent: int = 0  # bytes or streams the attacker got out
    notes: list[str] = field(default_factory=list)

    def count(self, status: int) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1


def _h2_connection(fixed_fields: list[tuple[str, str]] | None = None):
    """An h2 client connection; with `fixed_fields`, every head sent ends with those fields, encoded once."""
    import h2.config
    import h2.connection

    config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
    if fixed_fields is not None:
        config.normalize_outbound_headers = config.validate_outbound_headers = False
    conn = h2.connection.H2Connection(config)
    if fixed_fields is not None:
        conn.encoder = _FixedTailEncoder(conn.encoder, fixed_fields)
    conn.initiate_connection()
    return conn


class _FixedTailEncoder:
    """HPACK for heads that all end with the same fields: those are encoded once, never indexed (so
    their bytes do not depend on the dynamic table), and only the fields before them per head. An
    attacker encoding 1,200 heads of 55 KB in Python spent seconds of the CPU the victim shares,
    which was measured as if the gateway cost it; a real attacker would not pay it either."""

    def __init__(self, encoder, fields: list[tuple[str, str]]) -> None:
        from hpack import NeverIndexedHeaderTuple

        self._encoder = encoder
        self._count = len(fields)
        self._tail = encoder.encode([NeverIndexedHeaderTuple(name, value) for name, value in fields])

    def encode(self, headers, huffman: bool = True) -> bytes:
        headers = list(headers)
        return self._encoder.encode(headers[:-self._count], huffman) + self._tail

    def __getattr__(self, name):  # header_table_size and the rest: the real encoder's
        return getattr(self._encoder, name)

    def __setattr__(self, name, value):
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._encoder, name, value)


def _h2_pump(tls: ssl.SSLSocket, conn, outcome: Outcome, wanted, wait: float = 0.05) -> bool:
    """Read what the gateway sent (waiting up to `wait` for it) and feed it to `conn`; False once the
    connection is over. Sends block (the socket's own timeout): a gateway that stops reading is
    what some attacks measure, not a failure."""
    import h2.events

    if not tls.pending() and not select.select([tls], [], [], wait)[0]:
        return True
    try:
        data = tls.recv(65536)
    except (OSError, ssl.SSLError):
        outcome.closed = True
        return False
    if not data:
        outcome.closed = True
        return False
    try:
        events = conn.receive_data(data)
    except Exception as exc:  # a protocol error on the gateway's side of the conversation
        outcome.notes.append(f"h2: {type(exc).__name__}")
        outcome.closed = True
        return False
    for event in events:
        if isinstance(event, h2.events.ResponseReceived):
            outcome.count(int(dict(event.headers)[":status"]))
        elif isinstance(event, h2.events.StreamReset):
            outcome.resets += 1
        elif isinstance(event, h2.events.ConnectionTerminated):
            outcome.goaway = int(event.error_code)
        elif isinstance(event, h2.events.DataReceived):
            conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        if wanted is not None:
            wanted(event)
    try:
        tls.sendall(conn.data_to_send())
    except (OSError, ssl.SSLError):
        outcome.closed = True
        return False
    return outcome.goaway is None


def h2_held_streams(world: World, streams: int = 100, per_stream: int = 900_000, hold: threading.Event | None = None,
                    seconds: float = 20.0) -> Outcome:
    """One HTTP/2 connection opens `streams` POSTs that each declare a body of a little over
    `per_stream` bytes (under stream_large_bodies: the gateway buffers them), sends `per_stream`
    bytes of DATA on each as flow control allows, and never ends any of them. Runs until every stream
    is answered, reset or fully sent, or for `seconds`; then holds the connection open until `hold`
    is set (if given)."""
    outcome = Outcome("h2_held_streams")
    tls = tls_tunnel(world, world.attacker, ORIGIN_NAME, alpn="h2")
    conn = _h2_connection()
    tls.sendall(conn.data_to_send())
    left: dict[int, int] = {}
    done: set[int] = set()

    def wanted(event) -> None:
        import h2.events

        if isinstance(event, (h2.events.ResponseReceived, h2.events.StreamReset)):
            done.add(event.stream_id)

    try:
        for _ in range(streams):
            sid = conn.get_next_available_stream_id()
            conn.send_headers(sid, [(":method", "POST"), (":scheme", "https"), (":authority", ORIGIN_NAME),
                                    (":path", "/upload"), ("content-length", str(per_stream + 1))])
            left[sid] = per_stream
        tls.sendall(conn.data_to_send())
        deadline = time.monotonic() + seconds
        chunk = bytes(16384)
        while time.monotonic() < deadline:
            progressed = False
            for sid, remaining in list(left.items()):
                if sid in done or remaining <= 0:
                    continue
                try:
                    window = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size, remaining)
                except Exception:  # the stream is closed
                    done.add(sid)
                    continue
                if window > 0:
                    conn.send_data(sid, chunk[:window])
                    left[sid] = remaining - window
                    outcome.sent += window
                    progressed = True
            data = conn.data_to_send()
            if data:
                try:
                    tls.sendall(data)
                except (OSError, ssl.SSLError):
                    outcome.closed = True
                    break
            if not _h2_pump(tls, conn, outcome, wanted):
                break
            if all(sid in done or left[sid] <= 0 for sid in left) and not progressed:
                break
        if hold is not None and not outcome.closed:
            while not hold.is_set() and _h2_pump(tls, conn, outcome, wanted):
                pass
    finally:
        tls.close()
    return outcome


def h2_rapid_reset(world: World, streams: int = 6000, seconds: float = 20.0) -> Outcome:
    """CVE-2023-44487: one HTTP/2 connection sends HEADERS (a complete GET) then RST_STREAM(CANCEL)
    for `streams` streams as fast as it can, reading whatever comes back, until the gateway sends
    GOAWAY or closes, or every stream is out; then reads until the gateway has answered or `seconds`."""
    import h2.errors

    outcome = Outcome("h2_rapid_reset")
    tls = tls_tunnel(world, world.attacker, ORIGIN_NAME, alpn="h2")
    conn = _h2_connection()
    tls.sendall(conn.data_to_send())
    deadline = time.monotonic() + seconds
    headers = [(":method", "GET"), (":scheme", "https"), (":authority", ORIGIN_NAME), (":path", "/ok")]
    try:
        while outcome.sent < streams and time.monotonic() < deadline:
            for _ in range(min(100, streams - outcome.sent)):
                sid = conn.get_next_available_stream_id()
                conn.send_headers(sid, headers, end_stream=True)
                conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
                outcome.sent += 1
            try:
                tls.sendall(conn.data_to_send())
            except (OSError, ssl.SSLError):
                outcome.closed = True
                break
            if not _h2_pump(tls, conn, outcome, None, wait=0):
                break
        while not outcome.closed and outcome.goaway is None and time.monotonic() < deadline:
            if not _h2_pump(tls, conn, outcome, None, wait=0.2):
                break
    finally:
        tls.close()
    return outcome


def huge_client_hello(world: World, size: int = 8 << 20, seconds: float = 20.0) -> Outcome:
    """In an allowed CONNECT tunnel, a TLS ClientHello declaring `size` bytes, sent as 16 KiB
    records as fast as the gateway reads them, never finished. Runs until the gateway closes the
    tunnel or `size` bytes are out."""
    outcome = Outcome("huge_client_hello")
    try:
        sock = connect(world, world.attacker, f"{ORIGIN_NAME}:443")
    except OSError as exc:  # closed at accept: the attacker is past its new-connection rate
        outcome.closed = True
        outcome.notes.append(type(exc).__name__)
        return outcome
    record = 16384
    body = b"\x01" + size.to_bytes(3, "big") + b"\x03\x03" + bytes(32)
    first = body + bytes(record - len(body))
    deadline = time.monotonic() + seconds
    try:
        sock.settimeout(seconds)
        sock.sendall(b"\x16\x03\x01" + record.to_bytes(2, "big") + first)
        outcome.sent = len(first)
        filler = b"\x16\x03\x01" + record.to_bytes(2, "big") + bytes(record)
        while outcome.sent < size and time.monotonic() < deadline:
            sock.sendall(filler)
            outcome.sent += record
    except (OSError, ssl.SSLError):
        outcome.closed = True
    if not outcome.closed:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            sock.recv(4096)  # an alert, or the close itself
            outcome.closed = True
        except (TimeoutError, socket.timeout):
            outcome.notes.append("the gateway kept the tunnel open")
        except OSError:
            outcome.closed = True
    sock.close()
    return outcome


def decompression_bomb(world: World, times: int = 3) -> Outcome:
    """GET /bomb on the bound rule `times` times, one after the other, each on a fresh tunnel: a few
    hundred bytes of brotli that decode to the world's bomb size."""
    outcome = Outcome("decompression_bomb")
    for _ in range(times):
        try:
            with tls_tunnel(world, world.attacker, BOUND_NAME) as tls:
                tls.sendall(f"GET /bomb HTTP/1.1\r\nHost: {BOUND_NAME}\r\nConnection: close\r\n\r\n".encode())
                status, headers, got = read_response(tls)
                outcome.count(status)
                outcome.sent += got
                if headers.get("x-egress-reason"):
                    outcome.notes.append(headers["x-egress-reason"])
        except (OSError, ssl.SSLError, ValueError) as exc:
            outcome.closed = True
            outcome.notes.append(f"{type(exc).__name__}")
    return outcome


def streamed_bomb(world: World, times: int = 3) -> Outcome:
    """GET /bomb-chunked on the bound rule `times` times: the same bomb, chunked, so the gateway
    decodes and redacts it as it streams, and cuts it off past its ratio."""
    return _bound_gets(world, "/bomb-chunked", times, Outcome("streamed_bomb"))


def bound_lines(world: World, times: int = 3) -> Outcome:
    """GET /lines on the bound rule `times` times: 20 MiB of short lines that stay within every
    budget, decoded whole and redacted (served, 200)."""
    return _bound_gets(world, "/lines", times, Outcome("bound_lines"))


def _bound_gets(world: World, path: str, times: int, outcome: Outcome) -> Outcome:
    for _ in range(times):
        try:
            with tls_tunnel(world, world.attacker, BOUND_NAME) as tls:
                tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {BOUND_NAME}\r\nConnection: close\r\n\r\n".encode())
                status, headers, got = read_response(tls, limit=64 << 20)
                outcome.count(status)
                outcome.sent += got
        except (OSError, ssl.SSLError, ValueError) as exc:
            outcome.closed = True
            outcome.notes.append(f"{type(exc).__name__}")
    return outcome


def upstream_pieces(world: World, connections: int = 2, seconds: float = 20.0) -> Outcome:
    """Review 32: an upstream the sandbox picks answers in 1-byte chunks (GET /pieces, 2,000,000 of
    them), read as fast as they come on `connections` tunnels, again until `seconds`. Before, each
    chunk was one event through every layer and a read of 64 KiB one step of ~0.1 s of the loop
    (another sandbox's p50 17 ms -> 3.5-6.3 s); now a read's chunks are merged, parsed ~1 ms per
    step, the rest behind the read-ahead gate. Nothing is refused: it is slowed."""
    outcome = Outcome("upstream_pieces")
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def one() -> None:
        while time.monotonic() < deadline:
            with tls_tunnel(world, world.attacker, ORIGIN_NAME) as tls:
                tls.settimeout(max(deadline - time.monotonic(), 0.1))
                tls.sendall(f"GET /pieces HTTP/1.1\r\nHost: {ORIGIN_NAME}\r\n\r\n".encode())
                try:
                    status, _, got = read_response(tls)
                except (OSError, ssl.SSLError):
                    return
                with lock:
                    outcome.count(status)
                    outcome.sent += got

    return _on_threads(connections, one, seconds, outcome, lock)


def request_body_bomb(world: World, connections: int = 4, requests: int = 100, seconds: float = 20.0) -> Outcome:
    """`connections` kept-alive tunnels POST forms of 52 bytes of brotli (lgwin 24, 64 MiB of
    zeros) on the open rule, `requests` in all: each is decoded for its method-override scan until
    it passes its budget, 413."""
    import brotli

    body = brotli.compress(bytes(64 << 20), quality=5, lgwin=24)
    head = (f"POST /upload HTTP/1.1\r\nHost: {ORIGIN_NAME}\r\nContent-Type: application/x-www-form-urlencoded\r\n"
            f"Content-Encoding: br\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    outcome = Outcome("request_body_bomb")
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def take() -> bool:
        """One of the `requests`, taken before it is sent: checked and counted apart, two threads
        both saw 5 of 6 sent and sent a 7th (three audit lines more than the test allows)."""
        with lock:
            if time.monotonic() >= deadline or outcome.sent >= requests:
                return False
            outcome.sent += 1
            return True

    def one() -> None:
        while take():
            with tls_tunnel(world, world.attacker, ORIGIN_NAME) as tls:
                while True:
                    tls.sendall(head + body)
                    status, headers, _ = read_response(tls)
                    with lock:
                        outcome.count(status)
                    if headers.get("connection", "").lower() == "close" or not take():
                        break

    return _on_threads(connections, one, seconds, outcome, lock)


def _on_threads(count: int, one, seconds: float, outcome: Outcome, lock: threading.Lock) -> Outcome:
    """`one()` on `count` threads at once, each given `seconds` (and TIMEOUT more) to end; a
    connection the gateway reset or closed marks the outcome `closed`."""
    def guarded() -> None:
        try:
            one()
        except (OSError, ssl.SSLError, ValueError, ConnectionError):
            with lock:
                outcome.closed = True

    threads = [threading.Thread(target=guarded, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + TIMEOUT)
    return outcome


def request_flood(world: World, connections: int = 8, requests: int = 4000, seconds: float = 20.0) -> Outcome:
    """`connections` kept-alive tunnels send pipelined GETs (allowed ones) as fast as the gateway
    answers, `requests` in all, and count the answers by status."""
    outcome = Outcome("request_flood")
    lock = threading.Lock()
    per = requests // connections
    deadline = time.monotonic() + seconds

    def one() -> None:
        with tls_tunnel(world, world.attacker, ORIGIN_NAME) as tls:
            request = f"GET /ok HTTP/1.1\r\nHost: {ORIGIN_NAME}\r\n\r\n".encode()
            for start in range(0, per, 20):
                batch = min(20, per - start)
                tls.sendall(request * batch)
                for _ in range(batch):
                    status, headers, _ = read_response(tls)
                    with lock:
                        outcome.count(status)
                        outcome.sent += 1
                    if headers.get("connection", "").lower() == "close":
                        return
                if time.monotonic() > deadline:
                    return

    return _on_threads(connections, one, seconds, outcome, lock)


def connection_flood(world: World, count: int = 2000, seconds: float = 20.0) -> Outcome:
    """New connections as fast as the kernel accepts them, each a CONNECT that is then dropped;
    counts the ones the gateway closed without answering."""
    outcome = Outcome("connection_flood")
    deadline = time.monotonic() + seconds
    while outcome.sent < count and time.monotonic() < deadline:
        sock = socket.socket()
        sock.settimeout(TIMEOUT)
        try:
            sock.bind((world.attacker, 0))
            sock.connect((world.gateway.host, world.gateway.port))
            sock.sendall(f"CONNECT {ORIGIN_NAME}:443 HTTP/1.1\r\nHost: {ORIGIN_NAME}:443\r\n\r\n".encode())
            answer = sock.recv(64)
            if answer.startswith(b"HTTP/1.1 "):
                outcome.count(int(answer[9:12]))
            else:
                outcome.count(0)  # closed at accept
        except OSError:
            outcome.count(0)
        finally:
            sock.close()
        outcome.sent += 1
    return outcome


def connection_bursts(world: World, burst: int = 90, period: float = 2.0) -> Outcome:
    """A and its accomplices (four sandboxes) each open `burst` connections at once, every
    `period` seconds: CONNECT, TLS, one GET, close. Inside every budget (the connection bucket
    holds 100 and refills 50 a second); together they saturate a worker with TLS handshakes (review
    35's F4, docs/load.md round 11). One round per call: the benchmark repeats it while B measures."""
    import asyncio

    outcome = Outcome("connection_bursts")
    context = ssl.create_default_context(cafile=str(world.gateway.ca_cert))
    context.set_alpn_protocols(["http/1.1"])
    host, port = world.gateway.host, world.gateway.port

    async def one(source: str) -> int:
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            return 0
        try:
            writer.write(f"CONNECT {ORIGIN_NAME}:443 HTTP/1.1\r\nHost: {ORIGIN_NAME}:443\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                return int(head[9:12])
            await writer.start_tls(context, server_hostname=ORIGIN_NAME)
            writer.write(f"GET /ok HTTP/1.1\r\nHost: {ORIGIN_NAME}\r\nConnection: close\r\n\r\n".encode())
            answer = await reader.read()
            return int(answer[9:12]) if answer.startswith(b"HTTP/1.1 ") else 0
        except (OSError, ssl.SSLError, ValueError, asyncio.IncompleteReadError):
            return 0
        finally:
            writer.close()

    async def round_() -> None:
        sources = (world.attacker, *world.others)
        for status in await asyncio.gather(*(one(source) for source in sources for _ in range(burst))):
            outcome.count(status)
        outcome.sent += burst * len(sources)

    started = time.monotonic()
    asyncio.run(round_())
    time.sleep(max(0.0, period - (time.monotonic() - started)))  # the attackers' own pacing
    return outcome


def _huffman_block(value_bytes: int) -> bytes:
    """An HPACK block of a GET to the origin plus one `x-big` literal of `value_bytes` Huffman-coded
    'a's, built directly (hpack's own encoder takes seconds for megabytes): 'a' is the 5-bit code
    00011, so eight of them are the same 5 bytes."""
    import hpack

    head = hpack.Encoder().encode([(":method", "GET"), (":scheme", "https"), (":authority", ORIGIN_NAME),
                                   (":path", "/ok")])
    eight = int("00011" * 8, 2).to_bytes(5, "big")
    data = eight * (value_bytes // 8)
    name = b"x-big"
    length, prefix = len(data), b""
    if length < 127:
        prefix = bytes([0x80 | length])
    else:  # RFC 7541 5.1: a 7-bit prefix, then 7 bits a byte
        prefix, rest = bytearray([0x80 | 127]), length - 127
        while rest >= 128:
            prefix.append((rest % 128) | 128)
            rest //= 128
        prefix.append(rest)
    return head + b"\x00" + bytes([len(name)]) + name + bytes(prefix) + data


_BIG_BLOCK: dict[int, bytes] = {}


def h2_header_block(world: World, value_bytes: int = 8 << 20, seconds: float = 20.0) -> Outcome:
    """Review 5's CONTINUATION attack: HEADERS + CONTINUATION frames of 128 KiB (the frame size the
    gateway advertises) carrying one `value_bytes` Huffman value, the block ended, on one h2
    connection; then reads until the gateway answers, sends GOAWAY or closes."""
    from hyperframe.frame import ContinuationFrame, HeadersFrame

    outcome = Outcome("h2_header_block")
    block = _BIG_BLOCK.setdefault(value_bytes, _huffman_block(value_bytes))
    piece = 1 << 17
    pieces = [block[at:at + piece] for at in range(0, len(block), piece)][:64]
    tls = tls_tunnel(world, world.attacker, ORIGIN_NAME, alpn="h2")
    conn = _h2_connection()
    deadline = time.monotonic() + seconds
    try:
        tls.sendall(conn.data_to_send())
        for n, data in enumerate(pieces):
            frame = (HeadersFrame if n == 0 else ContinuationFrame)(1, data)
            frame.flags = ({"END_STREAM"} if n == 0 else set()) | ({"END_HEADERS"} if n == len(pieces) - 1 else set())
            try:
                tls.sendall(frame.serialize())
            except (OSError, ssl.SSLError):
                outcome.closed = True
                break
            outcome.sent += len(data)
        while not outcome.closed and outcome.goaway is None and not outcome.statuses and time.monotonic() < deadline:
            if not _h2_pump(tls, conn, outcome, None, wait=0.2):
                break
    except Exception as exc:  # the client's h2 state does not know of the raw stream: what came back is noted
        outcome.notes.append(type(exc).__name__)
    finally:
        tls.close()
    return outcome


def many_header_fields(world: World, connections: int = 4, fields: int = 12_000, seconds: float = 20.0) -> Outcome:
    """Review 5's many-fields attack: `connections` tunnels each send GETs of `fields` tiny `a:0`
    headers (~60 KB, under the head size limit), one at a time, for `seconds` or until refused."""
    outcome = Outcome("many_header_fields")
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    request = (f"GET /ok HTTP/1.1\r\nHost: {ORIGIN_NAME}\r\n".encode() + b"a:0\r\n" * fields + b"\r\n")

    def one() -> None:
        while time.monotonic() < deadline:
            with tls_tunnel(world, world.attacker, ORIGIN_NAME) as tls:
                for _ in range(20):
                    tls.sendall(request)
                    status, headers, _ = read_response(tls)
                    with lock:
                        outcome.count(status)
                        outcome.sent += 1
                    if status != 200 or headers.get("connection", "").lower() == "close":
                        return
                    if time.monotonic() > deadline:
                        return

    return _on_threads(connections, one, seconds, outcome, lock)


def h2_small_data(world: World, streams: int = 100, frames: int = 9000, rounds: int = 6,
                  seconds: float = 20.0) -> Outcome:
    """Review 15: a connection writes HEADERS for `streams` POSTs, then `frames` one-byte DATA
    frames rotating over them, in one write (18,000 small-frame tokens: inside the default burst
    of 20,000); a new connection each round, `rounds` times or for `seconds`, reading what comes
    until the gateway has parsed the round (a PING sent after the frames is acknowledged) or
    ended the connection. Before, each round held the worker ~1 s (frames x streams work, and no
    step limit on DATA); now the second or third round finds the sandbox's small-frame bucket
    empty (GOAWAY). (Each round once read for 1 s whatever came: on a loaded machine the gateway
    had not parsed a round's frames when its connection closed, and no round reached the budget.)"""
    import h2.events

    outcome = Outcome("h2_small_data")
    deadline = time.monotonic() + seconds
    for _ in range(rounds):
        if time.monotonic() >= deadline:
            break
        tls = _tunnel_when_allowed(world, alpn="h2")
        conn = _h2_connection()
        parsed = threading.Event()
        try:
            ids = []
            for _ in range(streams):
                ids.append(conn.get_next_available_stream_id())
                conn.send_headers(ids[-1], [(":method", "POST"), (":scheme", "https"), (":authority", ORIGIN_NAME),
                                            (":path", "/upload"), ("content-length", "100000")])
            for n in range(frames):
                conn.send_data(ids[n % streams], b"z")
            conn.ping(b"parsed?!")
            tls.sendall(conn.data_to_send())
            outcome.sent += frames
            while time.monotonic() < deadline and not parsed.is_set() and _h2_pump(
                    tls, conn, outcome, lambda e: isinstance(e, h2.events.PingAckReceived) and parsed.set(), wait=0.1):
                pass
        except (OSError, ssl.SSLError):
            outcome.closed = True
        finally:
            tls.close()
    return outcome


def h2_held_heads(world: World, connections: int = 12, streams: int = 100, fields: int = 190,
                  value_bytes: int = 270, seconds: float = 20.0) -> Outcome:
    """Review 14: `connections` HTTP/2 connections each open `streams` POSTs with heads of `fields`
    fields of `value_bytes` (a ~55 KB header block) that declare a body never sent: each stream
    holds its decoded head until the body idle timeout. Past the sandbox's buffer budget the
    heads are refused, 503 `buffer_budget` (before: 1,798 such streams took +291 MiB, none refused)."""
    outcome = Outcome("h2_held_heads")
    extra = [(f"x-held-{i:03d}", "v" * value_bytes) for i in range(fields)]
    held = []
    deadline = time.monotonic() + seconds
    try:
        for _ in range(connections):
            if time.monotonic() >= deadline:
                break
            tls = tls_tunnel(world, world.attacker, ORIGIN_NAME, alpn="h2")
            conn = _h2_connection(fixed_fields=extra)
            held.append((tls, conn))
            for n in range(streams):
                sid = conn.get_next_available_stream_id()
                conn.send_headers(sid, [(":method", "POST"), (":scheme", "https"), (":authority", ORIGIN_NAME),
                                        (":path", f"/held/{n}"), ("content-length", "100")] + extra)
                outcome.sent += 1
            try:
                tls.sendall(conn.data_to_send())
            except (OSError, ssl.SSLError):
                outcome.closed = True
            _h2_pump(tls, conn, outcome, None, wait=0.2)
        end = min(deadline, time.monotonic() + 2.0)
        while time.monotonic() < end:
            for tls, conn in held:
                _h2_pump(tls, conn, outcome, None, wait=0.01)
    finally:
        for tls, _ in held:
            tls.close()
    return outcome


ATTACKS = {
    "h2_held_streams": h2_held_streams,
    "decompression_bomb": decompression_bomb,
    "huge_client_hello": huge_client_hello,
    "h2_rapid_reset": h2_rapid_reset,
    "request_flood": request_flood,
    "connection_flood": connection_flood,
    "connection_bursts": connection_bursts,
    "request_body_bomb": request_body_bomb,
    "streamed_bomb": streamed_bomb,
    "bound_lines": bound_lines,
    "h2_header_block": h2_header_block,
    "many_header_fields": many_header_fields,
    "h2_small_data": h2_small_data,
    "h2_held_heads": h2_held_heads,
    "upstream_pieces": upstream_pieces,
}


if __name__ == "__main__":  # a process of the world: `origin ADDRESS CERT KEY BOMB` or `victim HOST PORT CA SOURCE PACE`
    role, *rest = sys.argv[1:]
    if role == "origin":
        _origin_main(rest[0], rest[1], rest[2], int(rest[3]))
    else:
        _victim_main(rest[0], int(rest[1]), rest[2], rest[3], float(rest[4]), *rest[5:6])
