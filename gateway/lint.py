"""Warnings a policy reviewer wants, on a policy that already loads: `egress-gateway check` prints them.

Pure: `lint(policy, text)` looks only at the compiled policy and its own text (re-parsed with
locations so every warning names file:line:column and the key path, like loader errors do).
Each warning has a stable code (`WARNING_CODES`); `check --strict` turns them into errors.

Shadowing is reported only when it is certain: every host of the later rule is covered by an
earlier rule (same protocol, granted to every sandbox the later one is) whose schemes, ports,
methods and paths are at least as wide, so the later rule can never decide a request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .addresses import AddressGuard
from .cdn import shared_cdn
from .globs import PathGlob
from .hostnames import HostError, canonical_host, is_ip_literal
from .matcher import HostPattern
from .policy import DEFAULT_PORTS, STANDARD_METHODS, Policy, Rule
from .yamlsource import ConfigIssue, Location, Node, node_at, parse

WARNING_CODES: dict[str, str] = {
    "unused-rule": "no sandbox grants this rule (the policy has a sandboxes section)",
    "unused-secret": "no inject template references this secret",
    "shadowed-rule": "earlier, wider rules decide every request this rule could match",
    "multi-tenant-wildcard": "a wildcard over a platform where anyone can host a name",
    "broad-credentials": "credentials bound to a broad rule (wildcards, many hosts, any method and path)",
    "static-host-denied": "a static_hosts address the deny list refuses (not exempted by allow_ip_ranges)",
    "passthrough-shared-cdn": "an inspect: false host on a shared CDN: domain fronting inside the tunnel",
    "passthrough-overlap": "an inspect: false rule and an inspecting rule cover the same host",
    "bound-host-also-unbound": "a host a rule binds credentials to is also allowed by a rule that injects none",
    "byte-budget-bypassed": "a sandbox with a byte budget is granted an inspect: false or protocol: tcp rule",
}

# Platforms where the names under a domain belong to different customers: a wildcard at (or above)
# one of these lets the sandbox reach anybody's bucket, page, tunnel or function, i.e. an
# exfiltration endpoint of the attacker's choosing.
MULTI_TENANT_DOMAINS = frozenset({
    # AWS (see also MULTI_TENANT_ZONES)
    "s3.amazonaws.com", "cloudfront.net", "awsapprunner.com", "amplifyapp.com",
    # Azure
    "blob.core.windows.net", "web.core.windows.net", "file.core.windows.net", "queue.core.windows.net",
    "table.core.windows.net", "dfs.core.windows.net", "azurewebsites.net", "azureedge.net", "azurefd.net",
    "azurestaticapps.net", "azurecontainerapps.io", "cloudapp.azure.com", "cloudapp.net", "trafficmanager.net",
    # Google
    "appspot.com", "run.app", "a.run.app", "cloudfunctions.net", "googleusercontent.com",
    "storage.googleapis.com", "firebaseapp.com", "firebaseio.com", "web.app",
    # GitHub, GitLab, Bitbucket
    "github.io", "githubusercontent.com", "gitlab.io", "bitbucket.io",
    # Hosting and edge platforms
    "herokuapp.com", "herokudns.com", "vercel.app", "now.sh", "netlify.app", "netlify.com", "pages.dev",
    "workers.dev", "r2.dev", "r2.cloudflarestorage.com", "trycloudflare.com", "fly.dev", "onrender.com",
    "glitch.me", "repl.co", "replit.app", "replit.dev", "deno.dev", "surge.sh", "railway.app",
    "ondigitalocean.app", "digitaloceanspaces.com", "supabase.co", "hf.space", "modal.run",
    # Tunnels and request catchers
    "ngrok.io", "ngrok-free.app", "ngrok.app", "ngrok.dev", "loca.lt", "localtunnel.me", "serveo.net",
    "pipedream.net",
})
# Zones where every wildcard, however deep, covers other customers' endpoints
# (`*.execute-api.us-east-1.amazonaws.com`, `*.s3.eu-west-1.amazonaws.com`, Lambda function URLs).
MULTI_TENANT_ZONES = frozenset({"amazonaws.com", "on.aws"})

MANY_HOSTS = 3  # a credential bound to this many hosts (or more) is "broad"


@dataclass(frozen=True)
class Finding:
    code: str
    location: Location
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        return f"{self.location}: {where}warning: {self.message} [{self.code}]"

    def as_dict(self) -> dict:
        return {"file": self.location.file, "line": self.location.line, "column": self.location.column,
                "path": self.path, "message": self.message, "code": self.code}


def issue_dict(issue: ConfigIssue) -> dict:
    """A loader error (or any located issue) as JSON: file, line, column, key path, message."""
    loc = issue.location
    return {"file": loc.file, "line": loc.line, "column": loc.column, "path": issue.path, "message": issue.message}


def lint(policy: Policy, text: str) -> list[Finding]:
    """Every warning for a policy that loaded, in file order. `text` is the policy's source text."""
    tree, _issues = parse(text, policy.source)
    view = _Tree(tree)
    findings: list[Finding] = []
    findings += _unused_rules(policy, view)
    findings += _unused_secrets(policy, view)
    findings += _shadowed_rules(policy, view)
    findings += _multi_tenant_wildcards(policy, view)
    findings += _broad_credentials(policy, view)
    findings += _denied_static_hosts(policy, view)
    findings += _passthrough_shared_cdn(policy, view)
    findings += _passthrough_overlap(policy, view)
    findings += _bound_host_also_unbound(policy, view)
    findings += _byte_budget_bypassed(policy, view)
    return sorted(findings, key=lambda f: (f.location.line, f.location.column, f.code))


