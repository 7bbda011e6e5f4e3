"""Policy file, version 1: the security team's interface.

`load_policy(path)` parses and validates a YAML file and compiles it into a `Policy`: rule globs
become regexes and host patterns go into a `HostIndex`, so nothing per request depends on the
number of rules. Every problem is reported with file:line:column and the key path, all at once.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .addresses import RangeTable, default_deny_table, parse_network
from .credentials import (
    FORBIDDEN_INJECT_HEADERS,
    HEADER_NAME_RE,
    SECRET_NAME_RE,
    Injection,
    SecretSource,
    Template,
    TemplateError,
)
from .foreign import DEFAULT as DEFAULT_FOREIGN, ForeignCredentials, header_key, query_key
from .grants import DEFAULT_GRANT_PORTS, DEFAULT_GRANT_SCHEMES, DEFAULT_MAX_TTL, Grantable
from .grants import parse_duration as parse_ttl
from .hostnames import HostError, IPAddress, canonical_host
from .globs import PathGlob
from .matcher import HostIndex, HostPattern
from .paths import compile_glob
from .placeholders import NO_POSITIONS, Positions
from .ratelimit import parse_size
from .refusal_page import DEFAULT_STYLE, FORMATS, MessageTemplate, MessageTemplateError, RefusalStyle
from .tokens import (
    DEFAULT_LEEWAY_SECONDS,
    MAX_LEEWAY_SECONDS,
    SUPPORTED_ALGORITHMS,
    KeyFileError,
    TokenSettings,
    load_keys,
    parse_duration,
)
from .yamlsource import ConfigIssue, Location, Node, PolicyError, Validator, parse_checked, value_kind

SCHEMES = ("http", "https")
DEFAULT_PORTS = {"https": 443, "http": 80}
STANDARD_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})
FORBIDDEN_METHODS = frozenset({"TRACE", "TRACK", "CONNECT"})
_METHOD_RE = re.compile(r"^[A-Z][A-Z0-9_-]{0,31}\Z")
_RULE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")
_QUERY_NAME_RE = re.compile(r"^[!-\"$%'-<>@-~]{1,64}\Z")  # printable ASCII but '#', '&', '=', '?'


TOP_KEYS = {"version", "network", "resolver", "rules", "sandboxes", "secrets", "mode", "foreign_credentials",
            "refusals", "identity"}
REFUSALS_KEYS = {"message", "format"}
IDENTITY_KEYS = {"tokens"}
TOKEN_KEYS = {"keys", "algorithms", "audience", "issuer", "leeway", "profile_claim", "default_profile", "rules_claim",
              "required"}
_CLAIM_NAME_RE = re.compile(r"^[!-~]{1,128}\Z")
NETWORK_KEYS = {"deny_ip_ranges", "allow_ip_ranges", "strict_original_destination"}
RESOLVER_KEYS = {"static_hosts"}
RULE_KEYS = {
    "id", "hosts", "ports", "schemes", "methods", "paths", "protocol", "mode",
    "inject", "allow_wildcard_credentials", "allow_plaintext_credentials", "inspect",
    "foreign_credentials", "placeholders", "allow_body", "limits",
}
FOREIGN_KEYS = {"headers", "query"}
PLACEHOLDER_KEYS = {"query", "path"}
INJECT_KEYS = {"header", "query", "value"}
SECRET_SOURCE_KEYS = {"env", "file"}
MODES = ("enforce", "report")
SANDBOX_KEYS = {"id", "source_ips", "rules", "limits", "grantable"}
GRANTABLE_KEYS = {"rules", "hosts", "ports", "schemes", "methods", "max_ttl"}
PROTOCOLS = ("http", "tcp")
HTTP_ONLY_RULE_KEYS = ("schemes", "methods", "paths", "allow_body", "limits")
# `limits:` keys -> (window in seconds, unit): request counts per minute, body bytes per hour.
LIMIT_KEYS: dict[str, tuple[float, str]] = {
    "requests_per_minute": (60.0, "requests"),
    "upload_bytes_per_hour": (3600.0, "bytes"),
    "download_bytes_per_hour": (3600.0, "bytes"),
    "requests_per_credential_per_minute": (60.0, "requests"),
}
DEFAULT_SANDBOX_ID = "default"
DEFAULT_POLICY_NAME = "default.yaml"


@dataclass(frozen=True)
class Limits:
    """A `limits:` mapping (a sandbox's or a rule's): None for a key not set. Enforced by
    addons/rate_limits.py over sliding windows (gateway/ratelimit.py)."""

    requests_per_minute: int | None = None
    upload_bytes_per_hour: int | None = None
    download_bytes_per_hour: int | None = None
    requests_per_credential_per_minute: int | None = None

    def items(self) -> list[tuple[str, int]]:
        """The keys set, in LIMIT_KEYS order."""
        return [(k, getattr(self, k)) for k in LIMIT_KEYS if getattr(self, k) is not None]

    def __bool__(self) -> bool:
        return bool(self.items())


NO_LIMITS = Limits()


@dataclass(frozen=True)
class Rule:
    id: str
    index: int
    hosts: tuple[HostPattern, ...]
    schemes: frozenset[str]
    ports: frozenset[int] | None  # None: the scheme's default port
    methods: frozenset[str] | None  # None: any standard method
    path_globs: tuple[str, ...] | None  # None: any path
    path_patterns: tuple[PathGlob, ...] | None  # linear-time matchers (gateway/globs.py)
    location: Location
    protocol: str = "http"  # http: HTTP(S) requests; tcp: raw TCP (transparent mode)
    injections: tuple[Injection, ...] = ()
    mode: str | None = None  # enforce | report | None (the policy's mode)
    allow_wildcard_credentials: bool = False
    allow_plaintext_credentials: bool = False
    # False: TLS passthrough. The ClientHello's SNI is checked and the destination pinned, then the
    # TLS bytes are relayed unread (no Host, method, path or credential checks are possible).
    inspect: bool = True
    # A bound rule refuses requests carrying any other credential in these (gateway/foreign.py).
    foreign_credentials: ForeignCredentials = DEFAULT_FOREIGN
    # Where placeholders are swapped besides header values (gateway/placeholders.py).
    placeholders: Positions = NO_POSITIONS
    # True: GET, HEAD, OPTIONS and DELETE requests may carry a body (gateway/bodies.py: off by
    # default, since an origin that ignores it reads it as the next request on the connection).
    allow_body: bool = False
    limits: Limits = NO_LIMITS  # per sandbox using the rule (credentials: per secret, every sandbox together)

    @property
    def secrets(self) -> tuple[str, ...]:
        """Secrets this rule is bound to (referenced by its inject templates), in order."""
        return tuple(dict.fromkeys(name for i in self.injections for name in i.template.secrets))

    def allows_port(self, port: int, scheme: str | None = None) -> bool:
        """With no scheme (a CONNECT, before the tunnel shows TLS or not): any of the rule's schemes."""
        schemes = self.schemes if scheme is None else self.schemes & {scheme}
        if self.ports is not None:
            return bool(schemes) and port in self.ports
        return any(DEFAULT_PORTS[s] == port for s in schemes)

    def allows_method(self, method: str) -> bool:
        if method in FORBIDDEN_METHODS:
            return False
        return method in (STANDARD_METHODS if self.methods is None else self.methods)

    def allows_path(self, normalised_path: str) -> bool:
        if self.path_patterns is None:
            return True
        return any(p.match(normalised_path) for p in self.path_patterns)


