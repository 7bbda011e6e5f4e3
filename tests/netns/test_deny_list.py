"""The default deny list, from inside a closed namespace: names that resolve (static_hosts) to
metadata, private, CGNAT, ULA/link-local and IPv4-embedding IPv6 addresses are refused with 403
denied_address, and the recording upstream on each of those addresses sees nothing, not even a
TCP connection. A rule naming the metadata IP itself does not help: the deny list beats rules."""

from __future__ import annotations

import pytest

from .conftest import FORBIDDEN_STATIC
from .lab import assert_refused, audit_since

pytestmark = pytest.mark.netns

NAMES = [*FORBIDDEN_STATIC, "mixed-static.test"]

# Spellings of 169.254.169.254 (and of IPv6 forms that embed it) as CONNECT / URL hosts.
METADATA_SPELLINGS = [
    "169.254.169.254",
    "169.254.169.254.",
    "2852039166",
    "0xa9fea9fe",
    "0XA9FEA9FE",
    "0251.0376.0251.0376",
    "0xa9.0xfe.0xa9.0xfe",
    "169.254.43518",
    "169.16689662",
    "[::ffff:169.254.169.254]",
    "[::ffff:a9fe:a9fe]",
    "[64:ff9b::a9fe:a9fe]",
    "[::a9fe:a9fe]",
]


@pytest.fixture(scope="module")
def gateway(gateways):
    return gateways("default")


@pytest.mark.parametrize("name", NAMES)
def test_connect_to_name_on_deny_list(lab, gateway, client_for, name):
    mark = len(gateway.audit())
    reply = client_for(gateway).connect_only(f"{name}:443")
    assert_refused(lab, reply, "denied_address")
    [entry] = [e for e in audit_since(gateway, mark) if e.get("event") == "connect"]
    assert (entry["decision"], entry["reason"], entry["host"], entry["address"]) == ("deny", "denied_address", name, None)


@pytest.mark.parametrize("name", NAMES)
def test_absolute_form_to_name_on_deny_list(lab, gateway, client_for, name):
    reply = client_for(gateway).absolute_get(f"http://{name}/latest/meta-data/", name)
    assert_refused(lab, reply, "denied_address")


@pytest.mark.parametrize("host", METADATA_SPELLINGS)
def test_connect_to_metadata_literal_despite_rule(lab, gateway, client_for, host):
    reply = client_for(gateway).connect_only(f"{host}:443")
    assert_refused(lab, reply, "denied_address")


@pytest.mark.parametrize("host", METADATA_SPELLINGS)
def test_absolute_form_to_metadata_literal_despite_rule(lab, gateway, client_for, host):
    reply = client_for(gateway).absolute_get(f"http://{host}/latest/meta-data/iam/", host)
    assert_refused(lab, reply, "denied_address")


def test_literal_without_rule_is_refused_too(lab, gateway, client_for):
    """10.0.0.5 has no rule naming it: refused (no_rule) before any lookup, nothing dialled."""
    for authority in ("10.0.0.5:443", "167772165:443", "[::ffff:10.0.0.5]:443"):
        reply = client_for(gateway).connect_only(authority)
        assert_refused(lab, reply, "no_rule")
