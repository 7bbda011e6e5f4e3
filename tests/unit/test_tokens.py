"""gateway/tokens.py: a signed token proves a sandbox's identity only when every check passes; each
refusal is token_expired or token_invalid, and none of them quotes the token."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import textwrap
import time
from pathlib import Path

import jwt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.lib.tokens import claims, kubernetes_claims, new_signer, write_jwks
from gateway.identity import Identity, scope_of
from gateway.policy import PolicyError, compile_policy
from gateway.tokens import (
    MAX_TOKEN_BYTES,
    TokenRefused,
    TokenSettings,
    TokenVerifier,
    claim_at,
    fingerprint,
    load_keys,
)

PROFILES = frozenset({"agent", "ci"})
SIGNERS = {alg: new_signer(alg) for alg in ("EdDSA", "ES256", "RS256")}
OTHER = new_signer("EdDSA")  # a key the gateway does not trust


@pytest.fixture()
def jwks_path(tmp_path: Path) -> Path:
    return write_jwks(tmp_path / "jwks.json", *SIGNERS.values())


def verifier(path: Path, **changes) -> TokenVerifier:
    base = dict(key_files=(path,), jwks=True, algorithms=("EdDSA", "ES256", "RS256"), audience="egress-gateway",
                issuer=None, leeway=30.0, profile_claim=("egress_profile",), default_profile=None,
                rules_claim="egress_rules", required=True)
    extra = changes.pop("verifier_args", {})
    base.update(changes)
    return TokenVerifier(TokenSettings(**base), PROFILES, **extra)


def refused(v: TokenVerifier, token: str) -> TokenRefused:
    with pytest.raises(TokenRefused) as info:
        v.verify(token)
    if len(token) > 3:
        assert token not in info.value.message and token not in str(info.value)
    return info.value


@pytest.mark.parametrize("alg", ["EdDSA", "ES256", "RS256"])
def test_a_valid_token_of_each_algorithm_proves_its_subject_and_profile(jwks_path, alg):
    proof = verifier(jwks_path).verify(SIGNERS[alg].mint(claims("task-1", "agent")))
    assert (proof.subject, proof.profile, proof.rule_ids) == ("task-1", "agent", None)


def test_an_expired_token_is_token_expired(jwks_path):
    token = SIGNERS["EdDSA"].mint(claims("task-1", "agent", now=time.time() - 3600, ttl=60))
    assert refused(verifier(jwks_path), token).reason == "token_expired"


def test_leeway_is_honoured(jwks_path):
    token = SIGNERS["EdDSA"].mint(claims("task-1", "agent", now=time.time() - 70, ttl=60))  # 10 s past exp
    assert verifier(jwks_path, leeway=30.0).verify(token).subject == "task-1"
    assert refused(verifier(jwks_path, leeway=5.0), token).reason == "token_expired"


def test_leeway_is_capped_by_the_loader(tmp_path):
    with pytest.raises(PolicyError, match="identity.tokens.leeway"):
        _policy(tmp_path, "leeway: 10m")


def test_a_token_not_valid_yet_is_token_invalid_and_not_cached(jwks_path):
    v = verifier(jwks_path)
    token = SIGNERS["EdDSA"].mint(claims("task-1", "agent", now=time.time() + 600))
    assert refused(v, token).reason == "token_invalid"
    assert refused(v, token).reason == "token_invalid"
    assert v.verifications == 2  # judged again: it may become valid


@pytest.mark.parametrize("change, why", [
    ({"aud": "another-service"}, "audience"),
    ({"aud": ["another-service", "x"]}, "audience"),
])
def test_a_token_for_another_audience_is_refused(jwks_path, change, why):
    token = SIGNERS["RS256"].mint(claims("task-1", "agent") | change)
    assert why in refused(verifier(jwks_path), token).message


def test_an_audience_list_naming_the_gateway_is_accepted(jwks_path):
    token = SIGNERS["RS256"].mint(claims("task-1", "agent") | {"aud": ["x", "egress-gateway"]})
    assert verifier(jwks_path).verify(token).subject == "task-1"


def test_the_issuer_is_checked_when_the_policy_names_one(jwks_path):
    v = verifier(jwks_path, issuer="https://issuer.test")
    assert v.verify(SIGNERS["ES256"].mint(claims("t", "agent", iss="https://issuer.test"))).subject == "t"
    assert "issuer" in refused(v, SIGNERS["ES256"].mint(claims("t", "agent", iss="https://evil.test"))).message
    assert refused(v, SIGNERS["ES256"].mint(claims("t", "agent"))).reason == "token_invalid"  # no iss at all


def test_a_token_signed_by_an_unknown_key_is_refused(jwks_path):
    stranger = new_signer("EdDSA", kid=SIGNERS["EdDSA"].kid)  # even claiming a trusted key's kid
    assert refused(verifier(jwks_path), stranger.mint(claims("t", "agent"))).message == "bad signature"


def test_an_unknown_kid_is_refused(jwks_path):
    assert "unknown kid" in refused(verifier(jwks_path), OTHER.mint(claims("t", "agent"))).message


def test_alg_none_is_refused(jwks_path):
    token = jwt.encode(claims("t", "agent"), None, algorithm="none")
    assert refused(verifier(jwks_path), token).reason == "token_invalid"  # "a.b." is not even three segments


def _forge(header: dict, payload: dict, signature: bytes = b"sig") -> str:
    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()
    return ".".join([b64(json.dumps(header).encode()), b64(json.dumps(payload).encode()), b64(signature)])


def test_alg_none_with_a_signature_segment_is_refused_by_the_algorithm_check(jwks_path):
    token = _forge({"alg": "none", "typ": "JWT"}, claims("t", "agent"))
    assert "'none' is not allowed" in refused(verifier(jwks_path), token).message


def test_hs256_signed_with_the_public_key_is_refused(jwks_path):
    """Key confusion: the RSA public key (public knowledge) used as an HMAC secret."""
    signer = SIGNERS["RS256"]
    token = jwt.api_jws.PyJWS().encode(json.dumps(claims("t", "agent")).encode(), key=b"x", algorithm="HS256",
                                       headers={"kid": signer.kid})
    head, body, _sig = token.split(".")
    mac = hmac.new(signer.pem(), f"{head}.{body}".encode(), hashlib.sha256).digest()
    forged = f"{head}.{body}." + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()
    refusal = refused(verifier(jwks_path, algorithms=("RS256",)), forged)
    assert refusal.reason == "token_invalid" and "HS256" in refusal.message


def test_an_rs256_token_when_only_eddsa_is_allowed_is_refused(jwks_path):
    token = SIGNERS["RS256"].mint(claims("t", "agent"))
    assert "'RS256' is not allowed" in refused(verifier(jwks_path, algorithms=("EdDSA",)), token).message


def test_an_alg_that_does_not_fit_the_key_type_finds_no_key(jwks_path):
    """PS256 is allowed, but the RSA key's JWK says RS256: it verifies nothing else."""
    signer = SIGNERS["RS256"]
    token = signer.mint(claims("t", "agent"), alg="PS256")
    assert "no key fits" in refused(verifier(jwks_path, algorithms=("PS256", "RS256")), token).message


