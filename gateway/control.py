"""The control API's meaning, sans I/O: a request (method, path, query, JSON body, principal) in, a
status and a JSON body out, every change made as registry ops (gateway/registry.py) and handed to
`publish`, which applies them where the registry lives (this process's event loop, or the
supervisor and every worker, gateway/control_fanout.py) and returns once they are in force.

The listener (gateway/control_server.py) authenticates and bounds the bytes; this module validates,
bounds the state (sandboxes, grants per sandbox), rate-limits per principal, and audits every
change and every refusal (`event: control`, no secrets: a token is never in a line, only the name
of its principal). Routes are `ROUTES`; docs/control-api.openapi.yaml describes the same set
(tests/e2e/test_control_api.py checks they agree).
"""

from __future__ import annotations

import json
import math
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote

from .engine import Engine
from .explain import ExplainError, describe_scope, explain, parse_header
from .grants import MAX_TTL_CEILING, GrantError, build_grant
from .policy import STANDARD_METHODS, Policy
from .ratelimit import BucketTable
from .registry import (LABEL_KEY_RE, MAX_ADDRESSES, MAX_LABEL_VALUE, MAX_LABELS, SANDBOX_ID_RE, Registry,
                       parse_address)

DEFAULT_SOCKET = "/run/egress/control.sock"
DEFAULT_MAX_SANDBOXES = 200_000
DEFAULT_MAX_GRANTS = 32
DEFAULT_MAX_BODY = 64 * 1024
DEFAULT_RATE = 2000.0  # requests a second per principal
DEFAULT_BURST = 4000
DEFAULT_REGISTRATION_TTL = 86400.0
MAX_PAGE = 1000
DEFAULT_PAGE = 100

# method, path template, action (the audit's and the metrics' name for it)
ROUTES: tuple[tuple[str, str, str], ...] = (
    ("GET", "/v1/status", "status"),
    ("GET", "/v1/sandboxes", "list"),
    ("POST", "/v1/sandboxes", "register"),
    ("GET", "/v1/sandboxes/{id}", "get"),
    ("DELETE", "/v1/sandboxes/{id}", "deregister"),
    ("GET", "/v1/sandboxes/{id}/grants", "list_grants"),
    ("POST", "/v1/sandboxes/{id}/grants", "grant"),
    ("DELETE", "/v1/sandboxes/{id}/grants/{grant}", "revoke"),
    ("GET", "/v1/sandboxes/{id}/explain", "explain"),
)
CHANGES = frozenset({"register", "deregister", "grant", "revoke", "expire"})
ACTIONS = tuple(sorted({a for _, _, a in ROUTES} | {"expire", "unknown"}))
_SEGMENT = r"([^/]+)"
MAX_EXPLAIN_URL = 8192
_METHOD_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32}\Z")  # an HTTP token


def _compile(template: str) -> re.Pattern:
    return re.compile("^" + re.sub(r"\{\w+\}", _SEGMENT, template) + "$")


_MATCHERS = [(method, _compile(template), action) for method, template, action in ROUTES]


