"""Decision and the closed set of reason codes."""

from __future__ import annotations

import pytest

from gateway.decision import REASON_HEADER, REASONS, RULE_HEADER, Decision


def test_headers():
    assert REASON_HEADER == "X-Egress-Reason"
    assert RULE_HEADER == "X-Egress-Rule"


@pytest.mark.parametrize(
    "reason, status",
    [
        ("allowed", 200), ("no_rule", 403), ("port_not_allowed", 403), ("scheme_not_allowed", 403),
        ("method_not_allowed", 403), ("path_not_allowed", 403), ("method_forbidden", 403), ("denied_address", 403),
        ("self_address", 403), ("sni_mismatch", 421), ("host_mismatch", 421), ("authority_mismatch", 421),
        ("bad_host", 400), ("bad_path", 400), ("bad_host_header", 400), ("bad_header", 400), ("upgrade_refused", 400),
        ("resolve_failed", 502), ("internal_error", 500), ("unsolicited_upgrade", 502),
    ],
)
def test_status_codes(reason, status):
    assert REASONS[reason][0] == status
    if reason != "allowed":
        assert Decision.deny(reason, "m").status == status


def test_allow_and_deny():
    allowed = Decision.allow("r1", "fine")
    assert allowed == Decision(True, "allowed", "fine", "r1", [])
    assert allowed.status == 200
    denied = Decision.deny("no_rule", "nope", "r2", ["a", "b"])
    assert denied == Decision(False, "no_rule", "nope", "r2", ["a", "b"])
    assert Decision.deny("bad_path", "x").notes == []


def test_unknown_reason_refused():
    with pytest.raises(KeyError):
        Decision.deny("made_up", "x")


def test_notes_are_not_shared():
    a = Decision.deny("no_rule", "a")
    b = Decision.deny("no_rule", "b")
    a.notes.append("x")
    assert b.notes == []


def test_body():
    assert Decision.deny("no_rule", "no rule allows a.test:443").body() == (
        "egress gateway: no rule allows a.test:443\nreason: no_rule\n"
    )
    assert Decision.deny("port_not_allowed", "msg", "r1", ["rule r1: port 22 not in [443]"]).body() == (
        "egress gateway: msg\nreason: port_not_allowed\nrule: r1\nrule r1: port 22 not in [443]\n"
    )


def test_every_reason_has_a_status_and_meaning():
    for code, (status, meaning) in REASONS.items():
        assert code == code.lower()
        assert status in (200, 400, 403, 407, 408, 413, 421, 429, 431, 500, 502, 503, 504)
        assert meaning
