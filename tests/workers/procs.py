"""Which process is which: the supervisor's worker processes, their listening sockets, and which
worker accepted a given client connection. Read from /proc only (Linux), nothing is guessed.

A worker is a descendant of the supervisor that holds a listening socket on the gateway's port.
The worker that serves a connection is the process holding the server side of it: the
/proc/net/tcp entry whose local address is the gateway's and whose remote address is the client's
socket, matched by inode against /proc/PID/fd. (An accepted socket has an inode; one still waiting
in the accept queue shows inode 0, so the lookup polls.)
"""

from __future__ import annotations

import os
import re
import socket
import struct
from pathlib import Path

from tests.support.waiting import wait_for  # noqa: F401  (the worker suites call procs.wait_for)

LISTEN = "0A"


def children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                found += [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                continue
    except OSError:
        return []
    return sorted(set(found))


def descendants(pid: int) -> list[int]:
    result, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            if child not in result:
                result.append(child)
                todo.append(child)
    return result


def stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: [state, ppid, ...] (None when gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def identity(pid: int) -> tuple[int, int] | None:
    """(pid, start time): tells a process apart from a later one that reuses its pid."""
    fields = stat_fields(pid)
    return (pid, int(fields[19])) if fields else None


def running(ident: tuple[int, int]) -> bool:
    """Is this exact process still alive (not gone, not a zombie, pid not reused)?"""
    fields = stat_fields(ident[0])
    return bool(fields) and fields[0] not in ("Z", "X") and int(fields[19]) == ident[1]


def gone(ident: tuple[int, int]) -> bool:
    """Exited (a zombie counts: its sockets are already closed)."""
    return not running(ident)


def _parse_addr(text: str) -> tuple[str, int]:
    address, port = text.split(":")
    if len(address) == 8:
        ip = socket.inet_ntoa(struct.pack("<I", int(address, 16)))
    else:
        raw = bytes.fromhex(address)
        ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
        if ip.startswith("::ffff:"):
            ip = ip[7:]
    return ip, int(port, 16)


def tcp_table() -> list[tuple[tuple[str, int], tuple[str, int], str, int]]:
    """(local, remote, state, inode) of every TCP socket in this network namespace."""
    return socket_table("/proc/net", "tcp")


def socket_table(proc_net: str, proto: str) -> list[tuple[tuple[str, int], tuple[str, int], str, int]]:
    """(local, remote, state, inode) of every `proto` (tcp or udp) socket, IPv4 and IPv6, listed in
    `proc_net` (/proc/net: this network namespace; /proc/PID/net: the one process PID lives in)."""
    rows = []
    for name in (f"{proc_net}/{proto}", f"{proc_net}/{proto}6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            rows.append((_parse_addr(parts[1]), _parse_addr(parts[2]), parts[3], int(parts[9])))
    return rows


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        entries = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for entry in entries:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{entry}")
        except OSError:
            continue
        match = re.fullmatch(r"socket:\[(\d+)\]", target)
        if match:
            inodes.add(int(match.group(1)))
    return inodes


def listening_inodes(port: int) -> set[int]:
    return {inode for local, _remote, state, inode in tcp_table() if state == LISTEN and local[1] == port and inode}


def listeners(pids: list[int], port: int) -> list[int]:
    """Those of `pids` that hold a listening socket on `port`."""
    inodes = listening_inodes(port)
    return [pid for pid in pids if socket_inodes(pid) & inodes]


def workers(supervisor: int, port: int) -> list[int]:
    """Descendants of the supervisor listening on `port` (the supervisor itself is not counted)."""
    return listeners(descendants(supervisor), port)


def owner(sock: socket.socket, server_port: int, pids, timeout: float = 5.0) -> int:
    """The pid among `pids` (a list, or a callable returning one, re-read on every attempt: workers
    may be restarting) that accepted the connection of client socket `sock` to `server_port`."""
    candidates = pids if callable(pids) else (lambda: pids)
    client = sock.getsockname()[:2]
    client = (client[0][7:] if client[0].startswith("::ffff:") else client[0], client[1])
    inodes: set = set()

    def holder() -> int | None:
        inodes.clear()
        inodes.update(inode for local, remote, _state, inode in tcp_table()
                      if local[1] == server_port and remote == client and inode)
        if inodes:
            for pid in candidates():
                if socket_inodes(pid) & inodes:
                    return pid
        return None

    return wait_for(holder, timeout, f"a process among {candidates()} holding the server side of {client} -> "
                    f":{server_port}", interval=0.02, detail=lambda: f"(inodes {inodes})")
