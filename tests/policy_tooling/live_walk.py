"""Random policies and requests, and what live traffic does with them: the connection's session
(gateway/session.py, the generators the live guards drive), the credential verdict the injector
asks (gateway/credential_checks.py) and the audit lines the guards write (addons/audit_fields.py,
GatewayState.record). The property tests for `explain` and `replay` compare against this."""

from __future__ import annotations

import asyncio
import ipaddress

import yaml
from hypothesis import strategies as st

from addons import passthrough
from addons.audit_fields import connection_fields, decision_fields
from addons.state import GatewayState
from gateway import methods
from gateway.credential_checks import credential_verdict
from gateway.credentials import placeholder
from gateway.decision import verdict_fields
from gateway.engine import Engine
from gateway.resolver import ResolveError
from gateway.session import PASSTHROUGH, RequestHead, drive_now

NAMES = ["a.test", "b.a.test", "c.test", "meta.test", "gone.test"]
ADDRESSES = {"a.test": ["203.0.113.1"], "b.a.test": ["203.0.113.2", "203.0.113.3"], "c.test": ["198.51.100.7"],
             "meta.test": ["203.0.113.9", "169.254.169.254"]}
HOST_PATTERNS = ["a.test", "*.a.test", "c.test", "meta.test", "gone.test", "203.0.113.0/24", "198.51.100.7"]
CLIENT = "10.0.0.2"
KEY = b"k" * 32  # the placeholder key live traffic holds; explain and replay know placeholders by shape only
SECRET = "tok"
P = "{placeholder}"  # stands for this client's placeholder of the secret (`Live.placeholders`)
PATHS = ["/", "/v1/models", "/x", "/v1/a/y", "/v1/%2e%2e/x", "/y?_method=DELETE", "/v1/q?api_key=mine",
         f"/v1/q?key={P}"]
HEADERS = [(), (("Host", "evil.test"),), (("X-HTTP-Method-Override", "DELETE"),),
           (("Authorization", "Bearer mine"),), (("Authorization", f"Bearer {P}"),)]


@st.composite
def rules(draw, index):
    rule = {"id": f"r{index}", "hosts": draw(st.lists(st.sampled_from(HOST_PATTERNS), min_size=1, max_size=2,
                                                      unique=True))}
    if draw(st.booleans()):
        rule["schemes"] = draw(st.lists(st.sampled_from(["http", "https"]), min_size=1, max_size=2, unique=True))
    if draw(st.booleans()):
        rule["ports"] = draw(st.lists(st.sampled_from([80, 443, 8080, 8443]), min_size=1, max_size=2, unique=True))
    if draw(st.booleans()):
        rule["methods"] = draw(st.lists(st.sampled_from(["GET", "POST", "PUT", "DELETE"]), min_size=1, max_size=3,
                                        unique=True))
    if draw(st.booleans()):
        rule["paths"] = draw(st.lists(st.sampled_from(["/v1/**", "/x", "/**", "/v1/*/y"]), min_size=1, max_size=2,
                                      unique=True))
    if draw(st.booleans()):
        rule["mode"] = draw(st.sampled_from(["report", "enforce"]))
    if draw(st.integers(0, 5)) == 0 and set(rule.get("schemes", ["https"])) == {"https"} and not {
            "methods", "paths"} & set(rule) and not any(h[0].isdigit() for h in rule["hosts"]):
        rule["inspect"] = False  # passthrough: https, names, no method or path (what the loader accepts)
    elif draw(st.integers(0, 2)) == 0:
        _bind(draw, rule)
    return rule


def _bind(draw, rule: dict) -> None:
    """Credentials: the rule injects the secret (the loader wants the allowances a rule's hosts and
    schemes need), and may swap placeholders in the query too."""
    rule["inject"] = [{"header": "Authorization", "value": f"Bearer ${{secrets.{SECRET}}}"}]
    if any(not h[0].isalpha() or h.startswith("*") for h in rule["hosts"]):
        rule["allow_wildcard_credentials"] = True
    if "http" in rule.get("schemes", ["https"]):
        rule["allow_plaintext_credentials"] = True
    if draw(st.booleans()):
        rule["placeholders"] = {"query": ["key"]}


@st.composite
def policies(draw, sandboxes: bool = False, every_address: bool = False):
    """(policy text, headers every request carries). static_hosts names some of ADDRESSES (all with
    `every_address`); live traffic resolves the others (to the same addresses), which replay then
    knows only as recorded."""
    count = draw(st.integers(min_value=0, max_value=4) | st.integers(min_value=2, max_value=4))
    known = sorted(ADDRESSES) if every_address else draw(st.lists(st.sampled_from(sorted(ADDRESSES)), unique=True))
    document = {
        "version": 1,
        "network": {"allow_ip_ranges": ["203.0.113.0/24", "198.51.100.0/24"],
                    "strict_original_destination": draw(st.booleans())},
        "resolver": {"static_hosts": {name: ADDRESSES[name] for name in known}},
        "secrets": {SECRET: {"env": "EGRESS_TEST_UNREAD"}},  # never read: decisions do not need the value
        "rules": [draw(rules(i)) for i in range(count)],
    }
    if draw(st.booleans()):
        document["mode"] = "report"
    if sandboxes and count and draw(st.booleans()):
        granted = draw(st.lists(st.sampled_from([r["id"] for r in document["rules"]]), unique=True))
        document["sandboxes"] = [{"id": "box", "source_ips": [f"{CLIENT}/32"], "rules": granted}]
    headers = draw(st.sampled_from(HEADERS))
    return yaml.safe_dump(document, sort_keys=False), headers


