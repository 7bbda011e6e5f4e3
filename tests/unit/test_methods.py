"""Method overrides (gateway/methods/): every spelling a framework reads, found; the engine judges
the wire method and every override; bodies are scanned chunk by chunk with the same result as whole."""

from __future__ import annotations

import json
import random
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway import methods
from gateway.engine import Engine, RequestFacts, body_override_refusal
from gateway.hostnames import canonical_host
from gateway.methods import BodyScanner, Override, overrides
from gateway.policy import compile_policy

POLICY = """
version: 1
rules:
  - id: read
    hosts: [api.example.com]
    methods: [GET, HEAD]
  - id: write
    hosts: [api.example.com]
    methods: [GET, POST, DELETE]
    paths: ["/write/**"]
  - id: default
    hosts: [open.example.com]
  - id: ro
    hosts: [ro.example.com]
    methods: [GET, HEAD]
  - id: trial
    hosts: [trial.example.com]
    methods: [GET]
    mode: report
"""

ENGINE = Engine.build(compile_policy(POLICY, "test.yaml"))
DISALLOWED = ("DELETE", "PUT", "PATCH", "POST", "PROPFIND", "PURGE", "MOVE")


def decide(target: str, method: str = "GET", headers=(), host: str = "api.example.com"):
    return ENGINE.check_request(RequestFacts(canonical_host(host), 443, "https", method, target, tuple(headers)))


def _case(text: str, rnd: random.Random) -> str:
    return "".join(c.upper() if rnd.random() < 0.5 else c.lower() for c in text)


# --- spellings -----------------------------------------------------------------------------------


@given(st.sampled_from(methods.OVERRIDE_HEADERS), st.randoms(use_true_random=False), st.sampled_from(DISALLOWED))
def test_every_header_spelling_is_an_override(name, rnd, method):
    spelled = "".join("_" if c == "-" and rnd.random() < 0.5 else c for c in _case(name, rnd))
    value = _case(method, rnd)
    found = overrides([(spelled, f" {value}\t")], "/")
    assert found == (Override("header", spelled, method),)
    decision = decide("/", headers=[(spelled, value)], host="ro.example.com")
    assert (decision.allowed, decision.reason, decision.rule) == (False, "method_not_allowed", "ro")
    assert spelled in decision.message and method in decision.message


_PHP_LIKE = {"_": ["_", ".", "%20", "%5F", "%5f", "%2E", "+"], "-": ["-", "_", ".", "%2D"]}


def _spell_field(name: str, rnd: random.Random) -> str:
    out = []
    for i, c in enumerate(_case(name, rnd)):
        choices = _PHP_LIKE.get(c)
        if choices and i == 0:  # PHP drops leading spaces: a leading "_" must stay a "_" or a "."
            choices = ["_", ".", "%5F", "%2E"]
        if choices:
            out.append(rnd.choice(choices))
        elif rnd.random() < 0.2:
            out.append("%%%02X" % ord(c))
        else:
            out.append(c)
    text = "".join(out)
    if rnd.random() < 0.2:
        text += "[]"
    if rnd.random() < 0.2:
        text = quote(text, safe="")  # encoded once more: the gateway decodes up to four times
    return text


@given(st.sampled_from(methods.OVERRIDE_FIELDS), st.randoms(use_true_random=False), st.sampled_from(DISALLOWED))
def test_every_query_spelling_is_an_override(name, rnd, method):
    if name.startswith("_") and not name.startswith("_method_"):
        name = "_method"
    spelled = _spell_field(name, rnd)
    value = rnd.choice([method, method.lower(), quote(method, safe=""), "%%%02X%s" % (ord(method[0]), method[1:]),
                        f"+{method}+", f"GET,{method}"])
    target = f"/x?a=1&{spelled}={value}&b=2"
    found = overrides((), target)
    assert method in [o.method for o in found], (target, found)
    decision = decide(target, host="ro.example.com")
    assert (decision.allowed, decision.reason) == (False, "method_not_allowed"), (target, decision)