class _Tree:
    """Locations in the parsed policy, by key path (the loader already checked the shapes)."""

    def __init__(self, root: Node):
        self.root = root

    def get(self, *keys: str | int) -> Node | None:
        return node_at(self.root, *keys)

    def key_location(self, *keys: str | int) -> Location:
        parent = self.get(*keys[:-1])
        if parent is not None and isinstance(parent.value, dict) and keys[-1] in parent.key_locations:
            return parent.key_locations[keys[-1]]
        node = self.get(*keys)
        return node.location if node is not None else self.root.location

    def location(self, *keys: str | int) -> Location:
        node = self.get(*keys)
        if node is not None:
            return node.location
        return self.location(*keys[:-1]) if len(keys) > 1 else self.root.location


def _rule_id_location(view: _Tree, rule: Rule) -> Location:
    return view.location("rules", rule.index, "id")


def _per_host(view: _Tree, rules: Iterable[Rule], code: str,
              say: Callable[[Rule, HostPattern], str | None]) -> list[Finding]:
    """A finding `code` at each host pattern of `rules` that `say` has something to say about."""
    findings = []
    for rule in rules:
        for j, pattern in enumerate(rule.hosts):
            message = say(rule, pattern)
            if message is not None:
                findings.append(Finding(code, view.location("rules", rule.index, "hosts", j),
                                        f"rules[{rule.index}].hosts[{j}]", message))
    return findings


# --------------------------------------------------------------------------------------------
# unused rules and secrets


def _unused_rules(policy: Policy, view: _Tree) -> list[Finding]:
    if policy.sandboxes is None:
        return []
    granted = set().union(*(s.rule_ids for s in policy.sandboxes)) if policy.sandboxes else set()
    return [
        Finding("unused-rule", _rule_id_location(view, rule), f"rules[{rule.index}].id",
                f"rule {rule.id} is granted to no sandbox, so no client can use it")
        for rule in policy.rules if rule.id not in granted
    ]


def _unused_secrets(policy: Policy, view: _Tree) -> list[Finding]:
    if not policy.secrets:
        return []
    used = {name for rule in policy.rules for name in rule.secrets}
    return [
        Finding("unused-secret", view.key_location("secrets", name), f"secrets.{name}",
                f"secret {name} is declared but no rule's inject template references it")
        for name in policy.secrets if name not in used
    ]


# --------------------------------------------------------------------------------------------
# shadowing


