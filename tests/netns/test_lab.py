"""The harness itself: every recording upstream is reachable from the gateway's namespace (so a
gateway that dialled a forbidden address would be caught), and the lab has no way off the machine."""

from __future__ import annotations

import socket
import subprocess

import pytest

from .conftest import LINK_LOCAL

pytestmark = pytest.mark.netns


def test_every_recorder_counts_a_direct_connection(lab):
    lab.reset()
    with lab.inside(lab.gw):
        lab.assert_thread_in(lab.gw)
        scope = socket.if_nametoindex(lab.gw_if)
        for address, port in lab.upstreams:
            sockaddr = (address, port, 0, scope) if address == LINK_LOCAL else (address, port)
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            with socket.socket(family) as s:
                s.settimeout(3)
                s.connect(sockaddr)
        # An IPv4-mapped destination reaches the IPv4 recorder.
        with socket.socket(socket.AF_INET6) as s:
            s.settimeout(3)
            s.connect(("::ffff:169.254.169.254", 443))
    lab.settle()  # the recorders count in their own accept threads: every connection made is counted now
    untouched = [f"{a}:{p}" for (a, p), s in lab.upstreams.items() if s.connections < 1]
    assert untouched == [] and lab.upstream("169.254.169.254", 443).connections >= 2


def test_namespaces_are_closed(lab):
    lab.check_closed()
    for ns in (lab.gw, lab.up):
        routes = subprocess.run(["ip", "-n", ns, "route", "get", "1.1.1.1"], capture_output=True, text=True)
        assert routes.returncode != 0, f"{ns} has a route to 1.1.1.1: {routes.stdout}"