@pytest.mark.parametrize("target", [
    "/x?x_method=DELETE", "/x?_methods=DELETE", "/x?_methodx=DELETE", "/x?method_=DELETE", "/x?amethod=DELETE",
    "/x?method=flickr.photos.search", "/x?method=subtract", "/x?method=sms", "/x?_method=", "/x?_method",
    "/x?q=_method%3DDELETE",
])
def test_look_alikes_and_api_parameters_are_not_overrides(target):
    assert overrides((), target) == ()
    assert decide(target).allowed


@pytest.mark.parametrize("headers", [
    [("X-HTTP-Method-Override-Not", "DELETE")], [("X-Override", "DELETE")], [("Method", "DELETE")],
    [("X-HTTP-Method-Override", "")], [("X-HTTP-Method-Override", " , ")],
])
def test_headers_that_are_not_overrides(headers):
    assert overrides(headers, "/") == ()
    assert decide("/", headers=headers).allowed


@pytest.mark.parametrize("value", ["DELETE;x", "DEL ETE", "DÉLETE", "DELETE\x00", "GET/1", "ſearch", "\"GET\""])
def test_a_value_that_is_not_a_method_token_is_refused(value):
    [found] = overrides([("X-HTTP-Method-Override", value)], "/")
    assert found.method is None and found.describe() == f"header X-HTTP-Method-Override: {methods.NOT_A_METHOD}"
    decision = decide("/", headers=[("X-HTTP-Method-Override", value)])
    assert (decision.allowed, decision.reason) == (False, "method_not_allowed")


def test_every_element_of_a_list_and_every_duplicate_counts():
    assert [o.method for o in overrides([("X-HTTP-Method-Override", "GET, DELETE"),
                                         ("x-method-override", "head")], "/?_method=GET&_method=PUT")] == [
        "GET", "DELETE", "HEAD", "GET", "PUT"]
    assert not decide("/", headers=[("X-HTTP-Method-Override", "GET"), ("X-HTTP-Method-Override", "DELETE")]).allowed
    assert not decide("/?_method=GET;_method=DELETE").allowed


def test_the_generic_name_counts_only_with_a_registered_method():
    assert [o.method for o in overrides((), "/?method=delete&method=eth_call&method=PROPFIND")] == ["DELETE",
                                                                                                     "PROPFIND"]


# --- the engine ----------------------------------------------------------------------------------


def test_allowed_overrides_pass_and_the_message_names_them():
    decision = decide("/", "POST", [("X-HTTP-Method-Override", "GET")], host="open.example.com")
    assert decision.allowed and "header X-HTTP-Method-Override: GET" in decision.message
    assert decide("/", headers=[("X-HTTP-Method-Override", "head")]).allowed


def test_the_rule_that_allows_every_named_method_decides():
    decision = decide("/write/x", headers=[("X-HTTP-Method-Override", "DELETE")])
    assert (decision.allowed, decision.rule) == (True, "write")
    decision = decide("/other", headers=[("X-HTTP-Method-Override", "DELETE")])
    # read fails at the method stage (the override), write at the path: the furthest one explains.
    assert (decision.allowed, decision.reason, decision.rule) == (False, "path_not_allowed", "write")
    assert any("rule read: method override header X-HTTP-Method-Override: DELETE" in n for n in decision.notes)


@pytest.mark.parametrize("method", ["TRACE", "track", "CONNECT"])
def test_overrides_to_forbidden_methods_are_method_forbidden(method):
    for kwargs in ({"headers": [("X-HTTP-Method", method)]}, {"target": f"/?_method={method}"}):
        decision = decide(kwargs.get("target", "/"), headers=kwargs.get("headers", ()), host="open.example.com")
        assert (decision.allowed, decision.reason) == (False, "method_forbidden")


def test_report_mode_reports_an_override():
    decision = decide("/", headers=[("X-HTTP-Method-Override", "DELETE")], host="trial.example.com")
    assert (decision.allowed, decision.would_deny, decision.reason) == (True, True, "method_not_allowed")
    assert decision.verdict == "would_deny"


