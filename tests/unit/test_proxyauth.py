"""gateway/proxyauth.py: a proxy-level request's Proxy-Authorization sets its connection's identity
once; a missing, bad or different one is a 407 reason, and none of them quotes the token."""

from __future__ import annotations

import base64
import ipaddress
import textwrap

import pytest

from bench.lib.tokens import claims, new_signer, write_jwks
from gateway.hopbyhop import without_proxy_credentials
from gateway.identity import scope_of
from gateway.policy import compile_policy
from gateway.proxyauth import Malformed, authenticate, token_of
from gateway.session import ClientSession
from gateway.tokens import TokenVerifier

SIGNER = new_signer("EdDSA")


@pytest.fixture()
def policy(tmp_path):
    write_jwks(tmp_path / "jwks.json", SIGNER)
    def make(required: bool = True):
        text = textwrap.dedent(f"""\
            version: 1
            rules: [{{id: a, hosts: [a.test]}}, {{id: b, hosts: [b.test]}}]
            sandboxes:
              - {{id: agent, rules: [a]}}
              - {{id: default, rules: [b]}}
            identity:
              tokens: {{keys: jwks.json, audience: egress-gateway, required: {str(required).lower()}}}
            """)
        (tmp_path / "policy.yaml").write_text(text)
        return compile_policy(text, str(tmp_path / "policy.yaml"))
    return make


def basic(token: str, user: str = "sandbox") -> str:
    return "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()


def verifier_of(policy) -> TokenVerifier:
    return TokenVerifier(policy.tokens, frozenset(policy.sandboxes_by_id))


def session() -> ClientSession:
    return ClientSession("10.0.0.9:5000", "regular", ipaddress.ip_address("10.0.0.9"))


def test_basic_and_bearer_carry_the_token():
    assert token_of([basic("tok.en.x")]) == "tok.en.x"
    assert token_of([basic("a:b", user="")]) == "a:b"  # the password is everything after the first colon
    assert token_of(["Bearer tok.en.x"]) == "tok.en.x" and token_of(["bearer  tok.en.x "]) == "tok.en.x"
    assert token_of([]) is None


@pytest.mark.parametrize("values", [["Digest x"], ["Basic !!!"], [basic("")], ["Basic " + base64.b64encode(b"nocolon").decode()],
                                    ["Bearer a", "Bearer b"], ["Bearer"]])
def test_unreadable_credentials_are_malformed(values):
    with pytest.raises(Malformed):
        token_of(values)


def test_a_valid_token_identifies_the_connection_as_its_subject_with_its_profile(policy):
    p = policy()
    conn = session()
    assert authenticate(conn, [basic(SIGNER.mint(claims("task-9", "agent")))], verifier_of(p)) is None
    scope = scope_of(p, conn.address, conn.identity)
    assert (scope.sandbox, scope.profile, scope.rule_ids) == ("task-9", "agent", frozenset({"a"}))


def test_missing_expired_and_bad_tokens_are_refused_with_their_reasons(policy):
    v = verifier_of(policy())
    expired = SIGNER.mint(claims("t", "agent", now=0, ttl=10))
    bad = new_signer("EdDSA", kid=SIGNER.kid).mint(claims("t", "agent"))
    assert authenticate(session(), [], v).reason == "proxy_auth_required"
    for token, reason in ((expired, "token_expired"), (bad, "token_invalid")):
        conn = session()
        refusal = authenticate(conn, [basic(token)], v)
        assert refusal.reason == reason and refusal.status == 407
        assert token not in refusal.message and token not in refusal.body()
        assert conn.identity is None and conn.proxy_credential is None
    assert authenticate(session(), ["Digest abc"], v).reason == "token_invalid"


def test_without_required_a_client_without_a_token_is_named_by_its_address_but_a_bad_one_is_refused(policy):
    p = policy(required=False)
    v = verifier_of(p)
    conn = session()
    assert authenticate(conn, [], v) is None
    assert conn.identity is None and scope_of(p, conn.address, conn.identity).sandbox == "default"
    assert authenticate(session(), [basic("x.y.z")], v).reason == "token_invalid"


def test_one_connection_cannot_switch_identity(policy):
    p = policy(required=False)
    v = verifier_of(p)
    first, second = SIGNER.mint(claims("task-1", "agent")), SIGNER.mint(claims("task-2", "agent"))
    conn = session()
    assert authenticate(conn, [basic(first)], v) is None
    assert authenticate(conn, [basic(first)], v) is None  # the same token again: fine
    assert authenticate(conn, ["Bearer " + first], v) is None  # the same token in the other scheme
    assert authenticate(conn, [basic(second)], v).reason == "identity_changed"
    assert authenticate(conn, [], v).reason == "identity_changed"
    assert conn.identity.sandbox == "task-1"
    anonymous = session()
    assert authenticate(anonymous, [], v) is None
    assert authenticate(anonymous, [basic(first)], v).reason == "identity_changed"
    assert anonymous.identity is None


def test_without_identity_tokens_the_credential_is_ignored():
    conn = session()
    assert authenticate(conn, [basic("anything")], None) is None and conn.identity is None


def test_proxy_authorization_is_removed_in_every_spelling():
    fields = [(b"Host", b"a"), (b"Proxy-Authorization", b"Basic x"), (b"proxy-authorization", b"y"), (b"X", b"z")]
    assert without_proxy_credentials(fields) == [(b"Host", b"a"), (b"X", b"z")]
    assert without_proxy_credentials([(b"Host", b"a")]) is None
