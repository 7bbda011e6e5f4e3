"""The shipped JSON Schema (draft 2020-12) and the policy loader agree.

- Every example policy in policies/ is valid for both.
- Every file in tests/policy_cases/invalid/ is rejected by both, and at the key path its first line
  names (`# expect: PATH`): the loader reports an issue at exactly that path, the schema an error
  at that path, one of its parents or one of its children.
- Every file in tests/policy_cases/loader_only/ is rejected by the loader (at its path) and accepted
  by the schema: the places a schema cannot express, listed in docs/policy.md.
"""

from __future__ import annotations

import json
from importlib import resources

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.policy import PolicyError, compile_policy

from .helpers import CASES, POLICIES, ROOT

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema comes with the test extra (pip install -e .[test])")

SCHEMA_HEADER = "# yaml-language-server: $schema=./policy.schema.json"
EXAMPLES = sorted(POLICIES.glob("*.yaml"))
INVALID = sorted((CASES / "invalid").glob("*.yaml"))
LOADER_ONLY = sorted((CASES / "loader_only").glob("*.yaml"))


SCHEMA = json.loads((ROOT / "gateway" / "policy.schema.json").read_text(encoding="utf-8"))
TEMPLATE = jsonschema.Draft202012Validator(SCHEMA["$defs"]["template"])


@pytest.fixture(scope="module")
def validator():
    return jsonschema.Draft202012Validator(SCHEMA)


def _expected_path(text: str) -> str:
    first = text.splitlines()[0]
    assert first.startswith("# expect:"), "the first line must be '# expect: KEY.PATH'"
    return first.split(":", 1)[1].strip()


def _schema_path(error) -> str:
    out = ""
    for part in error.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _within(parent: str, path: str) -> bool:
    return parent == "" or path == parent or path.startswith(parent + ".") or path.startswith(parent + "[")


def test_shipped_schemas_are_identical():
    assert (ROOT / "gateway" / "policy.schema.json").read_bytes() == (POLICIES / "policy.schema.json").read_bytes()


def test_schema_is_a_valid_draft_2020_12_schema(validator):
    assert validator.schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(validator.schema)


def test_schema_is_package_data():
    shipped = resources.files("gateway").joinpath("policy.schema.json")
    assert shipped.is_file()
    assert json.loads(shipped.read_text(encoding="utf-8"))["title"].startswith("egress-gateway policy")


def test_there_are_cases():
    assert len(EXAMPLES) >= 4 and len(INVALID) >= 40 and len(LOADER_ONLY) >= 10


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_policies_are_valid_for_both(path, validator):
    text = path.read_text(encoding="utf-8")
    assert text.splitlines()[0] == SCHEMA_HEADER, f"{path.name} must start with {SCHEMA_HEADER!r}"
    errors = [f"{_schema_path(e)}: {e.message}" for e in validator.iter_errors(yaml.safe_load(text))]
    assert not errors, errors
    compile_policy(text, path.name)


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_invalid_cases_are_rejected_by_both(path, validator):
    text = path.read_text(encoding="utf-8")
    expected = _expected_path(text)
    errors = list(validator.iter_errors(yaml.safe_load(text)))
    assert errors, "the schema accepts it"
    paths = [_schema_path(e) for e in errors]
    assert any(_within(p, expected) or _within(expected, p) for p in paths), (expected, paths)
    with pytest.raises(PolicyError) as info:
        compile_policy(text, path.name)
    found = [i.path for i in info.value.issues]
    assert expected in found, (expected, [str(i) for i in info.value.issues])


@pytest.mark.parametrize("path", LOADER_ONLY, ids=lambda p: p.stem)
def test_loader_only_cases(path, validator):
    """What the loader alone rejects (documented in docs/policy.md): the schema accepts these."""
    text = path.read_text(encoding="utf-8")
    expected = _expected_path(text)
    errors = [f"{_schema_path(e)}: {e.message}" for e in validator.iter_errors(yaml.safe_load(text))]
    assert not errors, f"the schema rejects it too: move it to invalid/ ({errors})"
    with pytest.raises(PolicyError) as info:
        compile_policy(text, path.name)
    found = [i.path for i in info.value.issues]
    assert expected in found, (expected, [str(i) for i in info.value.issues])


