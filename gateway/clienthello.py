"""What a TLS ClientHello must look like before its connection is relayed unread (passthrough).

An intercepted connection is safe whatever the ClientHello says: the gateway terminates the TLS
and dials the pinned name itself. A passthrough connection is not: the upstream server reads this
very ClientHello and picks the site it serves from it. So the name the gateway checked must be
the only name the upstream can read:

- exactly one server_name extension, holding exactly one host_name entry, equal (byte for byte,
  before canonicalisation) to the SNI the gateway checked: a second entry or a second extension
  is where a parser differential between the gateway and the upstream would hide;
- no Encrypted ClientHello (the real name is encrypted: the checked SNI is only the outer, public
  name) and no draft ESNI;
- no extension type twice (RFC 8446 4.2 forbids it; servers differ in which copy they take).

Works on the (type, data) extension pairs any TLS parser yields; no mitmproxy types here.
"""

from __future__ import annotations

from collections.abc import Iterable

from .decision import Decision

SERVER_NAME = 0x0000
ECH = 0xFE0D  # encrypted_client_hello (RFC 9849)
ESNI = 0xFFCE  # draft encrypted_server_name, still sent by some old clients
HOST_NAME = 0


def server_names(data: bytes) -> list[tuple[int, bytes]] | None:
    """The (name_type, name) entries of a server_name extension, or None if it is malformed."""
    if len(data) < 2:
        return None
    total = int.from_bytes(data[:2], "big")
    if total != len(data) - 2:
        return None
    entries, at = [], 2
    while at < len(data):
        if at + 3 > len(data):
            return None
        name_type, length = data[at], int.from_bytes(data[at + 1 : at + 3], "big")
        at += 3
        if at + length > len(data):
            return None
        entries.append((name_type, data[at : at + length]))
        at += length
    return entries


def check_passthrough_hello(sni: str | None, extensions: Iterable[tuple[int, bytes]]) -> Decision | None:
    """None when the ClientHello may be relayed unread; else the refusal."""
    extensions = list(extensions)
    types = [ext_type for ext_type, _ in extensions]
    if ECH in types or ESNI in types:
        return Decision.deny("ech_refused", "a passthrough connection cannot use Encrypted ClientHello: "
                             "the name the upstream would serve is hidden from the gateway")
    if len(set(types)) != len(types):
        return Decision.deny("bad_client_hello", "the TLS ClientHello repeats an extension")
    if not sni:
        return Decision.deny("sni_required", "a passthrough connection needs a TLS SNI naming the destination")
    found = [data for ext_type, data in extensions if ext_type == SERVER_NAME]
    entries = server_names(found[0]) if len(found) == 1 else None
    if entries is None or len(entries) != 1 or entries[0][0] != HOST_NAME:
        return Decision.deny("bad_client_hello", "the TLS server_name extension must hold exactly one host name")
    if entries[0][1] != sni.encode("ascii", "replace"):
        return Decision.deny("bad_client_hello", "the TLS server_name extension does not say what was checked")
    return None


# -- reading a ClientHello off the wire, within a budget -------------------------------------------

NEED_MORE, COMPLETE, TOO_LARGE, MALFORMED = "need_more", "complete", "too_large", "malformed"
HANDSHAKE = 0x16
CLIENT_HELLO = 0x01
MAX_RECORD = 2**14  # RFC 8446 5.1: a plaintext record holds at most 2^14 bytes
# Real clients send their hello in one record (four at most for 64 KiB); tools that fragment it to
# evade DPI use a handful. Each record costs a round of the reader's loop: thousands of 1-byte
# records would cost the event loop more than the bytes they carry.
MAX_RECORDS = 256
DEFAULT_MAX_CLIENT_HELLO_BYTES = 64 * 1024
# What a hello costs mitmproxy (and kaitai, and the passthrough checks) grows with its items, not
# its bytes: a legal 64 KiB hello of ~16,000 empty extensions cost ~100 ms of CPU to inspect, so
# 45 a second saturated a worker. Real clients send fewer than 30 extensions (Chrome ~18, Firefox
# ~17, curl/OpenSSL ~12) and fewer than 200 cipher suites (OpenSSL's "ALL" ~140; browsers ~16).
MAX_EXTENSIONS = 128
MAX_CIPHER_SUITES = 512


def _too_many_items(body) -> str | None:
    """Why a ClientHello body (after its 4-byte header) has too many cipher suites or extensions,
    or None. Bounded work: at most MAX_EXTENSIONS + 1 steps. A body whose lengths do not add up is
    left to the parser (it is refused as bad_client_hello there)."""
    at = 2 + 32  # legacy_version, random
    if len(body) < at + 1:
        return None
    at += 1 + body[at]  # legacy_session_id
    if len(body) < at + 2:
        return None
    suites = int.from_bytes(body[at : at + 2], "big") // 2
    if at + 2 + 2 * suites > len(body):
        return None  # lengths that do not add up: malformed, not large
    if suites > MAX_CIPHER_SUITES:
        return f"the TLS ClientHello offers {suites} cipher suites (limit {MAX_CIPHER_SUITES})"
    at += 2 + 2 * suites
    if len(body) < at + 1:
        return None
    at += 1 + body[at]  # legacy_compression_methods
    if len(body) < at + 2:
        return None
    end = min(len(body), at + 2 + int.from_bytes(body[at : at + 2], "big"))
    at += 2
    count = 0
    while at + 4 <= end:
        count += 1
        if count > MAX_EXTENSIONS:
            return f"the TLS ClientHello has more than {MAX_EXTENSIONS} extensions"
        at += 4 + int.from_bytes(body[at + 2 : at + 4], "big")
    return None


