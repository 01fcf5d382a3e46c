"""Hybrid groups: sliding-window freeing and eviction, Mamba state blocks, per-group events."""

from __future__ import annotations

import random

import pytest
from ea_helpers import EventState, admit, decode, events_of, opening, prefill, tokens

from engine_adapter.kv_cache_manager import KVCacheManager
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


def step(kv: KVCacheManager, state: EventState | None = None) -> list[object]:
    """End the engine step (its events), start the next one (Mamba's same-step set)."""
    batch = kv.step_events()
    if state is not None:
        state.apply_batch(batch)
    kv.new_step_starts()
    return events_of(batch)


def held(ids: list[int | None]) -> list[int]:
    return [i for i, b in enumerate(ids) if b is not None]


@pytest.mark.parametrize("profile", ["full", "swa-hybrid"])
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
        # The window keeps only its tail before the replay boundary floor(31/16)*16 = 16:
        # block 0; full attention keeps both blocks.
        expected = req.wire_hashes[:1] if spec.kind == "sliding_window" else req.wire_hashes
        assert ev.block_hashes == expected


def test_mamba_prompt_cut_at_replay_boundary_stores_state_then_empty_event() -> None:
    kv = kv_for("mamba-hybrid", 16)
    req = kv.new_request("r", list(range(32)))
    # vLLM's block-aligned split stops the prefill at floor((32 - 1) / 16) * 16 = 16.
    admit(kv, req, chunk=16)
    first = step(kv)
    assert [(e.group_idx, e.block_hashes, e.token_ids) for e in first] == [
        (0, req.wire_hashes[:1], list(range(16))),
        (1, req.wire_hashes[:1], list(range(16))),  # the state after 16 tokens
    ]
    assert first[1].kv_cache_spec_kind == "mamba"
    admit_more(kv, req, 16)
    second = step(kv)
    # Both groups grew by a full block: full attention stores it, Mamba emits an empty
    # BlockStored (no state is kept past the replay boundary), both parented on block 0.
    assert [(e.group_idx, e.block_hashes, e.token_ids) for e in second] == [
        (0, req.wire_hashes[1:2], list(range(16, 32))),
        (1, [], list(range(16, 32))),
    ]
    assert all(e.parent_block_hash == req.wire_hashes[0] for e in second)
    assert second[1].extra_keys is None


def test_swa_frees_blocks_behind_the_window_silently_and_keeps_only_the_replay_window() -> None:
    kv = kv_for("swa-hybrid", 65)  # 64 usable blocks + the null block
    rng = random.Random(1)
    req = kv.new_request("r", tokens(rng, 160))  # 10 blocks per group
    admit(kv, req)
    full_ev, swa_ev = kv.take_events()
    assert full_ev.block_hashes == req.wire_hashes  # all 10 blocks
    # Replay boundary floor(159/16) = block 9: the cdiv(63, 16) = 4 window blocks before it.
    assert swa_ev.block_hashes == req.wire_hashes[5:9]
    assert swa_ev.token_ids == req.all_token_ids  # covering the unhashed blocks too
    swa_before = kv.get_block_ids(req)[1]
    free_before = kv.num_free_blocks
    decode(kv, req, 7)  # computed 160: next token sees [97, 160] -> blocks 0..5 out
    assert kv.take_events() == []  # freeing is silent, block 10 not full yet
    full_ids, swa_ids = kv.get_block_ids(req)
    assert swa_ids[:6] == [None] * 6 and swa_ids[6:10] == swa_before[6:10]
    assert None not in full_ids
    assert kv.num_free_blocks == free_before + 6 - 2  # 6 freed; block 10 in each group
    # Freed unhashed blocks (positions 4..0) went to the head, position 4 first: the new
    # full block reuses it, the new window block position 3's.
    assert (full_ids[10], swa_ids[10]) == (swa_before[4], swa_before[3])
    # Position 5 was freed too but is hashed: still findable until it is reused.
    assert [i for i in range(11) if kv.is_cached_on_gpu(req, 1, i)] == [5, 6, 7, 8]


