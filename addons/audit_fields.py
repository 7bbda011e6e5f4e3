"""Audit-line fields taken from mitmproxy flows, in one place so every guard logs the same shape.

The verdict keys (`decision`, `reason`, `status`, `rule`, `message`) always come from a Decision
through gateway.decision.verdict_fields (`decision_fields`, or `verdict_fields` directly); no guard
spells a verdict by hand (tests/unit/test_audit_verdicts.py checks the source)."""

from __future__ import annotations

from gateway.decision import Decision, verdict_fields
from gateway.engine import Pin

from .state import ClientSession


def mode_name(proxy_mode) -> str:
    """A mitmproxy proxy mode as the audit's `mode` spells it ("regular", "transparent", "dns"...)."""
    return type(proxy_mode).__name__.removesuffix("Mode").lower() if proxy_mode else "?"


def connection_fields(conn: ClientSession | None, sandbox: str | None = None) -> dict:
    original = conn.original_destination if conn else None
    fields = {
        "client": conn.client if conn else None,
        "sandbox": sandbox,
        "mode": conn.mode if conn else None,
        "original_destination": f"{original[0]}:{original[1]}" if original else None,
    }
    identity = conn.identity if conn else None
    if identity is not None:  # named by a token (or a registration), not its address: say how, and its profile
        fields["identity"] = identity.via
        fields["profile"] = identity.profile
    return fields


def fallback_fields(state, client_conn) -> dict:
    """Who a fallback refusal (`_deny_on_error`: the decision itself failed) was for: the client,
    its sandbox and mode when they can be known, each looked up defensively (None if not), so that
    such lines name their source (and aggregate per source) instead of all sharing one."""
    conn = sandbox = None
    try:
        conn = state.connections.get(client_conn.id)
        if conn is not None and state.engine is not None:
            sandbox = state.scope(conn).sandbox
    except Exception:
        pass
    fields = connection_fields(conn, sandbox)
    if conn is None:
        try:
            host, port = client_conn.peername[:2]
            fields["client"] = f"{host}:{port}"
        except Exception:
            pass
    return fields


def flow_fields(flow, conn: ClientSession | None, sandbox: str | None = None) -> dict:
    request = flow.request
    return connection_fields(conn, sandbox) | {
        "sni": flow.client_conn.sni,
        "host_header": request.host_header if request is not None else None,
        "method": request.method if request is not None else None,
        "scheme": request.scheme if request is not None else None,
        "path": request.path if request is not None else None,
    }


def decision_fields(decision: Decision, pin: Pin | None = None, host: str | None = None, port: int | None = None) -> dict:
    """The verdict (gateway.decision.verdict_fields: the one place it is built) and the destination."""
    return verdict_fields(decision) | {
        "host": pin.host.value if pin else host,
        "port": pin.port if pin else port,
        "address": str(pin.address) if pin else None,
    }
