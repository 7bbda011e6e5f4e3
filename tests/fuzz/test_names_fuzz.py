"""Property/fuzz tests of name and address canonicalisation (gateway.hostnames), beyond tests/unit:

- every Unicode general category (surrogates, unassigned, format, combining, private use, line and
  paragraph separators ...) spliced into host names;
- confusables: homoglyphs from other scripts must give another name (never the ASCII one), while
  compatibility forms (full-width, mathematical, circled letters, the Kelvin sign, ligatures) give
  exactly the ASCII name, as UTS 46 says and as browsers and curl do;
- the canonical form is a fixpoint through every way the gateway re-reads a destination: as a bare
  host, in an authority (`host:port`, `[v6]:port`), restated in a Host header, and as a rule;
- labels: only an ASCII dot separates them (no other character may introduce one), every A-label
  decodes and re-encodes to itself, and a name is never something getaddrinfo would take for a
  numeric address (while an address is exactly what getaddrinfo makes of its text).
"""

from __future__ import annotations

import ipaddress
import socket
import unicodedata

import idna
from hypothesis import example, given
from hypothesis import strategies as st

from gateway.hostnames import Host, HostError, canonical_host, ip_host, parse_authority
from gateway.matcher import HostIndex, HostPattern
from gateway.requestcheck import check_restated

from .conftest import fuzz_settings

CATEGORIES = ["Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Pc", "Pd", "Ps", "Pe", "Pi",
              "Pf", "Po", "Sm", "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co", "Cn"]
ANY_CATEGORY = st.sampled_from(CATEGORIES).flatmap(lambda c: st.characters(categories=[c]))
LABEL = st.from_regex(r"\A[a-z0-9](?:[a-z0-9-]{0,8}[a-z0-9])?\Z").filter(lambda s: s[2:4] != "--")
NAME = st.lists(LABEL, min_size=1, max_size=4).map(".".join)
SPECIALS = st.sampled_from([".", "..", ":", "[", "]", "%", "@", "\\", "/", "#", "?", " ", "\t", "\x00", "\x7f",
                            "\u3002", "\uff0e", "\uff61", "\ufe52", "\u2024", "\u2488", "\u200b", "\u00ad", "\u200d",
                            "\u0338", "\u202e", "\ufeff", "xn--", "0x", "0", "1", "-", "_", "*", "\ud800", "\udfff"])
IPV4ISH = st.text(alphabet="0123456789abcdefxX.", min_size=1, max_size=18)


@st.composite
def spliced_names(draw):
    """An ASCII name with characters of random categories (and some specials) spliced in."""
    text = draw(NAME)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.one_of(ANY_CATEGORY, SPECIALS)) + text[at:]
    if draw(st.booleans()):
        text = text.upper() if draw(st.booleans()) else text + "."
    return text


HOSTS = st.one_of(spliced_names(), NAME, IPV4ISH, st.text(max_size=24),
                  st.text(alphabet=st.sampled_from(CATEGORIES).flatmap(lambda c: st.characters(categories=[c])),
                          max_size=10))


def canonical_or_none(raw: str) -> Host | None:
    try:
        host = canonical_host(raw)
    except HostError:
        return None
    assert isinstance(host, Host)
    return host


def bracketed(host: Host) -> str:
    return f"[{host.value}]" if host.ip is not None and host.ip.version == 6 else host.value


EXAMPLES = ["ａｌｌｏｗｅｄ.test", "\u212aelvin.test", "a\u200bb.test", "xn--bcher-kva.de", "１２７.０.０.１",
            "[::ffff:127.0.0.1]", "a\ufe52com", "a\u2024com", "allowed\u2488test", "a\u3002b", "\u200b.com",
            "0x7f.1", "127.0.0.1.", "0x7f.0x1g", "1.2.3", "08.1", "b\u00fccher.de", "\u0430llowed.test"]


def with_examples(strategy_test):
    for raw in EXAMPLES:
        strategy_test = example(raw, 443)(strategy_test)
    return strategy_test


