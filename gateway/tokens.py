"""Signed tokens that name a sandbox (policy `identity: tokens:`): the keys, and the verifier.

A sandbox in explicit mode proves who it is with a JWT its platform minted (or a Kubernetes
projected service-account token), sent as its proxy password. This module turns a token into a
`Proof` (its subject, profile and rule narrowing) or a refusal reason, and nothing else: no header parsing
(gateway/proxyauth.py), no I/O but reading the key files the policy names.

What it trusts, and why:
- Only public keys (JWKS of RSA, EC or OKP keys, or PEM public keys). Symmetric algorithms (HS*) are
  not supported at all: the gateway must never hold what can mint a token, and an HMAC key next to
  public keys is the classic key-confusion hole. A key file holding private material is refused.
- The algorithm is pinned per call: the token's `alg` must be in the policy's list *and* fit the
  key's type (an RSA key verifies RS*/PS* only); `none` is never accepted.
- `aud` must name the gateway's audience; `iss` is checked when the policy names one; `exp` and
  `sub` are required; `nbf`/`iat`/`exp` get a small leeway (capped at MAX_LEEWAY_SECONDS).
- A token is bounded (MAX_TOKEN_BYTES) and must be three base64url segments before any parsing.
- The token never appears in a message or an exception: only `fingerprint` (a short hash prefix).

Verified tokens are cached (an LRU keyed by the token's SHA-256, until the token's `exp`), refused
ones in a separate, smaller LRU so that a flood of garbage cannot evict good tokens. Both are
emptied when the key files change (checked at most every KEY_POLL_SECONDS); a policy reload builds
a new verifier.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.serialization import load_pem_public_key

MAX_TOKEN_BYTES = 8 * 1024  # a Kubernetes projected token is ~1.2 KiB; bounded before any parsing
MAX_LEEWAY_SECONDS = 300.0
DEFAULT_LEEWAY_SECONDS = 30.0
MAX_SUBJECT_LENGTH = 512  # system:serviceaccount:<namespace 63>:<name 253> fits with room
MAX_RULES_CLAIM_ITEMS = 256
MAX_KEYS = 64  # keys in the configured files together
MAX_KEY_FILE_BYTES = 1024 * 1024
KEY_POLL_SECONDS = 1.0  # key files are stat()ed at most this often, on the verify path
CACHE_SIZE = 16384  # verified tokens (a few hundred bytes each)
REFUSED_CACHE_SIZE = 4096
MIN_RSA_BITS = 2048
FINGERPRINT_HEX = 12  # what logs and the audit may carry of a token: a SHA-256 prefix

# alg -> the key types it may be verified with. Nothing symmetric, nothing unsigned.
SUPPORTED_ALGORITHMS: dict[str, tuple[type, ...]] = {
    "EdDSA": (ed25519.Ed25519PublicKey, ed448.Ed448PublicKey),
    "ES256": (ec.EllipticCurvePublicKey,), "ES384": (ec.EllipticCurvePublicKey,),
    "ES512": (ec.EllipticCurvePublicKey,),
    "RS256": (rsa.RSAPublicKey,), "RS384": (rsa.RSAPublicKey,), "RS512": (rsa.RSAPublicKey,),
    "PS256": (rsa.RSAPublicKey,), "PS384": (rsa.RSAPublicKey,), "PS512": (rsa.RSAPublicKey,),
}
_EC_CURVE_ALG = {"secp256r1": "ES256", "secp384r1": "ES384", "secp521r1": "ES512"}
_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\Z")
_SUBJECT_RE = re.compile(r"[\x21-\x7e]+\Z")  # printable ASCII, no space
_REFUSED_HEADERS = ("crit", "b64", "jku", "x5u", "jwk", "x5c")  # extensions or keys the token would choose itself

TOKEN_EXPIRED, TOKEN_INVALID = "token_expired", "token_invalid"


def fingerprint(token: str) -> str:
    """What may be written about a token: a short prefix of its SHA-256, never the token."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()[:FINGERPRINT_HEX]


class TokenRefused(Exception):
    """A token that does not prove an identity; `reason` is token_expired or token_invalid. The
    message says why in the gateway's words (never the token, never a library's message)."""

    def __init__(self, reason: str, message: str, cacheable: bool = False):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.cacheable = cacheable  # the same token is refused the same way until the keys change


class KeyFileError(ValueError):
    """A key file the policy names cannot be used; the message names the file."""


@dataclass(frozen=True)
class PublicKey:
    kid: str | None  # a JWKS key's id (PEM keys have none)
    algorithms: frozenset[str]  # what this key may verify (its type's, or its JWK `alg`)
    key: object  # a cryptography public key
    source: str


