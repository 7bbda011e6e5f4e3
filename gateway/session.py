"""One client connection's decisions, as a pure state machine (h11's model): the adapters in
addons/ read what the sandbox sent, feed it in as plain values, and apply what comes back.

A connection is in one of four named phases (`ClientSession.phase`):
- `unpinned`: no destination fixed yet (a proxy-port connection between absolute-form requests, or a
  transparent one before its SNI or first Host);
- `pinned`: `tunnel` holds the destination (an allowed CONNECT, or the SNI / first Host of a
  transparent connection); every later request must name it again or is refused;
- `passthrough`: pinned by a passthrough (inspect: false) rule: relayed unread once its ClientHello
  passes;
- `refused`: a TLS ClientHello or a reload's revocation refused the connection; every request on it
  gets that refusal.

Each event is a method (`connect`, `client_hello`, `request_head` are generators; `passthrough_hello`,
`raw_tcp` and the query `dial` answer at once); an allowed CONNECT or SNI pins the connection when
the adapter has audited it (`commit`), an allowed relay admits its upstream then (`relay`).
Everything else that changes the connection's state is a named method too (`set_original`, `admit`,
`poison`, `revoke`, `establish`, `keep_established`, `finish_request`), so adapters only read it.
It never does I/O: where it needs a name's addresses it yields `NeedAddresses` and is sent back the
addresses (or the ResolveError); where a request's decision makes something long-lived it yields
`Establish`, which the adapter hands to the gateway's reload bookkeeping (which may refuse the
connection at once: `phase == refused`). It returns a step value: the decision, the pin, what the
sandbox named (for the audit line), the facts the rules judged, and where the upstream goes.
`drive_now` runs one with a fixed answer for every name (tests, `explain`); addons/session_driver.py
runs one on the event loop.
"""

from __future__ import annotations

import inspect
import ipaddress
from collections.abc import Callable, Collection, Generator, Sequence
from dataclasses import dataclass, field

from . import bodies
from .clienthello import check_passthrough_hello
from .decision import Decision
from .engine import Engine, Pin, RequestFacts
from .hostnames import Host, HostError, IPAddress, canonical_host, ip_host, parse_authority
from .identity import Identity
from .policy import Rule, Scope
from .requestcheck import DEFAULT_PORTS, check_headers, check_restated
from .resolver import ResolveError
from .revocation import Established

UNPINNED, PINNED, PASSTHROUGH, REFUSED = "unpinned", "pinned", "passthrough", "refused"


@dataclass(frozen=True)
class NeedAddresses:
    """The session needs `host` resolved: send back its addresses, or the ResolveError."""

    host: Host


@dataclass(frozen=True)
class Establish:
    """The decision made something long-lived on the connection: record it (addons/state.py
    GatewayState.establish), then send back None."""

    established: Established


Resolved = "Sequence[IPAddress] | ResolveError | _Unchecked"
Steps = Generator[NeedAddresses | Establish, object, "Step"]


@dataclass(frozen=True)
class RequestHead:
    """A request head as the adapter read it, before anything is injected: plain values only."""

    method: str
    scheme: str
    path: str  # the request target as sent (origin-form path and query)
    http_version: str
    headers: tuple[tuple[str, str], ...]
    authority: str = ""  # HTTP/2's :authority, or an absolute-form request's authority as parsed
    raw_authority: str | None = None  # an absolute-form request's authority exactly as sent
    form: str | None = None  # the request target's form: origin | absolute | authority | asterisk
    end_stream: bool | None = None  # whether the head ended the request (None: not known)
    malformed: str | None = None  # the proxy found the request invalid, and will refuse it
    recorded: tuple = ()  # replay: method overrides an audit line recorded (its path may have lost them)

    def facts(self, host: Host, port: int, scheme: str) -> RequestFacts:
        return RequestFacts(host, port, scheme, self.method, self.path, self.headers,
                            bodies.request_framing(self.headers, self.end_stream), self.recorded)

    def hosts(self) -> list[str]:
        return [v for k, v in self.headers if k.lower() == "host"]


@dataclass(frozen=True)
class Step:
    """What one event decided, and what the adapter does about it."""

    decision: Decision
    pin: Pin | None = None  # the destination (also on a refusal inside a tunnel, for the audit line)
    host: str | None = None  # the destination the sandbox named, when not pinned (audit line)
    port: int | None = None
    facts: RequestFacts | None = None  # what the rules judged (a reload judges a WebSocket by it again)
    upstream: tuple[str, int] | None = None  # send the request to this address (proxied, transparent first)
    establish: Established | None = None  # a CONNECT's or SNI's tunnel: recorded once the allow is audited
    passthrough: Rule | None = None  # a CONNECT's or SNI's pin: the inspect: false rule that relays it unread

    @property
    def admitted(self) -> bool:
        return self.decision.allowed and self.pin is not None