def test_swa_freed_blocks_reused_unhashed_first_then_least_recent() -> None:
    kv = kv_for("swa-hybrid", 23)  # shared pool: 22 usable blocks
    state = EventState()
    rng = random.Random(2)
    a = kv.new_request("a", tokens(rng, 160))
    prefill(kv, a, state)
    decode(kv, a, 1)  # 161 tokens: 11 blocks per group, window blocks 0..5 freed
    state.apply_batch(kv.step_events())
    assert kv.num_free_blocks == 6
    b = kv.new_request("b", tokens(rng, 48))  # 3 blocks per group: every free block
    admit(kv, b)
    batch = kv.step_events()
    state.apply_batch(batch)
    removed = [
        (e.group_idx, e.block_hashes) for e in events_of(batch) if not isinstance(e, BlockStored)
    ]
    # Queue was [a's unhashed 4..0 (two of them reused by a's decode), 2 never used,
    # a's hashed window block 5]: only that last one is evicted.
    assert removed == [(1, [a.wire_hashes[5]])]
    assert state.counts == kv.residency()
    kv.free(b)
    kv.free(a)
    # free() goes group by group, each tail first: unhashed to the head (last group's
    # first), hashed to the tail. So c (8 blocks) takes the 4 unhashed blocks, then b's
    # older hashed ones -- full 2, 1, 0 and window block 1 -- before anything of a's.
    c = kv.new_request("c", tokens(rng, 64))
    admit(kv, c)
    batch = kv.step_events()
    state.apply_batch(batch)
    removed = [
        (e.group_idx, e.block_hashes) for e in events_of(batch) if not isinstance(e, BlockStored)
    ]
    assert removed == [(0, [b.wire_hashes[i]]) for i in (2, 1, 0)] + [(1, [b.wire_hashes[1]])]
    assert all(kv.is_cached_on_gpu(a, 0, i) for i in range(10))
    assert [i for i in range(10) if kv.is_cached_on_gpu(a, 1, i)] == [6, 7, 8]
    assert [i for i in range(3) if kv.is_cached_on_gpu(b, 1, i)] == [0]
    assert state.counts == kv.residency()


def test_swa_hit_lands_on_the_replay_window_and_a_branch_inside_the_prompt_misses() -> None:
    kv = kv_for("swa-hybrid", 23)
    state, rng, prompt = opening(3, 160)
    a = kv.new_request("a", prompt)
    prefill(kv, a, state)
    decode(kv, a, 1)
    state.apply_batch(kv.step_events())
    # Full attention holds all 10 blocks, the window only blocks 5..8 (ending at 144).
    probe = kv.new_request("p", [*prompt, 5, 6, 7])
    hit = kv.get_computed_blocks(probe)
    assert hit == 144 == event_hit(kv, state, probe)
    assert probe.shared_prefix_boundary == 160  # full attention alone reached further
    # A branch at token 100: full attention serves 96, but no complete window ends there.
    branch = kv.new_request("br", [*prompt[:100], *tokens(rng, 20)])
    assert kv.get_computed_blocks(branch) == 0 == event_hit(kv, state, branch)
    assert branch.shared_prefix_boundary == 96
    kv.free(a)
    gpu, _ = admit(kv, probe)
    assert gpu == 144
    swa = kv.get_block_ids(probe)[1]
    # cdiv(64 - 1, 16) = 4 window blocks adopted (a's), older positions are nulls
    assert swa[:5] == [None] * 5 and swa[5:9] == [
        kv.pools[1].get_cached((a.block_hashes[i], 1)).block_id for i in range(5, 9)
    ]


def test_swa_hit_needs_a_complete_window_run_and_one_lost_block_loses_it() -> None:
    kv = kv_for("swa-hybrid", 65)
    rng = random.Random(4)
    prompt = tokens(rng, 160)
    a = kv.new_request("a", prompt)
    admit(kv, a, chunk=96)  # step 1 ends at 96: window block 5 is already cached
    admit_more(kv, a, 64)  # step 2: blocks 0..1 of step 1 are freed, 6..8 cached
    kv.free(a)
    kv.take_events()
    assert [i for i in range(10) if kv.is_cached_on_gpu(a, 1, i)] == [5, 6, 7, 8]
    probe = kv.new_request("p", [*prompt, 1])
    assert kv.get_computed_blocks(probe) == 144
    pool = kv.pools[1]
    # Evict SWA block 8 (inside the window before 144) by hand via the pool.
    block = pool.get_cached((a.block_hashes[8], 1))
    assert block is not None
    pool.touch([block])
    pool._evict(block)  # as if exactly this block had been reused
    pool.free_blocks([block])
    # Blocks 5..7 are a run of 3 < 4: no window ends anywhere, so no hit at all.
    assert kv.get_computed_blocks(probe) == 0
    assert probe.shared_prefix_boundary == 160


def admit_more(kv: KVCacheManager, req, n: int) -> None:
    assert kv.allocate_slots(req, n)


def test_mamba_caches_only_the_replay_boundary_state() -> None:
    kv = kv_for("mamba-hybrid", 257)
    rng = random.Random(5)
    req = kv.new_request("r", tokens(rng, 1000))
    admit(kv, req, chunk=992)  # the split stops the prompt at floor(999/16)*16 = 992
    full_ev, mamba_ev = step(kv)
    assert full_ev.block_hashes == req.wire_hashes[:62]
    assert mamba_ev.group_idx == 1 and mamba_ev.kv_cache_spec_kind == "mamba"
    assert mamba_ev.block_hashes == [req.wire_hashes[61]]
    assert mamba_ev.parent_block_hash is None
    assert mamba_ev.token_ids == req.all_token_ids[:992]  # covers the skipped blocks too
    assert held(kv.get_block_ids(req)[1]) == [61]  # the running state only
    admit_more(kv, req, 8)
    assert step(kv) == []  # no group completes a block
    assert held(kv.get_block_ids(req)[1]) == [61, 62]  # previous state kept one more step
    decode(kv, req, 3)
    assert held(kv.get_block_ids(req)[1]) == [62]
    assert kv.is_cached_on_gpu(req, 1, 61)  # freed, still cached


