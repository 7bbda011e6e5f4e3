"""gateway/dnsmemory.py: what the gateway's DNS answered each client, bounded, and shared fairly
between sandboxes (review 37: one sandbox's answers pushed another's out of one shared table, and
that sandbox's raw TCP connections were refused)."""

from __future__ import annotations

import ipaddress

from hypothesis import example, given, settings, strategies as st

from gateway.dnsmemory import MAX_NAMES_PER_ENTRY, DnsMemory


def ip(text: str):
    return ipaddress.ip_address(text)


_BASE = int(ipaddress.ip_address("198.18.0.0"))  # a /15: 131,072 addresses


def _addresses(n: int, start: int = 0):
    return [ipaddress.ip_address(_BASE + start + i) for i in range(n)]


def test_a_sandbox_resolving_many_names_evicts_its_own_answers_not_another_s():
    """Review 37's probe in the pure core: B resolves git.internal once; A then resolves 13,000
    names of a CDN, 8 addresses each, into a memory of 10,000 entries."""
    now = [0.0]
    memory = DnsMemory(ttl=600, max_entries=10_000, clock=lambda: now[0])
    victim, attacker = ip("10.0.0.2"), ip("10.0.0.3")
    memory.remember(victim, "git.internal", [ip("192.0.2.22")], owner="sandbox:b")
    for n in range(13_000):
        now[0] += 1 / 190
        memory.remember(attacker, f"n{n}.cdn.test", _addresses(8, 8 * n), owner="sandbox:a")
    assert memory.names_for(victim, ip("192.0.2.22")) == {"git.internal"}
    assert len(memory) == 10_000
    assert memory.held("sandbox:a") == 9_999
    assert memory.names_for(attacker, _addresses(1, 8 * 12_999)[0]) == {"n12999.cdn.test"}  # its newest kept
    assert memory.names_for(attacker, _addresses(1, 0)[0]) == set()  # its oldest gone


def test_one_address_keeps_a_bounded_number_of_names_the_newest():
    """Many names of one wildcard rule answered with one address: the entry grew for as long as it
    was refreshed (720,000 names after an hour at 200 a second), and each raw TCP decision walked
    them all."""
    now = [0.0]
    memory = DnsMemory(ttl=600, clock=lambda: now[0])
    client, shared = ip("10.0.0.2"), ip("192.0.2.80")
    for n in range(5_000):
        now[0] += 0.005
        memory.remember(client, f"n{n}.wild.test", [shared])
    names = memory.names_for(client, shared)
    assert len(names) == MAX_NAMES_PER_ENTRY
    assert names == {f"n{n}.wild.test" for n in range(5_000 - MAX_NAMES_PER_ENTRY, 5_000)}
    assert len(memory) == 1


def test_an_answer_to_a_client_whose_sandbox_changed_moves_to_its_new_sandbox():
    memory = DnsMemory(max_entries=3)
    client = ip("10.0.0.2")
    memory.remember(client, "a.test", [ip("192.0.2.1")], owner="sandbox:old")
    memory.remember(client, "a.test", [ip("192.0.2.1")], owner="sandbox:new")  # (a reloaded policy)
    assert memory.held("sandbox:old") == 0 and memory.held("sandbox:new") == 1
    assert len(memory) == 1
    assert memory.names_for(client, ip("192.0.2.1")) == {"a.test"}


def test_without_an_owner_each_client_address_is_its_own():
    memory = DnsMemory(max_entries=4)
    light, heavy = ip("10.0.0.2"), ip("10.0.0.3")
    memory.remember(light, "git.test", [ip("192.0.2.22")])
    memory.remember(heavy, "many.test", _addresses(40))
    assert memory.names_for(light, ip("192.0.2.22")) == {"git.test"}
    assert memory.held(heavy.compressed) == 3


_OWNERS = ["a", "b", "c", "d"]


@settings(max_examples=200, deadline=None)
@example(max_entries=32, steps=[  # the entries bound was over, and the victim chosen by weight: owner a, 7
    ("b", 0, 1, 2.0), ("a", 9, 6, 0.0), ("b", 6, 4, 0.0), ("c", 14, 6, 4.0),  # entries of two names each,
    ("a", 8, 6, 0.0), ("b", 2, 3, 5.0), ("c", 5, 6, 5.0), ("a", 9, 6, 5.0),  # lost one though within its
    ("d", 13, 6, 5.0), ("d", 5, 6, 5.0), ("d", 9, 6, 5.0)])  # share of 8 entries (a hypothesis find)
@given(st.integers(2, 40), st.lists(st.tuples(st.sampled_from(_OWNERS), st.integers(0, 30), st.integers(1, 6),
                                              st.floats(0, 5)), max_size=80))
def test_the_memory_never_exceeds_its_bound_and_an_owner_within_its_even_share_loses_nothing(max_entries, steps):
    """Whatever the owners do: at most `max_entries` entries, and an owner that never held more
    than its even share (max_entries // owners) still has every answer it was given, unexpired."""
    now = [0.0]
    memory = DnsMemory(ttl=1_000, max_entries=max_entries, clock=lambda: now[0])
    given_to: dict[str, dict] = {o: {} for o in _OWNERS}  # owner -> {answered address: name}
    most: dict[str, int] = {o: 0 for o in _OWNERS}
    share = max_entries // len(_OWNERS)
    for owner, first, count, gap in steps:
        now[0] += gap
        client = ip(f"10.0.0.{_OWNERS.index(owner) + 1}")
        addresses = _addresses(count, first)
        name = f"{owner}{first}.test"
        memory.remember(client, name, addresses, owner=owner)
        for address in addresses:
            given_to[owner][address] = name
        most[owner] = max(most[owner], len(given_to[owner]))
        assert len(memory) <= max_entries and memory.weight() <= memory.max_weight
        assert memory.weight() == sum(memory.weight(o) for o in _OWNERS)
    for owner in _OWNERS:
        if most[owner] <= share:
            client = ip(f"10.0.0.{_OWNERS.index(owner) + 1}")
            for address, name in given_to[owner].items():
                assert name in memory.names_for(client, address)


def test_the_memory_is_bounded_by_weight_entries_and_their_names():
    """Bounded by entries only, 100,000 entries of 64 names were 194-250 MiB, and a sandbox whose
    resolver answers 4,000 addresses a name filled it in ~8 s (review 38). An entry weighs one plus
    its names; the heaviest owner gives way first."""
    memory = DnsMemory(ttl=600, max_entries=100_000, max_weight=20_000)
    victim, attacker = ip("10.0.0.2"), ip("10.0.0.3")
    memory.remember(victim, "git.internal", [ip("192.0.2.22")], owner="b")
    for n in range(20):
        memory.remember(attacker, f"n{n}.huge.test", _addresses(4_000, n * 4_000 % 120_000), owner="a")
        assert memory.weight() <= 20_000
    assert memory.names_for(victim, ip("192.0.2.22")) == {"git.internal"}
    assert memory.weight("b") == 2


def test_a_weight_bound_below_one_full_entry_is_raised_to_it():
    """Review 45: with max_weight under 1 + max_names, a lone owner's entry of many names was
    evicted whole as its last name was given."""
    memory = DnsMemory(max_entries=10, max_weight=5, max_names=64)
    client = ip("10.0.0.9")
    for i in range(5):
        memory.remember(client, f"n{i}.test", [ip("192.0.2.9")])
    assert memory.names_for(client, ip("192.0.2.9")) == {f"n{i}.test" for i in range(5)}
