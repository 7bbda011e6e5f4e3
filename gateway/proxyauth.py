"""Proxy authentication in explicit mode: the `Proxy-Authorization` of a CONNECT or of an
absolute-form request turned into the connection's identity, once, or into a 407.

Every client can send a proxy password (`HTTPS_PROXY=http://sandbox:TOKEN@gateway:8080` becomes
`Proxy-Authorization: Basic base64(sandbox:TOKEN)`); `Bearer TOKEN` is accepted too. The user name is
ignored: only the signed token (gateway/tokens.py) says who the sandbox is.

A connection's identity is decided by its first proxy-level request (the CONNECT, or the first
absolute-form request) and never changes: every later proxy-level request on it must present the
same credential (the same token, or none if the first presented none), else `identity_changed`, and
the connection is closed. Requests inside a CONNECT tunnel are the sandbox talking to its
destination: a `Proxy-Authorization` there is never identity (gateway/foreign.py treats it as any
other credential toward an origin).

Pure: header values in, a refusal (or None) out; the session records what was presented.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Sequence

from .decision import Decision
from .identity import Identity
from .session import ClientSession
from .tokens import MAX_TOKEN_BYTES, TokenRefused, TokenVerifier, fingerprint

HEADER = "proxy-authorization"
REALM = "egress-gateway"
# What a 407 asks for: both schemes carry the same token.
CHALLENGES = (f'Basic realm="{REALM}"', f'Bearer realm="{REALM}"')
NOTHING = ""  # what a connection that presented no credential records


class Malformed(ValueError):
    """A Proxy-Authorization value that holds no token the gateway can read (never quoted back)."""


def token_of(values: Sequence[str]) -> str | None:
    """The token in a request's Proxy-Authorization values (None: there is none), or Malformed."""
    if not values:
        return None
    if len(values) > 1:
        raise Malformed("more than one Proxy-Authorization field")
    value = values[0].strip()
    if len(value) > 2 * MAX_TOKEN_BYTES:
        raise Malformed(f"the Proxy-Authorization field is over {2 * MAX_TOKEN_BYTES} bytes")
    scheme, _, credentials = value.partition(" ")
    credentials = credentials.strip()
    if scheme.lower() == "bearer" and credentials:
        return credentials
    if scheme.lower() == "basic" and credentials:
        try:
            decoded = base64.b64decode(credentials, validate=True).decode("utf-8")
        except (binascii.Error, ValueError):
            raise Malformed("the Basic credentials are not base64 of UTF-8 text") from None
        _user, colon, password = decoded.partition(":")
        if not colon or not password:
            raise Malformed("the Basic credentials carry no password (the token goes in the proxy password)")
        return password
    raise Malformed("Proxy-Authorization must be Basic (the token as the password) or Bearer")


def _digest(token: str | None) -> str:
    return NOTHING if token is None else hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


def authenticate(session: ClientSession, values: Sequence[str], verifier: TokenVerifier | None) -> Decision | None:
    """Judge a proxy-level request's credential for `session`; None when it may go on (the
    session's identity set by the first one that proved it). Without a verifier (the policy has no
    `identity: tokens:`) the credential is ignored, as before tokens existed."""
    if verifier is None:
        return None
    try:
        token = token_of(values)
    except Malformed as exc:
        return Decision.deny("token_invalid", f"bad proxy credential: {exc}")
    digest = _digest(token)
    seen = session.proxy_credential
    if seen is not None and seen != digest:
        return Decision.deny("identity_changed", "this connection presented another proxy credential before: "
                                                 "one connection is one sandbox (connection closed)")
    if token is None:
        if verifier.settings.required:
            return Decision.deny("proxy_auth_required", "this gateway needs a signed token as the proxy password "
                                                        "(HTTPS_PROXY=http://sandbox:TOKEN@gateway:port)")
        session.authenticated(NOTHING, None)
        return None
    try:
        proof = verifier.verify(token)
    except TokenRefused as refusal:
        return Decision.deny(refusal.reason, f"proxy token {fingerprint(token)}: {refusal.message}")
    if seen is None:
        session.authenticated(digest, Identity(proof.subject, proof.profile, "token", proof.rule_ids))
    return None


def presented_fingerprint(values: Sequence[str]) -> str | None:
    """For the audit line: the short hash of the token presented, if one can be read."""
    try:
        token = token_of(values)
    except Malformed:
        return None
    return fingerprint(token) if token is not None else None
