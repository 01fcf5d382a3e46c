"""10,000 random and mutated msgpack payloads into the subscriber and ingest: no crash,
every one counted; batches with impossible values are dropped and counted, and cannot
hang or freeze the feed."""

from __future__ import annotations

import time

import msgspec
import pytest
from prometheus_client import CollectorRegistry
from routerkit import PlayedSource

from events.codec import DecodeError, decode_batch, encode_batch
from events.structs import BlockStored, KVEventBatch
from events.subscriber import BatchReceived
from router.index import MemoryIndex
from router.ingest import IngestManager
from stack.chaos import fuzz_events, hypothesis_payloads, random_payloads

TOTAL = 10_000
FROM_HYPOTHESIS = 1_000
OVER_TCP = 1_000


async def test_ten_thousand_garbage_payloads_are_all_counted_and_never_stop_the_feed():
    payloads = hypothesis_payloads(FROM_HYPOTHESIS, seed=8)
    assert len(payloads) == FROM_HYPOTHESIS
    payloads += random_payloads(TOTAL - len(payloads), seed=8)
    assert len(payloads) == TOTAL
    results = [
        await fuzz_events(payloads[:OVER_TCP], transport="tcp"),
        await fuzz_events(payloads[OVER_TCP:], transport="inproc"),
    ]
    for r in results:
        assert r.uncounted == 0, r
        assert r.feed_errors == 0, r
    assert sum(r.injected for r in results) == TOTAL + 2 * 4  # + wrong-shaped frames
    # The mix really exercised every path: decoded batches, undecodable payloads and
    # well-formed batches with impossible values (dropped by ingest, counted).
    assert sum(r.decoded for r in results) > 500
    assert sum(r.undecodable for r in results) > 5_000
    assert sum(r.invalid_events for r in results) > 10


@pytest.mark.parametrize(
    "raw",
    [
        [1.0, [[{}]], 0],  # an event tag that is a map
        [1.0, [{"type": []}], 0],  # a map event whose type is a list
        [1.0, [[[1], 2]], None],
    ],
)
async def test_unhashable_event_tags_are_counted_as_undecodable(raw):
    r = await fuzz_events([msgspec.msgpack.encode(raw)] * 3, transport="inproc")
    assert r.undecodable == 3 + 4 and r.uncounted == 0 and r.feed_errors == 0


def test_decode_batch_turns_an_unhashable_event_tag_into_a_decode_error():
    with pytest.raises(DecodeError):
        decode_batch(msgspec.msgpack.encode([1.0, [[{}]], 0]))


def _stored(h: int, group: int | None = 0, ts: float | None = None) -> KVEventBatch:
    ev = BlockStored([h], None, [], 16, None, "GPU", None, group_idx=group)
    batch = KVEventBatch(ts=time.time() if ts is None else ts, events=[ev])
    return decode_batch(encode_batch(batch))  # as it arrives from the wire


async def test_impossible_group_indexes_and_timestamps_are_dropped_not_fatal():
    now = time.time()
    batches = [
        _stored(1),
        _stored(2, group=10**12),  # learning a layout this wide would hang the loop
        _stored(3, group=-3),  # crashed layout learning
        _stored(4, ts=float("nan")),
        _stored(5, ts=now + 10 * 365 * 86400),  # would freeze the cursor for ten years
        _stored(6, ts=float("inf")),
        _stored(7),
    ]
    items = [BatchReceived(seq=i, batch=b, replayed=False) for i, b in enumerate(batches)]
    index, reg = MemoryIndex(), CollectorRegistry()
    mgr = IngestManager(
        index,
        registry=reg,
        source_factory=lambda source, start: PlayedSource(items),
        heartbeat_s=None,
        cursor_check_s=None,
    )
    try:
        await mgr.add_instance("e", "inproc://unused")
        await mgr.wait_for_seq("e", len(batches) - 1, timeout=10)
        assert (await index.lookup(list(range(1, 8)), ["e"]))["e"] == {0: 0b1000001}
        invalid = reg.get_sample_value(
            "kvroute_ingest_events_total",
            {"instance": "e", "type": "BlockStored", "status": "invalid"},
        )
        assert invalid == 5
        assert not reg.get_sample_value("kvroute_ingest_errors_total", {"instance": "e"})
        assert mgr.layouts.get("e") is not None and len(mgr.layouts.get("e").groups) == 1
    finally:
        await mgr.close()
