"""The pieces of the small-frame defence that need no network: HTTP/1 chunks merged per read and
metered per chunk (addons/http1.py ChunkMerger), adjacent HTTP/2 DATA events of one stream merged
(addons/h2_limits.py `_merged`), a WebSocket message's fragments (addons/websocket_limits.py
`_Reassembly`), and the read-ahead gate (addons/read_ahead.py). Properties over random bodies,
chunkings and read splits."""

from __future__ import annotations

import asyncio
import collections
import types

import h11
import h2.events
import pytest
from h11._readers import ChunkedReader, ContentLengthReader
from h11._receivebuffer import ReceiveBuffer
from hypothesis import given, settings, strategies as st
from mitmproxy.proxy import events as mitm_events

from addons import frame_limits, read_ahead
from addons.h2_limits import _merged
from addons.http1 import ChunkMerger, SmallChunkFlood
from addons.websocket_limits import _Reassembly


def _wire(chunks: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


def _read(wire: bytes, cuts: list[int], take) -> tuple[list[bytes], bool]:
    """Feed `wire` to a merged chunked reader in reads split at `cuts`; the Data events and whether
    EndOfMessage came."""
    merger, buf, out, ended = ChunkMerger(ChunkedReader(), take), ReceiveBuffer(), [], False
    points = sorted({c % (len(wire) + 1) for c in cuts} | {len(wire)})
    start = 0
    for end in points:
        buf += wire[start:end]
        start = end
        while True:
            event = merger(buf)
            if event is None:
                break
            if isinstance(event, h11.EndOfMessage):
                ended = True
                break
            out.append(bytes(event.data))
    return out, ended


chunk_lists = st.lists(st.binary(min_size=1, max_size=6000), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(chunks=chunk_lists, cuts=st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=12))
def test_merged_chunks_are_the_body_with_at_most_one_event_per_read(chunks, cuts):
    taken = []
    out, ended = _read(_wire(chunks), cuts, lambda cost: taken.append(cost) or True)
    assert ended
    assert b"".join(out) == b"".join(chunks)
    assert len(out) <= len(set(cuts)) + 1  # one event per read at most, however many chunks it held
    assert len(taken) == sum(1 for c in chunks if frame_limits.small(len(c)))  # every small chunk, once


def test_the_chunk_that_finds_no_token_raises():
    left = [3]

    def take(cost):
        left[0] -= cost
        return left[0] >= 0

    with pytest.raises(SmallChunkFlood):
        _read(_wire([b"a"] * 10), [], take)


def test_a_body_of_known_length_is_never_metered():
    merger, buf = ChunkMerger(ContentLengthReader(5), lambda cost: False), ReceiveBuffer()
    buf += b"abcde"
    assert bytes(merger(buf).data) == b"abcde"
    assert isinstance(merger(buf), h11.EndOfMessage)


def _data(stream_id: int, data: bytes, ended: bool = False, pad: int = 0) -> h2.events.DataReceived:
    return h2.events.DataReceived(stream_id=stream_id, data=data, flow_controlled_length=len(data) + pad,
                                  stream_ended=h2.events.StreamEnded(stream_id=stream_id) if ended else None)


h2_events = st.lists(st.tuples(st.sampled_from([1, 3, 5]), st.binary(max_size=20), st.booleans(),
                               st.integers(0, 5)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(items=h2_events)
def test_merged_data_events_keep_every_byte_and_all_flow_control(items):
    events = [_data(*item) for item in items]
    per_stream, credit = collections.defaultdict(bytes), collections.Counter()
    for e in events:
        per_stream[e.stream_id] += e.data
        credit[e.stream_id] += e.flow_controlled_length
    ends = [e.stream_id for e in events if e.stream_ended is not None]
    out = _merged(events)
    got, got_credit = collections.defaultdict(bytes), collections.Counter()
    for e in out:
        got[e.stream_id] += e.data
        got_credit[e.stream_id] += e.flow_controlled_length
    assert got == per_stream and got_credit == credit
    for sid in (1, 3, 5):  # every end of a stream, in its order
        assert [e.stream_ended is not None for e in out if e.stream_id == sid][-1:] == [
            e.stream_ended is not None for e in events if e.stream_id == sid][-1:]
    assert sum(e.stream_ended is not None for e in out) == len(ends)
    for a, b in zip(out, out[1:]):  # nothing left to merge
        assert not (a.stream_id == b.stream_id and a.stream_ended is None)


# Other events: a stream's own (its reset, its window) and the connection's (a ping, settings).
def _other(stream_id: int) -> h2.events.Event:
    if stream_id:
        return h2.events.WindowUpdated(stream_id=stream_id, delta=1)
    return h2.events.PingReceived(ping_data=b"12345678")


mixed_events = st.lists(st.one_of(
    st.tuples(st.just("data"), st.sampled_from([1, 3, 5]), st.binary(max_size=8), st.booleans()),
    st.tuples(st.just("other"), st.sampled_from([0, 1, 3, 5]), st.just(b""), st.just(False))), max_size=80)


def _signature(events: list, stream_id: int) -> list:
    """What a stream's layer sees: its bytes between its own events and the connection's, each
    marked, and where its DATA said the stream ended."""
    out, data = [], b""
    for e in events:
        sid = getattr(e, "stream_id", 0)
        if isinstance(e, h2.events.DataReceived) and sid == stream_id:
            data += e.data
            if e.stream_ended is not None:
                out += [data, "end"]
                data = b""
        elif sid in (0, stream_id):
            out += [data, type(e).__name__]
            data = b""
    return [piece for piece in out + [data] if piece != b""]


@settings(max_examples=300, deadline=None)
@given(items=mixed_events)
def test_data_of_streams_interleaved_in_one_read_is_merged_per_stream_keeping_each_stream_s_order(items):
    """Review 15: 9,000 one-byte DATA frames rotating over 100 streams were 9,000 events (~100 µs
    each in the layers above) because only neighbours were merged. A stream's frames are merged
    across other streams' frames now; its own events and the connection's still keep them apart."""
    events = [_data(sid, data, ended) if kind == "data" else _other(sid) for kind, sid, data, ended in items]
    expected = {sid: _signature(events, sid) for sid in (1, 3, 5)}
    credit = collections.Counter()
    for e in events:
        if isinstance(e, h2.events.DataReceived):
            credit[e.stream_id] += e.flow_controlled_length
    others = [e for e in events if not isinstance(e, h2.events.DataReceived)]
    out = _merged(events)
    assert {sid: _signature(out, sid) for sid in (1, 3, 5)} == expected
    assert [e for e in out if not isinstance(e, h2.events.DataReceived)] == others  # the rest, in order
    got = collections.Counter()
    for e in out:
        if isinstance(e, h2.events.DataReceived):
            got[e.stream_id] += e.flow_controlled_length
    assert got == credit
    # Nothing left to merge: between two DATA events of a stream, the first ended it or something
    # of the stream or the connection came.
    for i, a in enumerate(out):
        if isinstance(a, h2.events.DataReceived) and a.stream_ended is None:
            for b in out[i + 1:]:
                sid = getattr(b, "stream_id", 0)
                if sid in (0, a.stream_id):
                    assert not isinstance(b, h2.events.DataReceived) or b.stream_id != a.stream_id
                    break


@given(sizes=st.lists(st.integers(0, 9000), min_size=1, max_size=50))
def test_a_reassembled_message_is_whole_and_keeps_fragments_no_smaller_than_mitmproxys(sizes):
    reading = _Reassembly()
    pieces = [bytes([k % 256]) * n for k, n in enumerate(sizes)]
    for piece in pieces:
        reading.add(piece)
        reading.frame_done()
    assert reading.size == sum(sizes)
    content, fragments = reading.take()
    assert content == b"".join(pieces)
    if fragments:  # kept only when not finer than mitmproxy's own 4,000-byte fragments
        assert fragments == sizes and len(sizes) <= 1 + len(content) // 4000
    assert reading.size == 0 and reading.take() == (b"", [])


def _paused_layer(queued: list[int]):
    client = object()
    queue = collections.deque(mitm_events.DataReceived(None, b"x" * n) for n in queued)
    return types.SimpleNamespace(_paused=object() if queued else None, _paused_event_queue=queue,
                                 context=types.SimpleNamespace(client=client))


def test_the_gate_closes_over_the_read_ahead_and_opens_at_half():
    async def scenario():
        layer = _paused_layer([64 * 1024] * 5)  # 320 KiB queued
        read_ahead.settle(layer)
        assert read_ahead.closed(layer.context.client)
        layer._paused_event_queue.popleft()  # 256 KiB: still over half
        read_ahead.settle(layer)
        assert read_ahead.closed(layer.context.client)
        gate = read_ahead._gates[layer.context.client]
        waiter = asyncio.ensure_future(gate.wait())
        layer._paused_event_queue.popleft()
        layer._paused_event_queue.popleft()  # 128 KiB: half
        read_ahead.settle(layer)
        await asyncio.wait_for(waiter, 1)
        assert not read_ahead.closed(layer.context.client)
        layer._paused = None  # no longer paused: nothing counts as queued
        read_ahead.settle(layer)
        assert not read_ahead.closed(layer.context.client)

    asyncio.run(scenario())
