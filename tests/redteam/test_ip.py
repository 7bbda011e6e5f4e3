"""IP encodings and special ranges. Every spelling of an address (decimal, octal, hex, short,
mixed, IPv4-mapped/compatible, NAT64, 6to4, Teredo) is judged as that address; the deny list
(metadata 169.254.169.254 and 100.100.100.200, AWS fd00:ec2::254, CGNAT, ...) beats every rule,
including rules that name those addresses and names that resolve to them.

Loopback addresses are attacked on the host; every non-loopback address only inside the closed
namespace topology (tests/redteam/world.py), where the gateway runs and where recorders listen on
each special address: a connection the gateway wrongly made would be counted there.
"""

from __future__ import annotations

import pytest

from tests.e2e.helpers import Conn, assert_refused, connect_proxy, get, ipv4_spellings, start_tls, tunnel

from .common import attack, nothing_reached
from .world import (
    ALIBABA, AWS6, CGNAT, FORBIDDEN_V4, FORBIDDEN_V6, GATEWAY_SIDE, MAPPED, METADATA, NAT64, SIXTOFOUR, SPECIAL_NAMES,
    TEREDO,
)

pytestmark = attack("ip")


# --- loopback: the forbidden upstream's address, spelled every way ---------------------------------


@pytest.mark.parametrize("kind", ["decimal", "hex", "octal", "short", "mixed", "mapped", "mapped-hex",
                                  "compatible"])
def test_spellings_of_a_forbidden_address(rt, kind):
    address = rt.ip("other.test")
    spellings = ipv4_spellings(address)
    a, b, c, d = (int(x) for x in address.split("."))
    spellings |= {"mapped": f"[::ffff:{address}]", "mapped-hex": f"[::ffff:{a:02x}{b:02x}:{c:02x}{d:02x}]",
                  "compatible": f"[::{address}]"}
    conn, answer = tunnel(rt.gateway, f"{spellings[kind]}:443")
    conn.close()
    assert answer.status == 403, (answer.status, answer.body)
    assert answer.egress_reason in ("no_rule", "denied_address"), answer.body
    nothing_reached(rt.everything())


@pytest.mark.parametrize("kind", ["decimal", "hex", "octal", "short", "mixed"])
def test_spellings_of_an_allowed_address_reach_only_it(rt, kind):
    """The ip-literal rule names allowed.test's address: an absolute URL spelling it another way
    is that address (and the Host must agree with the URL)."""
    spelled = ipv4_spellings(rt.ip("allowed.test"))[kind]
    with connect_proxy(rt.gateway) as conn:
        response = conn.request("GET", f"http://{spelled}/ip-{kind}", [("Host", spelled)])
        other = conn.request("GET", f"http://{spelled}/ip-{kind}", [("Host", rt.ip("other.test"))])
    assert response.status == 200, response.text
    assert_refused(other, 400, "host_url_mismatch")
    assert [r.path for r in rt.upstreams.plain["allowed.test"].requests] == [f"/ip-{kind}"]
    nothing_reached(rt.recorders("other.test", "api.test", "deep.wild.test"))


# --- special ranges, inside the namespace topology -----------------------------------------------

SPELLINGS = {
    "metadata": METADATA,
    "metadata-decimal": "2852039166",
    "metadata-hex": "0xa9fea9fe",
    "metadata-octal": "0251.0376.0251.0376",
    "metadata-short": "169.254.43518",
    "metadata-mapped": f"[{MAPPED}]",
    "metadata-mapped-hex": "[::ffff:a9fe:a9fe]",
    "metadata-compatible": "[::a9fe:a9fe]",
    "metadata-nat64": f"[{NAT64}]",
    "metadata-6to4": f"[{SIXTOFOUR}]",
    "metadata-teredo": f"[{TEREDO}]",
    "alibaba": ALIBABA,
    "alibaba-decimal": "1684300999",
    "aws-ipv6": f"[{AWS6}]",
    "cgnat": CGNAT,
    "gateway-side": GATEWAY_SIDE,
}


def _forbidden(world) -> dict[str, object]:
    return {label: server for label, server in world.topology.servers.items()
            if any(label.startswith(f"{a}:") for a in FORBIDDEN_V4 + FORBIDDEN_V6)}


@pytest.mark.parametrize("label", sorted(SPELLINGS))
def test_connect_to_special_addresses(world, label):
    with world.gateway_ns():
        conn, answer = tunnel(world.gateway, f"{SPELLINGS[label]}:443")
    conn.close()
    assert answer.status == 403, (answer.status, answer.body)
    assert answer.egress_reason in ("denied_address", "self_address", "no_rule"), answer.body
    assert world.touched() == [], _forbidden(world)


@pytest.mark.parametrize("name", sorted(SPECIAL_NAMES))
def test_names_resolving_to_special_addresses(world, name):
    """Each name is allowed by a rule; static_hosts (or the namespace's /etc/hosts for
    hostsrebind.test) resolve it to a denied address: refused before any connection."""
    with world.gateway_ns():
        conn, answer = tunnel(world.gateway, f"{name}:443")
    conn.close()
    assert answer.status == 403, (answer.status, answer.body)
    assert answer.egress_reason in ("denied_address", "self_address"), answer.body
    assert world.touched() == []


@pytest.mark.parametrize("url", [f"http://{METADATA}/latest/meta-data/", "http://meta.test/latest/meta-data/",
                                 f"http://{ALIBABA}/latest/meta-data/", f"http://[{AWS6}]/latest/meta-data/"])
def test_absolute_form_to_metadata(world, url):
    host = url.split("//", 1)[1].split("/", 1)[0]
    with world.gateway_ns():
        conn = connect_proxy(world.gateway)
    with conn:
        response = conn.request("GET", url, [("Host", host), ("Metadata-Flavor", "Google")])
    assert_refused(response, 403, "denied_address")
    assert world.touched() == []


@pytest.mark.parametrize("host", [METADATA, "meta.test", "2852039166", f"[{MAPPED}]", ALIBABA, f"[{AWS6}]", CGNAT])
def test_transparent_plain_http_to_metadata(world, host):
    """The sandbox dials the metadata address itself; the Host names it in some spelling."""
    with Conn(world.connect(METADATA, 80)) as conn:
        response = get(conn, "/latest/meta-data/iam/security-credentials/", host)
    assert response.status == 403, response.text
    assert world.touched() == []


@pytest.mark.parametrize("dial", [METADATA, ALIBABA, CGNAT])
def test_transparent_tls_without_sni_to_special_addresses(world, dial):
    """No SNI: the destination is the dialled address, which a rule names and the deny list refuses."""
    with start_tls(Conn(world.connect(dial, 443)), world.gateway, None) as tls:
        response = get(tls, "/latest/meta-data/", dial)
    assert_refused(response, 403, "denied_address")
    assert world.touched() == []
