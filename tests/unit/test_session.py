"""gateway/session.py: a connection's walk (CONNECT, request heads; proxied, tunnelled and
transparent) driven with plain values and a fixed answer for every name, in milliseconds. The
e2e suites drive the same session through a real gateway; these pin down each case of the walk,
and a property says what the mission says: once pinned, nothing a request says moves the pin."""

from __future__ import annotations

import ipaddress
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.decision import Decision
from gateway.engine import Engine
from gateway.hostnames import Host
from gateway.policy import EVERY_RULE, compile_policy
from gateway.resolver import ResolveError
from gateway.clienthello import ECH, SERVER_NAME
from gateway.revocation import Established
from gateway.session import (PASSTHROUGH, PINNED, REFUSED, UNPINNED, ClientSession, Establish, NeedAddresses,
                             RequestHead, Step, drive_now)

ip = ipaddress.ip_address

POLICY = textwrap.dedent(
    """\
    version: 1
    network:
      strict_original_destination: true
      allow_ip_ranges: [203.0.113.0/24]
    resolver:
      static_hosts:
        api.test: [203.0.113.10, 203.0.113.11]
        metadata.test: [169.254.169.254]
        plain.test: [203.0.113.20]
        other.test: [203.0.113.30]
    rules:
      - id: api
        hosts: [api.test]
        methods: [GET, POST]
        paths: [/v1/**]
      - id: metadata
        hosts: [metadata.test]
      - id: plain
        hosts: [plain.test, other.test]
        schemes: [http]
      - id: gone
        hosts: [gone.test]
    """
)

ENGINE = Engine.build(compile_policy(POLICY, "session.yaml"))


class Names:
    """Answers every name the session asks for from static_hosts, and remembers what it asked."""

    def __init__(self, engine: Engine = ENGINE):
        self.static = engine.policy.static_hosts
        self.asked: list[str] = []

    def __call__(self, host: Host):
        self.asked.append(host.value)
        if host.is_ip:
            return [ip(host.value)]
        if host.value not in self.static:
            return ResolveError(f"{host.value}: no such name")
        return list(self.static[host.value])


def head(method="GET", path="/v1/models", *, host: str | None = "api.test", scheme="https", version="HTTP/1.1",
         authority="", raw_authority=None, form="origin", headers=(), malformed=None) -> RequestHead:
    fields = ((("Host", host),) if host is not None else ()) + tuple(headers)
    return RequestHead(method, scheme, path, version, fields, authority, raw_authority, form, True, malformed)


def connect(session: ClientSession, authority: str, names: Names | None = None, **kw) -> Step:
    """As ConnectGuard does: the step, and the pin committed once the allow is audited."""
    step = drive_now(session.connect(authority, ENGINE, EVERY_RULE, **kw), names or Names())
    if step.admitted:
        session.commit(step)
    return step


def request(session: ClientSession, request_head: RequestHead, names: Names | None = None, establish=None) -> Step:
    return drive_now(session.request_head(request_head, ENGINE, EVERY_RULE), names or Names(),
                     establish or (lambda established: None))


def tunnel(authority="api.test:443") -> ClientSession:
    session = ClientSession("10.0.0.2:5000", "regular", ip("10.0.0.2"))
    step = connect(session, authority)
    assert step.admitted, step.decision
    return session


# --- CONNECT --------------------------------------------------------------------------------------


def test_an_allowed_connect_pins_the_first_checked_address():
    session = ClientSession("10.0.0.2:5000", "regular", ip("10.0.0.2"))
    assert session.phase == UNPINNED
    step = connect(session, "API.test.:443")
    assert step.decision.allowed and step.decision.rule == "api"
    assert step.pin.address == ip("203.0.113.10") and step.pin.sni == "api.test"
    assert session.phase == PINNED and session.tunnel is step.pin
    assert step.establish is not None and step.establish.kind == "tunnel" and step.establish.rule == "api"


@pytest.mark.parametrize("authority, reason", [
    ("nobody.test:443", "no_rule"),
    ("api.test:22", "port_not_allowed"),
    ("api.test", "bad_host"),  # CONNECT needs a port
    ("[::1", "bad_host"),
])
def test_a_refused_connect_resolves_nothing_and_pins_nothing(authority, reason):
    session = ClientSession("10.0.0.2:5000", "regular")
    names = Names()
    step = connect(session, authority, names)
    assert step.decision.reason == reason and not step.admitted
    assert names.asked == [] and session.phase == UNPINNED


