"""All gateway addons, in the order they must run; the file `mitmdump -s` loads. The order, and
why each addon sits where it does, is the table `ADDON_ORDER` in addons/channels.py (checked
against `make_addons()` by tests/unit/test_channels.py).

    mitmdump -s addons/egress.py --set egress_policy=policies/default.yaml
"""

from __future__ import annotations

import os
import sys

try:
    import addons.core  # noqa: F401
except ImportError:
    # Loaded by path from a checkout (mitmdump -s addons/egress.py): make the project importable.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from addons.budget import BufferBudget  # noqa: E402
from addons.connect_guard import ConnectGuard  # noqa: E402
from addons.control import ControlApi  # noqa: E402
from addons.core import EgressCore  # noqa: E402
from addons.response_redaction import ResponseRedactor  # noqa: E402
from addons.dns_guard import DnsGuard  # noqa: E402
from addons.fair_share import FairShare  # noqa: E402
from addons.frame_limits import FrameLimits  # noqa: E402
from addons.gc_freeze import CollectorFreeze  # noqa: E402
from addons.h2_limits import Http2Limits  # noqa: E402
from addons.layer_guard import LayerGuard  # noqa: E402
from addons.limits import ConnectionLimiter  # noqa: E402
from addons.audit_log import AuditLogOwner  # noqa: E402
from addons.health import HealthEndpoint  # noqa: E402
from addons import hook_dispatch  # noqa: E402
from addons.lifecycle import Lifecycle  # noqa: E402
from addons.metrics import MetricsFeed  # noqa: E402
from addons.output_guard import OutputGuard  # noqa: E402
from addons.patches import check_mitmproxy_version  # noqa: E402
from addons.rate_limits import ConnectionRate, DownloadMeter, Limiter, RequestLimits  # noqa: E402
from addons.decode_pool import DecodePool  # noqa: E402
from addons.reload import PolicyReloader  # noqa: E402
from addons.request_guard import RequestGuard  # noqa: E402
from addons.upgrade_guard import UpgradeGuard  # noqa: E402
from addons.revocation import Revoker  # noqa: E402
from addons.state import GatewayState  # noqa: E402
from addons.streaming import BodyStreaming, Http2Preference  # noqa: E402
from addons.tls_guard import TlsGuard  # noqa: E402
from addons.leaf_keys import LeafKeys  # noqa: E402
from addons.tls_memory import ReleaseTlsBuffers  # noqa: E402
from addons.upstream_guard import UpstreamGuard  # noqa: E402
from addons.websocket_limits import WebsocketLimits  # noqa: E402


def make_addons(state: GatewayState | None = None) -> list:
    check_mitmproxy_version()  # before any of them patches mitmproxy
    hook_dispatch.install()  # each event's handlers looked up once, not walked for every event
    state = state or GatewayState()
    core = EgressCore(state)
    redactor = ResponseRedactor(state)
    limiter = Limiter(state)
    feed = MetricsFeed(state)
    lifecycle = Lifecycle(state)
    return [
        core,
        AuditLogOwner(state),  # opened before any decision can be written
        OutputGuard(redactor.redactor),  # early: mitmproxy's flow writers are off before any flow exists
        PolicyReloader(state, core.build_engine),
        ConnectionLimiter(state),
        BufferBudget(state),
        WebsocketLimits(state),  # WebSocket messages: reassembly bounded, relayed ones not kept
        ConnectionRate(limiter),  # after the concurrent-connection limit: a refused connection takes no token
        LayerGuard(state),
        Http2Limits(),  # the HTTP/2 budgets' options; upstream h2 connections drain their queue in a loop
        FrameLimits(),  # small frames per sandbox (HTTP/2 DATA, HTTP/1 chunks, WebSocket frames and pings)
        FairShare(state),  # each sandbox's share of the event loop: its reads wait while it is over
        ConnectGuard(state),
        TlsGuard(state),
        Http2Preference(),  # after TlsGuard: a refused or relayed ClientHello is left alone
        ReleaseTlsBuffers(),  # idle TLS connections give their buffers back
        LeafKeys(),  # sandboxes' certificates carry a P-256 key of their own (wraps CertStore: any place)
        RequestGuard(state),
        UpgradeGuard(state),  # an upstream's 101 to anything but the WebSocket asked for
        DecodePool(),  # a compressed request body's check: its decoder calls on the decode pool
        redactor,
        RequestLimits(limiter),  # decides in RequestGuard (one audit line); then guards the body before BodyStreaming
        BodyStreaming(),  # after the guard and the redactor: streams what they allowed and did not plan
        DownloadMeter(limiter),  # after BodyStreaming and the redactor chose how the response travels
        UpstreamGuard(state),
        Revoker(state),  # after the guards: registers WebSockets they allowed; judges again on every install
        ControlApi(state, feed),  # after the Revoker: a registry change judges open connections again
        DnsGuard(state),
        CollectorFreeze(state),  # once running: full collections skip what start-up made and what survived; thaws after closes or freed buffers
        feed,  # late: counts what the guards decided
        HealthEndpoint(state, feed, lifecycle),
        lifecycle,  # last: "ready" once every other addon is running
    ]


addons = make_addons()