@dataclass(frozen=True)
class Dial:
    """The answer to "may this connection open an upstream socket to (address, port)?", and if so
    the TLS server name to give it (None: plain HTTP, or bytes relayed unread)."""

    allowed: bool
    server_name: str | None = None


@dataclass
class ClientSession:
    """One client connection: what it is pinned to, what it may dial. Holds no proxy objects, so a
    stale entry can never keep a connection alive."""

    client: str
    mode: str
    address: IPAddress | None = None  # the client's IP: names its sandbox, unless `identity` does
    identity: Identity | None = None  # who the connection proved it is (gateway/identity.py), once set
    # What its first proxy-level request presented as a proxy credential (gateway/proxyauth.py): a
    # SHA-256 of the token, "" for none, None before any. Every later one must present the same.
    proxy_credential: str | None = None
    tunnel: Pin | None = None  # set by an allowed CONNECT (or SNI / first Host in transparent mode)
    # The rule that allowed the tunnel's destination, when it is a passthrough (inspect: false) rule:
    # the connection is relayed unread once its ClientHello passes (addons/passthrough.py).
    passthrough_rule: Rule | None = None
    poisoned: Decision | None = None  # set when the TLS SNI restated or named a refused destination
    original_destination: tuple[str, int] | None = None  # transparent mode: what the sandbox dialled
    named: tuple[str, int] | None = None  # transparent plain HTTP: the first request's Host, even if denied
    # (address, port) -> TLS server name the gateway may dial for this client, added only
    # when a request passed every check.
    admitted: dict[tuple[str, int], str | None] = field(default_factory=dict)
    # What became long-lived on this connection (a pinned tunnel, a passthrough or raw TCP relay, a
    # WebSocket), as admitted: judged again on every policy change (addons/revocation.py).
    established: list[Established] = field(default_factory=list)

    @property
    def phase(self) -> str:
        if self.poisoned is not None:
            return REFUSED
        if self.tunnel is None:
            return UNPINNED
        return PASSTHROUGH if self.passthrough_rule is not None else PINNED

    # --- what the adapters and the reload bookkeeping change: only through these -------------------

    def set_original(self, dialled: tuple[str, int]) -> None:
        """Transparent mode: the address the sandbox dialled, kept from the first time it is seen
        (audit lines, `strict_original_destination`, raw TCP rules); never dialled for a name."""
        if self.original_destination is None:
            self.original_destination = dialled

    def identify(self, identity: Identity) -> None:
        """The connection proved who it is: every later decision on it is judged as `identity`
        (gateway/identity.py `scope_of`)."""
        self.identity = identity

    def authenticated(self, credential: str, identity: Identity | None) -> None:
        """The first proxy-level request's credential was judged (gateway/proxyauth.py): it is the
        connection's for good, and so is the identity it proved (None: named by its address)."""
        if self.proxy_credential is not None:
            raise ValueError("a connection authenticates once")
        self.proxy_credential = credential
        if identity is not None:
            self.identify(identity)

    def admit(self, address: str, port: int, server_name: str | None) -> None:
        """A request (or relay) passed every check, and was audited: the upstream guard may now open
        a socket to (address, port), with this TLS server name (`dial`)."""
        self.admitted[(address, port)] = server_name

    def poison(self, refusal: Decision) -> None:
        """The connection is refused from now on: every later request gets `refusal`, no upstream
        socket may open (even to an address admitted before), and nothing is relayed unread."""
        self.poisoned = refusal
        self.admitted.clear()
        self.passthrough_rule = None

    def revoke(self, refusal: Decision) -> None:
        """`poison`, for a connection being closed (a reload no longer allows it, or judging it
        failed): nothing long-lived is left on it to judge again."""
        self.poison(refusal)
        self.established.clear()

    def establish(self, established: Established) -> None:
        """Something long-lived is on the connection now (addons/state.py GatewayState.establish):
        every policy change judges it again (addons/revocation.py)."""
        self.established.append(established)

    def keep_established(self, judged: Sequence[Established]) -> None:
        """A reload judged the connection's long-lived records again: these stay (with the
        generation that judged them), the rest are gone."""
        self.established[:] = judged

    def finish_request(self, request: RequestFacts) -> None:
        """A request in flight is over (its body and its response through, or it failed): a reload
        has nothing of it left to judge."""
        self.established[:] = [e for e in self.established if not (e.kind == "request" and e.request is request)]

    def dial(self, address: tuple | None) -> Dial:
        """May an upstream socket open to `address` (host, port)? Only to an (IP, port) a request or
        relay on this connection was admitted for, whatever path in the proxy led to the dial."""
        try:
            key = (ipaddress.ip_address(address[0]).compressed, int(address[1])) if address is not None else None
        except ValueError:
            key = None
        if key is None or key not in self.admitted:
            return Dial(False)
        return Dial(True, self.admitted[key])

    # --- CONNECT -----------------------------------------------------------------------------------

    def connect(self, authority: str, engine: Engine, scope: Scope,
                passthrough_rule: Callable[[Decision], Rule | None] = lambda decision: None) -> Steps:
        """A CONNECT names the tunnel's destination, once: decided, resolved, every address checked,
        pinned. `passthrough_rule` says which allowing rule, if any, relays unread."""
        if self.tunnel is not None:
            return Step(Decision.deny("nested_connect", "CONNECT inside a tunnel is refused"))
        try:
            host, port = parse_authority(authority)
        except HostError as exc:
            return Step(Decision.deny("bad_host", f"bad CONNECT authority: {exc}"))
        decision, pin = yield from _admit(engine, engine.check_destination(host, port, scope), host, port)
        if not decision.allowed or pin is None:
            return Step(decision, None, host.value, port)
        relay = passthrough_rule(decision)
        kind = "passthrough" if relay is not None else "tunnel"
        # Pinned once the allow is audited (`commit`): if that fails, the connection stays unpinned
        # (and refused). A reload that revoked it meanwhile logs its revocation after the allow,
        # and the adapter refuses the tunnel (phase refused).
        return Step(decision, pin, host.value, port, passthrough=relay,
                    establish=Established(kind, pin, decision.rule, self.address, engine.generation))

    def commit(self, step: "Step") -> None:
        """A CONNECT's or SNI's allowed step takes effect: the connection is pinned to its pin."""
        if not step.admitted:
            raise ValueError("only an allowed step pins a connection")
        self.tunnel = step.pin
        self.passthrough_rule = step.passthrough

    # --- a TLS ClientHello -------------------------------------------------------------------------

    def pins_by_sni(self) -> bool:
        """Whether a ClientHello now names the destination: a transparent connection not yet pinned."""
        return self.mode == "transparent" and self.tunnel is None and self.poisoned is None

    def client_hello(self, sni: str | None, dialled: tuple[str, int], engine: Engine, scope: Scope,
                     passthrough_rule: Callable[[Decision], Rule | None] = lambda decision: None) -> Steps:
        """On a pinned connection the SNI may only repeat the pinned name (else `sni_mismatch`, and
        the connection is refused). On a transparent connection not yet pinned it names the
        destination (the dialled IP when there is none), decided, resolved and pinned here; the
        dialled IP is recorded, never dialled. The step's pin is the connection's after the hello."""
        if not self.pins_by_sni():
            return self._sni_restated(sni)
        original_host, port = self.original_destination or dialled
        original = ipaddress.ip_address(original_host)
        try:
            host = canonical_host(sni) if sni else ip_host(original)
        except HostError as exc:
            return self._refused(Decision.deny("bad_host", f"bad TLS SNI: {exc}"), None, port)
        decision, pin = yield from _admit(engine, engine.check_destination(host, port, scope), host, port)
        if pin is not None and sni and (
                mismatch := engine.original_destination_refusal(original, host, pin.addresses, decision.rule)):
            decision, pin = mismatch, None
        if pin is None:
            return self._refused(decision, host, port)
        relay = passthrough_rule(decision)
        kind = "passthrough" if relay is not None else "tunnel"
        return Step(decision, pin, host.value, port, upstream=_upstream(pin), passthrough=relay,
                    establish=Established(kind, pin, decision.rule, self.address, engine.generation,
                                          original if sni else None))

    def _sni_restated(self, sni: str | None) -> Step:
        pin = self.tunnel
        if pin is None or not sni:
            return Step(Decision.allow(None, "the SNI restates nothing"), pin)
        if (mismatch := _sni_refusal(sni, pin)) is None:
            return Step(Decision.allow(None, "the SNI names the pinned destination"), pin)
        self.poisoned = mismatch
        return Step(self.poisoned, pin)

    def _refused(self, decision: Decision, host: Host | None, port: int) -> Step:
        """The ClientHello named a refused destination: so is every request on the connection."""
        self.poisoned = decision
        self.named = (host.value, port) if host is not None else None  # for the requests' audit lines
        return Step(decision, None, host.value if host is not None else None, port)

    # --- relayed unread: a passthrough ClientHello, raw TCP ----------------------------------------

    def passthrough_hello(self, sni: str | None, extensions: Sequence[tuple[int, bytes]]) -> Step:
        """A `passthrough` connection's ClientHello: relayed unread only if it can only mean the
        pinned destination (the SNI names it; gateway/clienthello.py: no ECH, no ambiguity). Changes
        nothing: the adapter audits the step, then applies it (`relay`, or `poison` on a refusal),
        so a hook that only looks (addons/layer_guard.py) can leave a refusal to the TLS guard."""
        pin, rule = self.tunnel, self.passthrough_rule
        if self.phase != PASSTHROUGH or pin is None or rule is None:
            raise ValueError("only a passthrough connection relays a ClientHello unread")
        refusal = _sni_refusal(sni, pin)
        if refusal is None:
            refusal = check_passthrough_hello(sni, extensions)
        if refusal is not None:
            return Step(refusal, pin, passthrough=rule)
        decision = Decision.allow(rule.id, f"rule {rule.id} relays TLS to {pin.host.authority(pin.port)} unread "
                                           "(inspect: false)")
        return Step(decision, pin, upstream=_upstream(pin), passthrough=rule)

    def raw_tcp(self, engine: Engine, scope: Scope, names_for: Callable[[IPAddress], Collection[str]]) -> Step:
        """Bytes that are neither TLS nor HTTP on a transparent connection: relayed only if a
        `protocol: tcp` rule allows the dialled address, by itself or by a name the gateway's DNS
        gave this client (`names_for`). Nothing to resolve: the dialled address is the destination.
        Like a CONNECT, the adapter audits the step, records its `establish`, then `relay`s it."""
        if self.original_destination is None:
            return Step(Decision.deny("non_http", "no original destination for raw TCP"))
        host, port = self.original_destination
        address = ipaddress.ip_address(host)
        names = names_for(address)
        decision = engine.tcp_decision(address, port, names, scope)
        if not decision.allowed:
            return Step(decision, None, address.compressed, port)
        pin = Pin(ip_host(address), port, address, (address,))
        return Step(decision, pin, address.compressed, port, upstream=_upstream(pin),
                    establish=Established("tcp", pin, decision.rule, self.address, engine.generation,
                                          names=tuple(sorted(names))))

    def relay(self, step: "Step") -> bool:
        """A relay's allowed step (`passthrough_hello`, `raw_tcp`) takes effect once audited: its
        upstream, and only that, may be dialled, with no server name of the gateway's (the bytes go
        through unread). False when a reload revoked the connection meanwhile (`poisoned`)."""
        if not step.admitted or step.upstream is None:
            raise ValueError("only an allowed step with an upstream is relayed")
        if self.poisoned is not None:
            return False
        self.admit(*step.upstream, None)
        return True

    # --- a request head ----------------------------------------------------------------------------

    def request_head(self, head: RequestHead, engine: Engine, scope: Scope) -> Steps:
        """Every HTTP request, before any upstream byte. Three shapes:
        - on a pinned connection, Host, :authority and any absolute-form authority must name the pin
          (421 otherwise), then method, path and scheme go to the rules;
        - the first request of a transparent plain-HTTP connection: its Host names the destination,
          decided, resolved and pinned for the rest of the connection;
        - an absolute-form request on the proxy port: the URL names the destination (per request),
          the Host header must agree with it (400), then the rules, resolution and address checks,
          and the request goes to the checked address."""
        if head.method == "CONNECT":
            return Step(Decision.deny("nested_connect", "CONNECT inside a tunnel is refused"), self.tunnel)
        if head.malformed is not None:
            return Step(Decision.deny("malformed_request", f"malformed request: {head.malformed[:200]}"))
        if self.poisoned is not None:
            named = self.named or (None, None)
            return Step(self.poisoned, self.tunnel, *named)
        if self.tunnel is not None:
            return self._tunnelled(head, self.tunnel, engine, scope)
        if self.mode == "transparent":
            return (yield from self._transparent_first(head, engine, scope))
        return (yield from self._proxied(head, engine, scope))

    def _tunnelled(self, head: RequestHead, pin: Pin, engine: Engine, scope: Scope) -> Step:
        if problem := check_headers(head.headers):
            return Step(problem, pin)
        restated = [("host", v) for v in head.hosts()]
        if head.authority:
            restated.append(("authority", head.authority))
        if not restated and head.http_version == "HTTP/1.1":
            return Step(Decision.deny("bad_host_header", "HTTP/1.1 request without a Host header"), pin)
        if problem := check_restated(restated, head.scheme, pin.host, pin.port):
            return Step(problem, pin)
        facts = head.facts(pin.host, pin.port, head.scheme)
        return Step(engine.check_request(facts, scope), pin, facts=facts)

    def _transparent_first(self, head: RequestHead, engine: Engine, scope: Scope) -> Steps:
        """Plain HTTP redirected transparently: the first request's Host names the destination, on
        the port the sandbox dialled; the gateway resolves it (the dialled IP is never used)."""
        if problem := check_headers(head.headers):
            return Step(problem)
        if self.original_destination is None:
            return Step(Decision.deny("bad_host", "no original destination on a transparent connection"))
        original_ip, port = self.original_destination
        hosts = head.hosts() + ([head.authority] if head.authority else [])
        if not hosts:
            return Step(Decision.deny("bad_host_header", "a transparent HTTP request needs a Host header"))
        try:
            host, host_port = parse_authority(hosts[0], port)
        except HostError as exc:
            return Step(Decision.deny("bad_host_header", f"malformed Host: {exc}"))
        named = (host.value, port)
        if self.named is not None and self.named != named:
            message = f"this connection already named {self.named[0]}:{self.named[1]}"
            return Step(Decision.deny("host_mismatch", message), None, *named)
        self.named = named
        if host_port != port:
            return Step(Decision.deny("host_mismatch", f"Host names port {host_port} but the connection is to port {port}"),
                        None, *named)
        if problem := check_restated([("host", v) for v in hosts[1:]], "http", host, port):
            return Step(problem, None, *named)
        facts = head.facts(host, port, "http")
        decision, pin = yield from _admit(engine, engine.check_request(facts, scope), host, port)
        if pin is None:
            return Step(decision, None, *named, facts=facts)
        original = ipaddress.ip_address(original_ip)
        if mismatch := engine.original_destination_refusal(original, host, pin.addresses, decision.rule):
            return Step(mismatch, None, *named, facts=facts)
        self.tunnel = pin
        yield Establish(Established("http", pin, decision.rule, self.address, engine.generation, original))
        if self.poisoned is not None:  # decided under a policy that a reload replaced meanwhile, and revoked
            return Step(self.poisoned, None, *named, facts=facts)
        return Step(decision, pin, *named, facts=facts, upstream=_upstream(pin))

    def _proxied(self, head: RequestHead, engine: Engine, scope: Scope) -> Steps:
        if head.form != "absolute":
            message = "this is a proxy: send absolute-form requests (http://host/path) or CONNECT"
            return Step(Decision.deny("origin_form", message))
        if head.scheme != "http":
            return Step(Decision.deny("https_absolute_form", "https:// URLs must be tunnelled with CONNECT"))
        if problem := check_headers(head.headers):
            return Step(problem)
        try:
            host, port = parse_authority(head.raw_authority or "", DEFAULT_PORTS["http"])
        except HostError as exc:
            return Step(Decision.deny("bad_host", f"bad URL authority: {exc}"))
        named = (host.value, port)
        hosts = head.hosts()
        if not hosts and head.http_version == "HTTP/1.1":
            return Step(Decision.deny("bad_host_header", "HTTP/1.1 request without a Host header"), None, *named)
        if problem := check_restated([("host", v) for v in hosts], "http", host, port):
            reason = "host_url_mismatch" if problem.reason == "host_mismatch" else problem.reason
            return Step(Decision.deny(reason, problem.message), None, *named)
        facts = head.facts(host, port, "http")
        decision, pin = yield from _admit(engine, engine.check_request(facts, scope), host, port)
        if pin is None:
            return Step(decision, None, *named, facts=facts)
        return Step(decision, pin, *named, facts=facts, upstream=_upstream(pin))