def test_the_address_verdict_wins_and_keeps_the_rule():
    session = ClientSession("10.0.0.2:5000", "regular")
    step = connect(session, "metadata.test:443")
    assert step.decision.reason == "denied_address" and "169.254.169.254" in step.decision.message
    assert step.decision.rule == "metadata" and step.pin is None and session.phase == UNPINNED


def test_a_name_that_does_not_resolve_is_refused_with_its_rule():
    session = ClientSession("10.0.0.2:5000", "regular")
    step = connect(session, "gone.test:443")
    assert (step.decision.reason, step.decision.rule) == ("resolve_failed", "gone") and session.phase == UNPINNED


def test_an_allowed_connect_pins_nothing_until_it_is_committed():
    """Review 8: the pin was set inside the walk, before the adapter audited the allow; when that
    failed (audit log on a full disk: 500), the connection stayed pinned with nothing established,
    so a reload never judged it again and its requests skipped the address checks."""
    session = ClientSession("10.0.0.2:5000", "regular")
    step = drive_now(session.connect("api.test:443", ENGINE, EVERY_RULE), Names())
    assert step.admitted and session.phase == UNPINNED and session.tunnel is None
    refused = drive_now(session.connect("nobody.test:443", ENGINE, EVERY_RULE), Names())
    with pytest.raises(ValueError):
        session.commit(refused)


def test_a_second_connect_is_nested():
    session = tunnel()
    names = Names()
    step = connect(session, "plain.test:80", names)
    assert step.decision.reason == "nested_connect" and names.asked == []
    assert session.tunnel.host.value == "api.test"


def test_a_passthrough_rule_makes_the_phase_passthrough():
    session = ClientSession("10.0.0.2:5000", "regular")
    rule = ENGINE.policy.rules_by_id["api"]
    step = connect(session, "api.test:443", passthrough_rule=lambda decision: rule)
    assert session.phase == PASSTHROUGH and step.establish.kind == "passthrough"


# --- requests in a tunnel ---------------------------------------------------------------------------


def test_a_request_naming_the_pin_goes_to_the_rules():
    session = tunnel()
    step = request(session, head())
    assert step.decision.allowed and step.pin is session.tunnel and step.upstream is None
    assert (step.facts.host.value, step.facts.port, step.facts.method) == ("api.test", 443, "GET")
    assert request(session, head("DELETE")).decision.reason == "method_not_allowed"
    assert request(session, head(path="/v2/x")).decision.reason == "path_not_allowed"


@pytest.mark.parametrize("request_head, reason", [
    (head(host="plain.test"), "host_mismatch"),
    (head(host="api.test:8443"), "host_mismatch"),
    (head(host="203.0.113.10"), "host_mismatch"),  # the pin's own address is not its name
    (head(host=None, version="HTTP/2.0", authority="plain.test"), "authority_mismatch"),
    (head(version="HTTP/2.0", authority="plain.test"), "authority_mismatch"),
    (head(headers=(("Host", "plain.test"),)), "bad_host_header"),  # a second Host
    (head(host=None), "bad_host_header"),
    (head(host="a b"), "bad_host_header"),
    (head("CONNECT"), "nested_connect"),
    (head(malformed="chunked and content-length"), "malformed_request"),
])
def test_a_request_restating_the_destination_is_refused(request_head, reason):
    session = tunnel()
    pin = session.tunnel
    names = Names()
    step = request(session, request_head, names)
    assert step.decision.reason == reason and not step.decision.allowed
    assert names.asked == [] and session.tunnel is pin and step.upstream is None


def test_http2_without_host_uses_its_authority():
    session = tunnel()
    assert request(session, head(host=None, version="HTTP/2.0", authority="api.test")).decision.allowed
    assert request(session, head(host=None, version="HTTP/2.0")).decision.allowed  # nothing restated


def test_a_refused_connection_answers_every_request_with_its_refusal():
    session = tunnel()
    session.poison(Decision.deny("sni_mismatch", "TLS SNI 'plain.test' is not the pinned destination"))
    assert session.phase == REFUSED
    for request_head in (head(), head(host="plain.test"), head("POST")):
        step = request(session, request_head)
        assert step.decision is session.poisoned and step.pin is session.tunnel