@dataclass(frozen=True)
class Sandbox:
    id: str
    rule_ids: frozenset[str]
    location: Location
    limits: Limits = NO_LIMITS  # over every request of the sandbox, whatever its rule
    # What the control API may grant to a registered sandbox of this profile (gateway/grants.py).
    grantable: Grantable | None = None


@dataclass(frozen=True)
class Scope:
    """Which rules a client may use: all of them (no `sandboxes` section) or one sandbox's."""

    sandbox: str | None  # the id the audit line names (a static entry's id, a token's or registration's)
    rule_ids: frozenset[str] | None  # None: every rule
    profile: str | None = None  # the `sandboxes:` entry whose limits apply (None: no entry)
    # A registered sandbox's active grants (gateway/grants.py GrantRules): rules of the policy it
    # adds (already in `rule_ids`) and transient rules the engine also looks up. Not compared.
    granted: object | None = field(default=None, compare=False)

    def grants(self, rule: Rule) -> bool:
        return self.rule_ids is None or rule.id in self.rule_ids


EVERY_RULE = Scope(None, None)
NO_RULE = Scope(None, frozenset())


@dataclass
class Policy:
    rules: tuple[Rule, ...]
    index: HostIndex
    deny_ranges: RangeTable
    allow_ranges: RangeTable
    static_hosts: dict[str, tuple[IPAddress, ...]]
    source: str
    sha256: str
    version: int = 1
    sandboxes: tuple[Sandbox, ...] | None = None  # None: no `sandboxes` section
    sandbox_sources: RangeTable = field(default_factory=RangeTable)
    strict_original_destination: bool = False
    secrets: dict[str, SecretSource] = field(default_factory=dict)
    mode: str = "enforce"
    rules_by_id: dict[str, Rule] = field(default_factory=dict)
    foreign_credentials: ForeignCredentials = DEFAULT_FOREIGN  # the default of every bound rule
    refusals: RefusalStyle = DEFAULT_STYLE  # how refusal bodies are worded (gateway/refusal_page.py)
    tokens: TokenSettings | None = None  # `identity: tokens:` (explicit-mode proxy authentication)

    def __post_init__(self) -> None:
        self.rules_by_id = {r.id: r for r in self.rules}
        self._scopes = {s.id: Scope(s.id, s.rule_ids, s.id) for s in self.sandboxes or ()}
        self.sandboxes_by_id = {s.id: s for s in self.sandboxes or ()}

    def sandbox_limits(self, sandbox_id: str | None) -> Limits:
        sandbox = self.sandboxes_by_id.get(sandbox_id or "") if sandbox_id is not None else None
        return sandbox.limits if sandbox is not None else NO_LIMITS

    def scope_for(self, client: IPAddress | None = None, sandbox_id: str | None = None) -> Scope:
        """The rules a client may use, by sandbox id or by source address (most specific range wins);
        a client no entry names gets the `default` sandbox if there is one, else no rule at all."""
        if self.sandboxes is None:
            return EVERY_RULE
        if sandbox_id is None and client is not None:
            if client.version == 6 and client.ipv4_mapped is not None:
                client = client.ipv4_mapped
            hit = self.sandbox_sources.lookup(client, longest=True)
            sandbox_id = hit[1] if hit else None
        if sandbox_id in self._scopes:
            return self._scopes[sandbox_id]
        return self._scopes.get(DEFAULT_SANDBOX_ID, NO_RULE)


