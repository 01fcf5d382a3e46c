"""CPU offload tier: when chunks are stored and published, how lookups extend GPU hits."""

from __future__ import annotations

import random

import pytest
from ea_helpers import EventState, admit, decode, events_of, opening, prefill, tokens

from engine_adapter.kv_cache_manager import KVCacheManager
from engine_adapter.offload import OffloadConfig
from engine_adapter.profiles import get_profile
from engine_adapter.request import Request
from events.offload_hit import offload_hit
from events.structs import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored

BS = 16


def make_kv(
    profile: str, num_blocks: int = 64, chunks: int = 64, k: int = 4, **kw
) -> KVCacheManager:
    cfg = OffloadConfig(
        num_cpu_chunks=chunks,
        blocks_per_chunk=k,
        policy=kw.pop("policy", "lru"),
        self_describing=kw.pop("self_describing", True),
        offload_prompt_only=kw.pop("offload_prompt_only", True),
        vllm_version=kw.pop("vllm_version", "0.33"),
    )
    prof = get_profile(profile, sliding_window=64, page_bytes=256)
    return KVCacheManager(prof, num_blocks, offload=cfg, **kw)


def cpu_events(events: list[object]) -> list[object]:
    return [e for e in events if getattr(e, "medium", None) == MEDIUM_CPU]


def prefill_and_free(kv: KVCacheManager, req, state: EventState) -> None:
    """Prefill ``req``, free it, then wait for its copies and apply all events."""
    prefill(kv, req, state)
    kv.free(req)
    kv.flush()
    state.apply_batch(kv.step_events())


def evict_gpu(kv: KVCacheManager, rng: random.Random, num_tokens: int, state: EventState) -> None:
    """Run a throwaway request that recycles ``num_tokens // 16`` blocks per group."""
    prefill_and_free(kv, kv.new_request(f"flood{rng.random()}", tokens(rng, num_tokens)), state)


def offloaded(
    kv: KVCacheManager, seed: int, num_tokens: int
) -> tuple[EventState, random.Random, Request]:
    """A random prompt prefilled, freed and copied to the CPU tier; its events applied."""
    state, rng, prompt = opening(seed, num_tokens)
    req = kv.new_request("a", prompt)
    prefill_and_free(kv, req, state)
    return state, rng, req


def end_step(kv: KVCacheManager) -> list[object]:
    """End a step, then wait for its copies: all events, CPU ones included."""
    events = events_of(kv.step_events())
    kv.flush()
    return events + events_of(kv.step_events())


def drop_gpu(kv: KVCacheManager, req, group: int, indices: range) -> None:
    """Evict exactly these cached blocks of ``req`` from the GPU (as if reused)."""
    pool = kv.pools[group]
    for i in indices:
        block = pool.get_cached((req.block_hashes[i], group))
        assert block is not None
        pool.touch([block])
        pool._evict(block)
        pool.free_blocks([block])


def expected_hit(kv: KVCacheManager, state: EventState, req) -> tuple[int, int]:
    return offload_hit(
        kv.specs,
        state.pred(req, MEDIUM_GPU),
        state.pred(req, MEDIUM_CPU),
        req.num_tokens,
        kv.tokens_per_chunk,
    )


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_cpu_events_come_the_step_after_the_store_and_describe_full_attention_only(
    version: str,
) -> None:
    # vLLM: the worker submits a store at the next step's start, so its BlockStored is in
    # the next step's batch; self-describing payloads only for full attention
    # (OffloadingEventsTracker.record_store), placeholders for window groups -- which in
    # 0.33 name their group's kind and window (``_placeholder_stored``).
    kv = make_kv("swa-hybrid", vllm_version=version)
    rng = random.Random(0)
    req = kv.new_request("r", tokens(rng, 128 + 5))
    admit(kv, req)
    first = events_of(kv.step_events())
    assert cpu_events(first) == [] and first  # GPU events only: copies in flight
    assert not any(m == MEDIUM_CPU for (_, _, m) in kv.residency())
    stored = cpu_events(events_of(kv.step_events()))
    w = req.wire_hashes
    # Window group: only the chunk before the replay boundary (132 -> 128) is reachable.
    assert [(e.group_idx, e.block_hashes) for e in stored] == [
        (0, w[0:4]),
        (0, w[4:8]),
        (1, [w[7]]),
    ]
    ev = stored[1]
    assert isinstance(ev, BlockStored)
    assert ev.parent_block_hash == w[3]
    assert ev.token_ids == req.all_token_ids[64:128]
    assert ev.block_size == BS and ev.extra_keys is None
    assert ev.kv_cache_spec_kind == "full_attention"
    placeholder = stored[2]
    assert (placeholder.token_ids, placeholder.block_size, placeholder.parent_block_hash) == (
        [],
        0,
        None,
    )
    if version == "0.32":
        assert placeholder.kv_cache_spec_kind is None
        assert placeholder.kv_cache_spec_sliding_window is None
    else:
        assert placeholder.kv_cache_spec_kind == "sliding_window"
        assert placeholder.kv_cache_spec_sliding_window == 64
    kv.close()


