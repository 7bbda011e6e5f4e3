"""check_headers and check_restated."""

from __future__ import annotations

import pytest

from gateway.decision import Decision
from gateway.hostnames import canonical_host
from gateway.requestcheck import authority_matches, check_headers, check_restated

C = canonical_host


def deny(reason: str, message: str) -> Decision:
    return Decision(False, reason, message, None, [])


# --------------------------------------------------------------------------------------------
# check_headers


def test_ordinary_headers_pass():
    assert check_headers([]) is None
    assert check_headers([("Host", "example.com"), ("Accept", "*/*"), ("User-Agent", "x y: z")]) is None
    assert check_headers([("Host", "example.com"), ("Upgrade", "websocket"), ("Connection", "Upgrade")]) is None
    assert check_headers([("upgrade", "WebSocket")]) is None
    assert check_headers([("Upgrade", " websocket , ")]) is None


@pytest.mark.parametrize(
    "headers",
    [
        [("Host", "a.com"), ("Host", "a.com")],
        [("Host", "a.com"), ("host", "b.com")],
        [("HOST", "a.com"), ("X", "y"), ("hOsT", "a.com")],
    ],
)
def test_duplicate_host(headers):
    assert check_headers(headers) == deny("bad_host_header", "more than one Host header")


@pytest.mark.parametrize("bad", ["\r", "\n", "\x00", "\r\n"])
def test_control_characters_in_values(bad):
    assert check_headers([("Host", f"a.com{bad}X-Injected: 1")]) == deny(
        "bad_host_header", "control character in header 'Host'"
    )
    assert check_headers([("X-Thing", f"v{bad}w")]) == deny("bad_header", "control character in header 'X-Thing'")


@pytest.mark.parametrize("name", ["X-A\r", "X-A\n", "X\x00A", "X A", "X:A"])
def test_bad_header_names(name):
    decision = check_headers([(name, "v")])
    assert decision is not None
    assert (decision.allowed, decision.reason) == (False, "bad_header")


def test_long_header_name_clipped_in_message():
    decision = check_headers([("X" * 100, "a\nb")])
    assert decision.message == f"control character in header {'X' * 40!r}"


@pytest.mark.parametrize(
    "headers",
    [
        [("Upgrade", "h2c")],
        [("Upgrade", "H2C")],
        [("Upgrade", "websocket, h2c")],
        [("Upgrade", "h2c, websocket")],
        [("Upgrade", "websocket"), ("Upgrade", "h2c")],
        [("Upgrade", "websocket"), ("Upgrade", "websocket")],
        [("Upgrade", "TLS/1.2")],
        [("Upgrade", "HTTP/2.0")],
        [("Upgrade", "")],
        [("Upgrade", " , ")],
        [("Upgrade", "websocket/13")],
    ],
)
def test_upgrades_other_than_websocket_refused(headers):
    assert check_headers(headers) == deny("upgrade_refused", "only 'Upgrade: websocket' is allowed")


@pytest.mark.parametrize("name", ["HTTP2-Settings", "http2-settings", "HTTP2-SETTINGS"])
def test_http2_settings_refused(name):
    assert check_headers([("Host", "a.com"), (name, "AAMAAABkAAQAAP__")]) == deny(
        "upgrade_refused", "HTTP2-Settings (h2c upgrade) is refused"
    )


def test_check_order_duplicate_host_first():
    headers = [("Host", "a\r"), ("Host", "b"), ("Upgrade", "h2c")]
    assert check_headers(headers).message == "more than one Host header"


# --------------------------------------------------------------------------------------------
# check_restated


