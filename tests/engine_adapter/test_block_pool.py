"""GPU block pool: vLLM's free-queue, caching and event semantics."""

from __future__ import annotations

import random

import pytest
from ea_helpers import EventState, admit, decode, events_of, prefill, tokens

from engine_adapter.block_pool import BlockPool
from engine_adapter.kv_cache_manager import KVCacheManager
from engine_adapter.profiles import get_profile
from events.hashing import hash_request_blocks, wire_hash
from events.structs import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored

BS = 16


def full_kv(num_blocks: int, **kw) -> KVCacheManager:
    return KVCacheManager(get_profile("full"), num_blocks, allocate_kv=False, **kw)


def test_block_stored_event_matches_vllm_shape_for_a_prompt() -> None:
    kv = full_kv(8)
    req = kv.new_request("r", list(range(32)))
    assert admit(kv, req) == (0, 0)
    events = events_of(kv.step_events(ts=1.5))
    assert len(events) == 1
    ev = events[0]
    assert isinstance(ev, BlockStored)
    expected = [wire_hash(h) for h in hash_request_blocks(list(range(32)), BS)]
    assert ev.block_hashes == expected
    assert ev.parent_block_hash is None
    assert ev.token_ids == list(range(32))
    assert ev.block_size == BS
    assert ev.medium == MEDIUM_GPU
    assert ev.group_idx == 0
    assert ev.kv_cache_spec_kind == "full_attention"
    assert ev.kv_cache_spec_sliding_window is None
    assert ev.extra_keys == [None, None]
    assert ev.lora_name is None


def test_decode_stores_block_when_it_becomes_full_with_parent_hash() -> None:
    kv = full_kv(8)
    req = kv.new_request("r", list(range(20)))
    admit(kv, req)
    first = events_of(kv.step_events())
    assert [len(e.block_hashes) for e in first] == [1]
    for t in range(20, 31):
        decode(kv, req, t)
        assert kv.step_events() is None  # block 1 not full yet
    decode(kv, req, 31)  # token 31 fills block 1 at schedule time
    (ev,) = events_of(kv.step_events())
    assert ev.block_hashes == [req.wire_hashes[1]]
    assert ev.parent_block_hash == req.wire_hashes[0]
    assert ev.token_ids == list(range(16, 32))


def test_lora_name_enters_hash_and_event_extra_keys() -> None:
    kv = full_kv(8)
    plain = kv.new_request("a", list(range(32)))
    lora = kv.new_request("b", list(range(32)), lora_name="sql", lora_path="/a/sql")
    assert plain.block_hashes != lora.block_hashes
    admit(kv, lora)
    (ev,) = events_of(kv.step_events())
    assert ev.lora_name == "sql"
    assert ev.extra_keys == [("sql",), ("sql",)]


def test_block_zero_is_the_null_block_and_never_handed_out() -> None:
    pool = BlockPool(5)
    assert pool.num_usable == pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]  # ascending from 1, as vLLM
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)  # block 0 is not in the free queue
    assert pool.usage == 1.0
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    pool.check_invariants()
    with pytest.raises(ValueError):
        BlockPool(1)  # only the null block: nothing usable


def test_free_queue_is_lru_and_request_tail_is_evicted_first() -> None:
    kv = full_kv(5)  # 4 usable blocks + the null block
    state = EventState()
    a = kv.new_request("a", list(range(64)))  # 4 full blocks
    prefill(kv, a, state)
    kv.free(a)
    b = kv.new_request("b", [7] * 17)  # needs 2 blocks: evicts a's two tail blocks
    prefill(kv, b, state)
    remaining = {h for (_, h, _) in state.counts}
    assert [w for w in a.wire_hashes if w not in remaining] == a.wire_hashes[2:]
    again = kv.new_request("a2", list(range(64)))
    assert kv.get_computed_blocks(again) == 2 * BS  # a's head still hits


def test_block_removed_only_when_cached_block_is_reused() -> None:
    kv = full_kv(5)  # 4 usable blocks + the null block
    a = kv.new_request("a", list(range(64)))
    admit(kv, a)
    kv.take_events()
    kv.free(a)
    assert kv.take_events() == []  # freeing is silent
    b = kv.new_request("b", [3] * 40)
    admit(kv, b)
    removed = [e for e in kv.take_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [
        [a.wire_hashes[3]],
        [a.wire_hashes[2]],
        [a.wire_hashes[1]],
    ]
    assert all(e.medium == MEDIUM_GPU and e.group_idx == 0 for e in removed)


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(5)  # 4 usable blocks + the null block
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_block(a, (b"x" * 32, 0))
    pool.free_blocks([a, b])  # a cached -> back, b uncached -> front
    (first,) = pool.get_new_blocks(1)
    assert first is b
    (second,) = pool.get_new_blocks(1)
    assert second is a
    (removed,) = pool.take_events()  # the pool owns its queue; draining empties it
    assert isinstance(removed, BlockRemoved) and pool.take_events() == []
    pool.free_blocks([c, d, second])


def test_a_pool_stamps_its_own_medium_on_its_events() -> None:
    pool = BlockPool(3, medium="CPU")
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, (b"y" * 32, 1))
    pool.free_blocks([a])
    pool.get_new_blocks(2)  # reuses a: its key goes
    (ev,) = pool.take_events()
    assert isinstance(ev, BlockRemoved) and ev.medium == "CPU" and ev.group_idx == 1


