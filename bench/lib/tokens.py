"""Signing keys and tokens for the proxy-token tests and benchmark (policy `identity: tokens:`):
what a platform's issuer, or a Kubernetes API server, would hold. Made at run time; nothing here
is a fixture on disk."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa


@dataclass
class Signer:
    alg: str
    kid: str | None
    private: object

    @property
    def public(self):
        return self.private.public_key()

    def jwk(self) -> dict:
        """The public key as a JWK (with kid and alg)."""
        algorithm = jwt.get_algorithm_by_name(self.alg)
        data = json.loads(algorithm.to_jwk(self.public))
        if self.kid is not None:
            data["kid"] = self.kid
        data["alg"] = self.alg
        data["use"] = "sig"
        return data

    def pem(self) -> bytes:
        return self.public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)

    def mint(self, claims: dict, headers: dict | None = None, alg: str | None = None) -> str:
        extra = dict(headers or {})
        if self.kid is not None:
            extra.setdefault("kid", self.kid)
        return jwt.encode(claims, self.private, algorithm=alg or self.alg, headers=extra)


def new_signer(alg: str = "EdDSA", kid: str | None = "auto") -> Signer:
    if alg == "EdDSA":
        key = ed25519.Ed25519PrivateKey.generate()
    elif alg.startswith("ES"):
        key = ec.generate_private_key({"ES256": ec.SECP256R1(), "ES384": ec.SECP384R1(),
                                       "ES512": ec.SECP521R1()}[alg])
    else:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return Signer(alg, uuid.uuid4().hex[:16] if kid == "auto" else kid, key)


def jwks(*signers: Signer) -> dict:
    return {"keys": [s.jwk() for s in signers]}


def write_jwks(path: Path, *signers: Signer) -> Path:
    """Written whole and renamed into place, as a ConfigMap update is seen: never half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(jwks(*signers)))
    tmp.replace(path)
    return path


def claims(sub: str, profile: str | None, audience: str = "egress-gateway", ttl: float = 600,
           now: float | None = None, **more) -> dict:
    now = time.time() if now is None else now
    out = {"sub": sub, "aud": audience, "iat": int(now), "nbf": int(now), "exp": int(now + ttl)}
    if profile is not None:
        out["egress_profile"] = profile
    return out | more


def kubernetes_claims(namespace: str, serviceaccount: str, pod: str = "agent-7c9f", audience: str = "egress-gateway",
                      issuer: str = "https://kubernetes.default.svc.cluster.local", ttl: float = 3607,
                      now: float | None = None) -> dict:
    """A projected service-account token's claims, as kube-apiserver writes them (audience list,
    the nested `kubernetes.io` claim)."""
    now = int(time.time() if now is None else now)
    return {
        "aud": [audience],
        "exp": now + int(ttl),
        "iat": now,
        "iss": issuer,
        "jti": str(uuid.uuid4()),
        "kubernetes.io": {
            "namespace": namespace,
            "node": {"name": "node-1", "uid": str(uuid.uuid4())},
            "pod": {"name": pod, "uid": str(uuid.uuid4())},
            "serviceaccount": {"name": serviceaccount, "uid": str(uuid.uuid4())},
        },
        "nbf": now,
        "sub": f"system:serviceaccount:{namespace}:{serviceaccount}",
    }
