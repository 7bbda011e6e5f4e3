"""The last guard before any upstream socket: only (address, port) pairs that a request on this
client connection was approved for may be dialled, with the pinned TLS server name.

Every upstream connection mitmproxy makes passes `server_connect`; whatever path led there (a bug
in another guard, a mitmproxy code path we did not foresee), an unapproved address is refused.
"""

from __future__ import annotations

import logging

from mitmproxy.proxy import server_hooks

from .failclosed import fail_closed
from .state import GatewayState

logger = logging.getLogger("egress")
REFUSED = "egress gateway: upstream connection not approved by policy"


def _refuse_on_error(self, data: server_hooks.ServerConnectionHookData, error: Exception) -> None:
    data.server.error = REFUSED


class UpstreamGuard:
    def __init__(self, state: GatewayState):
        self.state = state

    @fail_closed(_refuse_on_error)
    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        conn = self.state.connections.get(data.client.id)
        dial = conn.dial(data.server.address) if conn is not None else None  # gateway/session.py decides
        if dial is None or not dial.allowed:
            logger.warning("egress gateway: refused unapproved upstream connection to %r", data.server.address)
            data.server.error = REFUSED
            return
        if dial.server_name is not None:
            data.server.sni = dial.server_name