def _host_pattern(v: Validator, node: Node, path: str) -> HostPattern | None:
    raw = v.string(node, path)
    if raw is None:
        return None
    text = raw.strip()
    if text in ("*", "*.", "*.*"):
        v.error(node, path, f"{raw!r}: a wildcard needs a domain (\"*.example.com\")")
        return None
    if text.startswith("*."):
        rest = text[2:]
        if "*" in rest:
            v.error(node, path, f"{raw!r}: only one leading \"*.\" is allowed")
            return None
        try:
            domain = canonical_host(rest)
        except HostError as exc:
            v.error(node, path, f"{raw!r}: {exc}")
            return None
        if domain.is_ip:
            v.error(node, path, f"{raw!r}: a wildcard cannot cover an IP address")
            return None
        return HostPattern.wildcard(domain.value)
    if "*" in text:
        v.error(node, path, f"{raw!r}: \"*\" is only allowed as a leading \"*.\" label")
        return None
    if "/" in text:
        try:
            return HostPattern.cidr(parse_network(text))
        except ValueError as exc:
            v.error(node, path, f"{raw!r}: not a valid CIDR: {exc}")
            return None
    try:
        host = canonical_host(text)
    except HostError as exc:
        v.error(node, path, f"{raw!r}: {exc}")
        return None
    return HostPattern.exact(host)


def _ranges(v: Validator, node: Node, path: str) -> list[tuple[object, str]]:
    items = v.sequence(node, path) or []
    out = []
    for i, item in enumerate(items):
        p = f"{path}[{i}]"
        text = v.string(item, p)
        if text is None:
            continue
        try:
            out.append((parse_network(text), f"{path} entry {text}"))
        except ValueError as exc:
            v.error(item, p, f"{text!r} is not a valid CIDR: {exc}")
    return out


def _mode(v: Validator, node: Node | None, path: str) -> str | None:
    if node is None:
        return None
    value = v.string(node, path)
    if value is not None and value not in MODES:
        v.error(node, path, f"{value!r}: mode must be one of {', '.join(MODES)}")
        return None
    return value


def _injections(v: Validator, node: Node, path: str, secret_names: set[str]) -> tuple[Injection, ...]:
    found: list[Injection] = []
    seen: set[tuple[str, str]] = set()
    for i, item in enumerate(v.sequence(node, path, non_empty=True) or []):
        p = f"{path}[{i}]"
        fields = v.mapping(item, p, INJECT_KEYS)
        if fields is None:
            continue
        targets = [k for k in ("header", "query") if k in fields]
        if len(targets) != 1:
            v.error(item, p, "needs exactly one of 'header' or 'query'")
            continue
        target = targets[0]
        name = v.string(fields[target], f"{p}.{target}")
        if "value" not in fields:
            v.error(item, p, "missing required key 'value'")
            continue
        raw = v.string(fields["value"], f"{p}.value")
        if name is None or raw is None:
            continue
        if target == "header" and not HEADER_NAME_RE.match(name):
            v.error(fields[target], f"{p}.header", f"{name!r} is not a valid header name")
            continue
        if target == "header" and name.lower() in FORBIDDEN_INJECT_HEADERS:
            v.error(fields[target], f"{p}.header", f"{name!r} cannot be injected (it changes framing or routing)")
            continue
        key = (target, name.lower())
        if key in seen:
            v.error(fields[target], f"{p}.{target}", f"{name!r} is injected twice")
            continue
        seen.add(key)
        try:
            template = Template.parse(raw)
        except TemplateError as exc:
            v.error(fields["value"], f"{p}.value", str(exc))
            continue
        if not template.secrets:
            v.error(fields["value"], f"{p}.value", "references no secret (use ${secrets.NAME})")
            continue
        missing = [s for s in template.secrets if s not in secret_names]
        if missing:
            v.error(fields["value"], f"{p}.value", f"unknown secret {missing[0]!r} (declare it under secrets:)")
            continue
        found.append(Injection(target, name, template))
    return tuple(found)


def _secrets(v: Validator, node: Node) -> dict[str, SecretSource]:
    found: dict[str, SecretSource] = {}
    if not isinstance(node.value, dict):
        v.error(node, "secrets", f"must be a mapping of name to {{env: VAR}} or {{file: PATH}}, not {value_kind(node.value)}")
        return found
    for name, item in node.value.items():
        p = f"secrets.{name}"
        if not SECRET_NAME_RE.match(name):
            v.error(node.key_locations[name], p, f"{name!r}: secret names are letters, digits and '_'")
            continue
        fields = v.mapping(item, p, SECRET_SOURCE_KEYS)
        if fields is None:
            continue
        if len(fields) != 1:
            v.error(item, p, "needs exactly one of 'env' or 'file'")
            continue
        kind, value_node = next(iter(fields.items()))
        value = v.string(value_node, f"{p}.{kind}")
        if value is None:
            continue
        if kind == "file" and not value.startswith("/"):
            v.error(value_node, f"{p}.file", "must be an absolute path")
            continue
        found[name] = SecretSource(name, env=value if kind == "env" else None, file=value if kind == "file" else None)
    return found



# The lists a rule and a profile's `grantable:` share, read one way for both (each error names the
# item's file, line, column and key path).


def _host_patterns(v: Validator, node: Node, path: str, non_empty: bool = False) -> list[HostPattern]:
    found = []
    for i, item in enumerate(v.sequence(node, path, non_empty=non_empty) or []):
        pattern = _host_pattern(v, item, f"{path}[{i}]")
        if pattern is not None:
            found.append(pattern)
    return found


def _ports(v: Validator, node: Node, path: str) -> frozenset[int]:
    found = set()
    for i, item in enumerate(v.sequence(node, path, non_empty=True) or []):
        if isinstance(item.value, bool) or not isinstance(item.value, int) or not 1 <= item.value <= 65535:
            v.error(item, f"{path}[{i}]", f"{item.value!r}: a port is a number from 1 to 65535")
        else:
            found.add(item.value)
    return frozenset(found)