# --- absolute-form requests on the proxy port -------------------------------------------------------


def proxied(url_authority: str, host: str | None, scheme: str = "http") -> RequestHead:
    return head(host=host, scheme=scheme, form="absolute", raw_authority=url_authority, authority=url_authority,
                path="/")


def test_an_absolute_form_request_is_decided_and_sent_to_the_checked_address():
    session = ClientSession("10.0.0.2:5000", "regular")
    step = request(session, proxied("plain.test", "plain.test"))
    assert step.decision.rule == "plain" and step.upstream == ("203.0.113.20", 80)
    assert session.phase == UNPINNED  # per request: the next one names its own destination
    assert request(session, proxied("other.test", "other.test")).upstream == ("203.0.113.30", 80)


@pytest.mark.parametrize("request_head, reason", [
    (proxied("203.0.113.20", "plain.test"), "host_url_mismatch"),  # the production bypass: an IP URL, an allowed Host
    (proxied("plain.test", "other.test"), "host_url_mismatch"),
    (proxied("plain.test", None), "bad_host_header"),
    (proxied("plain.test:8080", "plain.test:8080"), "port_not_allowed"),
    (proxied("203.0.113.20", "203.0.113.20"), "no_rule"),
    (head(scheme="http"), "origin_form"),
    (proxied("api.test", "api.test", scheme="https"), "https_absolute_form"),
    (proxied("a b", "a b"), "bad_host"),
])
def test_a_refused_absolute_form_request_is_never_resolved(request_head, reason):
    names = Names()
    step = request(ClientSession("10.0.0.2:5000", "regular"), request_head, names)
    assert step.decision.reason == reason and step.upstream is None and names.asked == []


# --- transparent plain HTTP -------------------------------------------------------------------------


def transparent(dialled="203.0.113.20", port=80) -> ClientSession:
    session = ClientSession("10.0.0.2:5000", "transparent", ip("10.0.0.2"))
    session.set_original((dialled, port))
    return session


def test_the_first_host_pins_a_transparent_connection():
    session = transparent()
    made = []
    step = request(session, head(host="plain.test", scheme="http", path="/"), establish=made.append)
    assert step.admitted and step.upstream == ("203.0.113.20", 80) and session.phase == PINNED
    assert [e.kind for e in made] == ["http"] and made[0].original == ip("203.0.113.20")
    # later requests are judged against the pin, never resolved again
    names = Names()
    assert request(session, head(host="other.test", scheme="http", path="/"), names).decision.reason == "host_mismatch"
    assert request(session, head(host="plain.test", scheme="http", path="/"), names).decision.allowed
    assert names.asked == []


def test_a_transparent_connection_names_one_destination_even_when_refused():
    session = transparent()
    first = request(session, head(host="nobody.test", scheme="http", path="/"))
    assert first.decision.reason == "no_rule" and (first.host, first.port) == ("nobody.test", 80)
    again = request(session, head(host="plain.test", scheme="http", path="/"))
    assert again.decision.reason == "host_mismatch" and session.phase == UNPINNED


@pytest.mark.parametrize("request_head, dialled, reason", [
    (head(host="plain.test:8080", scheme="http", path="/"), "203.0.113.20", "host_mismatch"),
    (head(host="plain.test", scheme="http", path="/", headers=(("Host", "other.test"),)), "203.0.113.20",
     "bad_host_header"),
    (head(host=None, scheme="http", path="/"), "203.0.113.20", "bad_host_header"),
    (head(host="plain.test", scheme="http", path="/"), "203.0.113.99", "original_destination_mismatch"),
])
def test_a_transparent_first_request_that_restates_or_misdials_is_refused(request_head, dialled, reason):
    session = transparent(dialled)
    step = request(session, request_head)
    assert step.decision.reason == reason and step.upstream is None and session.phase == UNPINNED


def test_no_original_destination_is_refused():
    session = ClientSession("10.0.0.2:5000", "transparent")
    assert request(session, head(host="plain.test", scheme="http")).decision.reason == "bad_host"


