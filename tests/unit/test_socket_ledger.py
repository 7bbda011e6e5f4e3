"""gateway/sockets.py: the sockets each sandbox holds, its upstream cap, and its share of a worker
whose sockets are taken."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from gateway.sockets import MIN_RESERVE, SocketLedger, worker_limit_for


def test_the_worker_keeps_a_reserve_of_its_open_files():
    assert worker_limit_for(20_000) == 19_000
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


def test_a_taken_worker_refuses_the_sandbox_holding_its_share_and_at_its_limit_everyone():
    ledger = SocketLedger(worker_limit=10)  # from 8 on, only sandboxes under their share
    for _ in range(7):
        ledger.opened("hog", upstream=False)
    assert ledger.client_refusal("hog") is None  # alone, and most is still free
    ledger.opened("hog", upstream=False)
    assert "share" in ledger.client_refusal("hog")  # alone, it keeps the rest for others
    assert ledger.client_refusal("light") is None and ledger.upstream_refusal("light") is None
    ledger.opened("light", upstream=False)
    ledger.opened("light", upstream=True)
    assert "share" in ledger.upstream_refusal("hog")
    assert "all taken" in ledger.client_refusal("light")  # 10 of 10: nobody, however little it holds
    assert "all taken" in ledger.client_refusal("new")
    ledger.closed("hog", upstream=False)
    assert ledger.client_refusal("new") is None


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 60), st.lists(st.tuples(st.sampled_from("abcd"), st.booleans(), st.booleans()), max_size=200))
def test_the_worker_never_holds_more_than_it_shares_out_and_one_under_its_share_is_refused_only_when_all_is_taken(
        limit, steps):
    """Whatever the sandboxes do, taking every socket they are not refused: the total never passes
    the limit (a first version let sandboxes under their share go on past it: EMFILE); a sandbox
    holding less than its share of the soft line is refused only when everything is taken; and the
    totals add up."""
    ledger = SocketLedger(worker_limit=limit)
    for key, upstream, opening in steps:
        if opening:
            refusal = ledger.upstream_refusal(key) if upstream else ledger.client_refusal(key)
            if ledger.held(key) * 4 < ledger.soft and ledger.total < limit:
                assert refusal is None
            if refusal is None:
                ledger.opened(key, upstream)
        else:
            ledger.closed(key, upstream)
        assert ledger.total <= limit
        assert ledger.total == sum(ledger.held(k) for k in "abcd")
        assert ledger.total == sum(ledger.clients.values()) + sum(ledger.upstreams.values())


def test_a_lingering_socket_counts_against_its_sandbox_s_share_until_it_is_gone():
    """A closed socket still sending what was queued is a file until it is gone: released with its
    connection, four sandboxes whose clients never read took a worker to EMFILE (review 40). It
    counts towards the worker's share, not towards the sandbox's upstream cap (it is no connection)."""
    ledger = SocketLedger(worker_limit=10, upstream_limit=1)
    for _ in range(8):
        ledger.opened("reader-never", upstream=False)
        ledger.lingers("reader-never")  # its connection's close: the socket lingers...
        ledger.closed("reader-never", upstream=False)  # ...after the connection is released
    assert ledger.total == 8 and ledger.held("reader-never") == 8 and not ledger.clients
    assert "share" in ledger.client_refusal("reader-never")
    assert ledger.upstream_refusal("other") is None
    ledger.opened("other", upstream=True)
    ledger.opened("other", upstream=False)
    assert "all taken" in ledger.client_refusal("third")
    for _ in range(8):
        ledger.gone("reader-never")
    ledger.gone("reader-never")  # (one too many changes nothing)
    assert ledger.total == 2 and ledger.held("reader-never") == 0 and ledger.client_refusal("third") is None