def _schemes(v: Validator, node: Node, path: str) -> frozenset[str]:
    """Lower-cased: `HTTPS` is `https`, as URLs have it."""
    found = set()
    for i, item in enumerate(v.sequence(node, path, non_empty=True) or []):
        s = v.string(item, f"{path}[{i}]")
        if s is not None and s.lower() not in SCHEMES:
            v.error(item, f"{path}[{i}]", f"{s!r}: scheme must be one of {', '.join(SCHEMES)}")
        elif s is not None:
            found.add(s.lower())
    return frozenset(found)


def _methods(v: Validator, node: Node, path: str) -> frozenset[str]:
    found = set()
    for i, item in enumerate(v.sequence(node, path, non_empty=True) or []):
        m = v.string(item, f"{path}[{i}]")
        if m is None:
            continue
        if not _METHOD_RE.match(m):
            v.error(item, f"{path}[{i}]", f"{m!r}: methods are upper-case tokens like GET")
        elif m in FORBIDDEN_METHODS:
            v.error(item, f"{path}[{i}]", f"{m!r} is always refused and cannot be allowed")
        else:
            found.add(m)
    return frozenset(found)


def _rule_ids(v: Validator, node: Node, path: str, rule_ids: set[str]) -> set[str]:
    """Ids of rules the policy has (a sandbox's `rules`, a grantable's)."""
    found = set()
    for i, item in enumerate(v.sequence(node, path) or []):
        name = v.string(item, f"{path}[{i}]")
        if name is not None and name not in rule_ids:
            v.error(item, f"{path}[{i}]", f"{name!r}: no rule has this id")
        elif name is not None:
            found.add(name)
    return found


def _entry_id(v: Validator, fields: dict[str, Node], path: str, kind: str, seen: dict[str, Location]) -> str | None:
    """A rule's or a sandbox's `id` (an issue if it is malformed or an earlier entry's; `seen` records it)."""
    entry_id = v.string(fields["id"], f"{path}.id") if "id" in fields else None
    if entry_id is not None:
        if not _RULE_ID_RE.match(entry_id):
            v.error(fields["id"], f"{path}.id", f"{entry_id!r}: use letters, digits, '_', '.', '-' (max 63)")
        elif entry_id in seen:
            v.error(fields["id"], f"{path}.id", f"duplicate {kind} id {entry_id!r} (first at {seen[entry_id]})")
        else:
            seen[entry_id] = fields["id"].location
    return entry_id


def _rule(v: Validator, node: Node, path: str, index: int, seen: dict[str, Location],
          secret_names: set[str] = frozenset(), foreign_default: ForeignCredentials = DEFAULT_FOREIGN) -> Rule | None:
    fields = v.mapping(node, path, RULE_KEYS)
    if fields is None:
        return None
    v.required(node, path, fields, ("id", "hosts"))
    rule_id = _entry_id(v, fields, path, "rule", seen)

    hosts = _host_patterns(v, fields["hosts"], f"{path}.hosts", non_empty=True) if "hosts" in fields else []
    schemes = frozenset({"https"})
    if "schemes" in fields:
        schemes = _schemes(v, fields["schemes"], f"{path}.schemes") or schemes
    ports = _ports(v, fields["ports"], f"{path}.ports") if "ports" in fields else None
    methods = _methods(v, fields["methods"], f"{path}.methods") if "methods" in fields else None

    globs: tuple[str, ...] | None = None
    patterns: tuple[PathGlob, ...] | None = None
    if "paths" in fields:
        items = v.sequence(fields["paths"], f"{path}.paths", non_empty=True) or []
        g_list, p_list = [], []
        for i, item in enumerate(items):
            g = v.string(item, f"{path}.paths[{i}]")
            if g is None:
                continue
            try:
                p_list.append(compile_glob(g))
                g_list.append(g)
            except ValueError as exc:
                v.error(item, f"{path}.paths[{i}]", f"{g!r}: {exc}")
        globs, patterns = tuple(g_list), tuple(p_list)

    protocol = "http"
    if "protocol" in fields:
        value = v.string(fields["protocol"], f"{path}.protocol")
        if value is not None and value not in PROTOCOLS:
            v.error(fields["protocol"], f"{path}.protocol", f"{value!r}: protocol must be one of {', '.join(PROTOCOLS)}")
        elif value is not None:
            protocol = value
    if protocol == "tcp":
        for key in HTTP_ONLY_RULE_KEYS:
            if key in fields:
                v.error(fields[key], f"{path}.{key}", f"a protocol: tcp rule cannot restrict {key}")
        if "ports" not in fields:
            v.error(node, path, "a protocol: tcp rule needs ports")
        for i, pattern in enumerate(hosts):
            if pattern.kind == "wildcard":
                v.error(fields["hosts"], f"{path}.hosts", f"{pattern}: wildcards are not allowed in protocol: tcp rules")
        schemes = frozenset()

    rule_mode = _mode(v, fields.get("mode"), f"{path}.mode")
    flags = {}
    for flag in ("allow_wildcard_credentials", "allow_plaintext_credentials", "allow_body"):
        flags[flag] = False
        if flag in fields:
            if not isinstance(fields[flag].value, bool):
                v.error(fields[flag], f"{path}.{flag}", "must be true or false")
            else:
                flags[flag] = fields[flag].value
    injections = _injections(v, fields["inject"], f"{path}.inject", secret_names) if "inject" in fields else ()
    if injections:
        where = fields["inject"]
        if protocol == "tcp":
            v.error(where, f"{path}.inject", "a protocol: tcp rule cannot inject credentials")
        broad = [str(p) for p in hosts if p.kind != "exact"]
        if broad and not flags["allow_wildcard_credentials"]:
            v.error(where, f"{path}.inject", f"credentials bound to {', '.join(broad)} (not an exact host); "
                    "set allow_wildcard_credentials: true if that is really meant")
        if "http" in schemes and not flags["allow_plaintext_credentials"]:
            v.error(where, f"{path}.inject", "credentials would be sent over plain http; "
                    "set allow_plaintext_credentials: true if that is really meant")

    inspect = _inspect(v, fields, path, protocol, hosts, schemes)
    foreign = foreign_default
    positions = NO_POSITIONS
    for key in ("foreign_credentials", "placeholders"):
        if key in fields and "inject" not in fields:
            v.error(fields[key], f"{path}.{key}", "applies only to a rule that injects credentials (inject)")
    if "foreign_credentials" in fields:
        foreign = _foreign_credentials(v, fields["foreign_credentials"], f"{path}.foreign_credentials", foreign_default)
    if "placeholders" in fields:
        positions = _placeholders(v, fields["placeholders"], f"{path}.placeholders")
    limits = NO_LIMITS
    if "limits" in fields:
        limits = _limits(v, fields["limits"], f"{path}.limits")
        if limits.requests_per_credential_per_minute is not None and "inject" not in fields:
            v.error(fields["limits"], f"{path}.limits.requests_per_credential_per_minute",
                    "applies only to a rule that injects credentials (inject)")

    if rule_id is None or not hosts:
        return None
    return Rule(rule_id, index, tuple(hosts), schemes, ports, methods, globs, patterns, node.location, protocol,
                injections, rule_mode, flags["allow_wildcard_credentials"], flags["allow_plaintext_credentials"],
                inspect, foreign_credentials=foreign, placeholders=positions, allow_body=flags["allow_body"],
                limits=limits)