def test_a_reload_that_revokes_while_pinning_refuses_the_request():
    session = transparent()
    revoked = Decision.deny("revoked", "the policy changed")

    def establish(established):
        session.revoke(revoked)  # what addons/revocation.py does for a stale decision

    step = request(session, head(host="plain.test", scheme="http", path="/"), establish=establish)
    assert step.decision is revoked and step.upstream is None and session.phase == REFUSED


def test_the_session_asks_for_addresses_and_establishment_as_values():
    """Sans-I/O: the adapter sees exactly what the session needs, in order."""
    session = transparent()
    events = session.request_head(head(host="plain.test", scheme="http", path="/"), ENGINE, EVERY_RULE)
    need = next(events)
    assert isinstance(need, NeedAddresses) and need.host.value == "plain.test"
    made = events.send([ip("203.0.113.20")])
    assert isinstance(made, Establish)
    with pytest.raises(StopIteration) as stop:
        events.send(None)
    assert stop.value.value.upstream == ("203.0.113.20", 80)


# --- TLS ClientHello -------------------------------------------------------------------------------


def hello(session: ClientSession, sni: str | None, dialled=("203.0.113.10", 443), names: Names | None = None,
          **kw) -> Step:
    pinning = session.pins_by_sni()
    step = drive_now(session.client_hello(sni, dialled, ENGINE, EVERY_RULE, **kw), names or Names())
    if pinning and step.admitted:
        session.commit(step)
    return step


@pytest.mark.parametrize("sni, allowed", [("api.test", True), ("API.test.", True), (None, True),
                                          ("plain.test", False), ("203.0.113.10", False), ("api.test\x00x", False)])
def test_in_a_tunnel_the_sni_may_only_repeat_the_pin(sni, allowed):
    session = tunnel()
    pin = session.tunnel
    names = Names()
    step = hello(session, sni, names=names)
    assert step.decision.allowed is allowed and step.pin is pin and session.tunnel is pin and names.asked == []
    if not allowed:
        assert step.decision.reason == "sni_mismatch" and session.phase == REFUSED
        assert request(session, head()).decision.reason == "sni_mismatch"  # every request after it


def tls_transparent(dialled="203.0.113.10", port=443) -> ClientSession:
    return transparent(dialled, port)


def test_a_transparent_sni_names_and_pins_the_destination():
    session = tls_transparent()
    assert session.pins_by_sni()
    step = hello(session, "api.test")
    assert step.admitted and step.upstream == ("203.0.113.10", 443) and session.phase == PINNED
    assert step.establish.kind == "tunnel" and step.establish.original == ip("203.0.113.10")
    assert not session.pins_by_sni()
    assert request(session, head()).decision.allowed
    assert request(session, head(host="plain.test")).decision.reason == "host_mismatch"


def test_no_sni_names_the_dialled_address():
    session = tls_transparent("203.0.113.10")
    step = hello(session, None)
    assert step.decision.reason == "no_rule" and step.host == "203.0.113.10" and session.phase == REFUSED


@pytest.mark.parametrize("sni, dialled, reason", [
    ("nobody.test", "203.0.113.10", "no_rule"),
    ("metadata.test", "169.254.169.254", "denied_address"),
    ("api.test", "203.0.113.99", "original_destination_mismatch"),  # the dialled IP is not the name's
    ("a..b", "203.0.113.10", "bad_host"),
])
def test_a_refused_sni_refuses_the_connection_and_every_request_on_it(sni, dialled, reason):
    session = tls_transparent(dialled)
    step = hello(session, sni)
    assert step.decision.reason == reason and step.pin is None and step.upstream is None
    assert session.phase == REFUSED and session.tunnel is None
    later = request(session, head(host="api.test"))
    assert later.decision is session.poisoned


# --- a passthrough ClientHello ---------------------------------------------------------------------


def sni_extension(name: bytes) -> list[tuple[int, bytes]]:
    entry = b"\x00" + len(name).to_bytes(2, "big") + name
    return [(SERVER_NAME, len(entry).to_bytes(2, "big") + entry)]


def passthrough_tunnel() -> ClientSession:
    session = ClientSession("10.0.0.2:5000", "regular", ip("10.0.0.2"))
    rule = ENGINE.policy.rules_by_id["api"]
    connect(session, "api.test:443", passthrough_rule=lambda decision: rule)
    assert session.phase == PASSTHROUGH
    return session