def test_a_profile_the_policy_does_not_have_is_token_invalid(jwks_path):
    refusal = refused(verifier(jwks_path), SIGNERS["EdDSA"].mint(claims("t", "admin")))
    assert refusal.reason == "token_invalid" and "'admin'" in refusal.message


def test_without_a_profile_claim_the_default_profile_applies_or_it_is_refused(jwks_path):
    token = SIGNERS["EdDSA"].mint(claims("t", None))
    assert verifier(jwks_path, default_profile="ci").verify(token).profile == "ci"
    assert refused(verifier(jwks_path), token).reason == "token_invalid"


@pytest.mark.parametrize("sub", ["", "with space", "new\nline", "x" * 513, 42, None])
def test_a_bad_subject_is_refused(jwks_path, sub):
    body = claims("t", "agent")
    if sub is None:
        del body["sub"]
    else:
        body["sub"] = sub
    token = SIGNERS["EdDSA"].mint(body) if not isinstance(sub, int) else _forge({"alg": "EdDSA"}, body)
    assert refused(verifier(jwks_path), token).reason == "token_invalid"


@pytest.mark.parametrize("token", [
    "", "abc", "a.b", "a.b.c.d", "!!!.###.$$$", "e30.e30.", "bm90IGpzb24.e30.c2ln",
    "eyJhbGciOiJFZERTQSJ9.bm90IGpzb24.c2ln",  # header fine, payload not JSON
    "eyJhbGciOiJFZERTQSJ9.e30=.c2ln",  # padding
])
def test_malformed_tokens_are_token_invalid(jwks_path, token):
    assert refused(verifier(jwks_path), token).reason == "token_invalid"