def _limits(v: Validator, node: Node, path: str) -> Limits:
    """`limits: {requests_per_minute: N, upload_bytes_per_hour: SIZE, ...}`: positive whole numbers;
    the byte keys also take sizes like `100MiB` or `1.5GB`."""
    fields = v.mapping(node, path, set(LIMIT_KEYS))
    if fields is None:
        return NO_LIMITS
    if not fields:
        v.error(node, path, f"must set at least one of {', '.join(LIMIT_KEYS)}")
    values: dict[str, int] = {}
    for key, item in fields.items():
        if key not in LIMIT_KEYS:
            continue
        p = f"{path}.{key}"
        unit = LIMIT_KEYS[key][1]
        if unit == "bytes" and isinstance(item.value, str):
            try:
                value = parse_size(item.value)
            except ValueError as exc:
                v.error(item, p, f"{item.value!r}: {exc}")
                continue
        elif isinstance(item.value, bool) or not isinstance(item.value, int):
            hint = "a number of bytes or a size like 100MiB" if unit == "bytes" else "a whole number of requests"
            v.error(item, p, f"{item.value!r}: must be {hint}")
            continue
        else:
            value = item.value
        if not 1 <= value <= 2**53:
            v.error(item, p, f"{item.value!r}: must be at least 1 (remove the key for no limit)")
            continue
        values[key] = value
    return Limits(**values)


def _names(v: Validator, node: Node, path: str, kind: str, key) -> tuple[str, ...]:
    """A list of header names (kind "header") or query parameter names (kind "query"), each listed
    once after the loose comparison gateway/foreign.py makes (`key`)."""
    found: list[str] = []
    seen: dict[str, str] = {}
    for i, item in enumerate(v.sequence(node, path) or []):
        p = f"{path}[{i}]"
        name = v.string(item, p)
        if name is None:
            continue
        if kind == "header" and not HEADER_NAME_RE.match(name):
            v.error(item, p, f"{name!r} is not a valid header name")
            continue
        if kind == "query" and not _QUERY_NAME_RE.match(name):
            v.error(item, p, f"{name!r}: a query parameter name is 1-64 printable ASCII characters, "
                    "without '&', '=', '#', '?' or spaces")
            continue
        normal = key(name)
        if normal in seen:
            how = {header_key: ": names are compared case-insensitively, '_' as '-'",
                   query_key: ": names are compared percent-decoded and case-folded"}.get(key, "")
            v.error(item, p, f"{name!r} is listed twice (as {seen[normal]!r}{how})")
            continue
        seen[normal] = name
        found.append(name)
    return tuple(found)


def _foreign_credentials(v: Validator, node: Node, path: str, base: ForeignCredentials) -> ForeignCredentials:
    """`foreign_credentials: {headers: [...], query: [...]}`; a list given replaces `base`'s."""
    fields = v.mapping(node, path, FOREIGN_KEYS)
    if fields is None:
        return base
    headers = _names(v, fields["headers"], f"{path}.headers", "header", header_key) if "headers" in fields else base.headers
    query = _names(v, fields["query"], f"{path}.query", "query", query_key) if "query" in fields else base.query
    return ForeignCredentials(headers, query)


def _placeholders(v: Validator, node: Node, path: str) -> Positions:
    """`placeholders: {query: [NAME...], path: true|false}`."""
    fields = v.mapping(node, path, PLACEHOLDER_KEYS)
    if fields is None:
        return NO_POSITIONS
    query: tuple[str, ...] = ()
    if "query" in fields:
        query = _names(v, fields["query"], f"{path}.query", "query", lambda n: n)
    allow_path = False
    if "path" in fields:
        if not isinstance(fields["path"].value, bool):
            v.error(fields["path"], f"{path}.path", "must be true or false")
        else:
            allow_path = fields["path"].value
    return Positions(frozenset(query), allow_path)