def test_default_methods_rule_refuses_non_standard_overrides():
    assert decide("/", headers=[("X-HTTP-Method-Override", "DELETE")], host="open.example.com").allowed
    decision = decide("/", headers=[("X-HTTP-Method-Override", "PROPFIND")], host="open.example.com")
    assert (decision.allowed, decision.reason) == (False, "method_not_allowed")


def test_audit_descriptions_round_trip_to_headers():
    found = overrides([("X-HTTP-Method-Override", "GET, DELETE"), ("X_Method_Override", "x;y")], "/?_method=PUT")
    described = [o.describe() for o in found]
    assert described == ["header X-HTTP-Method-Override: GET", "header X-HTTP-Method-Override: DELETE",
                         f"header X_Method_Override: {methods.NOT_A_METHOD}", "query parameter _method: PUT"]
    again = overrides(methods.parse_described(described), "/?_method=PUT")
    assert [o.describe() for o in again] == described


# --- bodies --------------------------------------------------------------------------------------


def scan(headers, body: bytes, cuts=()) -> list[Override]:
    scanner = BodyScanner.for_headers(headers)
    assert scanner is not None
    found, start = [], 0
    for cut in sorted(cuts) + [len(body)]:
        found += scanner.feed(body[start:cut])
        start = cut
    return found + scanner.finish()


def _form_field(name: str, value: str) -> bytes:
    return f"{name}={value}".encode()


def _multipart_field(name: str, value: str, boundary: str = "bNd") -> bytes:
    return f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["title", "x_method", "methods", "_method", "_METHOD", "_method[]"]),
                          st.sampled_from(["DELETE", "GET", "patch", "hello", "POST"])), max_size=6),
       st.sampled_from(["form", "multipart", "json"]), st.lists(st.integers(0, 400), max_size=6))
def test_bodies_give_the_same_answer_in_any_chunking(fields, kind, cuts):
    if kind == "form":
        headers = [("Content-Type", "application/x-www-form-urlencoded")]
        body = b"&".join(_form_field(n, v) for n, v in fields)
    elif kind == "multipart":
        headers = [("Content-Type", "multipart/form-data; boundary=bNd")]
        body = b"".join(_multipart_field(n, v) for n, v in fields) + b"--bNd--\r\n"
    else:
        headers = [("Content-Type", "application/json")]
        body = json.dumps(dict(fields) | {"nested": {"_method": "DELETE"}}).encode()
        fields = list(dict(fields).items())
    expected = [v.upper() for n, v in fields if n.lower().removesuffix("[]") == "_method"]
    found = scan(headers, body, [c for c in cuts if c <= len(body)])
    assert [o.method for o in found] == expected, (body, found)
    assert found == scan(headers, body)


@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=5),
       st.sampled_from(["application/x-www-form-urlencoded", "multipart/form-data; boundary=bNd", "application/json",
                        None]))
def test_arbitrary_bytes_never_crash_the_scanner_and_chunking_does_not_matter(body, cuts, content_type):
    headers = [("Content-Type", content_type)] if content_type else []
    assert scan(headers, body, [c for c in cuts if c <= len(body)]) == scan(headers, body)


def test_multipart_spellings():
    cases = [
        (b'--B\r\ncontent-disposition: form-data; NAME="_method"\r\n\r\nDELETE\r\n--B--', "DELETE"),
        (b"--B\r\nContent-Disposition: form-data; name=_method\r\n\r\nput\r\n--B--", "PUT"),
        (b"--B\r\nContent-Disposition: form-data; name*=utf-8''%5Fmethod\r\n\r\nPATCH\r\n--B--", "PATCH"),
        (b'--B\nContent-Disposition: form-data; name="_method"\n\nDELETE\n--B--', "DELETE"),  # bare LF
        (b'--B\r\nContent-Disposition: form-data; name="_method"\r\n\r\nDELETE', "DELETE"),  # never closed
        (b'junk--B\r\nContent-Disposition: form-data; name="x"; filename="a"\r\n\r\n1\r\n--B\r\n'
         b'Content-Type: text/plain\r\nContent-Disposition: form-data; name="_method"\r\n\r\nDELETE\r\n--B--', "DELETE"),
    ]
    for body, method in cases:
        found = scan([("Content-Type", 'multipart/form-data; boundary="B"')], body)
        assert [o.method for o in found] == [method], body
    assert scan([("Content-Type", "multipart/form-data; boundary=B")],
                b'--B\r\nContent-Disposition: form-data; filename="_method"\r\n\r\nDELETE\r\n--B--') == []