def test_a_huge_token_is_refused_before_parsing(jwks_path):
    v = verifier(jwks_path)
    token = SIGNERS["EdDSA"].mint(claims("t", "agent", padding="x" * MAX_TOKEN_BYTES))
    assert "over" in refused(v, token).message
    assert v.verifications == 0


@pytest.mark.parametrize("header", [{"crit": ["b64"], "b64": False}, {"jku": "https://evil.test/jwks"},
                                    {"jwk": {"kty": "OKP"}}])
def test_headers_that_let_the_token_choose_its_own_key_or_rules_are_refused(jwks_path, header):
    token = SIGNERS["EdDSA"].mint(claims("t", "agent"), headers=header)
    assert refused(verifier(jwks_path), token).reason == "token_invalid"


def test_the_kubernetes_projected_token_works_as_it_is(tmp_path):
    cluster = new_signer("RS256")  # kube-apiserver's service-account key, published at /openid/v1/jwks
    path = write_jwks(tmp_path / "cluster-jwks.json", cluster)
    v = verifier(path, algorithms=("RS256",), issuer="https://kubernetes.default.svc.cluster.local",
                 profile_claim=tuple("kubernetes.io.serviceaccount.name".split(".")))
    token = cluster.mint(kubernetes_claims("ci-jobs", "agent"))
    assert jwt.get_unverified_header(token)["kid"] == cluster.kid
    proof = v.verify(token)
    assert (proof.subject, proof.profile) == ("system:serviceaccount:ci-jobs:agent", "agent")


def test_claim_paths_with_dotted_keys():
    body = {"kubernetes.io": {"serviceaccount": {"name": "agent"}}, "a": {"b": 1}, "a.b": 2}
    assert claim_at(body, "kubernetes.io.serviceaccount.name".split(".")) == "agent"
    assert claim_at(body, ["a", "b"]) == 2  # the longest key wins at each level
    assert claim_at(body, ["missing"]) is None and claim_at(body, ["a", "b", "c"]) is None


def test_the_rules_claim_is_read_as_a_narrowing(jwks_path):
    v = verifier(jwks_path)
    assert v.verify(SIGNERS["EdDSA"].mint(claims("t", "agent", egress_rules=["a"]))).rule_ids == frozenset({"a"})
    assert refused(v, SIGNERS["EdDSA"].mint(claims("t2", "agent", egress_rules="a"))).reason == "token_invalid"


POLICY = compile_policy(textwrap.dedent("""\
    version: 1
    rules:
      - {id: a, hosts: [a.test]}
      - {id: b, hosts: [b.test]}
      - {id: c, hosts: [c.test]}
    sandboxes:
      - {id: agent, rules: [a, b]}
      - {id: ci, rules: [c]}
    """), "p.yaml")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", "x", "*", ""]), max_size=6) | st.none())