@dataclass(frozen=True)
class TokenSettings:
    """`identity: tokens:` as the policy states it (validated by gateway/policy.py)."""

    key_files: tuple[Path, ...]
    jwks: bool  # one JWKS file (True) or PEM public-key files
    algorithms: tuple[str, ...]
    audience: str
    issuer: str | None = None
    leeway: float = DEFAULT_LEEWAY_SECONDS
    profile_claim: tuple[str, ...] = ("egress_profile",)  # dotted path, split where the token's keys allow
    default_profile: str | None = None
    rules_claim: str | None = None
    required: bool = True
    keys: tuple[PublicKey, ...] = ()  # as read when the policy was loaded


def _algorithms_for(key: object) -> frozenset[str]:
    if isinstance(key, rsa.RSAPublicKey):
        return frozenset(a for a in SUPPORTED_ALGORITHMS if a[:2] in ("RS", "PS"))
    if isinstance(key, ec.EllipticCurvePublicKey):
        alg = _EC_CURVE_ALG.get(key.curve.name)
        return frozenset({alg}) if alg else frozenset()
    if isinstance(key, (ed25519.Ed25519PublicKey, ed448.Ed448PublicKey)):
        return frozenset({"EdDSA"})
    return frozenset()


def _checked(key: object, where: str) -> frozenset[str]:
    if isinstance(key, rsa.RSAPublicKey) and key.key_size < MIN_RSA_BITS:
        raise KeyFileError(f"{where}: an RSA key of {key.key_size} bits; at least {MIN_RSA_BITS} are needed")
    algorithms = _algorithms_for(key)
    if not algorithms:
        raise KeyFileError(f"{where}: unsupported key type (use RSA, EC P-256/384/521 or Ed25519/Ed448 public keys)")
    return algorithms


def _read(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"key file {path} is over {MAX_KEY_FILE_BYTES} bytes")
    return data


def _jwks_keys(path: Path) -> list[PublicKey]:
    try:
        document = json.loads(_read(path))
    except (ValueError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"key file {path} is not JSON: {exc}") from None
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise KeyFileError(f"key file {path} is not a JWKS: it needs a non-empty \"keys\" list")
    keys = []
    for i, entry in enumerate(entries):
        where = f"{path} keys[{i}]"
        if not isinstance(entry, dict):
            raise KeyFileError(f"{where}: not an object")
        if entry.get("kty") == "oct" or "k" in entry:
            raise KeyFileError(f"{where}: a symmetric (oct) key; only public keys are accepted")
        if any(private in entry for private in ("d", "p", "q", "dp", "dq", "qi")):
            raise KeyFileError(f"{where}: holds private key material; publish the public key only")
        if entry.get("use", "sig") != "sig":
            continue  # an encryption key published alongside: not for signatures
        alg = entry.get("alg")
        if alg is not None and alg not in SUPPORTED_ALGORITHMS:
            raise KeyFileError(f"{where}: alg {str(alg)[:20]!r} is not supported "
                               f"(supported: {', '.join(SUPPORTED_ALGORITHMS)})")
        kid = entry.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise KeyFileError(f"{where}: kid must be a string")
        try:
            key = jwt.PyJWK(entry, alg).key
        except jwt.PyJWTError as exc:
            raise KeyFileError(f"{where}: not a usable key ({type(exc).__name__})") from None
        algorithms = _checked(key, where)
        if alg is not None:
            if alg not in algorithms:
                raise KeyFileError(f"{where}: alg {alg} does not fit the key's type")
            algorithms = frozenset({alg})
        keys.append(PublicKey(kid, algorithms, key, str(path)))
    return keys


def _pem_key(path: Path) -> PublicKey:
    try:
        key = load_pem_public_key(_read(path))
    except (ValueError, TypeError):
        raise KeyFileError(f"key file {path} is not a PEM public key (a private key, or a certificate, is not "
                           "accepted)") from None
    return PublicKey(None, _checked(key, str(path)), key, str(path))


def load_keys(paths: Sequence[Path], jwks: bool) -> tuple[PublicKey, ...]:
    """Every signature key the files hold; KeyFileError when one cannot be used."""
    keys: list[PublicKey] = []
    for path in paths:
        keys.extend(_jwks_keys(path) if jwks else [_pem_key(path)])
    if not keys:
        raise KeyFileError(f"no signature key in {', '.join(map(str, paths))}")
    if len(keys) > MAX_KEYS:
        raise KeyFileError(f"{len(keys)} keys; at most {MAX_KEYS}")
    return tuple(keys)