def test_forbidden_inject_headers_agree(validator):
    """The schema's list of headers that cannot be injected is the loader's."""
    from gateway.credentials import FORBIDDEN_INJECT_HEADERS

    header = validator.schema["$defs"]["injection"]["properties"]["header"]
    check = jsonschema.Draft202012Validator(header)
    for name in FORBIDDEN_INJECT_HEADERS:
        for spelling in (name, name.upper(), name.title()):
            assert not check.is_valid(spelling), spelling
    for name in ("Authorization", "x-api-key", "X-Goog-Api-Key", "Cookie"):
        assert check.is_valid(name), name


_TEMPLATE_PIECES = st.sampled_from(["$", "{", "}", "secrets.", "TOKEN", "_1", " ", "x", "env.", "\n", "\t", "Bearer "])


def _template_verdicts_agree(value: str) -> None:
    from gateway.credentials import Template, TemplateError

    by_schema = TEMPLATE.is_valid(value)
    try:
        by_loader = bool(Template.parse(value).secrets)
    except TemplateError:
        by_loader = False
    assert by_schema == by_loader, value


TRICKY_TEMPLATES = [
    "Bearer ${secrets.TOKEN}", "${secrets.TOKEN}", "${ secrets.TOKEN }", "$${secrets.TOKEN}", "$$${secrets.TOKEN}",
    "$${x} ${secrets.TOKEN}", "${secrets.TOKEN", "Bearer ${secrets.TOKEN}\n", "${env.TOKEN}", "${secrets.1A}",
    "${secrets.}", "${}", "$", "plain", "${secrets.TOKEN}${secrets.B}", "a$b${secrets.TOKEN}", "${secrets.T\tOKEN}",
    "${secrets.TOKEN}\x00", "${secrets." + "A" * 64 + "}", "${secrets." + "A" * 65 + "}",
]


@pytest.mark.parametrize("value", TRICKY_TEMPLATES)
def test_inject_value_templates_agree_on_edge_cases(value):
    """The schema's template patterns accept exactly the values the loader's template parser does
    (a valid template with at least one secret reference)."""
    _template_verdicts_agree(value)


@settings(max_examples=300, deadline=None)
@given(st.lists(_TEMPLATE_PIECES, min_size=1, max_size=9).map("".join))
def test_inject_value_templates_agree(value):
    _template_verdicts_agree(value)


REFUSAL_MESSAGE = jsonschema.Draft202012Validator(SCHEMA["$defs"]["refusalMessage"])
_MESSAGE_PIECES = st.sampled_from(["{", "}", "{{", "}}", "reason", "rule", "host", "status", "sandbox", "owner",
                                   " ", "x", ":", "\t", "\n", "\x7f", "\x85", "\u2028", "é", "{host:>9}", "{0}"])


def _message_verdicts_agree(value: str) -> None:
    from gateway.refusal_page import MessageTemplate, MessageTemplateError

    by_schema = REFUSAL_MESSAGE.is_valid(value)
    try:
        MessageTemplate.parse(value)
        by_loader = True
    except MessageTemplateError:
        by_loader = False
    assert by_schema == by_loader, value


TRICKY_MESSAGES = [
    "Blocked ({reason}); ask in #access quoting {rule} and {host}", "{{host}}", "{{{host}}}", "{host", "host}",
    "{}", "{ host }", "{HOST}", "{status}{sandbox}", "tab\there", "", "a" * 500, "a" * 501, "{host}" * 83,
    "bell\x07", "next line\x85", "ok – é ✓",
]


@pytest.mark.parametrize("value", TRICKY_MESSAGES)
def test_refusal_message_templates_agree_on_edge_cases(value):
    """The schema's refusals.message pattern accepts exactly the templates the loader compiles."""
    _message_verdicts_agree(value)


@settings(max_examples=300, deadline=None)
@given(st.lists(_MESSAGE_PIECES, min_size=1, max_size=9).map("".join))
def test_refusal_message_templates_agree(value):
    _message_verdicts_agree(value)