class ControlError(Exception):
    def __init__(self, status: int, reason: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.reason, self.message, self.retry_after = status, reason, message, retry_after


@dataclass(frozen=True)
class Limits:
    max_sandboxes: int = DEFAULT_MAX_SANDBOXES
    max_grants: int = DEFAULT_MAX_GRANTS
    max_body: int = DEFAULT_MAX_BODY
    rate: float = DEFAULT_RATE
    burst: float = DEFAULT_BURST


@dataclass
class Reply:
    status: int
    body: dict
    retry_after: float | None = None


def route(method: str, path: str) -> tuple[str, tuple[str, ...]]:
    """(action, path parameters), or ControlError 404/405."""
    allowed = []
    for m, pattern, action in _MATCHERS:
        match = pattern.match(path)
        if match:
            if m == method:
                return action, tuple(unquote(g) for g in match.groups())
            allowed.append(m)
    if allowed:
        raise ControlError(405, "method_not_allowed", f"{method} is not allowed on {path} (allowed: "
                                                      f"{', '.join(sorted(allowed))})")
    raise ControlError(404, "not_found", f"no such endpoint: {path} (see docs/control-api.md)")


REFUSAL_LINES_PER_SECOND = 10.0  # the listener's refusals (no token, too large) written to the audit log
REFUSAL_LINE_BURST = 50.0


class ControlService:
    """Validates and makes every change; one request at a time (`lock`)."""

    def __init__(self, registry: Registry, policy: Callable[[], Policy | None], publish: Callable[[list[dict]], int],
                 record: Callable[..., None], limits: Limits = Limits(), clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, count: Callable[[str, str], None] | None = None,
                 engine: Callable[[], Engine | None] | None = None):
        self.registry = registry
        self.policy = policy
        # The engine in force, for explain (the proxy's, whose deny list knows the gateway's own
        # addresses; the supervisor of `run --workers N` passes one built as its workers' are).
        # Without one, explain builds one from `policy`.
        self.engine = engine
        self._built: tuple[Policy, Engine] | None = None
        self.publish = publish
        self.record = record
        self.limits = limits
        self.clock = clock
        self.wall = wall
        self.count = count or (lambda action, result: None)
        self.lock = threading.RLock()
        self.boot_id = str(uuid.uuid4())  # a new one per gateway start: the platform sees a restart
        self.bucket = BucketTable(limits.rate, limits.burst, clock=clock)
        # Audit lines for what the listener refuses before knowing who asks (no token, too large):
        # anyone who can reach HOST:PORT can cause them, so they are rate-limited; the others are
        # counted (metrics) and the next line written says how many were left out (review 24).
        self.refusal_lines = BucketTable(REFUSAL_LINES_PER_SECOND, REFUSAL_LINE_BURST, clock=clock)
        self.refusals_unwritten = 0

    # --- one request ----------------------------------------------------------------------------------

    def handle(self, method: str, path: str, query: dict[str, list[str]], body: bytes, principal: str) -> Reply:
        with self.lock:
            action = "unknown"
            try:
                action, params = route(method, path)
                if self.limits.rate and (wait := self.bucket.take(principal)):
                    raise ControlError(429, "rate_limited", f"more than {self.limits.rate:g} control requests a "
                                                            f"second for {principal}", retry_after=wait)
                data = _json(body) if method == "POST" else {}
                reply = getattr(self, "_" + action)(params, query, data, principal)
                self.count(action, "ok")
                return reply
            except ControlError as exc:
                self.count(action, exc.reason)
                if action in CHANGES or exc.status in (401, 403, 429):
                    self.record(event="control", action=action, principal=principal, decision="deny",
                                reason=exc.reason, status=exc.status, message=exc.message,
                                sandbox=_sandbox_of(path))
                return Reply(exc.status, {"error": exc.reason, "message": exc.message}, exc.retry_after)

    def refuse(self, status: int, reason: str, message: str, principal: str, path: str) -> Reply:
        """A refusal the listener decided (authentication, size): audited and counted the same way."""
        with self.lock:
            self.count("unknown", reason)
            if self.refusal_lines.take("listener"):
                self.refusals_unwritten += 1
            else:
                unwritten, self.refusals_unwritten = self.refusals_unwritten, 0
                self.record(event="control", action="unknown", principal=principal, decision="deny", reason=reason,
                            status=status, message=message, sandbox=_sandbox_of(path),
                            **({"suppressed": unwritten} if unwritten else {}))
        return Reply(status, {"error": reason, "message": message})

    # --- reads ------------------------------------------------------------------------------------------

    def _status(self, params, query, data, principal) -> Reply:
        return Reply(200, {"boot_id": self.boot_id, "sandboxes": len(self.registry),
                           "grants": self.registry.grant_count, "seq": self.registry.seq,
                           "max_sandboxes": self.limits.max_sandboxes,
                           "max_grants_per_sandbox": self.limits.max_grants})

    def _list(self, params, query, data, principal) -> Reply:
        limit = _int(query, "limit", DEFAULT_PAGE, 1, MAX_PAGE)
        after = _one(query, "after")
        profile = _one(query, "profile")
        labels = []
        for item in query.get("label", []):
            key, sep, value = item.partition("=")
            if not sep:
                raise ControlError(400, "bad_request", "label filters are label=KEY=VALUE")
            labels.append((key, value))

        def keep(reg) -> bool:
            return (profile is None or reg.profile == profile) and all(reg.labels.get(k) == v for k, v in labels)
        page, cursor = self.registry.page(after, limit, keep)
        return Reply(200, {"sandboxes": [r.describe() for r in page], "next": cursor})

    def _get(self, params, query, data, principal) -> Reply:
        reg = self._registered(params[0])
        return Reply(200, reg.describe() | {"grants": [g.describe() for g in reg.grants.values()]})

    def _list_grants(self, params, query, data, principal) -> Reply:
        reg = self._registered(params[0])
        return Reply(200, {"grants": [g.describe() for g in reg.grants.values()]})

    def _explain(self, params, query, data, principal) -> Reply:
        """How the gateway decides URL for this registered sandbox now: its live scope (grants
        included) and the engine in force, so the answer is what its traffic gets. Names are not
        looked up (this runs on the proxy's event loop): static_hosts, else the addresses are not
        checked and the answer says so."""
        reg = self._registered(params[0])
        url = _one(query, "url")
        if not url:
            raise ControlError(400, "bad_request", "url is required (url=https://host/path, http://... or "
                                                   "tcp://IP:PORT)")
        if len(url) > MAX_EXPLAIN_URL:  # each candidate rule is matched against it: bounded work on the loop
            raise ControlError(400, "bad_request", f"url: at most {MAX_EXPLAIN_URL} characters")
        method = _one(query, "method") or "GET"
        if not _METHOD_RE.match(method):
            raise ControlError(400, "bad_request", f"method {method[:40]!r} is not an HTTP method")
        if method != method.upper():
            # Explained as given, never upper-cased: live traffic refuses such a request (400
            # non_http), and an answer for GET would disagree with it (review 26).
            raise ControlError(400, "bad_request", f"method {method!r}: methods are case-sensitive and the gateway "
                                                   "refuses one that is not upper-case (400 non_http)")
        engine = self._engine()
        scope = self.registry.scope_of_registration(engine.policy, reg.id, self.clock())
        if scope is None:
            raise ControlError(404, "unknown_sandbox", f"no sandbox {reg.id!r} is registered")
        try:
            headers = [parse_header(h) for h in query.get("header", [])]
            result = explain(engine.policy, url, method, scope=scope, scope_text="registered " + describe_scope(scope),
                             engine=engine, headers=headers)
        except ExplainError as exc:
            raise ControlError(400, "bad_request", str(exc)) from None
        return Reply(200, result.as_dict() | {"policy_sha256": engine.policy.sha256})

    def _engine(self) -> Engine:
        """The engine in force, else one built (once per policy) from the policy in force."""
        engine = self.engine() if self.engine is not None else None
        if engine is not None:
            return engine
        policy = self.policy()
        if policy is None:
            raise ControlError(503, "starting", "the gateway has no policy in force yet")
        if self._built is None or self._built[0] is not policy:
            built = Engine.build(policy)
            built.grant_rules = self.registry.grant_rules  # type: ignore[assignment]
            self._built = (policy, built)
        return self._built[1]

    def _registered(self, sandbox: str):
        reg = self.registry.get(sandbox)
        if reg is None or reg.expires <= self.clock():
            raise ControlError(404, "unknown_sandbox", f"no sandbox {sandbox!r} is registered")
        return reg

    # --- changes ----------------------------------------------------------------------------------------

    def _register(self, params, query, data, principal) -> Reply:
        policy = self._policy()
        _keys(data, {"id", "source_ips", "profile", "ttl_seconds", "labels"}, "bad_registration")
        sandbox = data.get("id")
        if not isinstance(sandbox, str) or not SANDBOX_ID_RE.match(sandbox):
            raise ControlError(422, "bad_registration", "id: letters, digits, '_', '.', ':', '-' (at most 512, as a token's sub)")
        if sandbox in policy.sandboxes_by_id:
            raise ControlError(409, "id_reserved", f"{sandbox!r} is a sandbox id of the policy file; a registration "
                                                   "needs an id of its own")
        profile = data.get("profile")
        if not isinstance(profile, str) or profile not in policy.sandboxes_by_id:
            raise ControlError(422, "unknown_profile", f"profile {profile!r} is not an entry of the policy's "
                                                       "sandboxes: section")
        raw = data.get("source_ips", [])
        if not isinstance(raw, list) or len(raw) > MAX_ADDRESSES:
            raise ControlError(422, "bad_registration", f"source_ips: a list of at most {MAX_ADDRESSES} addresses")
        if not raw and policy.tokens is None:
            # Without addresses only a token can name the sandbox: with no tokens configured such a
            # registration would match nothing, silently.
            raise ControlError(422, "bad_registration", "source_ips: at least one address (a registration without "
                                                        "addresses is for sandboxes that present proxy tokens, "
                                                        "and the policy has no identity: tokens: section)")
        try:
            addresses = list(dict.fromkeys(parse_address(a) for a in raw))
        except ValueError as exc:
            raise ControlError(422, "bad_registration", f"source_ips: {exc}") from None
        for address in addresses:
            owner = self.registry.owner(address)
            if owner is not None and owner != sandbox:
                raise ControlError(409, "address_in_use", f"{address} belongs to registered sandbox {owner!r}; "
                                                          "deregister it first")
        ttl = _ttl(data.get("ttl_seconds", DEFAULT_REGISTRATION_TTL), "bad_registration")
        labels = data.get("labels") or {}
        if not isinstance(labels, dict) or len(labels) > MAX_LABELS or not all(
                isinstance(k, str) and LABEL_KEY_RE.match(k) and isinstance(v, str) and len(v) <= MAX_LABEL_VALUE
                for k, v in labels.items()):
            raise ControlError(422, "bad_registration", f"labels: at most {MAX_LABELS} string keys (letters, "
                                                        f"digits, '_./-') to strings of at most {MAX_LABEL_VALUE}")
        old = self.registry.get(sandbox)
        if old is None and len(self.registry) >= self.limits.max_sandboxes:
            raise ControlError(409, "sandbox_limit", f"{self.limits.max_sandboxes} sandboxes are registered "
                                                     "already (--control-max-sandboxes)")
        now, wall = self.clock(), self.wall()
        op = {"op": "register", "registration": {
            "id": sandbox, "source_ips": [a.compressed for a in addresses], "profile": profile,
            "expires": now + ttl, "expires_at": wall + ttl, "by": principal, "labels": labels,
            "registered_at": wall if old is None else old.registered_at}}
        dropped = old is not None and old.profile != profile and len(old.grants)
        # The line first, then the change (as a reload does): the revocations it causes follow it.
        self.record(event="control", action="register", principal=principal, decision="allow",
                    reason="registered" if old is None else "updated", status=201 if old is None else 200,
                    message=f"sandbox {sandbox} {'registered' if old is None else 'updated'}: profile {profile}, "
                            f"{len(addresses)} address(es), for {ttl:g} s",
                    sandbox=sandbox, profile=profile, source_ips=op["registration"]["source_ips"], ttl_seconds=ttl,
                    labels=labels or None, grants_dropped=dropped or None)
        workers = self.publish([op])
        reg = self.registry.get(sandbox)
        return Reply(201 if old is None else 200, reg.describe() | {"workers": workers})

    def _deregister(self, params, query, data, principal) -> Reply:
        reg = self._registered(params[0])
        grants = len(reg.grants)
        self.record(event="control", action="deregister", principal=principal, decision="allow",
                    reason="deregistered", status=200, sandbox=reg.id, profile=reg.profile,
                    message=f"sandbox {reg.id} deregistered; its open connections are judged again",
                    source_ips=[a.compressed for a in reg.addresses], grants_dropped=grants or None)
        workers = self.publish([{"op": "deregister", "id": reg.id}])
        return Reply(200, {"deregistered": reg.id, "grants_dropped": grants, "workers": workers})

    def _grant(self, params, query, data, principal) -> Reply:
        reg = self._registered(params[0])
        policy = self._policy()
        if len(reg.grants) >= self.limits.max_grants:
            raise ControlError(409, "grant_limit", f"sandbox {reg.id} holds {len(reg.grants)} grants already "
                                                   "(--control-max-grants)")
        entry = policy.sandboxes_by_id.get(reg.profile)
        grant_id = "g-" + secrets.token_hex(6)
        try:
            grant = build_grant(data, entry.grantable if entry is not None else None, policy.rules_by_id,
                                grant_id=grant_id, sandbox=reg.id, by=principal, now=self.clock(), wall=self.wall(),
                                standard_methods=STANDARD_METHODS)
        except GrantError as exc:
            status = 403 if exc.reason == "outside_envelope" else 422
            raise ControlError(status, exc.reason, exc.message) from None
        shown = grant.describe()
        self.record(event="control", action="grant", principal=principal, decision="allow", reason="granted",
                    status=201, sandbox=reg.id, profile=reg.profile, grant=grant.id, rule=grant.rule_id,
                    message=f"grant {grant.id} to sandbox {reg.id}: rule {grant.rule_id}",
                    hosts=shown.get("hosts"), ttl_seconds=round(grant.expires - self.clock(), 3),
                    expires_at=grant.expires_at)
        workers = self.publish([{"op": "grant", "grant": grant.to_op()}])
        return Reply(201, shown | {"workers": workers})

    def _revoke(self, params, query, data, principal) -> Reply:
        reg = self._registered(params[0])
        grant = reg.grants.get(params[1])
        if grant is None:
            raise ControlError(404, "unknown_grant", f"sandbox {reg.id} has no grant {params[1]!r}")
        self.record(event="control", action="revoke", principal=principal, decision="allow", reason="revoked_grant",
                    status=200, sandbox=reg.id, grant=grant.id, rule=grant.rule_id,
                    message=f"grant {grant.id} of sandbox {reg.id} removed; its open connections are judged again")
        workers = self.publish([{"op": "revoke", "sandbox": reg.id, "grant": grant.id}])
        return Reply(200, {"revoked": grant.id, "workers": workers})

    # --- time --------------------------------------------------------------------------------------------

    def expire(self) -> float | None:
        """End what has run out (the timer calls this at each deadline): the ops are published like
        any change, each with one audit line. Returns the next deadline (monotonic), or None."""
        with self.lock:
            ops = self.registry.due(self.clock())
            if ops:
                described = []
                for op in ops:
                    reg = self.registry.get(op.get("id") or op.get("sandbox"))
                    grant = reg.grants.get(op["grant"]) if reg is not None and op["op"] == "revoke" else None
                    described.append((op, reg, grant))
                for op, reg, grant in described:
                    self.count("expire", "ok")
                    if op["op"] == "revoke":
                        self.record(event="control", action="expire", principal="gateway", decision="allow",
                                    reason="grant_expired", status=None, sandbox=op["sandbox"], grant=op["grant"],
                                    rule=grant.rule_id if grant is not None else None)
                    else:
                        self.record(event="control", action="expire", principal="gateway", decision="allow",
                                    reason="registration_expired", status=None, sandbox=op["id"],
                                    profile=reg.profile if reg is not None else None,
                                    source_ips=[a.compressed for a in reg.addresses] if reg is not None else None)
                self.publish(ops)
            return self.registry.next_deadline()

    def _policy(self) -> Policy:
        policy = self.policy()
        if policy is None or policy.sandboxes is None:
            raise ControlError(422, "unknown_profile", "the policy has no sandboxes: section, so no profile "
                                                       "to register a sandbox with")
        return policy


def _sandbox_of(path: str) -> str | None:
    parts = path.split("/")
    return unquote(parts[3]) if len(parts) > 3 and parts[1:3] == ["v1", "sandboxes"] and parts[3] else None


def _json(body: bytes) -> dict:
    try:
        data = json.loads(body or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ControlError(400, "bad_json", f"the body is not JSON: {exc}") from None
    except RecursionError:  # (review 24: deeply nested arrays were a 500 and a traceback)
        raise ControlError(400, "bad_json", "the body is nested too deeply") from None
    if not isinstance(data, dict):
        raise ControlError(400, "bad_json", "the body must be a JSON object")
    return data


def _keys(data: dict, allowed: set[str], reason: str) -> None:
    if unknown := sorted(set(data) - allowed):
        raise ControlError(422, reason, f"unknown keys {unknown} (allowed: {sorted(allowed)})")


def _ttl(value: object, reason: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_TTL_CEILING:
        raise ControlError(422, reason, f"ttl_seconds: a number of seconds from 0 to {int(MAX_TTL_CEILING)}")
    return float(value)


def _one(query: dict[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    return values[-1] if values else None


def _int(query: dict[str, list[str]], name: str, default: int, low: int, high: int) -> int:
    text = _one(query, name)
    if text is None:
        return default
    if not text.isdigit() or not low <= int(text) <= high:
        raise ControlError(400, "bad_request", f"{name}: a whole number from {low} to {high}")
    return int(text)