@st.composite
def requests(draw):
    scheme = draw(st.sampled_from(["http", "https"]))
    host = draw(st.sampled_from(NAMES + ["203.0.113.1", "198.51.100.7", "169.254.169.254"]) |
                st.sampled_from(["a.test", "c.test"]))
    port = draw(st.sampled_from([None, 80, 443, 8080, 8443]) | st.none())  # often the scheme's own
    path = draw(st.sampled_from(PATHS))
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]))
    return scheme, host, port, path, method


def addresses(host):
    """Every name's addresses, as live traffic's resolver answers (a ResolveError is sent back)."""
    if host.is_ip:
        return [host.ip]
    if host.value not in ADDRESSES:
        return ResolveError(f"{host.value}: no such name")
    return [ipaddress.ip_address(a) for a in ADDRESSES[host.value]]


class _Table:
    """A resolver that answers from ADDRESSES."""

    async def resolve(self, host):
        found = addresses(host)
        if isinstance(found, ResolveError):
            raise found
        return tuple(found)


def _fields(authority: str, headers) -> tuple:
    """The head a client sends: its own Host if it gives one (-H Host), else the URL's authority."""
    given = tuple(headers)
    return given if any(k.lower() == "host" for k, _ in given) else (("Host", authority), *given)


class Live:
    """One client of a gateway running `engine`: its session, and the audit lines the guards write."""

    def __init__(self, engine: Engine, mode: str = "regular"):
        self.engine = engine
        self.state = GatewayState()
        self.state.install(engine)
        self.lines: list[dict] = []
        self.state.decision_listeners.append(self.lines.append)
        self.session = self.state.connection("c1", (CLIENT, 5000), mode)
        self.scope = self.state.scope(self.session)

    def placeholders(self, path: str, headers) -> tuple[str, tuple]:
        """The path and headers with this client's own placeholder where they hold one."""
        token = placeholder(KEY, SECRET, self.scope.sandbox)
        return path.replace(P, token), tuple((k, v.replace(P, token)) for k, v in headers)

    def request(self, scheme: str, host: str, port: int | None, path: str, method: str, headers=()):
        """The request through the proxy port (https: CONNECT, then the request in the tunnel); the
        final decision, after the credential verdict."""
        authority = host if port is None else f"{host}:{port}"
        if scheme == "https":
            step = drive_now(self.session.connect(f"{host}:{port or 443}", self.engine, self.scope,
                                                  self.engine.passthrough_rule), addresses)
            self._record("connect", step, method="CONNECT", scheme="http", path=None)  # as ConnectGuard
            if not step.admitted:
                return step.decision
            self.session.commit(step)
            if self.session.phase == PASSTHROUGH:
                return step.decision  # relayed unread after its ClientHello (TlsGuard): no head is judged
            head = RequestHead(method, "https", path, "HTTP/1.1", _fields(authority, headers), form="origin",
                               end_stream=True)
        else:
            head = RequestHead(method, "http", path, "HTTP/1.1", _fields(authority, headers), authority, authority,
                               "absolute", True)
        step = drive_now(self.session.request_head(head, self.engine, self.scope), addresses)
        decision, injected = step.decision, []
        if decision.allowed and step.pin is not None:  # as RequestGuard, then CredentialInjector.apply
            rule = self.engine.policy.rules_by_id.get(decision.rule or "")
            if rule is not None and rule.secrets:
                tokens = {placeholder(KEY, name, self.scope.sandbox): name for name in rule.secrets}
                verdict = credential_verdict(rule, decision, head.scheme, step.pin.host, head.headers, path, tokens)
                decision = verdict.decision
                injected = list(rule.secrets) if verdict.inject else []
        found = step.facts.overrides if step.facts is not None else methods.overrides(head.headers, path)
        extra = {"method_override": methods.described(found)} if found else {}
        if injected:
            extra["injected"] = injected
        self._record("request", step, decision, method=method, scheme=scheme, path=path, **extra)
        return decision

    def client_hello(self, sni: str | None, dialled: tuple[str, int]):
        """A transparent connection's ClientHello, with the tls line TlsGuard (or, for a passthrough
        pin, addons/passthrough.py) writes for it."""
        self.session.original_destination = dialled
        step = drive_now(self.session.client_hello(sni, dialled, self.engine, self.scope,
                                                   lambda d: passthrough.rule_for(self.engine, d)), addresses)
        if step.passthrough is None or not step.decision.allowed:
            self.state.record(event="tls", **connection_fields(self.session, self.scope.sandbox),
                              **verdict_fields(step.decision), host=step.pin.host.value if step.pin else step.host,
                              port=step.pin.port if step.pin else step.port,
                              address=step.pin.address.compressed if step.pin else None, sni=sni, ech=False)
        else:
            self.session.commit(step)
            # the line TlsGuard._passthrough writes for a hello that passes its checks (no hello is drawn here)
            passthrough.record(self.state, self.session, step, sni, [])
        return step.decision

    def dns(self, name: str, query_type: str):
        """A DNS-mode question, with the line DnsGuard writes for it (the engine resolves from
        ADDRESSES, as `addresses` does)."""
        self.engine.resolver = _Table()
        answer = asyncio.run(self.engine.answer_dns(name, query_type, self.scope))
        self.state.record(event="dns", **connection_fields(self.session, self.scope.sandbox),
                          **verdict_fields(answer.decision, status_sent=False), host=answer.name or name[:253],
                          address=",".join(a.compressed for a in answer.addresses) or None, dns_type=query_type,
                          rcode=answer.rcode)
        return answer.decision

    def _record(self, event: str, step, decision=None, **sent) -> None:
        fields = connection_fields(self.session, self.scope.sandbox) | sent
        fields |= decision_fields(decision or step.decision, step.pin, step.host, step.port)
        self.state.record(event=event, **fields)