def test_json_spellings_and_non_strings():
    def found(body: bytes):
        return [o.method for o in scan([("Content-Type", "application/problem+json")], body)]

    assert found(b'{"_method":"GET","_method":"DELETE"}') == ["GET", "DELETE"]  # PHP: the last wins
    assert found(b'  {"\\u005f\\u006dethod" : "\\u0044ELETE"}') == ["DELETE"]
    assert found(b'{"_method": 5, "_method": ["DELETE"], "_method": {"a": "DELETE"}, "b": "_method"}') == []
    assert found(b'["_method", "DELETE"]') == []
    assert found(b'{"a": "x\\"_method\\": \\"DELETE"}') == []
    assert found(b'{"_method": "DEL\\tETE"}') == [None]


def test_which_bodies_are_scanned():
    assert BodyScanner.for_headers([]) is not None  # Rack parses a body without a type as a form
    assert BodyScanner.for_headers([("Content-Type", "text/plain")]) is None
    assert BodyScanner.for_headers([("Content-Type", "application/octet-stream")]) is None
    # No boundary: the body's first line still names one for a parser that guesses it.
    assert BodyScanner.for_headers([("Content-Type", "multipart/form-data")]) is not None
    # A coding nobody here decodes: the bytes as sent are still read (PHP ignores Content-Encoding).
    assert BodyScanner.for_headers([("Content-Type", "application/json"), ("Content-Encoding", "gzip")]) is not None
    assert BodyScanner.for_headers([("Content-Type", "application/x-git-upload-pack-request")]) is None
    from gateway.decompress import streaming_decoder

    assert BodyScanner.for_headers([("Content-Encoding", "gzip")], streaming_decoder) is not None
    assert BodyScanner.for_headers([("Content-Encoding", "gzip, br")], streaming_decoder).decoders  # stacked: both


def test_compressed_bodies_are_decoded_for_the_scan():
    import gzip

    from gateway.decompress import streaming_decoder

    body = gzip.compress(b"a=1&_method=DELETE")
    scanner = BodyScanner.for_headers([("Content-Encoding", "gzip")], streaming_decoder)
    found = scanner.feed(body[:7]) + scanner.feed(body[7:]) + scanner.finish()
    assert [o.method for o in found] == ["DELETE"]
    broken = BodyScanner.for_headers([("Content-Encoding", "gzip")], streaming_decoder)
    # The bytes as sent name DELETE (PHP reads them so); and a body that does not decode is uncheckable.
    assert [o.method for o in broken.feed(b"not gzip at all &_method=DELETE&")] == ["DELETE"]
    assert broken.problem and not broken.pending


def test_long_values_and_part_headers():
    [o] = scan([], b"_method=" + b"A" * (methods.VALUE_CAP + 1))
    assert o.method is None
    scanner = BodyScanner.for_headers([("Content-Type", "multipart/form-data; boundary=B")])
    scanner.feed(b"--B\r\nX-Pad: " + b"p" * (70 * 1024))
    assert scanner.unreadable


def test_body_refusals():
    rule = ENGINE.policy.rules_by_id["read"]
    assert body_override_refusal(rule, "GET", [Override("form", "_method", "HEAD")]) is None
    refusal = body_override_refusal(rule, "POST", [Override("form", "_method", "DELETE")])
    assert (refusal.reason, refusal.rule) == ("method_not_allowed", "read")
    assert "form field _method: DELETE" in refusal.message
    assert body_override_refusal(rule, "POST", [Override("json", "_method", "TRACE")]).reason == "method_forbidden"