def claim_at(claims: Mapping, path: Sequence[str]) -> object:
    """The value at a dotted claim path whose keys may themselves hold dots (Kubernetes'
    `kubernetes.io`): at each level the longest run of segments that is a key wins."""
    value: object = claims
    i = 0
    while i < len(path):
        if not isinstance(value, Mapping):
            return None
        for j in range(len(path), i, -1):
            key = ".".join(path[i:j])
            if key in value:
                value, i = value[key], j
                break
        else:
            return None
    return value


def parse_duration(value: str | int | float) -> float:
    """`30`, `30s`, `2m`: seconds."""
    if isinstance(value, bool):
        raise ValueError("not a duration")
    if isinstance(value, (int, float)):
        return float(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m)?\s*", str(value))
    if not match:
        raise ValueError("a duration is seconds, or a number with s or m (30s, 2m)")
    number, unit = float(match.group(1)), match.group(2) or "s"
    return number * {"ms": 0.001, "s": 1.0, "m": 60.0}[unit]



@dataclass(frozen=True)
class Proof:
    """What a verified token says: the sandbox (`sub`), the profile, and a narrowing of its rules."""

    subject: str
    profile: str
    rule_ids: frozenset[str] | None  # None: every rule of the profile


@dataclass(frozen=True)
class _Verified:
    proof: Proof
    valid_until: float  # exp + leeway, in time.time() seconds


