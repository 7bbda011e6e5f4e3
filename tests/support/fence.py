"""A fence for "nothing reached this listener": a probe connection of the test's own. The kernel's
accept queue is first in, first out, so once the listener has accepted the probe (and not counted
it), every connection that reached it before has been accepted and counted. This is the event a
"settle" sleep stood for, and it holds on a slow machine too.

The probe binds to the listener's own address first, so that its client address is known before it
connects; it must be opened where that address exists (the listener's network namespace)."""

from __future__ import annotations

import secrets
import socket
import threading


class AcceptFence:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._probes: dict[tuple, threading.Event] = {}  # client address -> accepted

    def claims(self, conn: socket.socket, addr) -> bool:
        """For the accept loop, before it counts `conn`: True (and `conn` closed) when it is a probe."""
        with self._lock:
            accepted = self._probes.get(tuple(addr[:2]))
        if accepted is None:
            return False
        accepted.set()
        conn.close()
        return True

    def settle(self, sockaddr: tuple, timeout: float = 5.0) -> None:
        """Return once the listener on `sockaddr` ((host, port), or IPv6's (host, port, flow,
        scope) for a link-local address) has accepted a probe opened now."""
        host = sockaddr[0]
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.settimeout(timeout)
            probe.bind((host, 0, *sockaddr[2:]))
            accepted = threading.Event()
            address = probe.getsockname()[:2]
            with self._lock:
                self._probes[address] = accepted
            try:
                probe.connect(sockaddr)
                assert accepted.wait(timeout), f"{sockaddr}: the settle probe was never accepted"
            finally:
                with self._lock:
                    del self._probes[address]


class DatagramFence:
    """The same fence for a receiver of datagrams (UDP, a raw ICMP socket): a probe datagram of
    the test's own with a token nobody else sends. Once the receiver has read it, it has read
    every datagram queued before it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[bytes, threading.Event] = {}

    def claims(self, payload: bytes) -> bool:
        """For the receive loop, before it records `payload`: True when it carries a probe's token."""
        with self._lock:
            for token, seen in self._tokens.items():
                if token in payload:
                    seen.set()
                    return True
        return False

    def settle(self, send, timeout: float = 5.0) -> None:
        """Return once the receiver has read the probe that `send(token)` sends now."""
        token = b"egress-fence-" + secrets.token_hex(8).encode()
        seen = threading.Event()
        with self._lock:
            self._tokens[token] = seen
        try:
            send(token)
            assert seen.wait(timeout), "the settle probe datagram never arrived"
        finally:
            with self._lock:
                del self._tokens[token]