class _Unchecked:
    """Sent back for NeedAddresses by a caller that cannot resolve (`explain` without DNS): the walk
    goes on as if every address passed, with a pin that has no address (never dialled: no
    `upstream`). The live driver (addons/session_driver.py) only ever sends what its resolver said."""

    def __repr__(self) -> str:
        return "UNCHECKED"


UNCHECKED = _Unchecked()


def _admit(engine: Engine, decision: Decision, host: Host, port: int):
    """Engine.admit, asking for the addresses instead of resolving them."""
    if not decision.allowed:
        return decision, None
    resolved = yield NeedAddresses(host)
    if resolved is UNCHECKED:
        return decision, Pin(host, port, None, ())
    return engine.admit_resolved(decision, host, port, resolved)


def _sni_refusal(sni: str | None, pin: Pin) -> Decision | None:
    """`sni_mismatch` when a TLS SNI names another host than the pin; None when it names the pin or
    there is none."""
    if not sni:
        return None
    try:
        if canonical_host(sni).value == pin.host.value:
            return None
    except HostError:
        pass
    return Decision.deny("sni_mismatch",
                         f"TLS SNI {sni[:100]!r} is not the pinned destination {pin.host.authority(pin.port)}")


def _upstream(pin: Pin) -> tuple[str, int] | None:
    return (pin.address.compressed, pin.port) if pin.address is not None else None