# What a passthrough rule cannot have: the gateway never sees the requests inside its tunnels.
PASSTHROUGH_FORBIDDEN_KEYS = {
    "methods": "methods cannot be checked inside an uninspected (inspect: false) TLS tunnel",
    "paths": "paths cannot be checked inside an uninspected (inspect: false) TLS tunnel",
    "inject": "credentials cannot be injected into an uninspected (inspect: false) TLS tunnel",
    "allow_body": "request bodies cannot be checked inside an uninspected (inspect: false) TLS tunnel",
    "limits": "requests and their bytes cannot be counted inside an uninspected (inspect: false) TLS tunnel",
}


def _refusals(v: Validator, node: Node) -> RefusalStyle:
    """`refusals: {message: TEMPLATE, format: text | json | negotiate}`: the template compiled here,
    once, so a refusal only fills it in."""
    fields = v.mapping(node, "refusals", REFUSALS_KEYS)
    if fields is None:
        return DEFAULT_STYLE
    if not fields:
        v.error(node, "refusals", f"must set at least one of {', '.join(sorted(REFUSALS_KEYS))}")
    template = None
    if "message" in fields:
        text = v.string(fields["message"], "refusals.message")
        if text is not None:
            try:
                template = MessageTemplate.parse(text)
            except MessageTemplateError as exc:
                v.error(fields["message"], "refusals.message", str(exc))
    style = "text"
    if "format" in fields:
        value = v.string(fields["format"], "refusals.format")
        if value is not None and value not in FORMATS:
            v.error(fields["format"], "refusals.format", f"{value!r}: format must be one of {', '.join(FORMATS)}")
        elif value is not None:
            style = value
    return RefusalStyle(template, style)


def _is_ip_text(value: str) -> bool:
    try:
        return canonical_host(value).is_ip
    except HostError:
        return False


def _inspect(v: Validator, fields: dict[str, Node], path: str, protocol: str,
             hosts: list[HostPattern], schemes: frozenset[str]) -> bool:
    """`inspect: false` (TLS passthrough) and what it rules out."""
    if "inspect" not in fields:
        return True
    node = fields["inspect"]
    if not isinstance(node.value, bool):
        v.error(node, f"{path}.inspect", "must be true or false")
        return True
    if node.value:
        return True
    for key, why in PASSTHROUGH_FORBIDDEN_KEYS.items():
        if key in fields:
            v.error(fields[key], f"{path}.{key}", why)
    if protocol != "http":
        v.error(node, f"{path}.inspect", "inspect: false applies to TLS (protocol: http with https) only; "
                "a protocol: tcp rule is never inspected anyway")
    if "schemes" in fields and schemes != {"https"}:
        v.error(fields["schemes"], f"{path}.schemes", "an inspect: false rule allows https only: plain http "
                "is always inspected, and a passthrough tunnel is pinned by its TLS SNI")
    for i, pattern in enumerate(hosts):
        if pattern.kind == "network" or (pattern.kind == "exact" and _is_ip_text(pattern.value)):
            v.error(fields["hosts"], f"{path}.hosts", f"{pattern}: an inspect: false rule needs host names: "
                    "the TLS SNI that pins a passthrough tunnel cannot be an IP address")
    return False