def test_duplicate_hash_removed_only_after_both_copies() -> None:
    kv = full_kv(7)  # 6 usable blocks + the null block
    state = EventState()
    prompt = list(range(40))  # 2 full blocks + a partial one
    a = kv.new_request("a", prompt)
    b = kv.new_request("b", prompt)
    # Both admitted before either caches: no hit, so each caches its own copy.
    assert kv.lookup(a) == (0, 0) and kv.lookup(b) == (0, 0)
    assert kv.allocate_slots(a, 40) and kv.allocate_slots(b, 40)
    state.apply_batch(kv.step_events())
    h0 = (0, a.wire_hashes[0], MEDIUM_GPU)
    assert state.counts[h0] == 2 == kv.residency()[h0]
    kv.free(a)
    kv.free(b)
    # Queue: [b2, a2 (uncached, front)] + [a1, a0, b1, b0]; 4 blocks evict a's copies.
    filler = kv.new_request("f", [9] * 64)
    admit(kv, filler)
    state.apply_batch(kv.step_events())
    assert state.counts == kv.residency()
    assert state.counts[h0] == 1
    probe = kv.new_request("p", prompt)
    assert kv.get_computed_blocks(probe) == 32  # b's copies still serve the prefix
    kv.free(filler)
    # Queue: [b1, b0] + filler's 4 cached blocks appended behind them.
    more = kv.new_request("m", [8] * 96)  # takes every usable block, b's copies first
    admit(kv, more)
    state.apply_batch(kv.step_events())
    assert h0 not in state.counts and h0 not in kv.residency()
    assert kv.get_computed_blocks(probe) == 0


def test_allocation_failure_changes_nothing() -> None:
    kv = full_kv(5)  # 4 usable: a takes 3, one stays free
    a = kv.new_request("a", list(range(48)))
    admit(kv, a)
    kv.take_events()
    free_before = kv.num_free_blocks
    assert free_before == 1
    b = kv.new_request("b", list(range(100, 164)))
    assert kv.lookup(b) == (0, 0)
    assert not kv.allocate_slots(b, 64)
    assert kv.num_free_blocks == free_before
    assert kv.take_events() == []
    assert kv.get_block_ids(b) == [[]]
    assert b.num_computed_tokens == 0


def test_reset_prefix_cache_refused_while_in_use_then_all_blocks_cleared() -> None:
    kv = full_kv(8)
    a = kv.new_request("a", list(range(48)))
    admit(kv, a)
    kv.take_events()
    assert not kv.reset_prefix_cache()
    assert kv.take_events() == []
    kv.free(a)
    assert kv.reset_prefix_cache()
    events = kv.take_events()
    assert len(events) == 1 and isinstance(events[0], AllBlocksCleared)


def test_events_queued_before_a_reset_are_published_before_its_clear() -> None:
    kv = full_kv(8)
    a = kv.new_request("a", list(range(48)))
    admit(kv, a)  # its BlockStored is still queued in the pool
    kv.free(a)
    assert kv.reset_prefix_cache()
    kinds = [type(e) for e in kv.take_events()]
    assert kinds == [BlockStored, AllBlocksCleared]
    assert kv.get_computed_blocks(kv.new_request("b", list(range(48)))) == 0
    assert not kv.residency()


def test_prefix_hit_touches_blocks_and_skips_their_events() -> None:
    kv = full_kv(16)
    a = kv.new_request("a", list(range(64)))
    admit(kv, a)
    kv.take_events()
    b = kv.new_request("b", [*range(64), 1000, 1001])
    gpu, _ = admit(kv, b)
    assert gpu == 64
    assert kv.take_events() == []  # hit blocks are not re-stored; block 4 is partial
    assert kv.get_block_ids(a)[0] == kv.get_block_ids(b)[0][:4]
    kv.pools[0].check_invariants()


@pytest.mark.parametrize("seed", range(3))
def test_hit_capped_at_num_tokens_minus_one(seed: int) -> None:
    rng = random.Random(seed)
    kv = full_kv(32)
    prompt = tokens(rng, 64)
    admit(kv, kv.new_request("a", prompt))
    same = kv.new_request("b", prompt)  # 64 tokens, all 4 blocks cached
    assert kv.get_computed_blocks(same) == 48  # block 3 holds the last token
    longer = kv.new_request("c", [*prompt, 5])
    assert kv.get_computed_blocks(longer) == 64