async def drive(steps: Steps, resolve: Callable, establish: Callable[[Established], None]) -> Step:
    """Run an event to its step: each NeedAddresses answered by `resolve(host)` (the addresses or a
    ResolveError; awaited when it returns an awaitable: the live resolver), each Establish handed
    to `establish`. The one driver loop: live traffic awaits it (addons/session_driver.py),
    `drive_now` runs it without an event loop."""
    value: object = None
    while True:
        try:
            need = steps.send(value)
        except StopIteration as stop:
            return stop.value
        if isinstance(need, NeedAddresses):
            value = resolve(need.host)
            if inspect.isawaitable(value):
                value = await value
        else:
            establish(need.established)
            value = None


def drive_now(steps: Steps, resolve: Callable[[Host], Resolved],
              establish: Callable[[Established], None] = lambda established: None) -> Step:
    """`drive` here and now, with answers that are not awaitable (tests, explain, replay): the
    coroutine never suspends, so one send runs it to its end."""
    run = drive(steps, resolve, establish)
    try:
        run.send(None)
    except StopIteration as stop:
        return stop.value
    run.close()
    raise RuntimeError("drive_now: an answer had to be awaited")


# --- a request as a sandbox sends it: what explain, replay and policy tests ask ------------------------


def decide_destination(engine: Engine, scope: Scope, host: Host, port: int, answer: Resolved = UNCHECKED) -> Step:
    """The CONNECT (or transparent SNI) decision for host:port, every name resolving to `answer`."""
    return drive_now(ClientSession("offline", "regular").connect(host.authority(port), engine, scope),
                     lambda name: answer)


