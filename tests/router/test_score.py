"""Scorer and layout: hybrid GPU hits, CPU chunk extension, full_only baseline, learning."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry
from routerkit import C0, C1, G0, G1, PlayedSource, batch, stored

from events.groups import (
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
    longest_cache_hit,
)
from events.offload_hit import offload_hit
from events.subscriber import BatchReceived
from router.decision.layout import InstanceLayout, LayoutRegistry
from router.decision.score import Score, Scorer, score_residency

FULL = InstanceLayout.full(16)
SWA = InstanceLayout((FullAttentionSpec(16), SlidingWindowSpec(16, 64)), tokens_per_chunk=64)
MAMBA = InstanceLayout((FullAttentionSpec(16), MambaSpec(16)), tokens_per_chunk=64)


def ones(lo: int, hi: int) -> int:
    return ((1 << hi) - 1) ^ ((1 << lo) - 1)


def test_full_attention_hit_is_the_cached_prefix_minus_the_last_token():
    res = {G0: ones(0, 10) | 1 << 11}
    assert score_residency(FULL, res, 12, 160) == Score(144, 0)  # 160 - 1 caps at 9 blocks
    assert score_residency(FULL, res, 12, 161) == Score(160, 0)
    assert score_residency(FULL, res, 12, 1) == Score(0, 0)
    assert score_residency(FULL, {}, 12, 500) == Score(0, 0)


def test_sliding_window_hit_needs_only_the_blocks_inside_the_window():
    # window 64 tokens -> the 4 blocks before the hit end must be cached; older ones not.
    # Full attention alone would reach 320: that is the junction the engine reports.
    res = {G0: ones(0, 20), G1: ones(12, 16)}
    assert score_residency(SWA, res, 20, 20 * 16 + 1) == Score(16 * 16, 0, 320)
    res[G1] = ones(13, 16) | ones(0, 2)  # no full window anywhere: only the leading run
    assert score_residency(SWA, res, 20, 20 * 16 + 1) == Score(2 * 16, 0, 320)
    res[G1] = ones(16, 20)  # the window ends where full attention does: no junction
    assert score_residency(SWA, res, 20, 20 * 16 + 1) == Score(320, 0, 0)


def test_mamba_hit_lands_on_the_last_cached_state_block():
    res = {G0: ones(0, 20), G1: 1 << 6 | 1 << 13}
    assert score_residency(MAMBA, res, 20, 20 * 16 + 1) == Score(14 * 16, 0, 320)
    res[G0] = ones(0, 10)  # full attention caps the hit; mamba then needs a state <= 10
    assert score_residency(MAMBA, res, 20, 20 * 16 + 1) == Score(7 * 16, 0, 160)
    res[G1] = 1 << 9  # the state right at the full-attention end: no junction
    assert score_residency(MAMBA, res, 20, 20 * 16 + 1) == Score(160, 0, 0)


def test_full_only_baseline_ignores_window_and_mamba_groups():
    res = {G0: ones(0, 20), G1: ones(0, 3)}
    assert score_residency(SWA, res, 20, 321) == Score(48, 0, 320)
    # The baseline sees full attention only: nothing cuts its hit, so no junction.
    assert score_residency(SWA, res, 20, 321, full_only=True) == Score(320, 0, 0)
    assert score_residency(MAMBA, res, 20, 321, full_only=True) == Score(320, 0, 0)


def test_cpu_extension_loads_whole_chunks_past_the_gpu_hit():
    # 4 blocks per chunk; chunks are named by their last block (positions 3, 7, 11, ...).
    res = {G0: ones(0, 5), C0: 1 << 3 | 1 << 7 | 1 << 11}
    layout = InstanceLayout.full(16, tokens_per_chunk=64)
    assert score_residency(layout, res, 16, 16 * 16) == Score(80, 192 - 80)
    res[C0] = 1 << 3 | 1 << 11  # chunk 1 missing: nothing loadable past the GPU hit
    assert score_residency(layout, res, 16, 16 * 16) == Score(80, 0)


def test_placeholder_and_self_describing_cpu_residency_score_the_same():
    layout = InstanceLayout.full(16, tokens_per_chunk=64)
    placeholder = {G0: ones(0, 2), C0: 1 << 3 | 1 << 7}
    self_describing = {G0: ones(0, 2), C0: ones(0, 8)}
    want = score_residency(layout, placeholder, 12, 12 * 16)
    assert want == Score(32, 96)
    assert score_residency(layout, self_describing, 12, 12 * 16) == want
    # Blocks of a chunk without its last block are not loadable.
    assert score_residency(layout, {C0: ones(0, 7)}, 12, 12 * 16) == Score(0, 64)


def test_groups_with_larger_blocks_read_the_hash_at_their_block_end():
    layout = InstanceLayout((FullAttentionSpec(32), SlidingWindowSpec(16, 32)))
    assert layout.hash_block_size == 16
    # hash positions 0..7; the 32-token group's block j is named by position 2j+1.
    res = {G0: 1 << 1 | 1 << 3 | 1 << 5, G1: ones(0, 8)}
    assert score_residency(layout, res, 8, 8 * 16 + 1) == Score(96, 0)
    res[G0] = 1 << 0 | 1 << 2 | 1 << 4  # the wrong sub-block: no hit
    assert score_residency(layout, res, 8, 8 * 16 + 1) == Score(0, 0)


@pytest.mark.parametrize("seed", range(6))
def test_mask_scoring_matches_the_engine_rules_on_random_residency(seed):
    rng = random.Random(seed)
    bs = 16
    ratio = rng.choice([1, 2])
    second = rng.choice(
        [SlidingWindowSpec(bs * ratio, rng.choice([48, 64, 128])), MambaSpec(bs * ratio)]
    )
    layout = InstanceLayout((FullAttentionSpec(bs), second), tokens_per_chunk=64 * ratio)
    npos = 32
    for _ in range(40):
        gpu = [rng.getrandbits(npos) | ones(0, rng.randrange(npos)) for _ in range(2)]
        cpu = [rng.getrandbits(npos) for _ in range(2)]
        n_tokens = rng.randrange(2, npos * bs + 10)

        def at(mask: int, g: int, i: int) -> bool:
            r = layout.groups[g].block_size // bs
            return (mask >> ((i + 1) * r - 1)) & 1 == 1

        def gpu_cached(g: int, i: int, gpu=gpu) -> bool:
            return at(gpu[g], g, i)

        def cpu_cached(g: int, i: int, cpu=cpu) -> bool:
            return at(cpu[g], g, i)

        want = offload_hit(layout.groups, gpu_cached, cpu_cached, n_tokens, 64 * ratio)
        assert want[0] == longest_cache_hit(layout.groups, gpu_cached, n_tokens - 1)
        # vLLM's shared_prefix_boundary: full attention's own hit (a multiple of the hit
        # alignment, the LCM of the block sizes) when it is longer than the hybrid hit.
        full_hit = longest_cache_hit(layout.groups[:1], gpu_cached, n_tokens - 1)
        full_hit -= full_hit % (bs * ratio)
        junction = full_hit if full_hit > want[0] else 0
        res = {G0: gpu[0], G1: gpu[1], C0: cpu[0], C1: cpu[1]}
        assert score_residency(layout, res, npos, n_tokens) == (*want, junction)


async def test_scorer_scores_candidates_from_either_backend(index):
    reg = LayoutRegistry(default=SWA)
    await index.apply("a", batch(stored(list(range(10)), 0), stored(list(range(6, 10)), 1)))
    await index.apply("b", batch(stored(list(range(4)), 0), stored(list(range(4)), 1)))
    await index.apply("b", batch(stored([3, 7], 0, "CPU", block_size=0)))
    scorer = Scorer(index, reg)
    baseline = Scorer(index, reg, full_only=True)
    hashes = list(range(12))
    # Without the window group's chunk only the full-attention-only baseline loads it.
    assert (await scorer.score(hashes, 12 * 16, ["b"]))["b"] == Score(64, 0)
    assert (await baseline.score(hashes, 12 * 16, ["b"]))["b"] == Score(64, 64)
    await index.apply("b", batch(stored([7], 1, "CPU", block_size=0)))
    got = await scorer.score(hashes, 12 * 16, ["a", "b", "c"])
    assert got == {"a": Score(160, 0), "b": Score(64, 64), "c": Score(0, 0)}
    assert await scorer.score(hashes, 12 * 16) == {"a": Score(160, 0), "b": Score(64, 64)}
    await index.apply("a", batch(stored(list(range(10, 12)), 0)))  # SWA group lacks 10, 11
    # Full attention alone would now reach 192: the junction where the window cut it.
    assert (await scorer.score(hashes, 12 * 16 + 1, ["a"]))["a"] == Score(160, 0, 192)
    assert (await baseline.score(hashes, 12 * 16 + 1, ["a"]))["a"] == Score(192, 0, 0)


async def test_scorer_accepts_digest_bytes_and_skips_instances_without_layout(index):
    digest = bytes(range(32))
    await index.apply("a", batch(stored([digest, 5])))  # type: ignore[list-item]
    scorer = Scorer(index, LayoutRegistry())
    assert await scorer.score([digest, 5, 6], 100, ["a"]) == {"a": Score(0, 0)}
    scorer.layouts.configure("a", FULL)
    assert await scorer.score([digest, 5, 6], 100, ["a"]) == {"a": Score(32, 0)}


# ---- layout learning ----------------------------------------------------------------------


def test_layout_is_learned_from_group_idx_kind_and_window():
    reg = LayoutRegistry()
    b = batch(
        stored([1], 0, kind="full_attention"),
        stored([1], 1, kind="sliding_window", window=1024),
        stored([1], 2, kind="mamba", block_size=32),
    )
    assert reg.observe("a", b)
    assert not reg.observe("a", b)  # nothing new
    got = reg.get("a")
    assert got is not None
    assert got.groups == (FullAttentionSpec(16), SlidingWindowSpec(16, 1024), MambaSpec(32))
    assert got.hash_block_size == 16
    assert reg.get("other") is None


def test_engines_without_spec_kind_use_the_configured_default_per_group():
    reg = LayoutRegistry(default=SWA)
    assert reg.observe("a", batch(stored([1], None), stored([2], 1)))  # old vLLM: no kind
    got = reg.get("a")
    assert got is not None and got.groups == SWA.groups
    assert got.tokens_per_chunk == 64
    reg2 = LayoutRegistry()
    reg2.observe("a", batch(stored([1], None)))
    assert reg2.get("a") == InstanceLayout.full(16)


def test_configured_layout_wins_over_learned_and_chunk_size_is_learned():
    reg = LayoutRegistry(configured={"b": MAMBA})
    cpu = stored([1, 2, 3, 4], 0, "CPU", kind="full_attention")
    assert reg.observe("a", batch(stored([1], 0, kind="full_attention"), cpu))
    got = reg.get("a")
    assert got is not None and got.tokens_per_chunk == 64
    reg.observe("b", batch(stored([1], 0, kind="full_attention")))
    assert reg.get("b") is MAMBA
    # Placeholders (block_size 0) and Mamba chunks (one hash) teach no chunk size.
    reg.observe("c", batch(stored([1], 0), stored([9], 0, "CPU", block_size=0)))
    reg.observe("c", batch(stored([9], 1, "CPU", kind="mamba")))
    got = reg.get("c")
    assert got is not None and got.tokens_per_chunk is None


def test_layout_answers_follow_every_change_of_the_registry():
    # ``get`` remembers its answers (it runs per candidate per decision): each way a
    # layout changes must show in the next answer.
    reg = LayoutRegistry()
    assert reg.get("a") is None
    reg.default = FULL
    assert reg.get("a") is FULL
    reg.hint_block_size("a", 32)
    hinted = reg.get("a")
    assert hinted is not None and hinted.hash_block_size == 32
    assert reg.observe("a", batch(stored([1], 0, kind="full_attention", block_size=64)))
    learned = reg.get("a")
    assert learned is not None and learned.hash_block_size == 64
    reg.configure("a", SWA)
    assert reg.get("a") is SWA
    reg.configure("a", None)
    assert reg.get("a") == learned
    reg.set_learned("a", MAMBA)
    assert reg.get("a") is MAMBA
    reg.forget("a")
    assert reg.get("a") is FULL
    reg.default = None
    assert reg.get("a") is None


def test_layout_round_trips_through_its_dict_form():
    for layout in (FULL, SWA, MAMBA):
        assert InstanceLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(ValueError):
        InstanceLayout(())
    with pytest.raises(ValueError):
        InstanceLayout.full(16, tokens_per_chunk=24)


async def test_a_reader_router_adopts_layouts_the_ingester_shared(make_index):
    from router.ingest import IngestManager

    writer_index, reader_index = make_index(), make_index()
    src = [
        BatchReceived(
            0,
            batch(
                stored([1, 2], 0, kind="full_attention"),
                stored([1, 2], 1, kind="sliding_window", window=64),
            ),
            False,
        )
    ]
    mgr = IngestManager(
        writer_index, registry=CollectorRegistry(), source_factory=lambda s, q: PlayedSource(src)
    )
    await mgr.add_instance("e1", "tcp://x:1")
    await mgr.wait_for_seq("e1", 0)
    reader = LayoutRegistry()
    assert reader.get("e1") is None  # asked before the layout is shared
    assert await reader.refresh_from(reader_index) == 1
    assert reader.get("e1") == InstanceLayout(SWA.groups)
    scores = await Scorer(reader_index, reader).score([1, 2, 3], 48)
    assert scores == {"e1": Score(32, 0)}
    await mgr.close()