def _pattern_covers(wide: HostPattern, narrow: HostPattern) -> bool:
    """Does every host `narrow` matches also match `wide`?"""
    if wide.kind == "exact":
        return narrow.kind == "exact" and narrow.value == wide.value
    if wide.kind == "wildcard":
        if narrow.kind == "exact":
            return not is_ip_literal(narrow.value) and narrow.value.endswith("." + wide.value)
        if narrow.kind == "wildcard":
            return narrow.value == wide.value or narrow.value.endswith("." + wide.value)
        return False
    # wide is a CIDR
    if narrow.kind == "network":
        return narrow.network.version == wide.network.version and narrow.network.subnet_of(wide.network)
    if narrow.kind == "exact" and is_ip_literal(narrow.value):
        address = canonical_host(narrow.value if ":" not in narrow.value else f"[{narrow.value}]").ip
        return address.version == wide.network.version and address in wide.network
    return False


def _ports_on(rule: Rule, scheme: str) -> frozenset[int]:
    return rule.ports if rule.ports is not None else frozenset({DEFAULT_PORTS[scheme]})


def _glob_covers(wide_glob: str, wide_pattern: PathGlob, narrow: str) -> bool:
    if wide_glob == narrow:
        return True
    if not any(c in narrow for c in "*?"):
        return bool(wide_pattern.match(narrow))  # a literal path: just try it
    if wide_glob.endswith("/**"):
        prefix = wide_glob[:-3]
        if not any(c in prefix for c in "*?"):
            # `/a/**` matches `/a` and everything below; a narrower glob starting `/a/` stays below.
            return prefix == "" or narrow == prefix or narrow.startswith(prefix + "/")
    return False


def _at_least_as_wide(wide: Rule, narrow: Rule) -> bool:
    if wide.protocol != narrow.protocol:
        return False
    if narrow.protocol == "tcp":
        return wide.ports is not None and narrow.ports is not None and narrow.ports <= wide.ports
    for scheme in narrow.schemes:
        if scheme not in wide.schemes or not _ports_on(narrow, scheme) <= _ports_on(wide, scheme):
            return False
    if not (narrow.methods if narrow.methods is not None else STANDARD_METHODS) <= (
        wide.methods if wide.methods is not None else STANDARD_METHODS
    ):
        return False
    if wide.path_globs is None:
        return True
    if narrow.path_globs is None:
        return False
    return all(
        any(_glob_covers(g, p, narrow_glob) for g, p in zip(wide.path_globs, wide.path_patterns))
        for narrow_glob in narrow.path_globs
    )


def _granted_wherever(policy: Policy, wide: Rule, narrow: Rule) -> bool:
    if policy.sandboxes is None:
        return True
    return all(wide.id in s.rule_ids for s in policy.sandboxes if narrow.id in s.rule_ids)


def _shadowed_rules(policy: Policy, view: _Tree) -> list[Finding]:
    findings = []
    granted_somewhere = (
        None if policy.sandboxes is None else set().union(set(), *(s.rule_ids for s in policy.sandboxes))
    )
    for later in policy.rules:
        if granted_somewhere is not None and later.id not in granted_somewhere:
            continue  # reported as unused-rule
        earlier = [
            r for r in policy.rules[: later.index]
            if _at_least_as_wide(r, later) and _granted_wherever(policy, r, later)
        ]
        if not earlier:
            continue
        deciders: list[str] = []
        for host in later.hosts:
            wide = next((r for r in earlier if any(_pattern_covers(p, host) for p in r.hosts)), None)
            if wide is None:
                break
            if wide.id not in deciders:
                deciders.append(wide.id)
        else:
            by = ", ".join(deciders)
            extra = " (so its credentials are never injected)" if later.injections else ""
            findings.append(Finding(
                "shadowed-rule", _rule_id_location(view, later), f"rules[{later.index}]",
                f"rule {later.id} can never decide a request: earlier rule{'s' if len(deciders) > 1 else ''} "
                f"{by} cover{'' if len(deciders) > 1 else 's'} all its hosts with at least as wide schemes, "
                f"ports, methods and paths{extra}",
            ))
    return findings


# --------------------------------------------------------------------------------------------
# wildcards over multi-tenant platforms