def run_prompt(kv: KVCacheManager, req, state: EventState, gpu: int = 0) -> None:
    """Compute ``req``'s prompt from ``gpu`` in one step -- for Mamba two: vLLM's
    scheduler ends a chunk at the replay boundary floor((P - 1) / B) * B -- then free it
    and apply all events, CPU ones included."""
    boundary = (req.num_tokens - 1) // BS * BS
    mamba = any(s.kind == "mamba" for s in kv.specs)
    chunks = [boundary - gpu, req.num_tokens - boundary] if mamba else [req.num_tokens - gpu]
    assert kv.allocate_slots(req, chunks[0], gpu, 0)
    for more in chunks[1:]:
        state.apply_batch(kv.step_events())
        kv.new_step_starts()
        assert kv.allocate_slots(req, more)
    state.apply_batch(kv.step_events())
    kv.new_step_starts()
    kv.free(req)
    kv.flush()
    state.apply_batch(kv.step_events())


@pytest.mark.parametrize("profile", ["swa-hybrid", "mamba-hybrid"])
def test_cpu_hit_extends_gpu_hit_across_groups(profile: str) -> None:
    kv = make_kv(profile, num_blocks=64)
    state = EventState()
    rng = random.Random(1)
    prompt = tokens(rng, 321)  # 20 full blocks, 5 chunks per group
    # A shorter sibling leaves the sparse group's state at its replay boundary 192 (SWA:
    # blocks 8..11, Mamba: block 11) on the GPU; the full prompt then leaves it at 320.
    a0 = kv.new_request("a0", prompt[:200])
    run_prompt(kv, a0, state)
    a = kv.new_request("a", prompt)
    assert kv.lookup(a) == (192, 0)
    run_prompt(kv, a, state, gpu=192)
    sparse = [i for i in range(20) if kv.is_cached_on_gpu(a, 1, i)]
    assert sparse == ([8, 9, 10, 11, 16, 17, 18, 19] if profile == "swa-hybrid" else [11, 19])
    drop_gpu(kv, a, 0, range(12, 20))  # full attention keeps 12 blocks on GPU
    if profile == "mamba-hybrid":
        drop_gpu(kv, a, 1, range(19, 20))  # the state at 320 is only on CPU
    state.apply_batch(kv.step_events())
    probe = kv.new_request("p", [*prompt, *tokens(rng, 10)])
    gpu, cpu = kv.lookup(probe)
    assert (gpu, cpu) == (192, 128) == expected_hit(kv, state, probe)
    assert kv.allocate_slots(probe, probe.num_tokens - gpu - cpu, gpu, cpu)
    assert probe.num_cpu_hit_tokens == cpu and probe.num_computed_tokens == probe.num_tokens
    ids = kv.get_block_ids(probe)
    assert None not in ids[0]
    held = [i for i, b in enumerate(ids[1]) if b is not None]
    # SWA: the window before 320 (blocks 16..19) + new; Mamba: loaded state + running
    assert held == ([16, 17, 18, 19, 20] if profile == "swa-hybrid" else [19, 20])
    events = events_of(kv.step_events())
    state.apply(events)
    gpu_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_GPU]
    assert gpu_stored[0].block_hashes == probe.wire_hashes[12:20]  # loaded blocks cached
    # The sparse group caches only what its replay boundary floor(330/16)*16 = 320 keeps.
    kept = probe.wire_hashes[16:20] if profile == "swa-hybrid" else probe.wire_hashes[19:20]
    assert gpu_stored[1].block_hashes == kept
    assert state.counts == kv.residency()
    kv.close()


def test_cpu_hit_needs_a_whole_chunk_beyond_gpu_hit() -> None:
    kv = make_kv("full", num_blocks=10)  # 9 usable blocks + the null block
    state, rng, a = offloaded(kv, 2, 128)
    prompt = a.prompt_token_ids
    evict_gpu(kv, rng, 32, state)  # takes the never-used block, then a's tail (block 7)
    probe = kv.new_request("p", [*prompt, 1])
    assert kv.get_computed_blocks(probe) == 112
    assert kv.is_cached_on_gpu(probe, 0, 6) and kv.offload.is_ready((probe.block_hashes[7], 0))
    assert kv.lookup(probe) == (112, 0) == expected_hit(kv, state, probe)
    kv.close()


