"""No audit line a client can shape is large (review of issue 15): values are capped (strings,
lists and dicts), a line is capped as a whole (MAX_LINE_BYTES, the longest client values shortened
and named in `truncated`), the chain stays valid, and method overrides are described distinct and
capped (gateway/methods/overrides.py), found once and in linear time."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import audit, methods
from gateway.audit import MAX_LINE_BYTES, AuditLog, verify_chain
from gateway.engine import RequestFacts
from gateway.hostnames import canonical_host


def _lines(path) -> list[bytes]:
    return path.read_bytes().splitlines()


def test_a_list_value_is_capped_in_entries(tmp_path):
    log = AuditLog(str(tmp_path / "a.log"))
    entry = log.record(event="request", decision="allow", method_override=["header X: GET"] * 15000)
    assert len(entry["method_override"]) == audit.MAX_ITEMS + 1
    assert entry["method_override"][-1] == f"+{15000 - audit.MAX_ITEMS} more"
    assert len(_lines(tmp_path / "a.log")[0]) <= MAX_LINE_BYTES


def test_a_dict_value_is_capped_and_deep_nesting_is_cut(tmp_path):
    log = AuditLog(str(tmp_path / "a.log"))
    nested: object = "x"
    for _ in range(10):
        nested = [nested]
    entry = log.record(event="x", extra={str(i): i for i in range(100)}, deep=nested)
    assert len(entry["extra"]) == audit.MAX_ITEMS + 1
    assert "[nested]" in json.dumps(entry["deep"])


def test_a_line_over_the_cap_is_shortened_marked_and_stays_chained(tmp_path):
    path = tmp_path / "a.log"
    log = AuditLog(str(path), chain=True)
    for _ in range(3):
        entry = log.record(event="request", decision="deny", reason="no_rule", path="/" + "p" * 2047,
                           host_header="h" * 2047, sni="s" * 2047, host="x" * 2047, message="m" * 2047)
    assert set(entry["truncated"]) >= {"path"}
    for raw in _lines(path):
        assert len(raw) <= MAX_LINE_BYTES
        line = json.loads(raw)
        assert (line["decision"], line["reason"]) == ("deny", "no_rule")
    assert verify_chain([str(path)]).ok


def test_a_line_under_the_cap_is_written_as_it_is(tmp_path):
    log = AuditLog(str(tmp_path / "a.log"))
    entry = log.record(event="request", decision="allow", path="/" + "p" * 2000)
    assert "truncated" not in entry and entry["path"] == "/" + "p" * 2000


_client_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=3000)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(["path", "host_header", "sni", "host", "message", "client", "extra"]),
                       st.one_of(_client_text, st.lists(_client_text, max_size=50)), max_size=7))
def test_any_client_values_fit_the_line_cap(tmp_path_factory, values):
    path = tmp_path_factory.mktemp("cap") / "a.log"
    log = AuditLog(str(path), chain=True)
    log.record(event="request", decision="deny", reason="no_rule", **values)
    [raw] = _lines(path)
    assert len(raw) <= MAX_LINE_BYTES
    assert json.loads(raw)["reason"] == "no_rule"
    assert verify_chain([str(path)]).ok


# --- method overrides: distinct, capped, found once ------------------------------------------------


def test_repeated_override_elements_are_one_override():
    found = methods.overrides([("X-HTTP-Method-Override", ",".join(["GET"] * 15000))],
                              "/?" + "&".join(["_method=GET"] * 5000))
    assert [o.describe() for o in found] == ["header X-HTTP-Method-Override: GET", "query parameter _method: GET"]


def test_too_many_distinct_overrides_end_in_one_that_names_no_method():
    for found in (methods.overrides([("X-HTTP-Method-Override", ",".join(f"M{i}" for i in range(5000)))], "/"),
                  methods.overrides([], "/?" + "&".join(f"_method=M{i}" for i in range(5000)))):
        assert len(found) == methods.MAX_ELEMENTS + 1
        assert found[-1].method is None  # refused whatever the rule allows
        assert methods.refused(found, lambda m: True) is found[-1]


def test_described_overrides_are_distinct_and_capped():
    found = methods.overrides([("X-HTTP-Method-Override", ",".join(f"M{i}" for i in range(40)))], "/")
    described = methods.described(found)
    assert len(described) == methods.DESCRIBED_CAP + 1 and described[-1] == f"+{40 - methods.DESCRIBED_CAP} more"
    assert methods.described(found[:3]) == [o.describe() for o in found[:3]]


def test_request_facts_find_the_overrides_once(monkeypatch):
    calls = []
    real = methods.overrides
    monkeypatch.setattr(methods, "overrides", lambda *a: calls.append(1) or real(*a))
    facts = RequestFacts(canonical_host("api.test"), 443, "https", "GET", "/?_method=GET",
                         (("X-HTTP-Method-Override", "GET"),))
    for _ in range(3):
        assert len(facts.overrides) == 2
    assert len(calls) == 1


def test_override_scanning_is_linear():
    """Doubling a header of distinct fields must not much more than double the work (a quadratic
    scan would quadruple it); counted in calls to the override constructor, not in time."""
    counts = []
    for n in (2000, 4000):
        made = []
        real = methods.Override
        methods.Override = lambda *a, _r=real: made.append(1) or _r(*a)  # type: ignore[misc]
        try:
            methods.overrides([("X-HTTP-Method-Override", ",".join(["GET"] * n))],
                              "/?" + "&".join(f"a{i}=1" for i in range(n)) + "&" + "&".join(["_method=GET"] * n))
        finally:
            methods.Override = real  # type: ignore[misc]
        counts.append(len(made))
    assert counts[1] <= 2 * counts[0] + 2 and counts[0] <= 4, counts


def test_a_body_naming_too_many_distinct_overrides_is_refused():
    """As for a header: past 64 distinct overrides the body counts as naming no method."""
    from addons.method_body import BodyOverrideCheck
    from gateway.decision import Decision

    class Scanner:
        problem = None
        pending = False
        decoders = ()

        def __init__(self, batches):
            self.batches = batches

        def feed_steps(self, data):  # (BodyScanner's steps: nothing to decode here)
            return self.batches.pop(0)
            yield

        def close(self):
            pass

    batches = [[methods.Override("form", "_method", f"M{i}") for i in range(j * 40, j * 40 + 40)] for j in range(3)]
    recorded = []
    judge = lambda found: None if all(o.method for o in found) else Decision.deny("method_not_allowed", "x")  # noqa: E731
    check = BodyOverrideCheck(Scanner(batches), judge, lambda d, f: recorded.append(f), bound=False)
    assert check.feed(b"") is None  # 40 distinct, all allowed
    refusal = check.feed(b"")  # 80 distinct: past the cap
    assert refusal is not None and refusal.reason == "method_not_allowed"
    assert len(recorded[0]) == methods.MAX_ELEMENTS + 1 and recorded[0][-1].method is None
