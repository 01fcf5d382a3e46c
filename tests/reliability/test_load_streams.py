"""Concurrent streams through the router against 4 engines: none lost, none mixed up (each
stream's text is what its engine's deterministic filler gives for its prompt, with one
response id and one engine), router bookkeeping back to zero, memory back near baseline.
(``kvroute bench chaos`` runs 1,000 at once.)"""

from __future__ import annotations

from stack.chaos import Fleet, stream_load

STREAMS = 200


async def test_concurrent_streams_arrive_intact_and_router_memory_returns(fleet: Fleet):
    r = await stream_load(fleet, streams=STREAMS, rounds=3, engines=4)
    assert r.warm_lost == []
    assert r.requests == 3 * STREAMS
    assert r.lost == [], "\n".join(r.lost[:20])
    assert r.distinct_ids == 3 * STREAMS  # no two streams shared a response
    assert set(r.running_after.values()) == {0.0}
    assert set(r.inflight_after.values()) == {0.0}
    # RSS after a round stays within 50 MB of the warm baseline and stops growing: the
    # allocator keeps its high-water mark (a round or two), a leak would keep climbing.
    after = r.rss_after_mb
    assert max(after) - r.rss_baseline_mb < 50, r
    assert after[2] - after[1] < 10, f"router RSS grows round after round: {after}"
