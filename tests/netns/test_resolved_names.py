"""Names resolved by the system resolver (getaddrinfo, via the namespace's /etc/hosts), not by
static_hosts: a public-looking address is dialled; a name with any address on the deny list is
refused, whichever order the addresses come in, and none of its addresses is dialled."""

from __future__ import annotations

import pytest

from .conftest import PUBLIC_V4, PUBLIC_V6
from .lab import assert_refused, audit_since

pytestmark = pytest.mark.netns

DENIED_NAMES = ["mixed.example", "mixed-rev.example", "mixed6.example", "private.example",
                "metadata.example", "ula.example"]


@pytest.fixture(scope="module")
def gateway(gateways):
    return gateways("default")


@pytest.mark.parametrize("name, address", [("public.example", PUBLIC_V4), ("public6.example", PUBLIC_V6)])
def test_public_name_over_https(lab, gateway, client_for, name, address):
    mark = len(gateway.audit())
    connect, reply = client_for(gateway).https_get(f"{name}:443", name, "/hello")
    assert connect.status == 200, connect.text()
    assert reply.status == 200, reply.text()
    assert reply.headers.get("x-upstream") == name
    upstream = lab.upstream(address, 443)
    assert [(r.method, r.path, r.sni) for r in upstream.requests] == [("GET", "/hello", name)]
    assert lab.touched_forbidden() == []
    connects = [e for e in audit_since(gateway, mark) if e.get("event") == "connect"]
    assert connects and connects[0]["address"] == address


def test_public_name_over_plain_http(lab, gateway, client_for):
    reply = client_for(gateway).absolute_get("http://public.example/plain?x=1", "public.example")
    assert reply.status == 200, reply.text()
    assert [(r.method, r.path) for r in lab.upstream(PUBLIC_V4, 80).requests] == [("GET", "/plain?x=1")]
    assert lab.touched_forbidden() == []


@pytest.mark.parametrize("name", DENIED_NAMES)
def test_connect_to_name_with_a_denied_address(lab, gateway, client_for, name):
    reply = client_for(gateway).connect_only(f"{name}:443")
    assert_refused(lab, reply, "denied_address")


@pytest.mark.parametrize("name", DENIED_NAMES)
def test_absolute_form_to_name_with_a_denied_address(lab, gateway, client_for, name):
    reply = client_for(gateway).absolute_get(f"http://{name}/", name)
    assert_refused(lab, reply, "denied_address")
