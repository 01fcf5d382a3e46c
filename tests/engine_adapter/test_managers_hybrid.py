"""Hybrid groups: sliding-window freeing and eviction, Mamba state blocks, per-group events."""

from __future__ import annotations

import random

import pytest
from ea_helpers import EventState, admit, decode, events_of, prefill, tokens

from engine_adapter.coordinator import KVCacheManager
from engine_adapter.profiles import get_profile
from events.groups import longest_cache_hit
from events.structs import MEDIUM_GPU, BlockStored

BS = 16


def kv_for(name: str, num_blocks: int, window: int = 64, **kw) -> KVCacheManager:
    return KVCacheManager(
        get_profile(name, sliding_window=window), num_blocks, allocate_kv=False, **kw
    )


def event_hit(kv: KVCacheManager, state: EventState, req) -> int:
    return longest_cache_hit(kv.specs, state.pred(req, MEDIUM_GPU), req.num_tokens - 1)


@pytest.mark.parametrize("profile", ["full", "swa-hybrid", "mamba-hybrid"])
def test_each_group_emits_one_block_stored_per_allocation(profile: str) -> None:
    kv = kv_for(profile, 16, window=1024)
    req = kv.new_request("r", list(range(32)))
    admit(kv, req)
    events = events_of(kv.step_events())
    assert [e.group_idx for e in events] == list(range(len(kv.specs)))
    for ev, spec in zip(events, kv.specs, strict=True):
        assert isinstance(ev, BlockStored)
        assert ev.kv_cache_spec_kind == spec.kind
        assert ev.kv_cache_spec_sliding_window == spec.sliding_window
        assert ev.token_ids == list(range(32)) and ev.block_size == BS
        assert ev.parent_block_hash is None
        # Mamba caches only the state at the step's last boundary (block 1).
        expected = req.wire_hashes[1:] if spec.kind == "mamba" else req.wire_hashes
        assert ev.block_hashes == expected


def test_swa_window_blocks_freed_silently_and_stay_cached() -> None:
    kv = kv_for("swa-hybrid", 64)
    rng = random.Random(1)
    req = kv.new_request("r", tokens(rng, 160))  # 10 blocks per group
    admit(kv, req)
    kv.take_events()
    free_before = kv.num_free_blocks
    decode(kv, req, 7)  # computed 160: next token sees [97, 160] -> blocks 0..5 out
    assert [e for e in kv.take_events() if not isinstance(e, BlockStored)] == []
    swa_ids = kv.get_block_ids(req)[1]
    assert swa_ids[:6] == [None] * 6 and None not in swa_ids[6:]
    assert None not in kv.get_block_ids(req)[0]
    assert kv.num_free_blocks == free_before + 6 - 2  # 6 freed; block 10 in each group
    for i in range(6):  # freed but still cached: findable until reused
        assert kv.is_cached_on_gpu(req, 1, i)


def test_swa_window_blocks_evicted_before_full() -> None:
    kv = kv_for("swa-hybrid", 22)  # shared pool, exactly what the request needs
    state = EventState()
    rng = random.Random(2)
    a = kv.new_request("a", tokens(rng, 160))
    prefill(kv, a, state)
    decode(kv, a, 1)  # 161 tokens: 11 blocks per group, window blocks 0..5 freed
    state.apply_batch(kv.step_events())
    assert kv.num_free_blocks == 6
    b = kv.new_request("b", tokens(rng, 32))  # 2 blocks per group
    admit(kv, b)
    batch = kv.step_events()
    state.apply_batch(batch)
    removed = [
        (e.group_idx, e.block_hashes) for e in events_of(batch) if not isinstance(e, BlockStored)
    ]
    # Freed tail first: the block nearest the window goes first.
    assert removed == [(1, [a.wire_hashes[i]]) for i in (5, 4, 3, 2)]
    assert state.counts == kv.residency()
    kv.free(b)
    kv.free(a)
    c = kv.new_request("c", tokens(rng, 64))  # 8 blocks: a's old window blocks, then b's
    admit(kv, c)
    state.apply_batch(kv.step_events())
    assert all(kv.is_cached_on_gpu(a, 0, i) for i in range(10))
    assert not any(kv.is_cached_on_gpu(a, 1, i) for i in range(6))
    assert state.counts == kv.residency()


def test_swa_hit_needs_only_the_window_blocks() -> None:
    kv = kv_for("swa-hybrid", 22)
    state = EventState()
    rng = random.Random(3)
    prompt = tokens(rng, 160)
    a = kv.new_request("a", prompt)
    prefill(kv, a, state)
    decode(kv, a, 1)
    state.apply_batch(kv.step_events())
    b = kv.new_request("b", tokens(rng, 32))
    prefill(kv, b, state)  # evicts a's early window blocks 5, 4, 3, 2
    kv.free(b)
    state.apply_batch(kv.step_events())
    assert [kv.is_cached_on_gpu(a, 1, i) for i in range(6)] == [True, True] + [False] * 4
    probe = kv.new_request("p", [*prompt, 5, 6, 7])
    hit = kv.get_computed_blocks(probe)
    assert hit == 160 == event_hit(kv, state, probe)
    kv.free(a)
    gpu, _ = admit(kv, probe)
    assert gpu == 160
    swa = kv.get_block_ids(probe)[1]
    # cdiv(64 - 1, 16) = 4 window blocks adopted, older positions are nulls
    assert swa[:6] == [None] * 6 and None not in swa[6:10]