def test_a_passthrough_hello_naming_the_pin_is_relayed_to_the_pinned_address_only():
    session = passthrough_tunnel()
    step = session.passthrough_hello("API.test.", sni_extension(b"API.test."))
    assert step.admitted and step.decision.rule == "api" and step.upstream == ("203.0.113.10", 443)
    assert session.admitted == {}  # nothing until the adapter has audited it
    assert session.relay(step) and session.dial(("203.0.113.10", 443)).allowed
    assert session.dial(("203.0.113.10", 443)).server_name is None  # the sandbox's own TLS, unread
    assert not session.dial(("203.0.113.11", 443)).allowed


@pytest.mark.parametrize("sni, extensions, reason", [
    ("plain.test", sni_extension(b"plain.test"), "sni_mismatch"),  # checked here, as client_hello does
    ("api.test", sni_extension(b"api.test") + [(ECH, b"\x00")], "ech_refused"),
    (None, [], "sni_required"),
    ("api.test", sni_extension(b"plain.test"), "bad_client_hello"),
])
def test_a_passthrough_hello_that_could_mean_another_host_is_refused_and_changes_nothing(sni, extensions, reason):
    """The step changes nothing: the layer guard only looks, and leaves a refusal to the TLS guard."""
    session = passthrough_tunnel()
    step = session.passthrough_hello(sni, extensions)
    assert step.decision.reason == reason and not step.admitted and step.upstream is None
    assert step.passthrough is session.passthrough_rule and session.phase == PASSTHROUGH
    with pytest.raises(ValueError):
        session.relay(step)
    session.poison(step.decision)  # what the TLS guard does once the line is written
    assert session.phase == REFUSED and session.passthrough_rule is None


def test_only_a_passthrough_connection_relays_a_hello_unread():
    with pytest.raises(ValueError):
        tunnel().passthrough_hello("api.test", sni_extension(b"api.test"))


# --- raw TCP ---------------------------------------------------------------------------------------

TCP_ENGINE = Engine.build(compile_policy(textwrap.dedent(
    """\
    version: 1
    network:
      allow_ip_ranges: [203.0.113.0/24]
    rules:
      - id: ssh
        protocol: tcp
        hosts: [203.0.113.7]
        ports: [22]
      - id: git
        protocol: tcp
        hosts: [git.test]
        ports: [22]
    """), "tcp.yaml"))


def raw(session: ClientSession, names=()) -> Step:
    return session.raw_tcp(TCP_ENGINE, EVERY_RULE, lambda address: set(names))


@pytest.mark.parametrize("dialled, names, rule", [("203.0.113.7", (), "ssh"), ("203.0.113.8", ("git.test",), "git")])
def test_raw_tcp_to_an_allowed_address_is_relayed_there_once_audited(dialled, names, rule):
    session = transparent(dialled, 22)
    step = raw(session, names)
    assert step.admitted and step.decision.rule == rule and (step.host, step.port) == (dialled, 22)
    assert step.upstream == (dialled, 22) and step.establish.kind == "tcp" and step.establish.names == names
    assert session.admitted == {} and session.established == []  # the adapter audits, records, then relays
    assert session.relay(step) and session.dial((dialled, 22)).allowed and session.phase == UNPINNED


@pytest.mark.parametrize("dialled, port, reason", [("203.0.113.8", 22, "no_rule"), ("203.0.113.7", 2222, None)])
def test_raw_tcp_no_rule_allows_is_refused_and_admits_nothing(dialled, port, reason):
    session = transparent(dialled, port)
    step = raw(session, ())
    assert not step.admitted and step.upstream is None and step.host == dialled
    assert reason is None or step.decision.reason == reason
    assert session.admitted == {} and session.phase == UNPINNED


def test_raw_tcp_without_an_original_destination_names_nothing():
    step = raw(ClientSession("10.0.0.2:5000", "transparent"))
    assert step.decision.reason == "non_http" and step.host is None and not step.admitted


def test_raw_tcp_revoked_while_it_was_recorded_is_not_relayed():
    session = transparent("203.0.113.7", 22)
    step = raw(session)
    session.revoke(Decision.deny("revoked", "the policy changed"))  # a stale decision, judged at establish
    assert not session.relay(step) and session.admitted == {} and session.phase == REFUSED


# --- the session's own state: changed only through its methods -----------------------------------------


