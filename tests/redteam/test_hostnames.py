"""Host name tricks: suffix and prefix confusion with the allowed names, the wildcard's apex,
unicode confusables and IDNA mappings (which must land on the name they map to, never on an
allowed one by accident), percent-encoding, userinfo, backslashes, zero-width characters and
trailing dots, in CONNECT authorities, absolute URLs, transparent SNI and transparent Host."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import Conn, build_request, connect_proxy, get, start_tls, tunnel
from tests.support.topology import ALLOWED, OTHER

from .common import attack, nothing_reached

pytestmark = attack("hostnames")

# CONNECT host -> the refusal expected: 403 for a well-formed name no rule covers, 400 otherwise.
# mitmproxy refuses any non-ASCII byte in a request line (400), which is fine too.
CONNECT_TRICKS = {
    "allowed.test.evil": 403,                # suffix: the allowed name as a label prefix
    "allowed.test.other.test": 403,
    "evil-allowed.test": 403,                # prefix without a dot
    "evilallowed.test": 403,
    "wild.test": 403,                        # the apex of *.wild.test
    "evilwild.test": 403,
    "deep.wild.test.evil": 403,
    "\u0430llowed.test": 403,                # Cyrillic a
    "allowed.t\u0435st": 403,                # Cyrillic e in the TLD
    "\uff4f\uff54\uff48\uff45\uff52.test": 403,  # fullwidth "other": maps to other.test, no rule
    "\u24de\u24e3\u24d7\u24d4\u24e1.test": 403,  # circled "other": maps to other.test
    "OTHER.TEST.": 403,
    "xn--zz.test": 400,                      # not a valid A-label
    "other%2etest": 400,
    "%6fther.test": 400,
    "other.test\\.allowed.test": 400,
    "allowed.test..": 400,
    "allowed.test...": 400,
    ".allowed.test": 400,
    "allowed\u3002test": 400,                # ideographic full stop
    "allowed.test\u200b": 400,               # zero-width space (or a name no rule covers)
    "other\u00adtest.test": 403,             # soft hyphen: UTS46 ignores it -> othertest.test
    "allowed.test\u0000": 400,
}


@pytest.mark.parametrize("host", sorted(CONNECT_TRICKS), ids=lambda h: h.encode("unicode_escape").decode())
def test_connect_host_name_tricks(rt, host):
    conn, answer = tunnel(rt.gateway, f"{host}:443")
    conn.close()
    expected = CONNECT_TRICKS[host]
    if not host.isascii():
        expected = (400, 403)  # refused in the request line, or mapped (IDNA) to a name no rule covers
    elif expected == 400:
        expected = (400, 403)  # an IDNA mapping may turn it into a well-formed name no rule covers
    else:
        expected = (expected,)
    assert answer.status in expected, (answer.status, answer.body)
    nothing_reached(rt.everything())


@pytest.mark.parametrize("url", [
    "http://allowed.test@other.test/", "http://other.test@allowed.test/", "http://allowed.test%40other.test/",
    "http://allowed.test\\@other.test/", "http://other.test\\.allowed.test/", "http://other.test#@allowed.test/",
    "http://allowed.test.evil/", "http://other.test%2f@allowed.test/", "http://allowed.test:80@other.test/",
])
def test_absolute_url_host_tricks(rt, url):
    with connect_proxy(rt.gateway) as conn:
        conn.send(build_request("GET", url, [("Host", url.split("//", 1)[1].split("/", 1)[0])]))
        try:
            response = conn.read_response()
        except (ConnectionError, OSError):
            response = None
    assert response is None or response.status in (400, 403), (response.status, response.text)
    nothing_reached(rt.everything())


@pytest.mark.parametrize("host", ["xn--bcher-kva.test", "XN--BCHER-KVA.TEST.", "bücher.test", "BÜCHER.TEST",
                                  "bu\u0308cher.test", "\uff42\u00fccher.test"])
def test_idna_spellings_of_an_allowed_name_are_one_destination(rt, host):
    """bücher.test (rule idn) resolves to allowed.test's address; a tunnel pinned to its A-label
    accepts every spelling of it in Host (U-label, upper case, decomposed umlaut, fullwidth b) and
    nothing but that address is ever dialled."""
    conn, answer = tunnel(rt.gateway, "xn--bcher-kva.test:80")
    with conn:
        assert answer.status == 200, answer
        response = get(conn, "/idn", host)
    assert response.status == 200, response.text
    assert [r.path for r in rt.upstreams.plain["allowed.test"].requests] == ["/idn"]
    nothing_reached(rt.recorders("other.test", "api.test", "deep.wild.test"))


@pytest.mark.parametrize("sni", ["allowed.test.other.test", "other.test.", "evil-allowed.test", "xn--llowed-9ve.test"])
def test_transparent_sni_name_tricks(world, sni):
    with start_tls(Conn(world.connect(ALLOWED, 443)), world.gateway, sni) as tls:
        response = get(tls, "/sni-trick", sni)
    assert response.status in (400, 403), response.text
    assert world.touched() == []


@pytest.mark.parametrize("host", ["allowed.test.evil", "allowed.test@other.test", "other%2etest", "OTHER.test."])
def test_transparent_host_name_tricks(world, host):
    with Conn(world.connect(OTHER, 80)) as conn:
        response = get(conn, "/host-trick", host)
    assert response.status in (400, 403), response.text
    assert world.touched() == []
