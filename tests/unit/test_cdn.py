"""Shared-CDN names for the domain-fronting warning on passthrough rules."""

import pytest

from gateway.cdn import shared_cdn


@pytest.mark.parametrize("name,cdn", [
    ("files.pythonhosted.org", "Fastly"),
    ("registry.npmjs.org", "Cloudflare"),
    ("d111111abcdef8.cloudfront.net", "Amazon CloudFront"),
    ("FILES.PYTHONHOSTED.ORG.", "Fastly"),
])
def test_known_names(name, cdn):
    assert shared_cdn(name) == cdn


def test_wildcards_over_a_cdn_or_its_customers():
    assert shared_cdn("fastly.net", wildcard=True) == "Fastly"
    assert shared_cdn("githubusercontent.com", wildcard=True) == "Fastly"


def test_the_cdn_apex_itself_and_unknown_names_are_not_flagged():
    assert shared_cdn("fastly.net") is None  # the company's own site, not a customer edge
    assert shared_cdn("mirror.internal.example") is None
    assert shared_cdn("internal.example", wildcard=True) is None
