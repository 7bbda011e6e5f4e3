"""The buffer ledger (gateway/budget.py): whatever sequence of reservations and releases, no
connection or sandbox holds more than its limit, and everything returns to zero."""

from hypothesis import given, settings, strategies as st

from gateway.budget import Ledger

CONNECTIONS = ["c1", "c2", "c3", "c4"]
SANDBOX_OF = {"c1": "s1", "c2": "s1", "c3": "s2", "c4": "s2"}

steps = st.lists(st.tuples(
    st.sampled_from(["open", "reserve", "release", "close", "drop"]),
    st.sampled_from(CONNECTIONS),
    st.integers(min_value=0, max_value=9),  # which of the connection's accounts
    st.integers(min_value=0, max_value=300),
), max_size=80)


@settings(max_examples=300, deadline=None)
@given(per_connection=st.one_of(st.none(), st.integers(1, 500)),
       per_sandbox=st.one_of(st.none(), st.integers(1, 800)), ops=steps)
def test_reservations_never_pass_a_limit_and_all_return_to_zero(per_connection, per_sandbox, ops):
    ledger = Ledger(per_connection, per_sandbox)
    accounts = {c: [] for c in CONNECTIONS}
    for op, conn, index, n in ops:
        mine = accounts[conn]
        if op == "open" or not mine:
            mine.append(ledger.account(conn, SANDBOX_OF[conn]))
            continue
        account = mine[index % len(mine)]
        if op == "reserve":
            before = ledger.held(connection=conn)
            room = ledger.room(conn, SANDBOX_OF[conn])
            granted = account.reserve(n)
            assert granted == (not account.closed and (room is None or n <= room))
            assert ledger.held(connection=conn) == before + (n if granted else 0)
        elif op == "release":
            account.release(n)
        elif op == "close":
            account.close()
        else:
            ledger.drop_connection(conn)
            assert ledger.held(connection=conn) == 0
        for c in CONNECTIONS:
            held = sum(a.held for a in accounts[c])
            assert ledger.held(connection=c) == held
            assert per_connection is None or held <= per_connection
        for s in set(SANDBOX_OF.values()):
            held = sum(a.held for c in CONNECTIONS if SANDBOX_OF[c] == s for a in accounts[c])
            assert ledger.held(sandbox=s) == held
            assert per_sandbox is None or held <= per_sandbox
    for mine in accounts.values():
        for account in mine:
            account.close()
    assert ledger.held() == 0 and not ledger.connections and not ledger.sandboxes and not ledger._accounts


def test_a_refused_reservation_charges_nothing_and_a_closed_account_takes_nothing():
    ledger = Ledger(per_connection=100, per_sandbox=150)
    a, b = ledger.account("c1", "s"), ledger.account("c2", "s")
    assert a.reserve(100) and not a.reserve(1)
    assert not b.reserve(51) and b.reserve(50) and ledger.held(sandbox="s") == 150
    a.close()
    assert not a.reserve(1) and ledger.held(sandbox="s") == 50 and b.reserve(50)
    ledger.drop_connection("c2")
    assert ledger.held() == 0 and b.closed


# -- decoders keep to their budgets in pieces (gateway/decompress.py) -------------------------------

import zlib  # noqa: E402

import pytest  # noqa: E402

from gateway.decompress import (  # noqa: E402
    PIECE, DecodedTooLarge, OverBudget, decode_whole, request_decoder, stream_decoder, streaming_decoder,
)


