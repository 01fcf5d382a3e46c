"""The hybrid hit rule: fixed-point implementation vs the brute-force definition."""

from __future__ import annotations

import math
from functools import reduce

from hypothesis import given, settings
from hypothesis import strategies as st

from events.groups import (
    FullAttentionSpec,
    KVCacheLayout,
    MambaSpec,
    SlidingWindowSpec,
    longest_cache_hit,
    longest_cache_hit_masks,
    spec_from_event,
)


def brute_force(specs, is_cached, max_tokens: int) -> int:
    """The definition: the largest L <= max_tokens, a multiple of every block size, that
    every group can serve (full: all blocks; window: the last cdiv(w-1, bs) blocks before L
    or all from 0; Mamba: the block ending at L). L = 0 always qualifies."""
    lcm = reduce(math.lcm, (s.block_size for s in specs), 1)
    for length in range(max_tokens - max_tokens % lcm, 0, -lcm):
        ok = True
        for g, s in enumerate(specs):
            n = length // s.block_size
            if isinstance(s, FullAttentionSpec):
                needed = range(n)
            elif isinstance(s, SlidingWindowSpec):
                needed = range(max(0, n - s.window_blocks), n)
            else:
                needed = range(n - 1, n)
            if not all(is_cached(g, i) for i in needed):
                ok = False
                break
        if ok:
            return length
    return 0


_spec = st.one_of(
    st.builds(FullAttentionSpec, st.sampled_from([4, 8])),
    st.builds(SlidingWindowSpec, st.sampled_from([4, 8]), st.integers(1, 40)),
    st.builds(MambaSpec, st.sampled_from([4, 8])),
)


@settings(max_examples=600, deadline=None)
@given(
    specs=st.lists(_spec, min_size=1, max_size=4),
    data=st.data(),
    max_tokens=st.integers(0, 130),
)
def test_fixed_point_equals_brute_force(specs, data, max_tokens):
    n_blocks = [max_tokens // s.block_size + 1 for s in specs]
    density = data.draw(st.sampled_from([0.5, 0.8, 0.95]))
    cached = [{i for i in range(n) if data.draw(st.floats(0, 1)) < density} for n in n_blocks]

    def is_cached(g: int, i: int) -> bool:
        return i in cached[g]

    want = brute_force(specs, is_cached, max_tokens)
    assert longest_cache_hit(specs, is_cached, max_tokens) == want
    masks = [sum(1 << i for i in c) for c in cached]
    assert longest_cache_hit_masks(specs, masks, max_tokens) == want


def test_window_blocks_lost_cap_the_hit_below_full_attention():
    specs = [FullAttentionSpec(16), SlidingWindowSpec(16, 64)]  # needs 4 window blocks
    # Full attention holds 10 blocks; the window group kept only blocks 0..2 and 6..7.
    window = {0, 1, 2, 6, 7}
    hit = longest_cache_hit(specs, lambda g, i: g == 0 or i in window, 160)
    assert hit == 48  # only the short-prefix case (blocks 0..2) qualifies
    window |= {4, 5}
    assert longest_cache_hit(specs, lambda g, i: g == 0 or i in window, 160) == 128


def test_mamba_needs_the_state_block_at_the_hit_end():
    specs = [FullAttentionSpec(16), MambaSpec(16)]
    assert longest_cache_hit(specs, lambda g, i: g == 0 or i == 3, 1000) == 64
    assert longest_cache_hit(specs, lambda g, i: g == 0, 1000) == 0


def test_hit_is_capped_by_max_tokens_and_aligned_to_lcm():
    specs = [FullAttentionSpec(16), FullAttentionSpec(32)]
    assert longest_cache_hit(specs, lambda g, i: True, 100) == 96
    assert longest_cache_hit(specs, lambda g, i: True, 31) == 0
    assert longest_cache_hit([], lambda g, i: True, 100) == 0


def test_spec_from_event_maps_vllm_kinds():
    assert spec_from_event("sliding_window", 1024, 16) == SlidingWindowSpec(16, 1024)
    assert spec_from_event("mamba", None, 16) == MambaSpec(16)
    assert spec_from_event("mla_attention", None, 16) == FullAttentionSpec(16)
    assert spec_from_event(None, None, 16) == FullAttentionSpec(16)
    layout = KVCacheLayout((FullAttentionSpec(16), SlidingWindowSpec(32, 100)))
    assert (layout.lcm_block_size, layout.hash_block_size) == (32, 16)
    assert layout.longest_cache_hit(lambda g, i: True, 70) == 64