def test_a_rules_claim_never_widens_the_profile(narrowing):
    """Whatever rule ids a (validly signed) token lists, its scope is within its profile's rules."""
    v = _SHARED_VERIFIER
    body = claims("t", "agent")
    if narrowing is not None:
        body["egress_rules"] = narrowing
    proof = v.verify(SIGNERS["EdDSA"].mint(body))
    scope = scope_of(POLICY, None, Identity(proof.subject, proof.profile, "token", proof.rule_ids))
    assert scope.rule_ids <= frozenset({"a", "b"})
    if narrowing is not None:
        assert scope.rule_ids <= set(narrowing)


def test_verified_tokens_are_cached_until_they_expire(jwks_path):
    now = [time.time()]
    v = verifier(jwks_path, verifier_args={"clock": lambda: now[0]})
    token = SIGNERS["ES256"].mint(claims("t", "agent", ttl=60))
    for _ in range(5):
        v.verify(token)
    assert v.verifications == 1
    now[0] += 60 + 31  # past exp and leeway: judged again (and PyJWT's own clock says it is still valid)
    v.verify(token)
    assert v.verifications == 2


def test_refused_tokens_are_cached_apart_and_bounded(jwks_path):
    v = verifier(jwks_path, verifier_args={"refused_cache_size": 2, "cache_size": 2})
    bad = [OTHER.mint(claims(f"t{i}", "agent")) for i in range(3)]
    good = SIGNERS["EdDSA"].mint(claims("good", "agent"))
    v.verify(good)
    for token in bad:
        refused(v, token)
    refused(v, bad[2])
    assert v.verifications == 4  # the last refusal came from the cache
    v.verify(good)
    assert v.verifications == 4  # garbage did not evict the good token


def test_a_key_file_change_is_picked_up_and_empties_the_cache(tmp_path):
    first, second = new_signer("EdDSA"), new_signer("EdDSA")
    path = write_jwks(tmp_path / "jwks.json", first)
    clock = [0.0]
    v = verifier(path, verifier_args={"monotonic": lambda: clock[0]})
    old = first.mint(claims("t", "agent"))
    v.verify(old)
    write_jwks(path, second)  # rotated: the old key withdrawn
    clock[0] += 0.5
    v.verify(old)  # not looked at yet (at most once a KEY_POLL_SECONDS)
    clock[0] += 1.0
    assert refused(v, old).reason == "token_invalid"
    assert v.verify(second.mint(claims("t", "agent"))).subject == "t"
    assert v.key_generation == 1


def test_a_key_file_overwritten_in_place_with_the_same_size_and_time_is_picked_up(tmp_path):
    """Review 23: `cp -p`, or a build with fixed file times, replaces a key file's bytes but keeps
    its inode, size and mtime: a withdrawn key went on verifying tokens until a reload."""
    import os

    first = new_signer("EdDSA")
    second = new_signer("EdDSA", kid=first.kid)
    path = write_jwks(tmp_path / "jwks.json", first)
    before = path.stat()
    clock = [0.0]
    v = verifier(path, verifier_args={"monotonic": lambda: clock[0]})
    old = first.mint(claims("t", "agent"))
    v.verify(old)
    text = write_jwks(tmp_path / "other.json", second).read_bytes()
    if len(text) != before.st_size:  # (the same size: pad the JSON with spaces, or cut the padding)
        text = text.rstrip() + b" " * (before.st_size - len(text.rstrip()))
    assert len(text) == before.st_size
    with open(path, "r+b") as file:  # in place: the same inode
        file.write(text)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_ino, path.stat().st_size, path.stat().st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns)
    clock[0] += 1.5
    assert refused(v, old).reason == "token_invalid"