class ClientHelloReader:
    """The first TLS records of a connection, fed in the pieces they arrive in, until they hold a
    whole ClientHello: sans I/O, linear in the bytes fed, memory bounded by the budget.

    mitmproxy's own reader re-parses its whole buffer on every read and joins records by
    concatenation (quadratic), and waits for as many bytes as the handshake header declares (up to
    16 MiB). Here the declared length is checked against `max_bytes` as soon as the handshake
    header is known (right after the first record header when it holds four bytes or more), and
    a record is judged by its header: nothing over the budget is ever buffered. A hello in more than
    MAX_RECORDS records is refused as too large too, and so is a complete hello of more than
    MAX_EXTENSIONS extensions or MAX_CIPHER_SUITES cipher suites (counted by walking their length
    fields, at most that many steps, before anything parses the hello).

    `verdict` is NEED_MORE until it settles on COMPLETE, TOO_LARGE or MALFORMED (`error` says why).
    Once COMPLETE, `canonical()` gives the same handshake bytes in as few records as TLS allows
    (byte for byte what was sent when it came in one record, as real clients send it), followed by
    whatever came after: a hello fragmented into thousands of tiny records costs mitmproxy's parser
    (and the upstream, for a relayed tunnel) no more than one in a single record."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_CLIENT_HELLO_BYTES):
        self.max_bytes = max_bytes
        self.verdict = NEED_MORE
        self.error = ""
        self.length: int | None = None  # the handshake message's size, its 4-byte header included
        self.version = b""  # the first record's legacy version: kept for the canonical records
        self.payload = bytearray()  # the handshake bytes of the complete records read so far
        self.rest = bytearray()  # what came after the record that completed the ClientHello
        self.records = 0  # complete records read
        self._pending = bytearray()  # an incomplete record, header included

    def feed(self, data: bytes) -> str:
        if self.verdict == COMPLETE:
            self.rest += data
        if self.verdict != NEED_MORE:
            return self.verdict
        pending = self._pending
        pending += data
        at = 0
        while self.verdict == NEED_MORE and len(pending) - at >= 5:
            content_type, major, minor = pending[at], pending[at + 1], pending[at + 2]
            size = int.from_bytes(pending[at + 3 : at + 5], "big")
            if content_type != HANDSHAKE or major != 3 or minor > 3:
                return self._settle(MALFORMED, "a record that is not a TLS handshake record came before the "
                                               "ClientHello was complete")
            if size == 0:
                return self._settle(MALFORMED, "an empty TLS record")
            if size > MAX_RECORD:
                return self._settle(TOO_LARGE, f"a TLS record of {size} bytes (TLS allows {MAX_RECORD})")
            if self.records >= MAX_RECORDS:
                return self._settle(TOO_LARGE, f"the TLS ClientHello spans more than {MAX_RECORDS} records")
            if not self.version:
                self.version = bytes(pending[at + 1 : at + 3])
            if self.length is None:  # the payload holds at most 3 bytes so far: this is cheap
                header = bytes(self.payload) + bytes(pending[at + 5 : at + 5 + min(size, 4)])
                if header and header[0] != CLIENT_HELLO:
                    return self._settle(MALFORMED, "the first TLS handshake message is not a ClientHello")
                if len(header) >= 4:
                    self.length = int.from_bytes(header[1:4], "big") + 4
                    if self.length > self.max_bytes:
                        return self._settle(TOO_LARGE, f"the TLS ClientHello declares {self.length} bytes "
                                                       f"(limit {self.max_bytes})")
            if len(pending) - at - 5 < size:
                break  # the record is still incomplete: its body is not copied until it is whole
            self.payload += pending[at + 5 : at + 5 + size]
            self.records += 1
            at += 5 + size
            if self.length is not None and len(self.payload) >= self.length:
                if (too_many := _too_many_items(memoryview(self.payload)[4 : self.length])) is not None:
                    return self._settle(TOO_LARGE, too_many)
                self.verdict = COMPLETE
                self.rest = pending[at:]
                at = len(pending)
        del pending[:at]
        return self.verdict

    def _settle(self, verdict: str, error: str) -> str:
        self.verdict, self.error = verdict, error
        self._pending = bytearray()
        self.payload = bytearray()
        return verdict

    @property
    def hello(self) -> bytes:
        """The ClientHello handshake message (its 4-byte header included), once COMPLETE."""
        return bytes(self.payload[: self.length]) if self.verdict == COMPLETE and self.length else b""

    def canonical(self) -> bytes:
        """The handshake bytes read, in records of at most 2^14 bytes, then what came after."""
        out = bytearray()
        for start in range(0, len(self.payload), MAX_RECORD):
            chunk = self.payload[start : start + MAX_RECORD]
            out += bytes([HANDSHAKE]) + self.version + len(chunk).to_bytes(2, "big") + chunk
        return bytes(out + self.rest)