def multi_tenant_platform(domain: str) -> str | None:
    """The multi-tenant platform a wildcard `*.domain` covers, if any."""
    if domain in MULTI_TENANT_DOMAINS:
        return domain
    for zone in MULTI_TENANT_ZONES:
        if domain == zone or domain.endswith("." + zone) or zone.endswith("." + domain):
            return zone
    for platform in sorted(MULTI_TENANT_DOMAINS):
        if domain == platform or platform.endswith("." + domain):
            return platform
    return None


def _multi_tenant_wildcards(policy: Policy, view: _Tree) -> list[Finding]:
    def say(rule: Rule, pattern: HostPattern) -> str | None:
        platform = multi_tenant_platform(pattern.value) if pattern.kind == "wildcard" else None
        if platform is None:
            return None
        what = "is" if platform == pattern.value else f"covers {platform}, which is"
        return (f"{pattern} {what} a multi-tenant platform: anyone can host a name there, so this lets the "
                f"sandbox reach (and send data to) other customers' endpoints; list the exact names instead")
    return _per_host(view, policy.rules, "multi-tenant-wildcard", say)


# --------------------------------------------------------------------------------------------
# credentials on broad rules


def _broad_credentials(policy: Policy, view: _Tree) -> list[Finding]:
    findings = []
    for rule in policy.rules:
        if not rule.injections:
            continue
        why = []
        patterns = [str(p) for p in rule.hosts if p.kind != "exact"]
        if patterns:
            why.append(f"non-exact hosts ({', '.join(patterns)})")
        if len(rule.hosts) >= MANY_HOSTS:
            why.append(f"{len(rule.hosts)} hosts")
        if rule.methods is None and rule.path_globs is None:
            why.append("any method to any path")
        if why:
            secrets = ", ".join(rule.secrets)
            findings.append(Finding(
                "broad-credentials", view.key_location("rules", rule.index, "inject"), f"rules[{rule.index}].inject",
                f"rule {rule.id} injects {secrets} on a broad rule: {'; '.join(why)}; bind credentials to one "
                f"exact host and the methods and paths that need them",
            ))
    return findings


# --------------------------------------------------------------------------------------------
# static_hosts entries the deny list refuses


def _denied_static_hosts(policy: Policy, view: _Tree) -> list[Finding]:
    node = view.get("resolver", "static_hosts")
    if node is None or not isinstance(node.value, dict):
        return []
    guard = AddressGuard(policy.deny_ranges, policy.allow_ranges)
    findings = []
    for name, value in node.value.items():
        for k, item in enumerate(value.value if isinstance(value.value, list) else []):
            literal = item.value
            try:
                bracketed = literal if ":" not in literal or literal.startswith("[") else f"[{literal}]"
                address = canonical_host(bracketed).ip
            except (HostError, TypeError):
                continue
            if address is None:
                continue
            verdict = guard.check(address)
            if not verdict.allowed:
                findings.append(Finding(
                    "static-host-denied", item.location, f"resolver.static_hosts.{name}[{k}]",
                    f"{name} -> {verdict.describe()}: every request to {name} will be refused "
                    f"({verdict.reason}); add the address to network.allow_ip_ranges if it is really meant",
                ))
    return findings


# --------------------------------------------------------------------------------------------
# passthrough (inspect: false) rules


def _passthrough_shared_cdn(policy: Policy, view: _Tree) -> list[Finding]:
    def say(rule: Rule, pattern: HostPattern) -> str | None:
        cdn = shared_cdn(pattern.value, wildcard=pattern.kind == "wildcard")
        if cdn is None:
            return None
        return (f"{pattern} is served by a shared CDN ({cdn}) and rule {rule.id} relays it unread "
                f"(inspect: false): inside the TLS the sandbox can send a Host header naming any other site "
                f"on that CDN (domain fronting), which the gateway cannot see; inspect this host unless the "
                f"bulk traffic really needs passthrough (docs/policy.md, Passthrough)")
    return _per_host(view, [r for r in policy.rules if not r.inspect], "passthrough-shared-cdn", say)