def compile_policy(text: str, source: str) -> Policy:
    """Parse, validate and compile policy text; raise PolicyError listing every problem."""
    v, root, top = parse_checked(text, source, TOP_KEYS)

    if "version" not in top:
        v.error(root, "version", "missing required key 'version' (use: version: 1)")
    elif type(top["version"].value) is not int or top["version"].value != 1:
        v.error(top["version"], "version", f"{top['version'].value!r}: only version 1 is supported")

    deny = default_deny_table()
    allow = RangeTable()
    strict = False
    if "network" in top:
        network = v.mapping(top["network"], "network", NETWORK_KEYS) or {}
        if "deny_ip_ranges" in network:
            node = network["deny_ip_ranges"]
            if node.value == "default":
                pass
            elif isinstance(node.value, list):
                deny = RangeTable.of(_ranges(v, node, "network.deny_ip_ranges"))
            else:
                v.error(node, "network.deny_ip_ranges", "must be \"default\" or a list of CIDRs")
        if "allow_ip_ranges" in network:
            allow = RangeTable.of(_ranges(v, network["allow_ip_ranges"], "network.allow_ip_ranges"))
        if "strict_original_destination" in network:
            node = network["strict_original_destination"]
            if not isinstance(node.value, bool):
                v.error(node, "network.strict_original_destination", "must be true or false")
            else:
                strict = node.value

    static_hosts: dict[str, tuple[IPAddress, ...]] = {}
    if "resolver" in top:
        resolver = v.mapping(top["resolver"], "resolver", RESOLVER_KEYS) or {}
        if "static_hosts" in resolver:
            node = resolver["static_hosts"]
            if not isinstance(node.value, dict):
                v.error(node, "resolver.static_hosts", f"must be a mapping of name to addresses, not {value_kind(node.value)}")
            else:
                for name, value in node.value.items():
                    p = f"resolver.static_hosts.{name}"
                    try:
                        host = canonical_host(name)
                    except HostError as exc:
                        v.error(node.key_locations[name], p, f"{name!r}: {exc}")
                        continue
                    if host.is_ip:
                        v.error(node.key_locations[name], p, "static_hosts maps names, not IP addresses")
                        continue
                    addresses = []
                    for i, item in enumerate(v.sequence(value, p, non_empty=True) or []):
                        literal = v.string(item, f"{p}[{i}]")
                        if literal is None:
                            continue
                        try:
                            bracketed = literal if ":" not in literal or literal.startswith("[") else f"[{literal}]"
                            parsed = canonical_host(bracketed)
                            if parsed.ip is None:
                                raise HostError("not an IP address")
                            addresses.append(parsed.ip)
                        except HostError as exc:
                            v.error(item, f"{p}[{i}]", f"{literal!r}: {exc}")
                    if host.value in static_hosts:
                        v.error(node.key_locations[name], p, "this name is listed twice (after canonicalisation)")
                    static_hosts[host.value] = tuple(addresses)

    secrets = _secrets(v, top["secrets"]) if "secrets" in top else {}
    policy_mode = _mode(v, top.get("mode"), "mode") or "enforce"
    foreign = DEFAULT_FOREIGN
    if "foreign_credentials" in top:
        foreign = _foreign_credentials(v, top["foreign_credentials"], "foreign_credentials", DEFAULT_FOREIGN)

    refusals = _refusals(v, top["refusals"]) if "refusals" in top else DEFAULT_STYLE

    rules: list[Rule] = []
    if "rules" in top:
        seen: dict[str, Location] = {}
        for i, item in enumerate(v.sequence(top["rules"], "rules") or []):
            rule = _rule(v, item, f"rules[{i}]", i, seen, set(secrets), foreign)
            if rule is not None:
                rules.append(rule)

    sandboxes: tuple[Sandbox, ...] | None = None
    sources = RangeTable()
    if "sandboxes" in top:
        sandboxes, sources = _sandboxes(v, top["sandboxes"], {r.id for r in rules})

    tokens: TokenSettings | None = None
    if "identity" in top:
        tokens = _identity(v, top["identity"], source, sandboxes)

    if v.issues:
        raise PolicyError(v.issues)
    index = HostIndex.build((pattern, rule.index) for rule in rules for pattern in rule.hosts)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return Policy(
        tuple(rules), index, deny, allow, static_hosts, source, digest,
        sandboxes=sandboxes, sandbox_sources=sources, strict_original_destination=strict,
        secrets=secrets, mode=policy_mode, foreign_credentials=foreign, refusals=refusals, tokens=tokens,
    )


def _identity(v: Validator, node: Node, source: str, sandboxes: tuple[Sandbox, ...] | None) -> TokenSettings | None:
    """`identity: {tokens: {...}}`: signed tokens as proxy credentials (gateway/tokens.py). Key files
    are read here, so a policy whose keys cannot be used does not load (nor reload)."""
    fields = v.mapping(node, "identity", IDENTITY_KEYS)
    if not fields or "tokens" not in fields:
        if fields is not None:
            v.error(node, "identity", "missing required key 'tokens'")
        return None
    path = "identity.tokens"
    t = v.mapping(fields["tokens"], path, TOKEN_KEYS)
    if t is None:
        return None
    v.required(fields["tokens"], path, t, ("keys", "audience"))
    if sandboxes is None:
        v.error(fields["tokens"], path, "a token names a profile, an entry of sandboxes:, so the policy needs a "
                "sandboxes section")
    profiles = {s.id for s in sandboxes or ()}
    base = Path(source).parent if not source.startswith("<") else Path(".")

    key_files: list[Path] = []
    jwks = True
    if "keys" in t:
        keys_node = t["keys"]
        if isinstance(keys_node.value, str):
            key_files = [base / keys_node.value] if keys_node.value else []
            if not keys_node.value:
                v.error(keys_node, f"{path}.keys", "must name a JWKS file or list PEM public-key files")
        elif isinstance(keys_node.value, list):
            jwks = False
            for i, item in enumerate(v.sequence(keys_node, f"{path}.keys", non_empty=True) or []):
                name = v.string(item, f"{path}.keys[{i}]")
                if name:
                    key_files.append(base / name)
        else:
            v.error(keys_node, f"{path}.keys", f"must be a JWKS file or a list of PEM files, not {value_kind(keys_node.value)}")

    algorithms = tuple(SUPPORTED_ALGORITHMS)
    if "algorithms" in t:
        found = []
        for i, item in enumerate(v.sequence(t["algorithms"], f"{path}.algorithms", non_empty=True) or []):
            alg = v.string(item, f"{path}.algorithms[{i}]")
            if alg is None:
                continue
            if alg not in SUPPORTED_ALGORITHMS:
                why = ("symmetric algorithms are not supported: the gateway verifies with public keys only"
                       if alg.upper().startswith("HS") else "an unsigned token proves nothing"
                       if alg.lower() == "none" else "not a supported algorithm")
                v.error(item, f"{path}.algorithms[{i}]", f"{alg!r}: {why} (supported: {', '.join(SUPPORTED_ALGORITHMS)})")
            elif alg in found:
                v.error(item, f"{path}.algorithms[{i}]", f"{alg!r} is listed twice")
            else:
                found.append(alg)
        algorithms = tuple(found)

    def text(key: str) -> str | None:
        if key not in t:
            return None
        value = v.string(t[key], f"{path}.{key}")
        if value is not None and not (0 < len(value) <= 1024):
            v.error(t[key], f"{path}.{key}", "must be 1 to 1024 characters")
            return None
        return value

    audience, issuer = text("audience"), text("issuer")
    leeway = DEFAULT_LEEWAY_SECONDS
    if "leeway" in t:
        try:
            leeway = parse_duration(t["leeway"].value)
            if not 0 <= leeway <= MAX_LEEWAY_SECONDS:
                raise ValueError(f"at most {MAX_LEEWAY_SECONDS:.0f}s: a larger clock skew is a clock to fix")
        except ValueError as exc:
            v.error(t["leeway"], f"{path}.leeway", f"{t['leeway'].value!r}: {exc}")
    profile_claim: tuple[str, ...] = ("egress_profile",)
    for key in ("profile_claim", "rules_claim"):
        value = text(key)
        if value is not None and not _CLAIM_NAME_RE.match(value):
            v.error(t[key], f"{path}.{key}", f"{value!r}: a claim name (dots for nested claims) of printable ASCII")
        elif value is not None and key == "profile_claim":
            profile_claim = tuple(value.split("."))
    rules_claim = text("rules_claim")
    default_profile = text("default_profile")
    if default_profile is not None and sandboxes is not None and default_profile not in profiles:
        v.error(t["default_profile"], f"{path}.default_profile", f"{default_profile!r}: no sandboxes entry has this id")
    required = True
    if "required" in t:
        if not isinstance(t["required"].value, bool):
            v.error(t["required"], f"{path}.required", "must be true or false")
        else:
            required = t["required"].value

    keys = ()
    if key_files:
        try:
            keys = load_keys(key_files, jwks)
            if algorithms and not any(key.algorithms & set(algorithms) for key in keys):
                v.error(t["keys"], f"{path}.keys", "no key verifies any of the allowed algorithms "
                        f"({', '.join(algorithms)})")
        except KeyFileError as exc:
            v.error(t["keys"], f"{path}.keys", str(exc))
    if audience is None or not key_files:
        return None
    return TokenSettings(tuple(key_files), jwks, algorithms, audience, issuer, leeway, profile_claim,
                         default_profile, rules_claim, required, keys)