@fuzz_settings(500)
@given(HOSTS, st.integers(1, 65535))
@with_examples
def test_canonical_names(raw, port):
    """Four properties of every canonical host, checked on one stream of inputs."""
    host = canonical_or_none(raw)
    if host is None:
        return
    fixpoint_everywhere(raw, host, port)
    only_ascii_dots_separate_labels(raw, host)
    a_labels_round_trip(host)
    never_numeric_to_getaddrinfo(raw, host)


def fixpoint_everywhere(raw: str, host: Host, port: int) -> None:
    """The canonical form is shaped right and is a fixpoint as a bare host, in an authority,
    restated in a Host header (default and explicit port), and as a rule."""
    value = host.value
    assert value.isascii() and value == value.lower() and not value.endswith("."), value
    if host.ip is None:
        assert set(value) <= set("abcdefghijklmnopqrstuvwxyz0123456789-_."), value
        assert len(value) <= 253 and all(1 <= len(label) <= 63 for label in value.split(".")), value
    else:
        assert value == host.ip.compressed
    assert canonical_host(bracketed(host)) == host
    assert parse_authority(host.authority(port)) == (host, port)
    assert parse_authority(bracketed(host), port) == (host, port)
    assert check_restated([("host", host.authority(port))], "https", host, port) is None
    assert check_restated([("host", bracketed(host))], "https", host, 443) is None
    assert check_restated([("authority", host.authority(port))], "http", host, port) is None
    assert HostIndex.build([(HostPattern.exact(host), 0)]).candidates(canonical_host(bracketed(host))) == [0]
    # the spelling the sandbox used restates itself too, in an authority and a Host header
    if not raw.startswith("[") and ":" not in raw:
        assert parse_authority(f"{raw}:{port}") == (host, port)
        assert check_restated([("host", raw)], "http", host, 80) is None


def only_ascii_dots_separate_labels(raw: str, host: Host) -> None:
    """No character but an ASCII dot may introduce a label (U+FE52, U+2024, U+2488 ... map to one
    under NFKC): a name has exactly as many labels as the raw text has dot-separated parts."""
    if host.is_ip:
        return
    parts = (raw[:-1] if raw.endswith(".") else raw).split(".")
    assert len(host.value.split(".")) == len(parts), (raw, host.value)


def a_labels_round_trip(host: Host) -> None:
    if host.is_ip:
        return
    for label in host.value.split("."):
        if label.startswith("xn--"):
            unicode_label = idna.decode(label)
            assert idna.encode(unicode_label).decode("ascii") == label, (label, unicode_label)
            assert canonical_host(unicode_label).value == label


def never_numeric_to_getaddrinfo(raw: str, host: Host) -> None:
    """What the gateway calls a name, getaddrinfo must not read as an address, and what it calls an
    address is exactly what getaddrinfo reads (AI_NUMERICHOST: no lookup is made)."""
    try:
        infos = socket.getaddrinfo(host.value, None, flags=socket.AI_NUMERICHOST)
    except (socket.gaierror, UnicodeError, ValueError):
        infos = None
    if host.ip is None:
        assert infos is None, (raw, host.value, infos)
    else:
        assert infos is not None, (raw, host.value)
        assert {ipaddress.ip_address(i[4][0].split("%")[0]) for i in infos} == {host.ip}


@fuzz_settings(400)
@given(IPV4ISH)
def test_numeric_looking_names(raw):
    host = canonical_or_none(raw)
    if host is not None:
        never_numeric_to_getaddrinfo(raw, host)
        fixpoint_everywhere(raw, host, 8443)


# --------------------------------------------------------------------------------------------
# confusables

HOMOGLYPHS = {  # other scripts' look-alikes: a different name, always
    "a": "\u0430\u0251\u03b1", "c": "\u0441\u03f2", "d": "\u0501", "e": "\u0435", "g": "\u0261",
    "h": "\u04bb", "i": "\u0456\u0131", "j": "\u0458", "l": "\u04cf", "n": "\u0578", "o": "\u043e\u03bf\u0585",
    "p": "\u0440\u03c1", "q": "\u051b", "s": "\u0455", "u": "\u057d", "v": "\u03bd", "w": "\u051d",
    "x": "\u0445", "y": "\u0443",
}


