"""gateway/sockets.py: the sockets each sandbox holds, its upstream cap, and its share of a worker
whose sockets are taken."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from gateway.sockets import MIN_RESERVE, SocketLedger, worker_limit_for


def test_the_worker_keeps_a_reserve_of_its_open_files():
    assert worker_limit_for(20_000) == 18_000
    assert worker_limit_for(200) == 200 - MIN_RESERVE
    assert worker_limit_for(10) == 1


def test_the_upstream_cap_is_each_sandbox_s_own():
    ledger = SocketLedger(worker_limit=1_000, upstream_limit=2)
    ledger.opened("a", upstream=True)
    ledger.opened("a", upstream=True)
    assert "egress_max_upstream_connections_per_sandbox" in ledger.upstream_refusal("a")
    assert ledger.upstream_refusal("b") is None
    ledger.closed("a", upstream=True)
    assert ledger.upstream_refusal("a") is None
    ledger.closed("a", upstream=True)
    ledger.closed("a", upstream=True)  # (one close too many changes nothing)
    assert ledger.total == 0 and ledger.held("a") == 0


def test_a_taken_worker_refuses_the_sandbox_holding_its_share_and_not_one_below_it():
    ledger = SocketLedger(worker_limit=10)
    for _ in range(9):
        ledger.opened("hog", upstream=False)
    assert ledger.client_refusal("hog") is None  # not taken yet
    ledger.opened("light", upstream=False)
    assert "share" in ledger.client_refusal("hog") and "share" in ledger.upstream_refusal("hog")
    assert ledger.client_refusal("light") is None and ledger.upstream_refusal("light") is None
    assert ledger.client_refusal("new") is None  # holding none: within any share


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 60), st.lists(st.tuples(st.sampled_from("abcd"), st.booleans(), st.booleans()), max_size=200))
def test_a_sandbox_within_its_even_share_is_never_refused_for_the_worker(limit, steps):
    """Whatever the others hold: a sandbox holding less than limit / 4 (its share with all four
    holding) is never refused for the worker's sockets; and the totals always add up."""
    ledger = SocketLedger(worker_limit=limit)
    for key, upstream, opening in steps:
        if opening:
            if ledger.held(key) * 4 < limit:
                assert ledger.client_refusal(key) is None
            if (ledger.upstream_refusal(key) if upstream else ledger.client_refusal(key)) is None:
                ledger.opened(key, upstream)
        else:
            ledger.closed(key, upstream)
        assert ledger.total == sum(ledger.held(k) for k in "abcd")
        assert ledger.total == sum(ledger.clients.values()) + sum(ledger.upstreams.values())
