"""Which host names are served by a shared CDN, for the domain-fronting warning on passthrough rules.

On a shared CDN, one edge address and one TLS certificate front thousands of customers; the edge
picks the customer from the HTTP Host header *inside* the TLS. The gateway checks the SNI of a
passthrough (inspect: false) connection but cannot see that Host header, so a sandbox allowed
`files.pythonhosted.org` unread can ask the same Fastly edge for any other Fastly customer's site.
Intercepted connections are not affected: there the Host header is pinned.

The list is knowingly incomplete (CDN customers change); it names the CDN suffixes themselves and
the package registries and download hosts a passthrough rule is most often written for.
"""

from __future__ import annotations

# Suffixes that are the CDNs' own names: everything under them is a CDN customer.
CDN_SUFFIXES: dict[str, str] = {
    "fastly.net": "Fastly", "fastlylb.net": "Fastly", "global.ssl.fastly.net": "Fastly",
    "cloudfront.net": "Amazon CloudFront",
    "akamai.net": "Akamai", "akamaized.net": "Akamai", "akamaihd.net": "Akamai", "akamaiedge.net": "Akamai",
    "edgekey.net": "Akamai", "edgesuite.net": "Akamai",
    "azureedge.net": "Azure Front Door / CDN", "azurefd.net": "Azure Front Door / CDN",
    "cdn.cloudflare.net": "Cloudflare", "workers.dev": "Cloudflare", "pages.dev": "Cloudflare",
    "b-cdn.net": "Bunny CDN", "cdn77.org": "CDN77", "kxcdn.com": "KeyCDN", "llnwd.net": "Edgio (Limelight)",
    "googleusercontent.com": "Google", "storage.googleapis.com": "Google Cloud Storage",
    "appspot.com": "Google App Engine", "gcdn.co": "Gcore",
}

# Well-known names that sit behind a shared CDN (as of 2026): registries, mirrors, downloads.
CDN_HOSTS: dict[str, str] = {
    "pypi.org": "Fastly", "files.pythonhosted.org": "Fastly", "pypi.python.org": "Fastly",
    "registry.npmjs.org": "Cloudflare", "registry.yarnpkg.com": "Cloudflare", "nodejs.org": "Cloudflare",
    "unpkg.com": "Cloudflare", "cdn.jsdelivr.net": "Fastly / Cloudflare",
    "rubygems.org": "Fastly", "index.rubygems.org": "Fastly",
    "repo.maven.apache.org": "Fastly", "repo1.maven.org": "Fastly",
    "static.crates.io": "Fastly / Amazon CloudFront", "index.crates.io": "Amazon CloudFront",
    "proxy.golang.org": "Google", "sum.golang.org": "Google", "storage.googleapis.com": "Google Cloud Storage",
    "dl.google.com": "Google",
    "deb.debian.org": "Fastly", "security.debian.org": "Fastly", "dl-cdn.alpinelinux.org": "Fastly",
    "objects.githubusercontent.com": "Fastly", "raw.githubusercontent.com": "Fastly",
    "release-assets.githubusercontent.com": "Fastly",
    "production.cloudflare.docker.com": "Cloudflare", "download.docker.com": "Amazon CloudFront",
    "huggingface.co": "Amazon CloudFront", "cdn-lfs.huggingface.co": "Amazon CloudFront",
    "cas-bridge.xethub.hf.co": "Amazon CloudFront",
    "conda.anaconda.org": "Cloudflare", "repo.anaconda.com": "Cloudflare",
    "api.nuget.org": "Azure Front Door / CDN", "globalcdn.nuget.org": "Azure Front Door / CDN",
}


def shared_cdn(name: str, wildcard: bool = False) -> str | None:
    """The CDN serving `name` (or, for a wildcard, the names under `*.name`), if known."""
    name = name.lower().rstrip(".")
    if not wildcard and name in CDN_HOSTS:
        return CDN_HOSTS[name]
    labels = name.split(".")
    for i in range(len(labels)):
        suffix = ".".join(labels[i:])
        if suffix in CDN_SUFFIXES and (i > 0 or wildcard):
            return CDN_SUFFIXES[suffix]
    if wildcard:
        # *.githubusercontent.com covers objects.githubusercontent.com, and so on.
        for host, cdn in CDN_HOSTS.items():
            if host.endswith("." + name):
                return cdn
    return None