def decide_request(engine: Engine, scope: Scope, scheme: str, host: Host, port: int, method: str, target: str,
                   headers: Sequence[tuple[str, str]] = (), answer: Resolved = UNCHECKED,
                   recorded: tuple = ()) -> Decision:
    """The decision live traffic gets for this request sent through the proxy port: https as a
    CONNECT and then the request in its tunnel, http as an absolute-form request; every name the
    walk asks about resolves to `answer` (addresses, a ResolveError, or UNCHECKED)."""
    authority = host.authority(port)
    fields = tuple(headers) if any(k.lower() == "host" for k, _ in headers) else (("Host", authority), *headers)
    session = ClientSession("offline", "regular")
    if scheme == "https":
        connect = drive_now(session.connect(authority, engine, scope, engine.passthrough_rule), lambda name: answer)
        if not connect.admitted:
            return connect.decision
        session.commit(connect)
        if session.phase == PASSTHROUGH:
            return connect.decision  # relayed unread once its ClientHello passes: no head is ever judged
        head = RequestHead(method, "https", target, "HTTP/1.1", fields, form="origin", recorded=recorded)
    else:
        head = RequestHead(method, scheme, target, "HTTP/1.1", fields, authority, authority, "absolute",
                           recorded=recorded)
    return drive_now(session.request_head(head, engine, scope), lambda name: answer).decision


def decide_raw_tcp(engine: Engine, scope: Scope, address: IPAddress, port: int, names: Collection[str] = ()) -> Decision:
    """The decision live traffic gets for bytes that are neither TLS nor HTTP, sent in transparent
    mode to address:port, with `names` the gateway's DNS answered with that address."""
    session = ClientSession("offline", "transparent")
    session.set_original((address.compressed, port))
    return session.raw_tcp(engine, scope, lambda dialled: names).decision