def test_a_broken_key_file_fails_closed_until_fixed(tmp_path):
    signer = new_signer("EdDSA")
    path = write_jwks(tmp_path / "jwks.json", signer)
    clock = [0.0]
    v = verifier(path, verifier_args={"monotonic": lambda: clock[0]})
    token = signer.mint(claims("t", "agent"))
    v.verify(token)
    path.write_text("{not json")
    clock[0] += 2
    assert "key files" in refused(v, token).message and "jwks.json" in v.key_error
    write_jwks(path, signer)
    clock[0] += 2
    assert v.verify(token).subject == "t" and v.key_error is None


def test_fingerprints_are_short_and_stable():
    assert fingerprint("abc") == fingerprint("abc") and len(fingerprint("abc")) == 12


# --- key files, as the loader reads them ---------------------------------------------------------


def test_pem_public_keys_are_accepted_and_private_ones_refused(tmp_path):
    signer = new_signer("ES256")
    (tmp_path / "k.pem").write_bytes(signer.pem())
    assert load_keys([tmp_path / "k.pem"], jwks=False)[0].algorithms == frozenset({"ES256"})
    from cryptography.hazmat.primitives import serialization
    (tmp_path / "priv.pem").write_bytes(signer.private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    with pytest.raises(ValueError, match="not a PEM public key"):
        load_keys([tmp_path / "priv.pem"], jwks=False)


@pytest.mark.parametrize("entry, why", [
    ({"kty": "oct", "k": "c2VjcmV0"}, "symmetric"),
    ({"kty": "OKP", "crv": "Ed25519", "x": "AAAA", "d": "AAAA"}, "private"),
    ({"kty": "RSA", "alg": "HS256", "n": "AQAB", "e": "AQAB"}, "not supported"),
])
def test_jwks_with_symmetric_or_private_keys_are_refused(tmp_path, entry, why):
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": [entry]}))
    with pytest.raises(ValueError, match=why):
        load_keys([path], jwks=True)


def _policy(tmp_path: Path, *lines: str, keys: str = "jwks.json"):
    write_jwks(tmp_path / "jwks.json", *SIGNERS.values())
    body = "\n".join(f"    {line}" for line in lines)
    text = textwrap.dedent("""\
        version: 1
        rules: [{id: a, hosts: [a.test]}]
        sandboxes: [{id: agent, rules: [a]}]
        identity:
          tokens:
            keys: %s
            audience: egress-gateway
        """) % keys + body + "\n"
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return compile_policy(text, str(path))


def test_the_loader_reads_keys_relative_to_the_policy_file(tmp_path):
    policy = _policy(tmp_path)
    assert policy.tokens.key_files == (tmp_path / "jwks.json",) and len(policy.tokens.keys) == 3
    assert policy.tokens.algorithms == ("EdDSA", "ES256", "ES384", "ES512", "RS256", "RS384", "RS512",
                                        "PS256", "PS384", "PS512")


@pytest.mark.parametrize("lines, where", [
    (["algorithms: [HS256]"], "identity.tokens.algorithms[0]"),
    (["algorithms: [none]"], "identity.tokens.algorithms[0]"),
    (["default_profile: admin"], "identity.tokens.default_profile"),
    (["required: maybe"], "identity.tokens.required"),
    (["algorithms: [ES384]"], "identity.tokens.keys"),  # no key of that type
])
def test_the_loader_refuses_unsafe_or_inconsistent_settings(tmp_path, lines, where):
    with pytest.raises(PolicyError) as info:
        _policy(tmp_path, *lines)
    assert any(issue.path == where for issue in info.value.issues), str(info.value)


def test_a_missing_key_file_does_not_load(tmp_path):
    with pytest.raises(PolicyError, match="cannot read key file"):
        _policy(tmp_path, keys="nowhere.json")


def _shared_verifier() -> TokenVerifier:
    import tempfile
    directory = Path(tempfile.mkdtemp(prefix="tokens-"))
    return verifier(write_jwks(directory / "jwks.json", *SIGNERS.values()))


_SHARED_VERIFIER = _shared_verifier()
