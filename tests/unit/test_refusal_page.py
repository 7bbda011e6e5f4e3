"""Refusal bodies (gateway/refusal_page.py): the policy's message template, the text and JSON
formats, negotiation on Accept, and the promise that no body carries a control character or passes
MAX_BODY_BYTES whatever the values it is built from."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.decision import Decision
from gateway.policy import PolicyError, compile_policy
from gateway.refusal_page import (
    DEFAULT_STYLE, JSON_TYPE, MAX_BODY_BYTES, MAX_MESSAGE_CHARS, MAX_NOTES, TEXT_TYPE, MessageTemplate,
    MessageTemplateError, RefusalStyle, clean, prefers_json,
)

TEMPLATE = "Blocked ({reason}, {status}). Ask in #platform-access quoting rule {rule}, host {host}, sandbox {sandbox}."
JSON_KEYS = ["reason", "status", "message", "detail", "rule", "host", "sandbox", "retry_after", "notes"]


def _style(fmt: str = "text", template: str | None = TEMPLATE) -> RefusalStyle:
    return RefusalStyle(MessageTemplate.parse(template) if template else None, fmt)


def test_without_a_policy_setting_the_text_body_is_as_it_always_was():
    decision = Decision.deny("port_not_allowed", "msg", "r1", ["rule r1: port 22 not in [443]"])
    page = DEFAULT_STYLE.page(decision, "a.test", "ci")
    assert page.content_type == TEXT_TYPE
    assert page.body == b"egress gateway: msg\nreason: port_not_allowed\nrule: r1\nrule r1: port 22 not in [443]\n"
    assert decision.body() == page.body.decode()


def test_the_template_is_the_first_line_of_the_text_body():
    decision = Decision.deny("no_rule", "no rule allows pypi.org:443")
    body = _style().page(decision, "pypi.org", "agent-7").body.decode()
    assert body.splitlines() == [
        "Blocked (no_rule, 403). Ask in #platform-access quoting rule (none), host pypi.org, sandbox agent-7.",
        "egress gateway: no rule allows pypi.org:443", "reason: no_rule"]


def test_the_json_body_has_every_key_null_when_unknown():
    decision = Decision.deny("bad_host", "the destination host or port is malformed")
    page = RefusalStyle(None, "json").page(decision)
    assert page.content_type == JSON_TYPE
    error = json.loads(page.body)["error"]
    assert list(error) == JSON_KEYS
    assert error == {"reason": "bad_host", "status": 400, "message": "the destination host or port is malformed",
                     "detail": "the destination host or port is malformed", "rule": None, "host": None,
                     "sandbox": None, "retry_after": None, "notes": []}


def test_the_json_body_carries_the_message_rule_host_and_retry_after():
    decision = Decision.deny("rate_limited", "too many requests", "github", ["a note"], retry_after=2.2)
    error = json.loads(_style("json").page(decision, "api.github.com", "ci").body)["error"]
    assert error["message"] == ("Blocked (rate_limited, 429). Ask in #platform-access quoting rule github, "
                                "host api.github.com, sandbox ci.")
    assert error["detail"] == "too many requests"
    assert (error["rule"], error["host"], error["sandbox"], error["status"]) == ("github", "api.github.com", "ci", 429)
    assert error["retry_after"] == 3  # what Retry-After says: whole seconds, rounded up
    assert error["notes"] == ["a note"]


@pytest.mark.parametrize("accept, json_wanted", [
    (None, False), ("", False), ("*/*", False), ("text/plain", False), ("text/html", False),
    ("application/json", True), ("application/*", True), ("application/json, text/plain, */*", True),
    ("application/json, */*", True), ("text/plain, application/json", False), ("text/*, application/json", True),
    ("application/json;q=0.5, text/plain", False), ("text/plain;q=0.5, application/json", True),
    ("application/json;q=0", False), ("application/json;q=nan", False), ("application/json;q=x", False),
    ("text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8", False),
    ("text/html, application/json;q=0.9, */*;q=0.8", True), ("APPLICATION/JSON", True),
])
def test_negotiation(accept, json_wanted):
    assert prefers_json(accept) is json_wanted
    page = _style("negotiate").page(Decision.deny("no_rule", "x"), "a.test", None, accept)
    assert page.content_type == (JSON_TYPE if json_wanted else TEXT_TYPE)


def test_text_and_json_formats_ignore_accept():
    decision = Decision.deny("no_rule", "x")
    assert _style("text").page(decision, accept="application/json").content_type == TEXT_TYPE
    assert _style("json").page(decision, accept="text/plain").content_type == JSON_TYPE


@pytest.mark.parametrize("text, why", [
    ("{owner}", "unknown placeholder {owner}"), ("{host:>9999}", "unknown placeholder"), ("{0}", "unknown placeholder"),
    ("{host.__class__}", "unknown placeholder"), ("a {", "unmatched '{'"), ("a }", "unmatched '}'"),
    ("a\tb", "control character U+0009"), ("a\u2028b", "control character U+2028"), ("", "must not be empty"),
    ("x" * 501, "more than 500"),
])
def test_bad_templates_are_refused(text, why):
    with pytest.raises(MessageTemplateError, match=why.replace("{", r"\{").replace("}", r"\}").replace("+", r"\+")):
        MessageTemplate.parse(text)


def test_braces_are_escaped_by_doubling():
    template = MessageTemplate.parse("{{host}} is {host}}}")
    assert template.render({"host": "a.test"}) == "{host} is a.test}"


def test_clean_replaces_controls_format_characters_and_surrogates_and_caps():
    assert clean("a\x1b[31mb\r\nc\u202ed\u2028e\udcff") == "a\ufffd[31mb\ufffd\ufffdc\ufffdd\ufffde\ufffd"
    assert clean("é✓ ok") == "é✓ ok"
    assert clean("x" * 300, 10) == "x" * 9 + "\u2026"


def _load(text: str):
    return compile_policy(text, "p.yaml")


def test_the_policy_key_compiles_the_template_once():
    policy = _load("version: 1\nrefusals:\n  message: 'ask {rule}'\n  format: negotiate\n")
    assert policy.refusals.format == "negotiate"
    assert policy.refusals.template.parts == ((False, "ask "), (True, "rule"))
    assert _load("version: 1\n").refusals is DEFAULT_STYLE


@pytest.mark.parametrize("body, path, line, message", [
    ("refusals:\n  message: 'see {owner}'\n", "refusals.message", 3, "unknown placeholder {owner}"),
    ("refusals:\n  format: html\n", "refusals.format", 3, "'html': format must be one of text, json, negotiate"),
    ("refusals:\n  colour: red\n", "refusals.colour", 3, "unknown key"),
    ("refusals: {}\n", "refusals", 2, "must set at least one of format, message"),
    ("refusals: json\n", "refusals", 2, "must be a mapping"),
    ("refusals:\n  message: 42\n", "refusals.message", 3, "must be a non-empty string"),
])
def test_policy_errors_name_file_line_and_key(body, path, line, message):
    with pytest.raises(PolicyError) as info:
        _load("version: 1\n" + body)
    issue = next(i for i in info.value.issues if i.path == path)
    assert (issue.location.file, issue.location.line) == ("p.yaml", line)
    assert message in issue.message
    assert f"p.yaml:{line}:" in str(info.value) and path in str(info.value)


_ANY_TEXT = st.text(st.characters(codec="utf-8"), max_size=2000) | st.text(
    st.sampled_from("\x00\x07\x1b\r\n\t\x7f\x85\u2028\u2029\u202e\u200b\ufeffa{}\"\\é"), max_size=3000)
_TEMPLATES = st.sampled_from([TEMPLATE, "{host}" * 83, "{rule}{host}{sandbox}" * 23, "plain"])


@settings(max_examples=300, deadline=None)
@given(host=_ANY_TEXT, rule=_ANY_TEXT | st.none(), sandbox=_ANY_TEXT | st.none(), message=_ANY_TEXT,
       notes=st.lists(_ANY_TEXT, max_size=20), template=_TEMPLATES,
       fmt=st.sampled_from(["text", "json"]), retry=st.none() | st.floats(allow_nan=True))
def test_no_body_carries_a_control_character_or_passes_the_cap(host, rule, sandbox, message, notes, template, fmt,
                                                                retry):
    decision = Decision(False, "no_rule", message, rule, notes, retry_after=retry)
    page = _style(fmt, template).page(decision, host, sandbox)
    assert len(page.body) <= MAX_BODY_BYTES
    text = page.body.decode("utf-8")  # never a surrogate, so always encodable
    controls = [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7f <= ord(c) <= 0x9f or c in "\u2028\u2029"]
    assert not controls
    if fmt == "json":
        assert "\n" not in text[:-1]
        error = json.loads(text)["error"]
        assert list(error) == JSON_KEYS
        assert len(error["message"]) <= MAX_MESSAGE_CHARS and len(error["notes"]) <= MAX_NOTES + 1
    else:
        assert len(text.splitlines()) <= 1 + 3 + MAX_NOTES + 1
