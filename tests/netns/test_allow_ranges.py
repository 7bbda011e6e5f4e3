"""allow_ip_ranges exempts exactly the listed ranges: an internal mirror at 10.1.2.3 inside
10.1.2.0/24 is reachable over HTTPS and plain HTTP; 10.1.3.3 just outside it, and the metadata
address, stay refused."""

from __future__ import annotations

import pytest

from .conftest import MIRROR
from .lab import assert_refused

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module")
def gateway(gateways):
    return gateways("mirror")


def test_mirror_over_https(lab, gateway, client_for):
    connect, reply = client_for(gateway).https_get("mirror.internal:443", "mirror.internal", "/simple/pkg/")
    assert connect.status == 200, connect.text()
    assert reply.status == 200, reply.text()
    assert reply.headers.get("x-upstream") == "mirror.internal"
    assert [(r.path, r.sni) for r in lab.upstream(MIRROR, 443).requests] == [("/simple/pkg/", "mirror.internal")]
    assert lab.touched_forbidden() == []


def test_mirror_over_plain_http(lab, gateway, client_for):
    reply = client_for(gateway).absolute_get("http://mirror.internal/simple/", "mirror.internal")
    assert reply.status == 200, reply.text()
    requests = lab.upstream(MIRROR, 80).requests
    assert [(r.method, r.path) for r in requests] == [("GET", "/simple/")]
    assert dict(requests[0].headers).get("Host") == "mirror.internal"
    assert lab.touched_forbidden() == []


@pytest.mark.parametrize("name", ["neighbour.internal", "metadata.internal"])
def test_outside_the_exempt_range(lab, gateway, client_for, name):
    assert_refused(lab, client_for(gateway).connect_only(f"{name}:443"), "denied_address")
    assert_refused(lab, client_for(gateway).absolute_get(f"http://{name}/", name), "denied_address")