def test_swa_hit_shrinks_to_a_complete_window() -> None:
    kv = kv_for("swa-hybrid", 64)
    rng = random.Random(4)
    prompt = tokens(rng, 160)
    a = kv.new_request("a", prompt)
    admit(kv, a, chunk=96)  # step 1 ends at 96
    admit_more(kv, a, 64)  # step 2: window blocks 0..1 of step 1 are freed
    kv.free(a)
    kv.take_events()
    pool = kv.pools[1]
    # Evict SWA block 8 (inside the window before 160) by hand via the pool.
    block = pool.get_cached((a.block_hashes[8], 1))
    assert block is not None
    pool.touch([block])
    pool._evict(block)  # as if exactly this block had been reused
    pool.free_blocks([block])
    probe = kv.new_request("p", [*prompt, 1])
    # Window for a hit at 160 needs blocks 6..9; block 8 missing -> hit at 128 needs 4..7.
    assert kv.get_computed_blocks(probe) == 128


def admit_more(kv: KVCacheManager, req, n: int) -> None:
    assert kv.allocate_slots(req, n)


def test_mamba_caches_only_last_boundary_per_step() -> None:
    kv = kv_for("mamba-hybrid", 256)
    rng = random.Random(5)
    req = kv.new_request("r", tokens(rng, 1000))
    admit(kv, req)
    full_ev, mamba_ev = events_of(kv.step_events())
    assert len(full_ev.block_hashes) == 62
    assert mamba_ev.group_idx == 1 and mamba_ev.kv_cache_spec_kind == "mamba"
    assert mamba_ev.block_hashes == [req.wire_hashes[61]]
    assert mamba_ev.parent_block_hash is None
    assert mamba_ev.token_ids == req.all_token_ids[:992]  # covers the skipped blocks too
    ids = kv.get_block_ids(req)[1]
    assert [i for i, b in enumerate(ids) if b is not None] == [61, 62]  # checkpoint, running
    decode(kv, req, 3)
    assert [i for i, b in enumerate(kv.get_block_ids(req)[1]) if b is not None] == [62]
    assert kv.is_cached_on_gpu(req, 1, 61)  # freed, still cached


def test_mamba_chunked_prefill_caches_each_step_end_and_hits_there() -> None:
    kv = kv_for("mamba-hybrid", 256)
    state = EventState()
    rng = random.Random(6)
    prompt = tokens(rng, 1000)
    req = kv.new_request("r", prompt)
    admit(kv, req, chunk=256)
    state.apply_batch(kv.step_events())
    for n in (256, 256, 232):
        admit_more(kv, req, n)
        state.apply_batch(kv.step_events())
    cached = [i for i in range(62) if kv.is_cached_on_gpu(req, 1, i)]
    assert cached == [15, 31, 47, 61]
    probe = kv.new_request("p", [*prompt[:600], *tokens(rng, 50)])
    # Full attention could serve 37 blocks; Mamba's last state at or below is block 31.
    assert kv.get_computed_blocks(probe) == 512 == event_hit(kv, state, probe)


def test_mamba_decode_caches_each_boundary() -> None:
    kv = kv_for("mamba-hybrid", 256)
    rng = random.Random(7)
    req = kv.new_request("r", tokens(rng, 1000))
    admit(kv, req)
    kv.take_events()
    for t in range(7):
        decode(kv, req, t)
    assert kv.take_events() == []
    decode(kv, req, 99)  # token index 1007: block 62 full at 1008
    events = kv.take_events()
    assert [(e.group_idx, e.block_hashes) for e in events] == [
        (0, [req.wire_hashes[62]]),
        (1, [req.wire_hashes[62]]),
    ]


def test_mamba_hit_block_is_adopted_and_next_state_allocated() -> None:
    kv = kv_for("mamba-hybrid", 256)
    rng = random.Random(8)
    prompt = tokens(rng, 1000)
    a = kv.new_request("a", prompt)
    admit(kv, a)
    state_block = kv.get_block_ids(a)[1][61]
    kv.free(a)
    b = kv.new_request("b", [*prompt[:992], *tokens(rng, 40)])
    gpu, _ = admit(kv, b)
    assert gpu == 992
    ids = kv.get_block_ids(b)[1]
    assert ids[61] == state_block  # the cached state is reused, not copied
    # 1032 tokens: checkpoint at 1024 (block 63) and running state (block 64)
    assert [i for i, x in enumerate(ids) if x is not None] == [61, 63, 64]


def test_pool_per_group_keeps_groups_apart() -> None:
    kv = kv_for("swa-hybrid", 12, pool_per_group=True)
    rng = random.Random(9)
    a = kv.new_request("a", tokens(rng, 160))  # 10 blocks in each group's pool
    admit(kv, a)
    decode(kv, a, 1)  # 11 blocks each, then 6 window blocks back to the SWA pool
    assert (kv.pools[0].num_free_blocks, kv.pools[1].num_free_blocks) == (1, 7)
    b = kv.new_request("b", tokens(rng, 40))  # 3 blocks per group: full pool too short
    assert kv.lookup(b) == (0, 0)
    assert not kv.allocate_slots(b, 40)
    c = kv.new_request("c", tokens(rng, 10))  # 1 block per group fits
    admit(kv, c)
    assert (kv.pools[0].num_free_blocks, kv.pools[1].num_free_blocks) == (0, 6)