def _sandboxes(v: Validator, node: Node, rule_ids: set[str]) -> tuple[tuple[Sandbox, ...], RangeTable]:
    sandboxes: list[Sandbox] = []
    sources = RangeTable()
    seen_ids: dict[str, Location] = {}
    seen_ranges: dict[object, str] = {}
    for i, item in enumerate(v.sequence(node, "sandboxes") or []):
        path = f"sandboxes[{i}]"
        fields = v.mapping(item, path, SANDBOX_KEYS)
        if fields is None:
            continue
        v.required(item, path, fields, ("id", "rules"))
        sandbox_id = _entry_id(v, fields, path, "sandbox", seen_ids)
        if "source_ips" in fields:
            for network, _label in _ranges(v, fields["source_ips"], f"{path}.source_ips"):
                if network in seen_ranges:
                    v.error(fields["source_ips"], f"{path}.source_ips",
                            f"{network} is already claimed by sandbox {seen_ranges[network]!r}")
                elif sandbox_id is not None:
                    seen_ranges[network] = sandbox_id
                    sources.add(network, sandbox_id)
        granted = _rule_ids(v, fields["rules"], f"{path}.rules", rule_ids) if "rules" in fields else set()
        limits = _limits(v, fields["limits"], f"{path}.limits") if "limits" in fields else NO_LIMITS
        grantable = _grantable(v, fields["grantable"], f"{path}.grantable", rule_ids) if "grantable" in fields else None
        if sandbox_id is not None:
            sandboxes.append(Sandbox(sandbox_id, frozenset(granted), item.location, limits, grantable))
    return tuple(sandboxes), sources


def _grantable(v: Validator, node: Node, path: str, rule_ids: set[str]) -> Grantable | None:
    """`grantable: {rules, hosts, ports, schemes, methods, max_ttl}`: the envelope of the grants the
    control API may give a registered sandbox of this profile (gateway/grants.py)."""
    fields = v.mapping(node, path, GRANTABLE_KEYS)
    if fields is None:
        return None
    if "rules" not in fields and "hosts" not in fields:
        v.error(node, path, "must set rules or hosts (what may be granted)")
    rules = _rule_ids(v, fields["rules"], f"{path}.rules", rule_ids) if "rules" in fields else set()
    hosts = _host_patterns(v, fields["hosts"], f"{path}.hosts") if "hosts" in fields else []
    ports = _ports(v, fields["ports"], f"{path}.ports") if "ports" in fields else DEFAULT_GRANT_PORTS
    schemes = _schemes(v, fields["schemes"], f"{path}.schemes") if "schemes" in fields else DEFAULT_GRANT_SCHEMES
    methods = _methods(v, fields["methods"], f"{path}.methods") if "methods" in fields else None
    max_ttl = DEFAULT_MAX_TTL
    if "max_ttl" in fields:
        try:
            max_ttl = parse_ttl(fields["max_ttl"].value)
        except ValueError as exc:
            v.error(fields["max_ttl"], f"{path}.max_ttl", f"{fields['max_ttl'].value!r}: {exc}")
    return Grantable(frozenset(rules), tuple(hosts), ports, schemes, methods, max_ttl)


def load_policy(path: str | Path) -> Policy:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError([ConfigIssue(Location(str(path), 1, 1), "", f"cannot read policy: {exc}")]) from None
    return compile_policy(text, str(path))


def default_policy_text() -> str:
    return resources.files("policies").joinpath(DEFAULT_POLICY_NAME).read_text(encoding="utf-8")


def load_default_policy() -> Policy:
    return compile_policy(default_policy_text(), f"<embedded policies/{DEFAULT_POLICY_NAME}>")
