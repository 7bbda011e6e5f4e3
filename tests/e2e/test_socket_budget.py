"""The sockets a sandbox holds: a cap on its upstream connections, and its share of a worker whose
sockets are taken (gateway/sockets.py, addons/limits.py; review 37: three sandboxes, each inside
every budget, held all 20,000 of a worker's file descriptors, and accept() and every dial then
failed for every sandbox).

Without a `sandboxes` section each client address is its own sandbox: the tests' sandboxes are
loopback source addresses of the session's block."""

from __future__ import annotations

import os
import socket

from tests.e2e.helpers import Conn, H2Client, extra_static_hosts, get, start_tls, tls_tunnel
from tests.support.tcp_origin import start_accepting
from tests.support.gateway import GatewayProcess
from tests.support.waiting import wait_for
from tests.conftest import policy_text


def _rules(names) -> str:
    return "".join(f"- id: r{i}\n  hosts: [{name}]\n  schemes: [http]\n" for i, name in enumerate(names))


def _connect(gateway, source: str) -> Conn:
    sock = socket.socket()
    sock.settimeout(10)
    sock.bind((source, 0))
    sock.connect((gateway.host, gateway.port))
    return Conn(sock)


def _closed_without_a_byte(conn: Conn) -> bool:
    try:
        return conn.sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_sandbox_at_its_upstream_cap_is_refused_503_nothing_dialled_and_freed_as_they_close(
        start_gateway, upstreams):
    names = list(upstreams.plain)[:3]
    gateway = start_gateway(_rules(names), args=["--set", "egress_max_upstream_connections_per_sandbox=2"])
    source, other = f"{upstreams.block}.200", f"{upstreams.block}.201"
    with _connect(gateway, source) as conn:
        for name in names[:2]:
            assert get(conn, f"http://{name}/held", name).status == 200
        gateway.mark()
        answer = get(conn, f"http://{names[2]}/over", names[2])
        assert answer.status == 503, answer
        assert upstreams.plain[names[2]].connections == 0  # nothing dialled
        line, = gateway.audit_lines(since=gateway.audit_mark, count=1, reason="too_many_connections")
        assert line["decision"] == "deny" and line["status"] == 503
        assert "egress_max_upstream_connections_per_sandbox" in line["message"]  # which budget
        with _connect(gateway, other) as theirs:  # another sandbox's cap is its own
            assert get(theirs, f"http://{names[2]}/theirs", names[2]).status == 200
    wait_for(lambda: upstreams.plain[names[0]].ended and upstreams.plain[names[1]].ended, 10,
             "the sandbox's upstreams closed with its connection")
    with _connect(gateway, source) as conn:
        assert get(conn, f"http://{names[2]}/again", names[2]).status == 200


def test_a_refused_dial_does_not_stick_to_its_destination_on_an_http2_connection(start_gateway, upstreams):
    """mitmproxy answers every later request for a destination with the error of a connection to it
    that failed: after a dial over the cap, an HTTP/2 connection's requests kept getting 503 once
    the sandbox's other upstream had closed (review 38). (An HTTP/1 connection is closed after
    such a refusal.)"""
    held_name, other = list(upstreams.tls)[:2]
    rules = f"- id: a\n  hosts: [{held_name}]\n- id: b\n  hosts: [{other}]\n"
    gateway = start_gateway(rules, args=["--set", "egress_max_upstream_connections_per_sandbox=1"])
    waiting = H2Client(tls_tunnel(gateway, f"{other}:443", alpn=["h2"]))
    try:
        with tls_tunnel(gateway, f"{held_name}:443") as holding:  # HTTP/1.1, kept alive: its upstream held
            assert get(holding, "/held", held_name).status == 200
            stream = waiting.send(other, "/over")
            waiting.wait(stream)
            assert waiting.responses[stream]["status"] == 503, waiting.responses[stream]
        wait_for(lambda: upstreams.tls[held_name].ended, 10, "the holding connection's upstream closed")
        stream = waiting.send(other, "/again")
        waiting.wait(stream)
        assert waiting.responses[stream]["status"] == 200, waiting.responses[stream]
    finally:
        waiting.conn.close()


