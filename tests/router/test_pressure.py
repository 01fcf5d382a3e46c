"""Memory pressure from the events: a GPU eviction marks an instance short of room for a
while; a CPU-tier removal, a store or silence does not."""

from __future__ import annotations

import math

from events.structs import BlockRemoved, BlockStored, KVEventBatch
from router.prediction.pressure import EvictionTracker


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _batch(*events) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events))


def _stored() -> BlockStored:
    return BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[0] * 16,
                       block_size=16, lora_id=None, medium="GPU", lora_name=None)  # fmt: skip


def test_room_is_known_from_events_and_lost_for_a_window_after_an_eviction():
    clock = Clock()
    t = EvictionTracker(window_s=10.0, clock=clock)
    assert not t.roomy("a")  # never heard from: not known to have room
    t.observe("a", _batch(_stored()))
    assert t.roomy("a")
    t.observe("a", _batch(_stored(), BlockRemoved(block_hashes=[1], medium="GPU")))
    assert not t.roomy("a")
    clock.t += 10.0
    assert not t.roomy("a")
    clock.t += 0.1
    assert t.roomy("a")
    t.observe("a", _batch(BlockRemoved(block_hashes=[2], medium=None)))  # older engines: GPU
    assert not t.roomy("a")
    t.forget("a")
    assert not t.roomy("a")


def test_cpu_tier_removals_and_empty_removals_are_not_pressure():
    t = EvictionTracker(window_s=10.0, clock=Clock())
    t.observe("b", _batch(BlockRemoved(block_hashes=[1], medium="CPU")))
    t.observe("b", _batch(BlockRemoved(block_hashes=[], medium="GPU")))
    assert t.roomy("b")


def test_the_router_feeds_the_tracker_from_ingest_and_the_cost_policy_reads_it():
    from router.config import RouterSettings
    from router.state import RouterState

    state = RouterState(RouterSettings(policy="cost"))
    tracker = state.prediction.evictions
    assert tracker is not None and state.ingest.listener is state.prediction
    assert tracker.roomy("i") is False  # never heard from
    state.prediction.batch_learned("i", _batch(BlockRemoved(block_hashes=[1], medium="GPU")))
    assert tracker.roomy("i") is False and tracker._last["i"] > -math.inf
    assert state.policy.roomy == tracker.roomy
    off = RouterState(RouterSettings(policy="cost", eviction_window_s=0))
    assert off.prediction.evictions is None and off.policy.roomy is None
    assert RouterState(RouterSettings(policy="round_robin")).prediction.evictions is None