def _gzip_zeros(mib: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    return b"".join([c.compress(bytes(1 << 20)) for _ in range(mib)] + [c.flush()])


def test_a_buffered_decode_stops_at_the_first_piece_its_budget_refuses():
    granted = []

    def reserve(n: int) -> bool:
        if sum(granted) + n > 3 * PIECE:
            return False
        granted.append(n)
        return True

    with pytest.raises(OverBudget):
        decode_whole("gzip", _gzip_zeros(12), limit=64 << 20, reserve=reserve)
    assert sum(granted) <= 3 * PIECE and max(granted) <= PIECE + 1


@pytest.mark.parametrize("make, most", [(request_decoder, 1 << 20), (stream_decoder, 1 << 20),
                                        (lambda e: streaming_decoder(e), 16 << 20)])
def test_every_piece_is_small_and_a_bomb_trips_near_its_grace(make, most):
    decoder = make("gzip")
    produced = 0
    with pytest.raises(DecodedTooLarge):
        for piece in decoder.pieces(_gzip_zeros(40)):
            assert len(piece) <= PIECE + 1
            produced += len(piece)
    assert produced <= most + PIECE


def test_a_request_decoder_stops_at_its_total_budget_within_the_ratio():
    """54:1 is within REQUEST_RATIO, but past REQUEST_LIMIT decoded bytes the scan stops: each
    decoded byte costs scanning time on the event loop."""
    import random

    from gateway.decompress import REQUEST_LIMIT

    rnd = random.Random(15)
    block = bytearray(1 << 20)
    for j in range(0, len(block), 150):
        block[j] = rnd.randrange(1, 256)
    c = zlib.compressobj(6, zlib.DEFLATED, 31)
    body = b"".join([c.compress(bytes(block)) for _ in range(REQUEST_LIMIT // (1 << 20) + 4)] + [c.flush()])
    for decoder, most in ((request_decoder("gzip"), REQUEST_LIMIT), (request_decoder("gzip", 2 << 20), 2 << 20)):
        produced = 0
        with pytest.raises(DecodedTooLarge):
            for start in range(0, len(body), 65536):
                for piece in decoder.pieces(body[start:start + 65536]):
                    produced += len(piece)
        assert produced <= most
    unbounded = request_decoder("gzip", None)
    assert sum(len(p) for p in unbounded.pieces(body)) == len(block) * (REQUEST_LIMIT // (1 << 20) + 4)


def test_held_bytes_count_past_the_limit_and_leave_no_room():
    """`hold` charges bytes already held (unread by a client): never refused, and while they last
    other buffers of the sandbox find no room."""
    from gateway.budget import Ledger

    ledger = Ledger(per_connection=100, per_sandbox=150)
    backlog, other = ledger.account("c1", "s"), ledger.account("c2", "s")
    backlog.hold(400)
    assert ledger.held(sandbox="s") == 400 and not other.reserve(1) and other.room() == 0
    backlog.release(300)
    assert other.reserve(50) and not other.reserve(1)
    ledger.drop_connection("c1")
    assert ledger.held(sandbox="s") == 50 and backlog.closed
    backlog.hold(10)  # closed: nothing more is counted
    assert ledger.held(sandbox="s") == 50


def test_room_handed_to_what_fills_it_is_not_counted_as_freed_memory():
    """`Ledger.released` counts memory freed (a thaw of the frozen objects comes every 128 MiB of it,
    addons/gc_freeze.py): a request's room for its answer's head, handed to the head, frees nothing."""
    ledger = Ledger(None, None)
    account = ledger.account("c1", "s1")
    assert account.reserve(100 + 8192)  # the request head and the room for its answer's head
    account.release(8192, freed=False)  # the room goes to the answer's head...
    account.hold(300)  # ...which takes what it costs
    assert ledger.released == 0
    account.close()  # the stream is over: its heads are freed
    assert ledger.released == 400 and ledger.held() == 0


def test_an_answer_head_in_its_request_s_room_frees_nothing():
    """The stream's side of it (addons/http_stream.py): the room handed over is not counted as freed."""
    from mitmproxy import http

    from addons import http_stream

    ledger = Ledger(None, None)
    stream = type("Stream", (), {})()
    stream._head_account = ledger.account("c1", "s1")
    assert stream._head_account.reserve(http_stream.RESPONSE_HEAD_ROOM)
    stream._response_room = http_stream.RESPONSE_HEAD_ROOM
    response = http.Response.make(200, b"", {"content-type": "text/plain"})
    assert http_stream.GatewayHttpStream._charge_response_head(stream, response)
    assert ledger.released == 0
    assert 0 < stream._head_account.held < http_stream.RESPONSE_HEAD_ROOM