def test_the_first_dialled_address_is_the_original_destination():
    session = transparent("203.0.113.20", 80)
    session.set_original(("203.0.113.99", 8080))
    assert session.original_destination == ("203.0.113.20", 80)


def test_only_an_admitted_address_may_be_dialled_with_its_server_name():
    session = tunnel()
    assert not session.dial(("203.0.113.10", 443)).allowed  # the CONNECT alone admits nothing: lazy upstreams
    session.admit("203.0.113.10", 443, "api.test")
    session.admit("2001:db8::1", 80, None)
    assert session.dial(("203.0.113.10", 443)) == session.dial(("203.0.113.10", "443"))
    assert session.dial(("203.0.113.10", 443)).server_name == "api.test"
    assert session.dial(("2001:db8:0::1", 80)).allowed and session.dial(("2001:db8::1", 80)).server_name is None
    for address in (("203.0.113.10", 80), ("203.0.113.11", 443), ("api.test", 443), ("203.0.113.10", "x"), None):
        assert not session.dial(address).allowed


def test_a_poisoned_connection_dials_nothing_and_relays_nothing():
    session = passthrough_tunnel()
    session.establish(Established("passthrough", session.tunnel, "api", session.address, 1))
    session.admit("203.0.113.10", 443, None)
    refusal = Decision.deny("internal_error", "failed")
    session.poison(refusal)
    assert session.phase == REFUSED and session.poisoned is refusal and session.passthrough_rule is None
    assert not session.dial(("203.0.113.10", 443)).allowed
    assert session.established  # still there for a reload to find (the TLS guard's failure)
    session.revoke(refusal)
    assert session.established == []  # closed: nothing left to judge again


def test_what_is_long_lived_is_recorded_judged_again_and_finished_through_the_session():
    session = tunnel()
    facts = head().facts(session.tunnel.host, 443, "https")
    first = Established("tunnel", session.tunnel, "api", session.address, 1)
    inflight = Established("request", session.tunnel, "api", session.address, 1, request=facts)
    session.establish(first)
    session.establish(inflight)
    assert session.established == [first, inflight]
    session.finish_request(head().facts(session.tunnel.host, 443, "https"))  # equal, but another request
    assert session.established == [first, inflight]
    session.finish_request(facts)
    assert session.established == [first]
    session.keep_established([])
    assert session.established == []


# --- the property: a pin never moves ----------------------------------------------------------------

HOSTS = st.sampled_from(["api.test", "plain.test", "other.test", "metadata.test", "203.0.113.10", "API.TEST.",
                         "api.test:443", "api.test:80", "[2001:db8::1]", "nobody.test", "", "a b", "api.test@x"])


@st.composite
def heads(draw):
    hosts = draw(st.lists(HOSTS, max_size=3))
    return RequestHead(
        method=draw(st.sampled_from(["GET", "POST", "CONNECT", "DELETE"])),
        scheme=draw(st.sampled_from(["http", "https"])),
        path=draw(st.sampled_from(["/v1/x", "/", "*", "http://plain.test/"])),
        http_version=draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0"])),
        headers=tuple(("Host", h) for h in hosts),
        authority=draw(HOSTS), raw_authority=draw(st.none() | HOSTS),
        form=draw(st.sampled_from(["origin", "absolute", "authority", None])), end_stream=True,
    )


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["tunnel", "transparent", "proxy"]), st.lists(heads(), min_size=1, max_size=6))
def test_once_pinned_no_request_moves_the_pin_and_no_refusal_reaches_an_upstream(mode, requests):
    if mode == "tunnel":
        session = tunnel()
    elif mode == "transparent":
        session = transparent()
    else:
        session = ClientSession("10.0.0.2:5000", "regular")
    for request_head in requests:
        pinned = session.tunnel
        step = request(session, request_head)
        if pinned is not None:
            assert session.tunnel is pinned  # the sandbox cannot rename its destination
            assert step.upstream is None
            if step.decision.allowed:
                assert step.pin is pinned
        if step.upstream is not None:  # only an allowed request is sent anywhere, and only to a checked address
            assert step.decision.allowed and step.pin is not None
            assert step.upstream == (step.pin.address.compressed, step.pin.port)
            assert ENGINE.address_refusal(step.pin.host, step.pin.addresses, step.pin.port) is None
        if not step.decision.allowed:
            assert step.upstream is None
