"""`explain` gives the verdict live traffic gets, through a real gateway on the standard policy:
for each request, explain's reason and status are the ones the gateway answers with (https sent as
CONNECT then the request in the tunnel, http as an absolute-form request on the proxy port).

One case is why this file exists: `https://` to a host whose only rule is `schemes: [http]` is
refused at the CONNECT (`port_not_allowed`: that rule's ports are 80), and explain used to say
`scheme_not_allowed`, having judged the request alone."""

from __future__ import annotations

import pytest

from gateway.explain import explain
from gateway.policy import load_policy
from tests.e2e.helpers import (  # noqa: F401  (fixtures are used by name)
    connect_proxy,
    fresh_upstreams,
    gateway,
    start_tls,
    tunnel,
)


def _live(gw, method: str, url: str) -> tuple[str, int | None]:
    scheme, rest = url.split("://", 1)
    authority, _, path = rest.partition("/")
    path = "/" + path
    if scheme == "https":
        connect_to = authority if ":" in authority.rsplit("]", 1)[-1] else f"{authority}:443"
        conn, answer = tunnel(gw, connect_to)
        with conn:
            if answer.status != 200:
                return answer.egress_reason, answer.status
            host = connect_to.rsplit(":", 1)[0].strip("[]")
            with start_tls(conn, gw, None if host.replace(".", "").isdigit() else host) as tls:
                response = tls.request(method, path, [("Host", authority)])
    else:
        with connect_proxy(gw) as conn:
            response = conn.request(method, url, [("Host", authority)])
    return (response.egress_reason or "allowed"), (response.status if response.egress_reason else None)


@pytest.fixture(scope="module")
def policy(gateway):
    return load_policy(str(gateway.policy))


CASES = [
    ("GET", "https://allowed.test/x"),
    ("DELETE", "https://allowed.test/x"),
    ("GET", "https://xn--bcher-kva.test/"),  # only `plain` (schemes: [http]) covers it
    ("GET", "http://xn--bcher-kva.test/"),
    ("GET", "http://allowed.test:8080/"),
    ("GET", "https://allowed.test:8443/"),
    ("GET", "https://api.test/ok/x"),
    ("GET", "https://api.test/nope"),
    ("POST", "https://api.test/ok/x"),
    ("GET", "https://api.test/ok/x?_method=DELETE"),
    ("GET", "http://api.test/ok/x"),
    ("GET", "https://other.test/"),
    ("GET", "http://other.test/"),
    ("GET", "https://meta.test/"),
    ("GET", "http://mapped.test/"),
    ("GET", "https://deep.wild.test/"),
    ("GET", "http://deep.wild.test/x"),
    ("GET", "https://169.254.169.254/"),
]


@pytest.mark.parametrize("method, url", CASES, ids=[f"{m} {u}" for m, u in CASES])
def test_explain_gives_the_answer_the_gateway_gives(gateway, policy, method, url):
    explained = explain(policy, url, method).decision
    expected = (explained.reason, None if explained.allowed else explained.status)
    assert _live(gateway, method, url) == expected, explained