@pytest.mark.parametrize(
    "kind, value, scheme, host, port",
    [
        ("host", "example.com", "https", "example.com", 443),
        ("host", "example.com:443", "https", "example.com", 443),
        ("host", "EXAMPLE.com.:443", "https", "example.com", 443),
        ("host", "example.com", "http", "example.com", 80),
        ("host", "example.com:80", "http", "example.com", 80),
        ("host", "example.com:8080", "http", "example.com", 8080),
        ("authority", "example.com:8443", "https", "example.com", 8443),
        ("authority", "bücher.de", "https", "xn--bcher-kva.de", 443),
        ("host", "127.0.0.1:80", "http", "0x7f.1", 80),
        ("host", "0x7f.1", "http", "127.0.0.1", 80),
        ("authority", "[2001:db8::1]", "https", "[2001:db8::1]", 443),
        ("authority", "[2001:DB8:0::1]:443", "https", "[2001:db8::1]", 443),
        ("host", "[::1]:8080", "http", "[::1]", 8080),
    ],
)
def test_restated_matches(kind, value, scheme, host, port):
    assert check_restated([(kind, value)], scheme, C(host), port) is None
    assert authority_matches(value, scheme, C(host), port) is True


@pytest.mark.parametrize(
    "kind, value, scheme, host, port, reason",
    [
        ("host", "other.com", "https", "example.com", 443, "host_mismatch"),
        ("authority", "other.com", "https", "example.com", 443, "authority_mismatch"),
        ("host", "example.com:8443", "https", "example.com", 443, "host_mismatch"),
        ("authority", "example.com:443", "https", "example.com", 8443, "authority_mismatch"),
        ("host", "example.com", "http", "example.com", 443, "host_mismatch"),  # http default is 80
        ("host", "example.com", "https", "example.com", 80, "host_mismatch"),
        ("host", "www.example.com", "https", "example.com", 443, "host_mismatch"),
        ("host", "127.0.0.2", "http", "127.0.0.1", 80, "host_mismatch"),
        ("authority", "[2001:db8::2]", "https", "[2001:db8::1]", 443, "authority_mismatch"),
        ("authority", "[::ffff:127.0.0.1]", "https", "127.0.0.1", 443, "authority_mismatch"),
    ],
)
def test_restated_mismatches(kind, value, scheme, host, port, reason):
    pinned = C(host)
    decision = check_restated([(kind, value)], scheme, pinned, port)
    assert decision == deny(reason, f"the {kind} {value!r} is not the pinned destination {pinned.authority(port)}")
    assert decision.status == 421


@pytest.mark.parametrize(
    "kind, value, scheme",
    [
        ("host", "", "https"),
        ("host", "example.com:", "https"),
        ("host", "example.com:x", "https"),
        ("host", "example.com:0", "https"),
        ("host", "example.com:443:443", "https"),
        ("host", "user@example.com", "https"),
        ("host", "example.com ", "https"),
        ("host", "exa%6dple.com", "https"),
        ("authority", "2001:db8::1", "https"),
        ("authority", "[2001:db8::1", "https"),
        ("authority", "[example.com]", "https"),
        ("host", "example.com", "ftp"),  # no default port for the scheme, and none given
        ("host", "0x-1.0.0.1", "https"),
        ("host", "0x0x7f.1", "https"),
    ],
)
def test_restated_malformed(kind, value, scheme):
    decision = check_restated([(kind, value)], scheme, C("example.com"), 443)
    assert decision is not None
    assert (decision.allowed, decision.reason) == (False, "bad_host_header")
    assert decision.message.startswith(f"malformed {kind}: ")
    assert decision.status == 400


def test_restated_checks_every_value_in_order():
    pinned = C("example.com")
    assert check_restated([("host", "example.com"), ("authority", "example.com:443")], "https", pinned, 443) is None
    first_bad = check_restated([("host", "example.com"), ("authority", "evil.com"), ("host", "")], "https", pinned, 443)
    assert first_bad.reason == "authority_mismatch"
    assert check_restated([], "https", pinned, 443) is None


def test_long_mismatch_value_clipped():
    value = f"{'a' * 60}.{'b' * 60}.{'c' * 60}.com"
    decision = check_restated([("host", value)], "https", C("example.com"), 443)
    assert decision.message == f"the host {value[:100]!r} is not the pinned destination example.com:443"
