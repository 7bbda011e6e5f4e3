"""gateway/foreign.py: on a bound rule, a credential that is not the platform's is found (where,
never its value) however its name is spelled, and the platform's own (what the rule injects, a
placeholder the gateway swaps) never is."""

from __future__ import annotations

import pytest

from gateway.foreign import (
    DEFAULT,
    DEFAULT_HEADERS,
    DEFAULT_QUERY,
    ForeignCredentials,
    find,
    header_key,
    query_key,
    scrub_target,
)

PH = "egress-placeholder-tok-" + "3f" * 20
TOKENS = {PH: "tok"}


def test_defaults():
    assert DEFAULT_HEADERS == ("Authorization", "Proxy-Authorization", "X-Api-Key", "Api-Key", "X-Goog-Api-Key")
    assert DEFAULT_QUERY == ("key", "api_key", "access_token")
    assert "cookie" not in DEFAULT.header_keys


@pytest.mark.parametrize("name", ["Authorization", "authorization", "PROXY-AUTHORIZATION", "x-api-key", "X_Api_Key",
                                  "x_api_key", "Api-Key", "api_key", "X-Goog-Api-Key", "x_goog_api_key"])
def test_every_spelling_of_an_auth_header(name):
    assert find([(name, "mine")], "/", DEFAULT) == f"header {name}"


@pytest.mark.parametrize("query, where", [
    ("key=mine", "key"), ("KEY=mine", "KEY"), ("Key=mine", "Key"), ("api_key=mine", "api_key"),
    ("api%5Fkey=mine", "api%5Fkey"), ("api%255Fkey=mine", "api%255Fkey"), ("api-key=mine", "api-key"),
    ("api.key=mine", "api.key"), ("api+key=mine", "api+key"), ("api_key[]=mine", "api_key[]"),
    ("key[0]=mine", "key[0]"), ("access_token=mine", "access_token"), ("x=1;key=mine", "key"),
    ("a=1&b=2&access_token=mine", "access_token"),
    # found by the fresh-eyes review: qs (Express) and Rack read a bracketed name as the name,
    # PHP reads an unclosed '[' as '_' and a name up to its NUL
    ("[api_key]=mine", "[api_key]"), ("%5Baccess_token%5D=mine", "%5Baccess_token%5D"), ("[key]=mine", "[key]"),
    ("api[key=mine", "api[key"), ("access[token=mine", "access[token"), ("key%00x=mine", "key%00x"),
    ("api_key%00=mine", "api_key%00"),
])
def test_every_spelling_of_an_auth_parameter(query, where):
    assert find([], f"/v1?{query}", DEFAULT) == f"query parameter {where}"


@pytest.mark.parametrize("headers, target", [
    ([], "/v1/x"),
    ([("X-Authorization", "mine"), ("X-Keys", "a"), ("Cookie", "session=abc")], "/v1?monkey=1&keys=2&q=key"),
    ([("Authorization", ""), ("X-Api-Key", "  ")], "/v1?key=&api_key"),  # empty: no credential at all
    ([("Authorization", f"Bearer {PH}")], "/"),
    ([("Authorization", PH)], "/"),
    ([("Authorization", f"token {PH}")], "/"),
    ([("Authorization", f"DeepL-Auth-Key {PH}")], "/"),
    ([("X-Api-Key", PH)], "/"),
])
def test_nothing_foreign(headers, target):
    assert find(headers, target, DEFAULT, TOKENS) is None


@pytest.mark.parametrize("value", [
    "Bearer mine", f"Bearer {PH} mine", f"sk-own {PH}", f"ownkeyletters {PH}", f"Bearer {PH}, Bearer mine", f"{PH}x",
    "egress-placeholder-tok-" + "a1" * 20,  # another sandbox's: not swapped, so not the platform's
])
def test_anything_but_one_scheme_word_and_a_swapped_placeholder_is_foreign(value):
    assert find([("Authorization", value)], "/", DEFAULT, TOKENS) == "header Authorization"


def test_a_swapped_query_placeholder_is_the_platforms_only_where_it_is_swapped():
    assert find([], f"/v?api_key={PH}", DEFAULT, TOKENS, placeholder_query=frozenset({"api_key"})) is None
    assert find([], f"/v?api_key={PH}", DEFAULT, TOKENS) == "query parameter api_key"


def test_what_the_rule_injects_is_replaced_and_its_look_alikes_are_foreign():
    injected_h, injected_q = frozenset({"x-custom-token"}), frozenset({"sig"})
    config = ForeignCredentials((), ())  # even with nothing configured
    kwargs = dict(injected_headers=injected_h, injected_query=injected_q)
    assert find([("X-Custom-Token", "mine")], "/v?sig=mine&SIG%2B=", config, **kwargs) is None
    assert find([("x-custom-token", "a"), ("X-CUSTOM-TOKEN", "b")], "/v?sig=1&sig=2", config, **kwargs) is None
    assert find([], "/v?s%69g=mine", config, **kwargs) is None  # the injection decodes names: replaced
    assert find([("X_Custom_Token", "mine")], "/", config, **kwargs) == "header X_Custom_Token"
    assert find([], "/v?SIG=mine", config, **kwargs) == "query parameter SIG"
    assert find([], "/v?sig[]=mine", config, **kwargs) == "query parameter sig[]"
    # an injected pair is replaced whole, ';' and all
    assert find([], "/v?sig=1;key=mine", DEFAULT, **kwargs) is None
    assert find([], "/v?x=1;sig=mine", config, **kwargs) == "query parameter sig"


def test_a_configured_set_replaces_the_defaults():
    config = ForeignCredentials(("X-Partner-Token",), ("token",))
    assert find([("Authorization", "mine")], "/v?key=mine", config) is None
    assert find([("x_partner_token", "mine")], "/", config) == "header x_partner_token"
    assert find([], "/v?TOKEN=mine", config) == "query parameter TOKEN"
    cookie = ForeignCredentials(("Cookie",), ())
    assert find([("Cookie", "session=mine")], "/", cookie) == "header Cookie"


def test_names_compare_loosely():
    assert header_key(" X_Api_Key ") == "x-api-key"
    assert query_key("API%5FKEY[]") == query_key("api.key") == query_key("api-key") == "api_key"


def test_scrub_target_blanks_values_never_names():
    assert scrub_target("/v?a=1&key=mine;access_token=t&KEY%3D=x#f", DEFAULT) == \
        "/v?a=1&key=[REDACTED];access_token=[REDACTED]&KEY%3D=x#f"
    assert scrub_target("/v?sig=mine", ForeignCredentials((), ()), frozenset({"sig"})) == "/v?sig=[REDACTED]"
    assert scrub_target("/v/x", DEFAULT) == "/v/x"


def test_without_an_injection_the_injected_names_are_credentials_too():
    """Report mode's would_deny gets no credential, so nothing replaces what the sandbox sent under
    the injected name: there it is the sandbox's own key (a report-mode bypass otherwise)."""
    kwargs = dict(injected_headers=frozenset({"x-custom"}), injected_query=frozenset({"sig"}), replaced=False)
    none = ForeignCredentials((), ())
    assert find([("X-Custom", "mine")], "/", none, **kwargs) == "header X-Custom"
    assert find([], "/v?sig=mine", none, **kwargs) == "query parameter sig"
    assert find([("X-Custom", PH)], "/", none, TOKENS, **kwargs) is None  # a placeholder is still no own key