def test_mamba_chunked_prefill_caches_only_the_boundary_and_a_branch_adds_its_junction() -> None:
    kv = kv_for("mamba-hybrid", 257)
    state, rng, prompt = opening(6, 1000)
    req = kv.new_request("r", prompt)
    admit(kv, req, chunk=256)
    step(kv, state)
    # 256-token steps; the last one is cut at the replay boundary 992, then 8 more.
    for n in (256, 256, 224, 8):
        admit_more(kv, req, n)
        step(kv, state)
    # The states after 256, 512, 768 tokens were computed but are not retained.
    assert [i for i in range(62) if kv.is_cached_on_gpu(req, 1, i)] == [61]
    resend = kv.new_request("q", [*prompt, 1, 2, 3])
    assert kv.get_computed_blocks(resend) == 992 == event_hit(kv, state, resend)
    branch = kv.new_request("p", [*prompt[:600], *tokens(rng, 50)])
    # Full attention could serve 37 blocks (592 tokens); no Mamba state at or below.
    assert kv.get_computed_blocks(branch) == 0 == event_hit(kv, state, branch)
    assert branch.shared_prefix_boundary == 592
    # The branch is split at that junction and at its own replay boundary 640.
    gpu, cpu = kv.lookup(branch)
    assert kv.allocate_slots(branch, 592, gpu, cpu, full_sequence_must_fit=True)
    step(kv, state)
    admit_more(kv, branch, 48)
    step(kv, state)
    admit_more(kv, branch, 10)
    step(kv, state)
    assert [i for i in range(41) if kv.is_cached_on_gpu(branch, 1, i)] == [36, 39]
    sibling = kv.new_request("s", [*prompt[:600], *tokens(rng, 30)])
    assert kv.get_computed_blocks(sibling) == 592 == event_hit(kv, state, sibling)


def test_mamba_decode_emits_an_empty_block_stored_at_each_boundary() -> None:
    kv = kv_for("mamba-hybrid", 257)
    rng = random.Random(7)
    req = kv.new_request("r", tokens(rng, 1000))
    admit(kv, req, chunk=992)
    admit_more(kv, req, 8)
    kv.take_events()
    for t in range(7):
        decode(kv, req, t)
    assert kv.take_events() == []
    decode(kv, req, 99)  # token index 1007: block 62 full at 1008
    events = kv.take_events()
    assert [(e.group_idx, e.block_hashes) for e in events] == [
        (0, [req.wire_hashes[62]]),
        (1, []),  # decode tokens create no Mamba boundary
    ]
    for e in events:
        assert e.parent_block_hash == req.wire_hashes[61]
        assert e.token_ids == req.all_token_ids[992:1008]
    assert held(kv.get_block_ids(req)[1]) == [62]
    decode(kv, req, 5)  # [1008, 1009): a new state block at 63
    assert held(kv.get_block_ids(req)[1]) == [62, 63]
    decode(kv, req, 5)  # the previous one is freed a step later
    assert held(kv.get_block_ids(req)[1]) == [63]


def test_mamba_hit_block_refused_in_its_own_step_then_adopted() -> None:
    kv = kv_for("mamba-hybrid", 257)
    rng = random.Random(8)
    prompt = tokens(rng, 1000)
    a = kv.new_request("a", prompt)
    admit(kv, a, chunk=992)
    step(kv)
    state_block = kv.get_block_ids(a)[1][61]
    admit_more(kv, a, 8)  # this step re-registers the boundary state (block 61)
    b = kv.new_request("b", [*prompt[:992], *tokens(rng, 40)])
    gpu, cpu = kv.lookup(b)
    assert (gpu, cpu) == (992, 0)
    # The same step refuses a hit on a state it (re-)registered.
    assert not kv.allocate_slots(b, 32, gpu, cpu, full_sequence_must_fit=True)
    assert kv.get_block_ids(b) == [[], []]
    step(kv)
    decode(kv, a, 1)  # a drops its block 61 (freed, still cached)
    # b's split stops at its replay boundary floor(1031/16)*16 = 1024.
    assert kv.allocate_slots(b, 32, gpu, cpu, full_sequence_must_fit=True)
    ids = kv.get_block_ids(b)[1]
    assert ids[61] == state_block  # the cached state is reused, not copied
    assert held(ids) == [61, 63]  # hit state + the running state after 1024
    step(kv)
    admit_more(kv, b, 8)
    ids = kv.get_block_ids(b)[1]
    assert held(ids) == [63, 64]
    assert kv.is_cached_on_gpu(b, 1, 61) and kv.is_cached_on_gpu(b, 1, 63)


def test_pool_per_group_keeps_groups_apart() -> None:
    kv = kv_for("swa-hybrid", 13, pool_per_group=True)  # 12 usable blocks in each pool
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
