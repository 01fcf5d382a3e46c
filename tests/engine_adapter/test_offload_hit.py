"""The CPU extension rule (events/offload_hit.py): vLLM's offloading lookup, per group."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from events.groups import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from events.offload_hit import cpu_extension, cpu_extension_masks, offload_hit, window_in_chunks

BS = 4
K = 2  # blocks per chunk
TPC = BS * K
FULL = FullAttentionSpec(BS)
SWA = SlidingWindowSpec(BS, 16)  # 2 chunks
MAMBA = MambaSpec(BS)


def chunks(*per_group: set[int]):
    """cpu_cached(g, block) from the set of offloaded chunk indices of each group."""

    def cached(g: int, i: int) -> bool:
        assert (i + 1) % K == 0, "only a chunk's last block is its key"
        return i // K in per_group[g]

    return cached


def test_window_in_chunks_per_kind() -> None:
    assert window_in_chunks(FULL, TPC) is None
    assert window_in_chunks(SWA, TPC) == 2
    assert window_in_chunks(SlidingWindowSpec(BS, 17), TPC) == 3
    assert window_in_chunks(MAMBA, TPC) == 1


def test_full_attention_takes_consecutive_chunks_from_the_gpu_hit() -> None:
    cached = chunks({0, 1, 2, 4})
    assert cpu_extension([FULL], cached, 48, 0, TPC) == 24  # stops at missing chunk 3
    assert cpu_extension([FULL], cached, 48, 8, TPC) == 16  # starts at chunk 1
    # GPU hit ends inside chunk 1 (12 tokens): chunk 1 must be offloaded too.
    assert cpu_extension([FULL], chunks({2}), 48, 12, TPC) == 0


def test_needs_at_least_one_whole_chunk_beyond_the_gpu_hit() -> None:
    cached = chunks({0, 1})
    assert cpu_extension([FULL], cached, 16, 12, TPC) == 0  # only 4 new tokens
    assert cpu_extension([FULL], cached, 16, 8, TPC) == 8


def test_full_only_may_cover_the_whole_prompt_but_windows_may_not() -> None:
    both = chunks({0, 1}, {0, 1})
    assert cpu_extension([FULL], both, 16, 0, TPC) == 16
    # With a window group the cap is num_tokens - 1: chunk 1 is still loaded whole.
    assert cpu_extension([FULL, SWA], both, 16, 0, TPC) == 15


def test_sliding_window_needs_only_its_last_window_of_chunks() -> None:
    cached = chunks({0, 1, 2, 3, 4}, {3, 4})
    assert cpu_extension([FULL, SWA], cached, 41, 0, TPC) == 40
    # Window run broken at chunk 3: the last complete run ends at chunk 2 ... none exists,
    # and the leading run from the GPU hit is empty: no hit.
    assert cpu_extension([FULL, SWA], chunks({0, 1, 2, 3, 4}, {1, 4}), 41, 0, TPC) == 0
    # Leading run from the GPU hit (its window is on the GPU): chunks 2, 3.
    assert cpu_extension([FULL, SWA], chunks({0, 1, 2, 3, 4}, {2, 3}), 41, 16, TPC) == 16


def test_mamba_needs_the_state_chunk_at_the_hit_end() -> None:
    cached = chunks({0, 1, 2, 3}, {1})
    assert cpu_extension([FULL, MAMBA], cached, 40, 0, TPC) == 16
    # max hit rounds down to a chunk: 40 tokens -> cap 39 -> 32
    assert cpu_extension([FULL, MAMBA], chunks({0, 1, 2, 3, 4}, {3, 4}), 40, 0, TPC) == 32


def test_window_groups_are_rechecked_when_a_later_group_shrinks_the_hit() -> None:
    # SWA's last window run ends at chunk 4 (chunks 3, 4); Mamba's state is at chunk 2,
    # so the hit shrinks to 24 tokens; SWA is re-checked there: chunks 1, 2 needed, only
    # chunk 2 is offloaded and the leading run from chunk 0 is empty -> no hit at all.
    specs = [FULL, SWA, MAMBA]
    cached = chunks({0, 1, 2, 3, 4}, {2, 3, 4}, {2})
    assert cpu_extension(specs, cached, 41, 0, TPC) == 0
    cached = chunks({0, 1, 2, 3, 4}, {1, 2, 3, 4}, {2})
    assert cpu_extension(specs, cached, 41, 0, TPC) == 24


def test_offload_hit_pairs_gpu_hit_with_cpu_extension() -> None:
    def gpu(g: int, i: int) -> bool:
        return i < 4  # blocks 0..3 on GPU in every group

    cpu = chunks({0, 1, 2, 3, 4}, {0, 1, 2, 3, 4})
    assert offload_hit([FULL, SWA], gpu, cpu, 41, TPC) == (16, 24)


SPECS = st.lists(st.sampled_from([FULL, SWA, SlidingWindowSpec(BS, 9), MAMBA]), max_size=2).map(
    lambda rest: [FULL, *rest]
)


@settings(max_examples=200, deadline=None)
@given(
    specs=SPECS,
    masks=st.lists(st.frozensets(st.integers(0, 9)), min_size=3, max_size=3),
    num_tokens=st.integers(1, 80),
    gpu_blocks=st.integers(0, 20),
)
def test_cpu_hit_is_always_loadable(specs, masks, num_tokens, gpu_blocks) -> None:
    """Whatever the extension returns, every block the engine must load for it (per
    group, from the GPU hit to the new hit end) lies in an offloaded chunk."""
    gpu = min(gpu_blocks * BS, (num_tokens - 1) // BS * BS)
    cached = chunks(*masks)
    hit = cpu_extension(specs, cached, num_tokens, gpu, TPC)
    if hit == 0:
        return
    end = gpu + hit
    assert hit >= TPC and end <= num_tokens
    for g, spec in enumerate(specs):
        first = gpu // BS
        if isinstance(spec, SlidingWindowSpec):
            first = max(first, max(0, end - spec.sliding_window + 1) // BS)
        elif isinstance(spec, MambaSpec):
            first = max(first, -(-end // BS) - 1)
        for block in range(first, -(-end // BS)):
            assert block // K in masks[g], (g, block, end)


def reference_cpu_extension(specs, cpu_cached, num_tokens, gpu_hit, tpc) -> int:
    """vLLM's ``OffloadingConnectorScheduler._lookup`` transcribed chunk by chunk (one
    ``cpu_cached`` call per chunk key): the oracle for the bit-parallel rule."""
    if not specs or tpc <= 0 or num_tokens <= 0:
        return 0
    per_chunk = [tpc // s.block_size for s in specs]
    windows = [window_in_chunks(s, tpc) for s in specs]
    full = [g for g, w in enumerate(windows) if w is None]
    windowed = sorted(
        (g for g, w in enumerate(windows) if w is not None), key=lambda g: -windows[g]
    )
    max_hit = num_tokens - (1 if windowed else 0)
    if any(isinstance(s, MambaSpec) for s in specs):
        max_hit -= max_hit % tpc
    num_keys, start = num_tokens // tpc, gpu_hit // tpc

    def window_lookup(hits: list[bool], window: int, first: int) -> int:
        run, required = 0, first
        for idx in range(len(hits) - 1, -1, -1):
            run, required = (run + 1, required) if hits[idx] else (0, window)
            if run == required:
                return idx + required
        return run

    hit, pending = 0, [*full, *windowed]
    while pending:
        looked_windowed, current, pending = False, pending, []
        for g in current:
            max_hit = min(max_hit, num_keys * tpc)
            if max_hit - gpu_hit < tpc:
                return 0
            num_chunks = min(-(-max_hit // tpc), num_keys)
            flags = [cpu_cached(g, (c + 1) * per_chunk[g] - 1) for c in range(start, num_chunks)]
            if windows[g] is None:
                n = next((i for i, f in enumerate(flags) if not f), len(flags))
            else:
                first = windows[g]
                if isinstance(specs[g], SlidingWindowSpec):
                    pad = -min(max_hit, num_chunks * tpc) % tpc
                    first = max(first, -(-(specs[g].sliding_window - 1 + pad) // tpc))
                n = window_lookup(flags, windows[g], first)
            if n == 0:
                return 0
            max_hit = min(max_hit, tpc * (start + n))
            new_hit = max_hit - gpu_hit
            if new_hit < tpc:
                return 0
            if new_hit < hit and looked_windowed and not pending:
                pending = list(windowed)
            looked_windowed |= windows[g] is not None
            hit = new_hit
    return hit


MIXED = st.lists(
    st.one_of(
        st.just(FULL),
        st.just(MAMBA),
        st.integers(1, 40).map(lambda w: SlidingWindowSpec(BS, w)),
        st.just(FullAttentionSpec(2 * BS)),
        st.integers(1, 40).map(lambda w: SlidingWindowSpec(2 * BS, w)),
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=600, deadline=None)
@given(
    specs=MIXED,
    k=st.integers(1, 4),
    blocks=st.lists(st.frozensets(st.integers(0, 40)), min_size=3, max_size=3),
    num_tokens=st.integers(1, 160),
    gpu_blocks=st.integers(0, 40),
)
def test_bit_parallel_rule_equals_vllms_chunk_by_chunk_lookup(
    specs, k, blocks, num_tokens, gpu_blocks
) -> None:
    """``cpu_extension`` (masks + big-int run searches) == the chunk-by-chunk transcription
    of vLLM's lookup, for any mix of groups, block sizes, chunk sizes and residency."""
    tpc = 2 * BS * k  # a multiple of every block size in MIXED
    gpu = min(gpu_blocks * BS, max(0, num_tokens - 1) // BS * BS)

    def cached(g: int, i: int) -> bool:
        return i in blocks[g]

    want = reference_cpu_extension(specs, cached, num_tokens, gpu, tpc)
    assert cpu_extension(specs, cached, num_tokens, gpu, tpc) == want
    masks = [sum(1 << i for i in blocks[g]) for g in range(len(specs))]
    assert cpu_extension_masks(specs, masks, num_tokens, gpu, tpc) == want
