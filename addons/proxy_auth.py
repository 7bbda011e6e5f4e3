"""Explicit mode's proxy credential: the CONNECT's (or a first absolute-form request's)
`Proxy-Authorization` read from the flow and judged by gateway/proxyauth.py `authenticate`, which
sets the connection's identity once. Only proxy-level requests count: a request inside a tunnel
(the connection is pinned) or on a transparent connection carries no proxy credential."""

from __future__ import annotations

import logging

from mitmproxy import http

from gateway.decision import Decision
from gateway.engine import Engine
from gateway.proxyauth import HEADER, authenticate, presented_fingerprint
from gateway.session import ClientSession

from .state import GatewayState


def is_proxy_level(session: ClientSession) -> bool:
    """A request addressed to the gateway as a proxy: a CONNECT, or an absolute-form request on an
    explicit-mode connection that no CONNECT pinned."""
    return session.mode == "regular" and session.tunnel is None


def check(flow: http.HTTPFlow, session: ClientSession, engine: Engine, state: GatewayState
          ) -> tuple[Decision | None, dict]:
    """(a refusal or None, audit fields: the presented token's short hash, never the token)."""
    if engine.tokens is None or not is_proxy_level(session):
        return None, {}
    values = flow.request.headers.get_all(HEADER)
    # Read once, gone from the flow whatever the verdict: a refused request is printed and kept by
    # mitmproxy (flow_detail) like an allowed one, and the token is addressed to the gateway alone.
    if values:
        del flow.request.headers[HEADER]
    named = session.identity
    refusal = authenticate(session, values, engine.tokens)
    if session.identity is not None and named is None:
        # Indexed by sandbox: a control API change to that sandbox judges its connections again.
        state.identified(flow.client_conn.id, session)
    _log_key_problem(engine)
    shown = presented_fingerprint(values)
    return refusal, ({"token": shown} if shown is not None else {})


_logged: list = [None, -1]  # (verifier, key generation) whose key problem was logged


def _log_key_problem(engine: Engine) -> None:
    """Say once per change of the key files that they cannot be used (every token is refused until
    they are fixed): the operator's log names the file, never a token."""
    tokens = engine.tokens
    if tokens.key_error is not None and _logged != [tokens, tokens.key_generation]:
        _logged[:] = [tokens, tokens.key_generation]
        logging.getLogger("egress").error("egress gateway: proxy token keys unusable, every token is refused: %s",
                                          tokens.key_error)
