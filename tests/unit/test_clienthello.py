"""The ClientHello check for passthrough: only an unambiguous hello naming the pinned host passes."""

import pytest

from gateway.clienthello import ECH, ESNI, SERVER_NAME, check_passthrough_hello, server_names


def sni_extension(*names: bytes, name_type: int = 0) -> bytes:
    entries = b"".join(bytes([name_type]) + len(n).to_bytes(2, "big") + n for n in names)
    return len(entries).to_bytes(2, "big") + entries


def hello(*names: bytes, extra=(), name_type: int = 0):
    return [(SERVER_NAME, sni_extension(*names, name_type=name_type)), (0x000A, b"\x00\x02\x00\x1d"), *extra]


def test_one_name_passes():
    assert check_passthrough_hello("pypi.test", hello(b"pypi.test")) is None


def test_no_sni_is_refused():
    decision = check_passthrough_hello(None, [(0x000A, b"")])
    assert decision.reason == "sni_required"
    assert decision.status == 421


@pytest.mark.parametrize("ext", [ECH, ESNI])
def test_encrypted_client_hello_is_refused(ext):
    decision = check_passthrough_hello("pypi.test", hello(b"pypi.test", extra=[(ext, b"\x00")]))
    assert decision.reason == "ech_refused"


def test_two_names_in_one_extension_are_refused():
    decision = check_passthrough_hello("pypi.test", hello(b"pypi.test", b"evil.test"))
    assert decision.reason == "bad_client_hello"


def test_repeated_extension_is_refused():
    extensions = hello(b"pypi.test") + [(SERVER_NAME, sni_extension(b"evil.test"))]
    assert check_passthrough_hello("pypi.test", extensions).reason == "bad_client_hello"


def test_a_name_other_than_the_checked_one_is_refused():
    assert check_passthrough_hello("pypi.test", hello(b"PYPI.test")).reason == "bad_client_hello"


def test_non_host_name_entry_is_refused():
    assert check_passthrough_hello("pypi.test", hello(b"pypi.test", name_type=1)).reason == "bad_client_hello"


@pytest.mark.parametrize("data", [b"", b"\x00", b"\x00\x05\x00\x00\x09abc", b"\x00\x04\x00\x00\x01ab"])
def test_malformed_server_name_extension(data):
    assert server_names(data) is None
    assert check_passthrough_hello("abc", [(SERVER_NAME, data)]).reason == "bad_client_hello"