@settings(max_examples=400)
@given(st.lists(st.sampled_from([b"a=1", b"_method=DELETE", b"_method=", b"_meth", b"od=PUT", b"&", b";", b"=",
                                 b"x", b"%5F", b"method=GET"]), max_size=8), st.integers(0, 200),
       st.sampled_from(["form", "multipart"]))
def test_not_pending_means_the_end_of_the_body_cannot_refuse(pieces, split, kind):
    """The streaming layer forwards everything it has unless the scanner is pending: that is only
    safe if ending the body right there could not reveal an override `feed` has not reported."""
    body = b"".join(pieces)
    headers = [("Content-Type", "application/x-www-form-urlencoded")]
    if kind == "multipart":
        headers = [("Content-Type", "multipart/form-data; boundary=b")]
        body = b'--b\r\nContent-Disposition: form-data; name="_method"\r\n\r\n' + body
    split = min(split, len(body))
    probe = BodyScanner.for_headers(headers)
    probe.feed(body[:split])
    pending = probe.pending
    ended = BodyScanner.for_headers(headers)
    ended.feed(body[:split])
    if not pending:
        assert ended.finish() == [], (body[:split], kind)


def test_pending_while_an_override_value_is_open():
    scanner = BodyScanner.for_headers([("Content-Type", "application/x-www-form-urlencoded")])
    assert scanner.feed(b"a=1&_meth") == [] and not scanner.pending
    assert scanner.feed(b"od=DEL") == [] and scanner.pending
    assert [o.method for o in scanner.feed(b"ETE&")] == ["DELETE"] and not scanner.pending
    json_scanner = BodyScanner.for_headers([("Content-Type", "application/json")])
    json_scanner.feed(b'{"_method": "DEL')
    assert not json_scanner.pending  # a JSON string only counts once closed


def test_a_failing_body_check_fails_closed():
    from addons.method_body import BodyOverrideCheck

    class Broken:
        pending = True
        problem = None
        decoders = ()

        def feed_steps(self, data):  # (BodyScanner's steps)
            raise RuntimeError("bug")
            yield

        def close(self):
            pass

    recorded = []
    check = BodyOverrideCheck(Broken(), lambda found: None, lambda d, found: recorded.append(d.reason), bound=False)
    refusal = check.feed(b"x")
    assert (refusal.allowed, refusal.reason, refusal.status) == (False, "internal_error", 500)
    assert recorded == ["internal_error"] and not check.pending and check.feed(b"y") is None


@pytest.mark.parametrize("name", ["X.HTTP.Method.Override", "x~http~method~override", "X HTTP-Method-Override",
                                  "X_HTTP.METHOD-OVERRIDE", "X.Method.Override", "x@http@method"])
def test_header_names_are_read_as_cgi_servers_file_them(name):
    """PHP's built-in server (and CGI environments) turn every non-alphanumeric character of a
    header name into `_`: `X.HTTP.Method.Override` is Symfony's X-HTTP-Method-Override (review 14a F5)."""
    assert [o.method for o in overrides([(name, "DELETE")], "/")] == ["DELETE"]


def test_header_names_that_no_server_reads_as_an_override():
    for name in ("X-HTTP-Method-Override.", "X-HTTP-Method-Override~", "XHTTPMethodOverride", "X-HTTP-Method-Overrides"):
        assert overrides([(name, "DELETE")], "/") == ()


def test_salesforce_httpmethod_parameter():
    assert [o.method for o in overrides([], "/services/data/v60.0/sobjects/Account/1?_HttpMethod=PATCH")] == ["PATCH"]
    assert [o.method for o in scan([], b"_HttpMethod=DELETE")] == ["DELETE"]


def test_replayed_query_overrides_parse_back():
    described = [o.describe() for o in overrides([], "/?_method=PUT&_method=x;y&X-HTTP-Method=DELETE,GET")]
    back = methods.described_query_overrides(described + ["header X-HTTP-Method-Override: PATCH"])
    assert [o.describe() for o in back] == described
    assert methods.described_query_overrides(["query parameter _method: DEL ETE"])[0].method is None
