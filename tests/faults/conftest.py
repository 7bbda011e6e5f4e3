"""Fixtures for the fault-injection tests: a loopback DNS server and the scripted upstreams.

Addresses used in the session's loopback block 127.X.0.0/24 (next to the standard upstreams on
.2-.5 and the credential suite's .20-.23): .53 DNS, .60-.69 scripted upstreams.
"""

from __future__ import annotations

import pytest

from .harness import can_isolate_dns, shared_loopback_dns

ISOLATION = can_isolate_dns()
needs_isolation = pytest.mark.skipif(
    not ISOLATION, reason="needs root and unshare(1): the gateway's DNS is isolated to a loopback resolver")


def address(upstreams, n: int) -> str:
    return f"{upstreams.block}.{n}"


@pytest.fixture(scope="session")
def loopback_dns(upstreams):
    """The loopback resolver every isolated gateway uses (None when isolation is impossible)."""
    if not ISOLATION:
        return None
    return shared_loopback_dns(address(upstreams, 53))
