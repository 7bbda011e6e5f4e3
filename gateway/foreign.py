"""A bound rule carries only the platform's credential: requests with another one are refused.

Leak class: exfiltration through an allowed API with the attacker's own key. A rule that injects
the platform's key for api.example.com lets the sandbox talk to that API; if the sandbox may also
send *its own* key there, it can upload whatever it likes into an account the attacker reads later
(files, fine-tuning data, a chat history), and the gateway would have approved every byte. So a
request on a rule bound to a secret is refused (403 `foreign_credential`) when it carries a
credential in one of a set of auth headers or query parameters, other than:

- what the rule injects: those headers and parameters are replaced whole (`inject` pops every
  spelling of the header; a query parameter whose decoded name is the injected one is replaced);
- a placeholder the gateway swaps (gateway/placeholders.py): the value is then the platform's own
  (`Bearer <placeholder>`, `<placeholder>`, or `?api_key=<placeholder>` where the rule lets the
  placeholder be swapped there);
- an empty value (no credential at all).

The set is configurable (`foreign_credentials` at the top of the policy, and per rule); the default
is `DEFAULT_HEADERS` and `DEFAULT_QUERY`. Names are compared loosely, because upstreams do: header
names case-insensitively with `_` as `-` (CGI, WSGI and PHP turn both into `HTTP_X_API_KEY`), query
names after percent-decoding, case-folded, without a trailing `[...]` (PHP and Rack arrays) and with
`.`, `-` and space as `_` (PHP's `$_GET`). A look-alike of a name the rule injects (`X_Api_Key`
when the rule injects `X-Api-Key`, `API_KEY` or `api_key[]` when it injects `api_key`) is never
replaced by the injection, so it always counts as foreign, whatever the configured set says. Query
pairs are split at `;` as well as `&` here (some servers do): looser splitting can only refuse more.

`Cookie` is not in the default set: APIs and their load balancers set cookies (session affinity,
bot management) that an SDK's cookie jar sends back on the next request, and refusing them would
break ordinary clients. A rule for an API that authenticates by cookie should list `Cookie`.

Not covered, by design: credentials in request bodies (form fields, JSON) and in paths (a token as
a path segment) are not inspected; restrict such APIs by `methods` and `paths`.

Pure: `find` looks at (name, value) pairs and the request target and returns where a foreign
credential is (`header X-Api-Key`, `query parameter key`), never its value; `scrub_target` blanks
the values of such parameters for the audit line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from urllib.parse import unquote_plus

DEFAULT_HEADERS = ("Authorization", "Proxy-Authorization", "X-Api-Key", "Api-Key", "X-Goog-Api-Key")
DEFAULT_QUERY = ("key", "api_key", "access_token")
SCRUBBED = "[REDACTED]"
DECODE_ROUNDS = 4
QUERY_SPLIT = re.compile(r"[&;]")
# "Bearer <placeholder>": one auth-scheme word before the placeholder, from a closed list (the IANA
# HTTP authentication schemes APIs use, and vendors' own), so that the sandbox cannot send its own
# key as a "scheme" next to the platform's. Compared case-insensitively.
AUTH_SCHEMES = frozenset(s.lower() for s in (
    "Basic", "Bearer", "Digest", "DPoP", "OAuth", "Token", "Bot", "Key", "ApiKey", "Api-Key", "SSWS",
    "GenieKey", "DeepL-Auth-Key", "Klaviyo-API-Key", "Zoho-oauthtoken", "Splunk",
))


def header_key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def fully_unquoted(text: str) -> str:
    """Percent and plus escapes decoded again and again (up to DECODE_ROUNDS), as servers that decode
    twice read them: `%2541` is `A` to them."""
    for _ in range(DECODE_ROUNDS):
        decoded = unquote_plus(text, errors="replace")
        if decoded == text:
            break
        text = decoded
    return text


def query_key(name: str) -> str:
    name = fully_unquoted(name).split("\0", 1)[0]  # PHP reads a name up to its first NUL
    name = name.strip().casefold().lstrip("[]")  # qs (Express) and Rack read "[api_key]" as api_key
    head = re.match(r"[^\[\]]*", name).group(0)
    rest = name[len(head):]
    # "api_key[x]" is an array of api_key (and "api_key]" is Rack's api_key); an unclosed
    # "api[key" is PHP's api_key.
    name = f"{head}_{rest[1:]}" if rest.startswith("[") and "]" not in rest else head
    return re.sub(r"[ .\-]", "_", name)


@dataclass(frozen=True)
class ForeignCredentials:
    """Which headers and query parameters count as carrying a credential (names as configured)."""

    headers: tuple[str, ...] = DEFAULT_HEADERS
    query: tuple[str, ...] = DEFAULT_QUERY

    @cached_property
    def header_keys(self) -> frozenset[str]:
        return frozenset(header_key(n) for n in self.headers)

    @cached_property
    def query_keys(self) -> frozenset[str]:
        return frozenset(query_key(n) for n in self.query)

    def describe(self) -> str:
        headers = ", ".join(self.headers) or "none"
        query = ", ".join(self.query) or "none"
        return f"headers [{headers}], query parameters [{query}]"


DEFAULT = ForeignCredentials()


def _platform_value(value: str, tokens: Mapping[str, str]) -> bool:
    """Is a header value nothing but a placeholder the gateway swaps (after one scheme word)?"""
    words = value.split()
    if len(words) == 1:
        return words[0] in tokens
    return len(words) == 2 and words[0].lower() in AUTH_SCHEMES and words[1] in tokens


def find(headers: Sequence[tuple[str, str]], target: str, config: ForeignCredentials,
         tokens: Mapping[str, str] | None = None, placeholder_query: frozenset[str] = frozenset(),
         injected_headers: frozenset[str] = frozenset(), injected_query: frozenset[str] = frozenset(),
         replaced: bool = True) -> str | None:
    """Where the request carries a credential that is not the platform's, or None.

    `injected_headers`: header names the rule injects (lower case); `injected_query`: query
    parameter names it injects (decoded); `replaced`: whether the injection will replace what the
    sandbox sent under those names (not on a would_deny request, which gets no credential: then
    they count like any other credential name); `tokens`: the placeholders the gateway swaps (or,
    with nothing swapped, would swap) on this request; `placeholder_query`: the query parameters
    (as sent) where it swaps them."""
    tokens = tokens if tokens is not None else {}
    header_names = config.header_keys | {header_key(n) for n in injected_headers}
    skipped_headers = injected_headers if replaced else frozenset()
    skipped_query = injected_query if replaced else frozenset()
    for name, value in headers:
        if name.lower() in skipped_headers or header_key(name) not in header_names:
            continue
        if not value.strip(" \t") or _platform_value(value, tokens):
            continue
        return f"header {name[:64]}"
    query_names = config.query_keys | {query_key(n) for n in injected_query}
    query = target.partition("#")[0].partition("?")[2]
    if not query:
        return None
    for pair in query.split("&"):
        name, _, value = pair.partition("=")
        if unquote_plus(name, errors="surrogateescape") in skipped_query:
            continue  # replaced whole by the rule's injection, ';' and all
        for i, piece in enumerate(QUERY_SPLIT.split(pair)):
            piece_name, _, piece_value = piece.partition("=")
            if query_key(piece_name) not in query_names:
                continue
            if not unquote_plus(piece_value, errors="replace").strip():
                continue
            if i == 0 and piece_value == value and value in tokens and name in placeholder_query:
                continue  # a placeholder swapped for the platform's value
            return f"query parameter {piece_name[:64]}"
    return None


def scrub_target(target: str, config: ForeignCredentials, injected_query: frozenset[str] = frozenset()) -> str:
    """The target with the value of every credential-carrying query parameter replaced by
    `[REDACTED]` (for the audit line of a refusal: which parameter, never its value)."""
    before_fragment, hash_mark, fragment = target.partition("#")
    path, question, query = before_fragment.partition("?")
    if not question:
        return target
    names = config.query_keys | {query_key(n) for n in injected_query}
    pieces = []
    for piece in re.split(r"([&;])", query):
        name, equals, value = piece.partition("=")
        if equals and value and query_key(name) in names:
            piece = name + equals + SCRUBBED
        pieces.append(piece)
    return path + "?" + "".join(pieces) + (hash_mark + fragment)
