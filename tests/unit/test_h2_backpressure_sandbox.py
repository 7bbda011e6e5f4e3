"""addons/h2_backpressure.py: the gates of one sandbox's HTTP/2 connections close together while
the bytes waiting for its clients' windows pass the per-sandbox high water, and open under half."""

from __future__ import annotations

import pytest

from addons import h2_backpressure as bp

MiB = 1024 * 1024


class Client:  # a stand-in for mitmproxy's Client: hashable, weak-referenceable
    pass


@pytest.fixture(autouse=True)
def water(monkeypatch):
    monkeypatch.setattr(bp, "sandbox_high_water", 6 * MiB)


def gate(client):
    g = bp._gates.get(client)
    return g is None or g.is_set()


def test_one_sandbox_over_its_total_closes_all_its_gates_and_no_others():
    a, b, other = Client(), Client(), Client()
    bp.update(a, 3 * MiB, "sandbox:s")
    bp.update(b, 0, "sandbox:s")
    bp.update(other, 3 * MiB, "sandbox:t")
    assert gate(a) and gate(b) and gate(other)
    bp.update(b, 3 * MiB + 1, "sandbox:s")  # s holds 6 MiB + 1: b waits at once,
    assert not gate(b) and gate(other)
    bp.update(a, 3 * MiB, "sandbox:s")  # a at its next event (one read later: the overshoot)
    assert not gate(a) and gate(other)
    assert bp.held("sandbox:s") == 6 * MiB + 1
    bp.update(a, 0, "sandbox:s")  # 3 MiB: still over half
    assert not gate(a) and not gate(b)
    bp.update(b, 1 * MiB, "sandbox:s")  # 1 MiB: under half, each under its own low water
    assert gate(a) and gate(b)
    for c in (a, b, other):
        bp.release(c)
    assert bp.held("sandbox:s") == 0 and bp.held("sandbox:t") == 0


def test_a_connection_that_goes_away_gives_its_bytes_back():
    hog, reader = Client(), Client()
    bp.update(hog, 4 * MiB, "sandbox:u")
    bp.update(reader, 3 * MiB, "sandbox:u")
    assert not gate(reader)
    bp.update(reader, 0, "sandbox:u")
    assert not gate(reader)  # the hog still holds 4 MiB: over half
    bp.release(hog)
    assert gate(reader) and bp.held("sandbox:u") == 0
    bp.release(reader)


def test_zero_turns_the_sandbox_total_off(monkeypatch):
    monkeypatch.setattr(bp, "sandbox_high_water", 0)
    a, b = Client(), Client()
    bp.update(a, 4 * MiB, "sandbox:v")
    bp.update(b, 4 * MiB, "sandbox:v")
    assert gate(a) and gate(b)  # each under its own 4 MiB
    bp.release(a)
    bp.release(b)