def _passthrough_overlap(policy: Policy, view: _Tree) -> list[Finding]:
    """Whether a tunnel is inspected is decided by the first rule (in file order) that allows its
    destination; when an inspecting rule covers the same names, the order silently decides."""
    findings = []
    http_rules = [r for r in policy.rules if r.protocol == "http"]
    for rule in http_rules:
        if rule.inspect:
            continue
        for other in http_rules:
            if not other.inspect:
                continue
            shared = [str(p) for p in rule.hosts for q in other.hosts if _pattern_covers(p, q) or _pattern_covers(q, p)]
            if not shared:
                continue
            first, then = (rule, other) if rule.index < other.index else (other, rule)
            findings.append(Finding(
                "passthrough-overlap", _rule_id_location(view, rule), f"rules[{rule.index}]",
                f"rule {rule.id} (inspect: false) and rule {other.id} (inspected) both cover "
                f"{', '.join(dict.fromkeys(shared))}: tunnels there follow rule {first.id}, the first in the file, "
                f"so {'they are relayed unread and rule ' + then.id + ' never sees their requests' if first is rule else 'they are inspected and rule ' + rule.id + ' only relays the names rule ' + other.id + ' does not cover'}",
            ))
    return findings


# --------------------------------------------------------------------------------------------
# bound hosts that an unbound rule also reaches


def _bound_host_also_unbound(policy: Policy, view: _Tree) -> list[Finding]:
    """A bound rule refuses requests carrying the sandbox's own key (foreign_credential); a rule
    without `inject` covering the same host does not, so the sandbox can send its own key there
    and exfiltrate through the same API. Rules no sandbox is granted are left out (unused-rule)."""
    granted = None if policy.sandboxes is None else set().union(set(), *(s.rule_ids for s in policy.sandboxes))
    unbound = [r for r in policy.rules if r.protocol == "http" and not r.injections
               and (granted is None or r.id in granted)]

    def say(rule: Rule, pattern: HostPattern) -> str | None:
        others = [o.id for o in unbound if any(_pattern_covers(p, pattern) for p in o.hosts)]
        if not others:
            return None
        which = ", ".join(others)
        return (f"{pattern} is bound to credentials by rule {rule.id}, but rule{'s' if len(others) > 1 else ''} "
                f"{which} also allow{'' if len(others) > 1 else 's'} it without any: there the sandbox can send "
                f"its own key and upload whatever it likes into an account of its choosing (foreign credentials "
                f"are refused only on rules that inject); remove the host from {which}, or bind "
                f"{'them' if len(others) > 1 else 'it'} too")
    return _per_host(view, [r for r in policy.rules if r.injections], "bound-host-also-unbound", say)


# --------------------------------------------------------------------------------------------
# byte budgets that unread tunnels bypass


def _byte_budget_bypassed(policy: Policy, view: _Tree) -> list[Finding]:
    """`upload_bytes_per_hour` and `download_bytes_per_hour` count HTTP bodies the gateway reads; the
    bytes of an `inspect: false` tunnel or a `protocol: tcp` connection are relayed unread and never
    counted, so such a rule granted to a sandbox with a byte budget lets it move any amount."""
    findings = []
    for index, sandbox in enumerate(policy.sandboxes or ()):
        budgets = [name for name in ("upload_bytes_per_hour", "download_bytes_per_hour")
                   if getattr(sandbox.limits, name) is not None]
        if not budgets:
            continue
        unread = [r for r in policy.rules if r.id in sandbox.rule_ids and (r.protocol == "tcp" or not r.inspect)]
        for rule in unread:
            kind = "protocol: tcp" if rule.protocol == "tcp" else "inspect: false"
            findings.append(Finding(
                "byte-budget-bypassed", view.key_location("sandboxes", index, "limits"), f"sandboxes[{index}].limits",
                f"sandbox {sandbox.id} has {' and '.join(budgets)}, but is granted rule {rule.id} ({kind}), whose "
                f"bytes the gateway relays unread and never counts: through it the sandbox can move any amount; "
                f"do not grant it, or inspect it",
            ))
    return findings