def test_full_attention_cpu_hit_may_cover_the_whole_prompt() -> None:
    kv = make_kv("full", num_blocks=17)  # 16 usable blocks + the null block
    state, rng, a = offloaded(kv, 3, 128)
    prompt = a.prompt_token_ids
    evict_gpu(kv, rng, 256, state)  # every GPU block recycled
    probe = kv.new_request("p", prompt)
    gpu, cpu = kv.lookup(probe)
    # Full attention only: the cap is num_tokens, not num_tokens - 1 (vLLM loads the
    # last chunk and recomputes the last token).
    assert (gpu, cpu) == (0, 128) == expected_hit(kv, state, probe)
    assert kv.allocate_slots(probe, 1, gpu, cpu)
    assert probe.num_computed_tokens == 128
    assert kv.get_computed_blocks(kv.new_request("q", [*prompt, 1])) == 128
    kv.close()


def test_swa_stores_only_reachable_window_chunks_and_lookup_follows_the_rule() -> None:
    # vLLM's _reachable_store_block_mask: a window group offers only the chunks holding the
    # window before the replay boundary (319 -> 256: blocks 12..15, chunk 3).
    kv = make_kv("swa-hybrid", num_blocks=49, chunks=64)  # 48 usable + the null block
    state, rng, a = offloaded(kv, 4, 320)
    swa_cpu = {h for (g, h, m) in kv.residency() if m == MEDIUM_CPU and g == 1}
    assert swa_cpu == {a.wire_hashes[15]}
    full_cpu = {h for (g, h, m) in kv.residency() if m == MEDIUM_CPU and g == 0}
    assert full_cpu == set(a.wire_hashes[:20])  # self-describing: every block named
    evict_gpu(kv, rng, 48 * BS // 2, state)  # recycle every GPU block
    probe = kv.new_request("p", [*a.prompt_token_ids[:256], 9])
    assert kv.get_computed_blocks(probe) == 0
    assert kv.lookup(probe) == (0, 256) == expected_hit(kv, state, probe)
    assert kv.allocate_slots(probe, 1, 0, 256)
    swa = kv.get_block_ids(probe)[1]
    # Only the window before 256 is loaded: cdiv(63, 16) = 4 blocks (chunk 3)
    assert [i for i, b in enumerate(swa) if b is not None] == [12, 13, 14, 15, 16]
    kv.close()


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_cpu_removed_events_fan_out_to_the_stored_hashes(version: str) -> None:
    kv = make_kv("full", num_blocks=32, chunks=2, vllm_version=version)
    rng = random.Random(5)
    a = kv.new_request("a", tokens(rng, 128))
    admit(kv, a)
    stored = cpu_events(end_step(kv))
    assert [e.block_hashes for e in stored] == [a.wire_hashes[0:4], a.wire_hashes[4:8]]
    b = kv.new_request("b", tokens(rng, 128))
    # b needs both CPU slots: a's chunks go -- 0.32 in the order they were stored; 0.33
    # by a's provisional rank, its tail first (``LRUCachePolicy.insert``: -position).
    admit(kv, b)
    removed = [e for e in end_step(kv) if isinstance(e, BlockRemoved)]
    w = a.wire_hashes
    order = w[0:4] + w[4:8] if version == "0.32" else w[4:8] + w[0:4]
    assert [(e.group_idx, e.medium, e.block_hashes) for e in removed] == [(0, MEDIUM_CPU, order)]
    assert {h for (_, h, m) in kv.residency() if m == MEDIUM_CPU} == set(b.wire_hashes[:8])
    kv.close()


def test_placeholder_mode_emits_vllm_legacy_cpu_events() -> None:
    kv = make_kv("swa-hybrid", chunks=2, self_describing=False)
    state = EventState()
    rng = random.Random(6)
    a = kv.new_request("a", tokens(rng, 64))
    admit(kv, a)
    events = end_step(kv)
    state.apply(events)
    stored = cpu_events(events)
    # The window group's only chunk ends at the replay boundary (63 -> 0): unreachable.
    assert [
        (e.group_idx, e.block_hashes, e.token_ids, e.block_size, e.parent_block_hash)
        for e in stored
    ] == [(0, [a.wire_hashes[3]], [], 0, None)]
    b = kv.new_request("b", tokens(rng, 64))
    admit(kv, b)
    c = kv.new_request("c", tokens(rng, 64))
    admit(kv, c)  # two slots: c's store evicts a's chunk
    events = end_step(kv)
    state.apply(events)
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted((e.group_idx, e.block_hashes, e.medium) for e in removed) == [
        (0, [a.wire_hashes[3]], MEDIUM_CPU),
    ]
    assert state.counts == kv.residency()
    kv.close()


def test_stores_skip_chunks_already_offloaded() -> None:
    kv = make_kv("full")
    rng = random.Random(7)
    prompt = tokens(rng, 128)
    admit(kv, kv.new_request("a", prompt))
    assert len(cpu_events(end_step(kv))) == 2
    b = kv.new_request("b", [*prompt, 3])
    admit(kv, b)
    assert cpu_events(end_step(kv)) == []
    kv.close()


@pytest.mark.parametrize("prompt_only", [True, False])
def test_decode_chunks_offloaded_only_when_not_prompt_only(prompt_only: bool) -> None:
    kv = make_kv("full", offload_prompt_only=prompt_only)
    rng = random.Random(8)
    req = kv.new_request("r", tokens(rng, 64))
    admit(kv, req)
    kv.step_events()
    for t in range(64):
        decode(kv, req, t)
        kv.step_events()
    kv.flush()
    kv.step_events()
    assert kv.offload.is_ready((req.block_hashes[3], 0))
    assert kv.offload.is_ready((req.block_hashes[7], 0)) is (not prompt_only)
    kv.close()


def test_reset_prefix_cache_keeps_the_cpu_tier_unless_reset_external() -> None:
    # vLLM: POST /reset_prefix_cache clears the GPU (AllBlocksCleared) and the CPU tier keeps
    # serving hits; ?reset_external=true empties the CPU tier too, with no event of its own.
    kv = make_kv("full")
    state = EventState()
    rng = random.Random(9)
    a = kv.new_request("a", tokens(rng, 128))
    prefill(kv, a, state)
    kv.free(a)
    kv.flush()
    state.apply_batch(kv.step_events())
    assert kv.reset_prefix_cache()
    events = events_of(kv.step_events())
    assert [type(e) for e in events] == [AllBlocksCleared]
    assert {m for (_, _, m) in kv.residency()} == {MEDIUM_CPU}
    assert kv.lookup(kv.new_request("b", a.all_token_ids)) == (0, 128)
    assert kv.reset_prefix_cache(reset_external=True)
    assert [type(e) for e in events_of(kv.step_events())] == [AllBlocksCleared]
    assert not kv.residency()
    assert kv.lookup(kv.new_request("c", a.all_token_ids)) == (0, 0)
    kv.close()


def test_lookup_is_a_pure_read_and_a_finished_request_reranks_its_prefix() -> None:
    # vLLM: CPUOffloadingManager.lookup changes nothing; on_request_finished re-ranks the
    # chunks a request stored or reused, so its prefix is evicted last.
    for run_it in (False, True):
        kv = make_kv("full", chunks=4)
        state = EventState()
        rng = random.Random(11)
        a = kv.new_request("a", tokens(rng, 128))
        b = kv.new_request("b", tokens(rng, 128))
        for r in (a, b):
            prefill_and_free(kv, r, state)
        a2 = kv.new_request("a2", a.all_token_ids)
        if run_it:
            prefill_and_free(kv, a2, state)  # GPU hit; its chunks are re-offered: reused
        else:
            kv.lookup(a2)  # a lookup alone: no recency change
        c = kv.new_request("c", tokens(rng, 128))
        prefill_and_free(kv, c, state)
        assert kv.offload.is_ready((a.block_hashes[7], 0)) is run_it
        assert kv.offload.is_ready((b.block_hashes[7], 0)) is not run_it
        kv.close()


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_a_preempted_request_restarting_at_token_0_offers_every_chunk_again_in_033(
    version: str,
) -> None:
    # vLLM 0.33's get_num_new_matched_tokens sets next_stored_chunk_idx = 0 when a request
    # is looked up at token 0 (after preemption); 0.32 keeps its store progress, so a
    # chunk stored before the preemption and evicted since is never offered again.
    kv = make_kv("full", num_blocks=64, chunks=2, vllm_version=version)
    rng = random.Random(7)
    r = kv.new_request("r", tokens(rng, 128 + 5))
    admit(kv, r, chunk=64)
    assert [e.block_hashes for e in cpu_events(end_step(kv))] == [r.wire_hashes[0:4]]
    kv.free(r, finished=False)  # preempted: recompute from token 0
    r.num_computed_tokens = 0
    x = kv.new_request("x", tokens(rng, 128 + 5))
    admit(kv, x)  # its two chunks take the tier: r's chunk 0 goes
    removed = [e for e in cpu_events(end_step(kv)) if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [r.wire_hashes[0:4]]
    kv.free(x)
    end_step(kv)
    assert admit(kv, r) == (64, 0)  # r's GPU blocks are still cached
    stored = [e.block_hashes for e in cpu_events(end_step(kv)) if isinstance(e, BlockStored)]
    w = r.wire_hashes
    assert stored == ([w[4:8]] if version == "0.32" else [w[0:4], w[4:8]])
    kv.close()
