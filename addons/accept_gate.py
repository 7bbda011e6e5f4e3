"""A connection is counted against its sandbox's sockets the moment it is accepted, and refused there.

asyncio's listening socket accepts up to 100 connections at each poll (selector_events 3.12,
`_accept_connection`), and a connection was counted in the worker's socket ledger (gateway/sockets.py)
only once its setup reached `client_connected`, a poll or more later. Sandboxes opening connections as
fast as they were refused kept hundreds accepted ahead of the count: eight sandboxes took a worker with
1,024 open files to EMFILE (review 40: accept() then fails and asyncio stops accepting for a second,
for every sandbox; 240 tracebacks in 15 s, a neighbour's p99 1.9 s), whatever reserve was kept.

`install()` replaces the accept loop with the same loop that asks the gate (`Gate.admit`) for every
socket it accepts: admitted, it is counted at once (the connection's setup, `claim`, takes the count
over); refused, it is closed before anything else is made for it (no transport, no task, no handler)
and its audit line written. A count whose connection never reaches `claim` (its setup failed) is
given back when its socket object goes, or when the kernel gives its descriptor to another socket.
Only the proxy's own listeners are asyncio's in the gateway (the metrics and control servers are
threads'), so every asyncio accept is gated once a gate is set.
"""

from __future__ import annotations

import errno
import logging
import weakref
from asyncio import constants, selector_events
from collections.abc import Callable

_ORIGINAL = selector_events.BaseSelectorEventLoop._accept_connection


class Gate:
    """What the accept loop asks (`admit`) and what a connection's setup tells (`claim`)."""

    def __init__(self, refusal: Callable[[tuple], tuple[str, str | None]],
                 count: Callable[[str], None], uncount: Callable[[str], None],
                 refused: Callable[[tuple, str, tuple | None], None]):
        self._refusal = refusal  # peername -> (sandbox key, why it may not connect now or None)
        self._count, self._uncount, self._refused = count, uncount, refused
        # The sockets counted and not claimed yet, by file descriptor: the one thing two of them open
        # at once cannot share. By peer address, a sandbox reconnecting from the same port before
        # the first connection's setup claimed it made the two share one entry, and one count was
        # never given back (review 41: 340 of a worker's 448 held for good, by no socket).
        self._ahead: dict[int, tuple[str, object]] = {}  # fd -> (sandbox key, its finalizer)

    def admit(self, conn, addr, listening: tuple | None = None) -> bool:
        """`listening`: the address of the socket that accepted it (which listener: its mode)."""
        fd = conn.fileno()
        stale = self._ahead.pop(fd, None)
        if stale is not None:  # the kernel gave its number again: that socket is closed, never claimed
            stale[1].detach()
            self._uncount(stale[0])
        peer = tuple(addr[:2])
        key, refusal = self._refusal(peer)
        if refusal is not None:
            self._refused(peer, refusal, listening)
            return False
        self._count(key)  # (first: a count that raised leaves no entry to give back, review 51)
        self._ahead[fd] = (key, weakref.finalize(conn, self._never_claimed, fd))
        return True

    def claim(self, fd: int | None) -> None:
        """The connection on socket `fd` reached its setup: its count is the setup's now, and its
        finalizer goes (kept until the socket went, it held ~400 bytes for every open connection)."""
        entry = self._ahead.pop(fd, None) if fd is not None else None
        if entry is not None:
            entry[1].detach()
            self._uncount(entry[0])

    def _never_claimed(self, fd: int) -> None:
        """The socket object is gone, never claimed (its setup failed): its count goes with it. (A
        finalizer runs once and is detached with its entry: the entry under `fd` is its own.)"""
        entry = self._ahead.pop(fd, None)
        if entry is not None:
            self._uncount(entry[0])

    @property
    def ahead(self) -> int:
        return len(self._ahead)


_gate: Gate | None = None


def set_gate(gate: Gate | None) -> None:
    global _gate
    _gate = gate


def claim(handler) -> None:
    """`handler`'s client connection reached its setup (addons/limits.py `client_connected`)."""
    if _gate is None or handler is None:
        return
    io = handler.transports.get(handler.client)
    try:
        sock = io.writer.get_extra_info("socket")
    except (AttributeError, KeyError):  # a mitmproxy_rs stream (DNS, WireGuard, local modes): never gated
        return
    if sock is not None:
        _gate.claim(sock.fileno())


def gated_accept_connection(self, protocol_factory, sock, sslcontext=None, server=None, backlog=100,
                            ssl_handshake_timeout=constants.SSL_HANDSHAKE_TIMEOUT,
                            ssl_shutdown_timeout=constants.SSL_SHUTDOWN_TIMEOUT):
    """asyncio 3.12's `_accept_connection`, each accepted socket admitted by the gate first."""
    gate = _gate
    if gate is None:
        return _ORIGINAL(self, protocol_factory, sock, sslcontext, server, backlog,
                         ssl_handshake_timeout, ssl_shutdown_timeout)
    for _ in range(backlog):
        try:
            conn, addr = sock.accept()
            conn.setblocking(False)
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return None
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                raise  # the event loop logs and ignores it
            logging.getLogger("egress").warning("egress gateway: accept() failed (%s); accepting again in %ss",
                                                exc, constants.ACCEPT_RETRY_DELAY)
            self._remove_reader(sock.fileno())
            self.call_later(constants.ACCEPT_RETRY_DELAY, self._start_serving, protocol_factory, sock, sslcontext,
                            server, backlog, ssl_handshake_timeout, ssl_shutdown_timeout)
            return None
        try:
            admitted = gate.admit(conn, addr, sock.getsockname())
        except Exception:  # fail closed: a connection the gate could not decide is not served
            logging.getLogger("egress").exception("egress gateway: could not decide an accepted connection")
            admitted = False
        if not admitted:
            conn.close()
            continue
        self.create_task(self._accept_connection2(protocol_factory, conn, {"peername": addr}, sslcontext, server,
                                                  ssl_handshake_timeout, ssl_shutdown_timeout))
    return None


ACCEPT_CALLBACKS = frozenset({_ORIGINAL, gated_accept_connection})  # a listening socket's callback


def install() -> None:
    selector_events.BaseSelectorEventLoop._accept_connection = gated_accept_connection