def _worker_with_200_files(tmp_path, pki, upstreams) -> tuple[str, GatewayProcess]:
    """(the one allowed name, a started gateway whose worker has 200 open files: 136 shared out,
    from 108 on only to sandboxes under their share), with connection rates that never refuse."""
    name = next(iter(upstreams.plain))
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text(upstreams, _rules([name])))
    gateway = GatewayProcess(policy, tmp_path / "gw", upstream_ca=pki.ca_cert,
                             command_prefix=["prlimit", "--nofile=200:200", "--"],
                             extra_args=["--set", "egress_new_connection_burst_per_sandbox=1000",
                                         "--set", "egress_max_new_connections_per_second_per_sandbox=1000"])
    return name, gateway.start()


def test_once_a_worker_s_sockets_are_taken_the_sandbox_holding_the_most_opens_no_more(tmp_path, pki, upstreams):
    """A worker with 200 open files shares out 136 sockets (less a reserve of 64), and from 108
    (80%) on only to sandboxes under their share: sandbox A holds 108 idle connections; its next
    ones are closed at accept, while B, holding none, is still served (a connection and its
    upstream dial)."""
    name, gateway = _worker_with_200_files(tmp_path, pki, upstreams)
    held: list[Conn] = []
    try:
        hog, light = f"{upstreams.block}.202", f"{upstreams.block}.203"
        gateway.mark()
        for _ in range(120):
            held.append(_connect(gateway, hog))
        lines = gateway.audit_lines(since=gateway.audit_mark, count=12, reason="too_many_connections")  # the 109th to the 120th
        assert all(line["client"].startswith(hog + ":") and "share" in line["message"] for line in lines)
        assert _closed_without_a_byte(held[-1])
        with _connect(gateway, light) as conn:
            assert get(conn, f"http://{name}/light", name).status == 200
        gateway.mark()
        for _ in range(40):  # B, under its share, up to all that is shared out (136), and no further
            held.append(_connect(gateway, light))
        lines = gateway.audit_lines(since=gateway.audit_mark, count=12, reason="too_many_connections")
        assert all("all taken" in line["message"] for line in lines), [line["message"] for line in lines]
        assert _open_files(gateway.process.pid) < 200
        assert "Too many open files" not in gateway.log()
    finally:
        for conn in held:
            conn.sock.close()
        gateway.stop()


def test_a_connection_refused_as_it_is_accepted_names_its_listener_s_mode(tmp_path, pki, upstreams):
    """The audit line of a connection closed at accept (addons/accept_gate.py) says which listener
    took it: a sandbox holding its share of a transparent listener's sockets is refused with mode
    `transparent`, as every other line of that listener says (it said `regular`)."""
    name = next(iter(upstreams.plain))
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text(upstreams, _rules([name])))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        transparent_port = probe.getsockname()[1]
    gateway = GatewayProcess(policy, tmp_path / "gw", upstream_ca=pki.ca_cert,
                             command_prefix=["prlimit", "--nofile=200:200", "--"],
                             extra_args=["--mode", f"transparent@127.0.0.1:{transparent_port}",
                                         "--set", "egress_new_connection_burst_per_sandbox=1000",
                                         "--set", "egress_max_new_connections_per_second_per_sandbox=1000"]).start()
    held: list[socket.socket] = []
    try:
        hog = f"{upstreams.block}.211"
        for _ in range(120):
            held.append(socket.create_connection(("127.0.0.1", transparent_port), timeout=5, source_address=(hog, 0)))
        lines = gateway.audit_lines(count=12, reason="too_many_connections")
        assert len(lines) >= 12 and all(line["client"].startswith(hog + ":") for line in lines)
        assert {line["mode"] for line in lines} == {"transparent"}, [line["mode"] for line in lines]
    finally:
        for sock in held:
            sock.close()
        gateway.stop()