class TokenVerifier:
    """Tokens to identities under one policy's settings; cached; keys re-read when their files change."""

    def __init__(self, settings: TokenSettings, profiles: frozenset[str],
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic,
                 cache_size: int = CACHE_SIZE, refused_cache_size: int = REFUSED_CACHE_SIZE):
        self.settings = settings
        self.profiles = profiles
        self._clock = clock
        self._monotonic = monotonic
        self._keys = settings.keys or load_keys(settings.key_files, settings.jwks)
        self._key_files = self._stat_all()
        self._next_poll = monotonic() + KEY_POLL_SECONDS
        self._cache: OrderedDict[bytes, _Verified] = OrderedDict()
        self._refused: OrderedDict[bytes, tuple[str, str]] = OrderedDict()
        self._cache_size = cache_size
        self._refused_size = refused_cache_size
        self.key_error: str | None = None  # the key files' problem since their last change (None: fine)
        self.key_generation = 0  # bumped on every change of the key files (a test can wait for it)
        self.verifications = 0  # signatures checked (cache misses): for the benchmark and tests

    # --- key files -----------------------------------------------------------------------------

    def _stat_all(self) -> tuple:
        """What says a key file changed: its identity, size, time and a digest of its bytes (review
        23: a file overwritten in place with the same size and time, as `cp -p` does, kept a
        withdrawn key verifying tokens). Key files are small, read at most every KEY_POLL_SECONDS."""
        out = []
        for path in self.settings.key_files:
            try:
                st = os.stat(path)
                with open(path, "rb") as file:
                    digest = hashlib.sha256(file.read(MAX_KEY_FILE_BYTES + 1)).digest()
                out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, digest))
            except OSError:
                out.append(None)
        return tuple(out)

    def refresh_keys(self, force: bool = False) -> bool:
        """Re-read the key files if they changed (at most every KEY_POLL_SECONDS unless `force`).
        A file that cannot be used now leaves NO key (fail closed: every token is refused until it
        is fixed) and says why in `key_error`. True when the key set changed."""
        now = self._monotonic()
        if not force and now < self._next_poll:
            return False
        self._next_poll = now + KEY_POLL_SECONDS
        seen = self._stat_all()
        if seen == self._key_files and not force:
            return False
        self._key_files = seen
        try:
            self._keys = load_keys(self.settings.key_files, self.settings.jwks)
            self.key_error = None
        except KeyFileError as exc:
            self._keys = ()
            self.key_error = str(exc)
        self._cache.clear()
        self._refused.clear()
        self.key_generation += 1
        return True

    # --- verifying -----------------------------------------------------------------------------

    def verify(self, token: str) -> Proof:
        """What `token` proves, or TokenRefused."""
        self.refresh_keys()
        if len(token) > MAX_TOKEN_BYTES:
            raise TokenRefused(TOKEN_INVALID, f"the token is over {MAX_TOKEN_BYTES} bytes")
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        hit = self._cache.get(digest)
        if hit is not None:
            if self._clock() < hit.valid_until:
                self._cache.move_to_end(digest)
                return hit.proof
            del self._cache[digest]
        refused = self._refused.get(digest)
        if refused is not None:
            self._refused.move_to_end(digest)
            raise TokenRefused(*refused, cacheable=True)
        try:
            verified = self._verify(token)
        except TokenRefused as refusal:
            if refusal.cacheable:
                self._refused[digest] = (refusal.reason, refusal.message)
                if len(self._refused) > self._refused_size:
                    self._refused.popitem(last=False)
            raise
        self._cache[digest] = verified
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return verified.proof

    def _verify(self, token: str) -> _Verified:
        self.verifications += 1
        s = self.settings
        if not _TOKEN_RE.match(token):
            raise _refused(TOKEN_INVALID, "the token is not a compact JWS (three base64url segments)")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise _refused(TOKEN_INVALID, "the token's header is not valid base64url JSON") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in s.algorithms:
            shown = alg[:16] if isinstance(alg, str) else type(alg).__name__
            raise _refused(TOKEN_INVALID, f"algorithm {shown!r} is not allowed (allowed: {', '.join(s.algorithms)})")
        if refused := [h for h in _REFUSED_HEADERS if h in header]:
            raise _refused(TOKEN_INVALID, f"the token's header has {refused[0]!r}, which the gateway does not accept")
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise _refused(TOKEN_INVALID, "the token's kid is not a string")
        if not self._keys:
            raise TokenRefused(TOKEN_INVALID, "no usable signature key (the key files are broken: see the log)")
        candidates = [k for k in self._keys if alg in k.algorithms and (kid is None or k.kid is None or k.kid == kid)]
        if not candidates:
            raise _refused(TOKEN_INVALID, "no key fits the token (unknown kid, or no key of the algorithm's type)")
        options = {"require": ["exp", "sub", "aud"], "verify_sub": False, "verify_jti": False}
        for i, key in enumerate(candidates):
            try:
                claims = jwt.decode(token, key=key.key, algorithms=[alg], audience=s.audience, issuer=s.issuer,
                                    leeway=s.leeway, options=options)
                break
            except jwt.InvalidSignatureError:
                if i == len(candidates) - 1:
                    raise _refused(TOKEN_INVALID, "bad signature") from None
            except jwt.ExpiredSignatureError:
                raise _refused(TOKEN_EXPIRED, "the token has expired") from None
            except jwt.ImmatureSignatureError:
                raise TokenRefused(TOKEN_INVALID, "the token is not valid yet (nbf or iat in the future)") from None
            except jwt.InvalidAudienceError:
                raise _refused(TOKEN_INVALID, "the token is not for this audience") from None
            except jwt.InvalidIssuerError:
                raise _refused(TOKEN_INVALID, "the token is from another issuer") from None
            except jwt.MissingRequiredClaimError as exc:
                raise _refused(TOKEN_INVALID, f"the token has no {exc.claim!r} claim") from None
            except jwt.PyJWTError as exc:
                raise _refused(TOKEN_INVALID, f"the token is malformed ({type(exc).__name__})") from None
        return _Verified(self._proof(claims), self._expiry(claims))

    def _expiry(self, claims: Mapping) -> float:
        exp = claims.get("exp")
        if isinstance(exp, bool) or not isinstance(exp, (int, float)):
            raise _refused(TOKEN_INVALID, "the token's exp is not a number")
        return float(exp) + self.settings.leeway

    def _proof(self, claims: Mapping) -> Proof:
        s = self.settings
        subject = claims.get("sub")
        if not isinstance(subject, str) or not _SUBJECT_RE.match(subject) or len(subject) > MAX_SUBJECT_LENGTH:
            raise _refused(TOKEN_INVALID, f"the token's sub must be 1 to {MAX_SUBJECT_LENGTH} printable ASCII "
                                          "characters without spaces")
        profile = claim_at(claims, s.profile_claim)
        if profile is None:
            if s.default_profile is None:
                raise _refused(TOKEN_INVALID, f"the token has no {'.'.join(s.profile_claim)!r} claim and the "
                                              "policy sets no default_profile")
            profile = s.default_profile
        if not isinstance(profile, str) or profile not in self.profiles:
            shown = profile[:64] if isinstance(profile, str) else type(profile).__name__
            raise _refused(TOKEN_INVALID, f"the token names profile {shown!r}, which the policy's sandboxes "
                                          "do not have")
        rule_ids = None
        if s.rules_claim is not None and s.rules_claim in claims:
            value = claims[s.rules_claim]
            if (not isinstance(value, list) or len(value) > MAX_RULES_CLAIM_ITEMS
                    or not all(isinstance(r, str) for r in value)):
                raise _refused(TOKEN_INVALID, f"the token's {s.rules_claim!r} claim must be a list of at most "
                                              f"{MAX_RULES_CLAIM_ITEMS} rule ids")
            rule_ids = frozenset(value)  # narrows only: identity.scope_of intersects it with the profile's
        return Proof(subject, profile, rule_ids)


def _refused(reason: str, message: str) -> TokenRefused:
    """A refusal that will be the same next time (until the keys change): cached."""
    return TokenRefused(reason, message, cacheable=True)