def compat_forms(ch: str) -> list[str]:
    """Compatibility spellings of an ASCII letter or digit that UTS 46 maps back to it."""
    forms = [ch.upper()]
    if ch.isalpha():
        offset = ord(ch) - ord("a")
        forms += [chr(0xFF41 + offset), chr(0xFF21 + offset), chr(0x1D41A + offset), chr(0x1D400 + offset),
                  chr(0x24D0 + offset), chr(0x1D5BA + offset)]
        if ch == "k":
            forms.append("\u212a")  # KELVIN SIGN
    elif ch.isdigit():
        forms += [chr(0xFF10 + int(ch)), chr(0x1D7CE + int(ch))]
    return forms


@st.composite
def confusable(draw, kind: str):
    name = draw(NAME.filter(lambda n: any(c in HOMOGLYPHS for c in n) and canonical_or_none(n) is not None
                            and not canonical_or_none(n).is_ip))
    positions = [i for i, c in enumerate(name) if (c in HOMOGLYPHS if kind == "homoglyph" else c.isalnum())]
    chosen = draw(st.lists(st.sampled_from(positions), min_size=1, max_size=3, unique=True))
    chars = list(name)
    for i in chosen:
        options = HOMOGLYPHS[chars[i]] if kind == "homoglyph" else compat_forms(chars[i])
        chars[i] = draw(st.sampled_from(list(options)))
    return name, "".join(chars)


@fuzz_settings(200)
@given(confusable("homoglyph"))
@example(("allowed.test", "\u0430llowed.test"))
@example(("pypi.org", "\u0440ypi.org"))
def test_homoglyphs_never_become_the_ascii_name(case):
    ascii_name, spoof = case
    target = canonical_host(ascii_name)
    host = canonical_or_none(spoof)
    if host is None:
        return
    assert host != target, (spoof, host)
    index = HostIndex.build([(HostPattern.exact(target), 0)])
    assert index.candidates(host) == [], (spoof, host)
    assert any(label.startswith("xn--") for label in host.value.split(".")), host


@fuzz_settings(200)
@given(confusable("compat"))
@example(("allowed.test", "ａｌｌｏｗｅｄ.test"))
@example(("kelvin.test", "\u212aelvin.test"))
@example(("file.test", "\ufb01le.test"))
def test_compatibility_forms_are_the_ascii_name(case):
    ascii_name, spelled = case
    host = canonical_or_none(spelled)
    assert host == canonical_host(ascii_name) or host is None, (spelled, host)
    # and it is what UTS 46 says: NFKC + case fold, the mapping curl and browsers apply
    if host is not None:
        assert unicodedata.normalize("NFKC", spelled).lower() == ascii_name


# --------------------------------------------------------------------------------------------
# IPv6 text forms


@st.composite
def ipv6_texts(draw):
    address = draw(st.ip_addresses(v=6))
    groups = address.exploded.split(":")
    groups = [g.lstrip("0") or "0" if draw(st.booleans()) else g for g in groups]
    if draw(st.booleans()) and address.ipv4_mapped is None:
        text = ":".join(groups)
    else:
        head = ":".join(groups[:6])
        tail = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        text = f"{head}:{tail}"
    if draw(st.booleans()):
        text = text.upper()
    if draw(st.booleans()):
        text = address.compressed if draw(st.booleans()) else text
    return address, text


@fuzz_settings(200)
@given(ipv6_texts(), st.integers(1, 65535))
def test_every_ipv6_spelling_is_one_address(case, port):
    address, text = case
    host = canonical_host(f"[{text}]")
    assert host == ip_host(address), (text, host)
    assert parse_authority(f"[{text}]:{port}") == (host, port)
    for bad in (f"[{text}%eth0]", f"[{text}%25eth0]", f"[[{text}]]", f"[{text}]."):
        try:
            canonical_host(bad)
        except HostError:
            continue
        raise AssertionError(f"{bad!r} was accepted")