def _open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_closed_connection_whose_peer_never_reads_lets_go_of_its_socket(start_gateway, upstreams):
    """A close waits for what was queued to be sent, with no deadline of its own: a client that
    asks for a large download and never reads kept the gateway's socket (a file descriptor and its
    send buffer) after the connection was cut and released from its sandbox's counts (review 38:
    246 of a worker's 256 descriptors held while the count said 0). Aborted after
    CLOSE_DRAIN_SECONDS."""
    gateway = start_gateway("- id: a\n  hosts: [allowed.test]\n", args=["--set", "egress_body_idle_timeout=1"])
    pid = gateway.process.pid
    before = _open_files(pid)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (small: the gateway's side fills sooner)
    sock.settimeout(10)
    sock.connect((gateway.host, gateway.port))
    conn = Conn(sock)
    try:
        conn.send(b"CONNECT allowed.test:443 HTTP/1.1\r\nHost: allowed.test:443\r\n\r\n")
        assert conn.read_response(head_only=True).status == 200
        tls = start_tls(conn, gateway, "allowed.test")
        tls.send(b"GET /bytes/64000000 HTTP/1.1\r\nHost: allowed.test\r\n\r\n")  # and never read
        gateway.audit_lines(count=1, wait=30, reason="response_body_timeout")  # cut: the gateway closes
        wait_for(lambda: _open_files(pid) <= before, 30, "the gateway's sockets of the cut connection closed")
    finally:
        sock.close()


class _OneMessageWebSocket:
    """An origin that answers every upgrade with 101, one `size`-byte binary message and a close
    frame, then waits for the gateway to close its side."""

    ACCEPT = b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo="  # for the sample key of RFC 6455

    def __init__(self, address: str, size: int) -> None:
        self.answer = (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                       b"Sec-WebSocket-Accept: " + self.ACCEPT + b"\r\n\r\n"
                       + b"\x82\x7f" + size.to_bytes(8, "big") + b"W" * size + b"\x88\x02" + (1000).to_bytes(2, "big"))
        self._stopped = False
        self._sock = socket.create_server((address, 0))
        self.port = self._sock.getsockname()[1]
        start_accepting(self._sock, self._serve, lambda: self._stopped)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                head = b""
                while b"\r\n\r\n" not in head and (piece := conn.recv(4096)):
                    head += piece
                conn.sendall(self.answer)
                while conn.recv(65536):
                    pass
            except OSError:
                pass

    def stop(self) -> None:
        self._stopped = True
        self._sock.close()


def _upgrade(gateway, source: str, origin: _OneMessageWebSocket, rcvbuf: int | None = None) -> socket.socket:
    """A connection from `source` that asked the origin for a WebSocket; `rcvbuf` (set before the
    connect, so the window it offers stays small): a client that barely reads."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.bind((source, 0))
    sock.connect((gateway.host, gateway.port))
    sock.sendall(f"GET http://ws.test:{origin.port}/ws HTTP/1.1\r\nHost: ws.test:{origin.port}\r\n"
                 "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                 "Sec-WebSocket-Version: 13\r\n\r\n".encode())
    return sock


def _disconnected(gateway, source: str) -> int:
    """How many of `source`'s connections the gateway's log shows closed (the handler ended: its
    counts released)."""
    return sum(1 for line in gateway.log().splitlines() if f"[{source}:" in line and line.endswith("] client disconnect"))


def _upgraded(sock: socket.socket) -> bool:
    with sock:
        try:
            return sock.recv(12) == b"HTTP/1.1 101"
        except OSError:
            return False


def test_a_closed_socket_still_sending_counts_against_its_sandbox_s_share_until_it_is_gone(tmp_path, pki, upstreams):
    """A socket the gateway closed with bytes still queued lingers until its peer has read them (or
    stops reading for CLOSE_DRAIN_SECONDS): it was released from its sandbox's count at the close,
    and four sandboxes whose clients never read took a worker to EMFILE (review 40: accept() failed
    for everyone, a neighbour's p99 0.1 -> 1 s). A worker with 80 open files shares out 16 sockets,
    from 12 on only to sandboxes under their share: sandbox A leaves 4 WebSockets lingering (a
    server's 8 MB message it never reads), so its 10 idle connections pass the 12 and the last ones
    are closed at accept (uncounted, the lingering sockets let all 10 in); B, holding none, is
    still served; once A's clients are gone, A is served again. (The steps after
    the WebSockets' close take well under CLOSE_DRAIN_SECONDS, 5 s, after which the lingering
    sockets are aborted.)"""
    origin = _OneMessageWebSocket(f"{upstreams.block}.214", 8_000_000)
    rules = f"- id: ws\n  hosts: [ws.test]\n  schemes: [http]\n  ports: [{origin.port}]\n"
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_text(upstreams, rules, extra_static_hosts({"ws.test": f"{upstreams.block}.214"})))
    gateway = GatewayProcess(policy, tmp_path / "gw", upstream_ca=pki.ca_cert,
                             command_prefix=["prlimit", "--nofile=80:80", "--"])
    gateway.start()
    hog, light = f"{upstreams.block}.204", f"{upstreams.block}.205"
    lingering = [_upgrade(gateway, hog, origin, rcvbuf=4096) for _ in range(4)]
    held: list[Conn] = []
    try:
        wait_for(lambda: _disconnected(gateway, hog) == 4, 10, "the gateway closed the four WebSockets (released them)")
        gateway.mark()
        for _ in range(10):
            held.append(_connect(gateway, hog))
        lines = gateway.audit_lines(since=gateway.audit_mark, count=2, reason="too_many_connections")
        assert all(line["client"].startswith(hog + ":") and "share" in line["message"] for line in lines), lines
        assert _closed_without_a_byte(held[9])
        assert _upgraded(_upgrade(gateway, light, origin))
    finally:
        for sock in lingering:
            sock.close()  # unread bytes: a reset, and the lingering sockets are gone
        for conn in held:
            conn.sock.close()
    try:
        wait_for(lambda: _upgraded(_upgrade(gateway, hog, origin)), 20,
                 "A served again once its lingering sockets are gone")
        assert "Too many open files" not in gateway.log()
    finally:
        gateway.stop()
        origin.stop()


def test_connections_accepted_in_one_burst_are_counted_as_they_are_accepted(tmp_path, pki, upstreams):
    """asyncio accepts up to 100 connections at each poll, and a connection was counted (or refused)
    only once its setup ran, a poll or more later: hundreds were held ahead of the count, and
    sandboxes opening connections as fast as they were refused took a worker to EMFILE (review 40).
    Now each is counted, or refused and closed, as it is accepted: four sandboxes opening 400
    connections, 100 at once (what the listening socket queues), against a worker with 200 open
    files (136 shared out) leave it short of none, and a fifth sandbox is served."""
    name, gateway = _worker_with_200_files(tmp_path, pki, upstreams)
    sources = [f"{upstreams.block}.{206 + i}" for i in range(4)]

    def refusals() -> int:
        lines = gateway.audit()
        return (sum(1 for line in lines if line["reason"] == "too_many_connections" and line["event"] == "connection")
                + sum(line["count"] for line in lines
                      if line["event"] == "suppressed" and line["reason"] == "too_many_connections"))

    def handled() -> int:  # served (a handler made) or refused as accepted
        connects = sum(1 for line in gateway.log().splitlines()
                       if line.endswith("] client connect") and any(f"[{source}:" in line for source in sources))
        return connects + refusals()

    opened: list[socket.socket] = []
    try:
        for wave in range(4):
            for i in range(100):
                sock = socket.socket()
                sock.setblocking(False)
                sock.bind((sources[i % 4], 0))
                sock.connect_ex((gateway.host, gateway.port))
                opened.append(sock)
            wait_for(lambda: handled() >= len(opened), 30, f"wave {wave + 1}'s connections accepted",
                     detail=lambda: repr((handled(), refusals())))
        assert refusals() >= 400 - 136
        assert "Too many open files" not in gateway.log()
        with _connect(gateway, f"{upstreams.block}.210") as conn:  # a fifth sandbox, holding none: served
            assert get(conn, f"http://{name}/fifth", name).status == 200
    finally:
        for sock in opened:
            sock.close()
        gateway.stop()
