"""Predict-on-route credits only what vLLM retains, and hands over to the index cleanly.

A just-routed prompt leaves every full-attention block cached but, under vLLM's sparse
retention, only the sliding-window tail / Mamba state at ``floor((P-1)/B)*B`` (and at the
shared-prefix junction). A speculative entry crediting more would predict hits vLLM cannot
serve (a branch inside the prompt); one dropped before the index has the engine's events
would predict misses.
"""

from __future__ import annotations

from events.groups import FullAttentionSpec, MambaSpec, SlidingWindowSpec, hit_rule
from events.retention import retained_prompt_blocks
from router.decision.layout import InstanceLayout, LayoutRegistry
from router.decision.score import Score
from router.prediction.predict import retained_junction
from router.prediction.speculative import SpeculativeResidency

BS = 32
GEMMA = (SlidingWindowSpec(BS, 64),) * 5 + (FullAttentionSpec(BS),)
QWEN = (MambaSpec(BS),) * 3 + (FullAttentionSpec(BS),)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _hit(specs: tuple, held: list[tuple[int, list[int]]], n_tokens: int) -> tuple[int, int]:
    masks = [0] * len(specs)
    for g, positions in held:
        for p in positions:
            masks[g] |= 1 << p
    return hit_rule(specs).hit_and_junction(masks, n_tokens - 1)


def test_swa_prompt_retains_only_the_window_tail_at_the_replay_boundary() -> None:
    held = dict(retained_prompt_blocks(GEMMA, 352, BS))
    assert held[5] == list(range(11))  # full attention: every full block
    assert all(held[g] == [8, 9] for g in range(5))  # 351 -> 320: blocks 8, 9
    # A resend hits 320; a branch inside the prompt (at 200) hits nothing, but full
    # attention holds 192: that is the junction a request routed there retains.
    assert _hit(GEMMA, list(held.items()), 352) == (320, 0)
    assert _hit(GEMMA, list(held.items()), 200) == (0, 192)


def test_junction_retains_state_a_sibling_can_resume_from() -> None:
    held = dict(retained_prompt_blocks(GEMMA, 400, BS, junction=192))
    assert held[0] == [4, 5, 10, 11]  # tails ending at 192 and at 384
    held_q = dict(retained_prompt_blocks(QWEN, 400, BS, junction=192))
    assert held_q[0] == [5, 11] and held_q[3] == list(range(12))


def test_no_junction_state_where_the_cpu_tier_loads_past_the_junction() -> None:
    # Full attention holds 128 tokens on GPU, the hybrid hit is 0 (no Mamba state there):
    # junction 128. Served from GPU alone, the request computes through 128 and keeps a
    # state there; with its CPU tier loading 0..512 it resumes at 512 and keeps none at
    # 128 (a sibling branching at 128 then hits nothing there on GPU).
    assert retained_junction(Score(0, 0, 128)) == 128
    assert retained_junction(Score(0, 96, 128)) == 128  # loads to 96, computes through 128
    assert retained_junction(Score(0, 128, 128)) == 128  # the loaded boundary is the junction
    assert retained_junction(Score(0, 512, 128)) == 0
    assert retained_junction(Score(256, 256, 384)) == 256  # the GPU hit: its state is there
    held = dict(
        retained_prompt_blocks(QWEN, 600, BS, junction=retained_junction(Score(0, 512, 128)))
    )
    assert held[0] == [17]  # only the state at the replay boundary (599 -> 576)


def test_retained_blocks_are_what_the_engines_mask_keeps() -> None:
    """The router's prediction (the reachable blocks alone) and the engine's rule
    (``cacheable_mask`` over every block) name the same blocks: one rule, both sides."""
    from events.retention import cache_hit_alignment, cacheable_mask, reachable_boundaries

    odd = (SlidingWindowSpec(48, 100), FullAttentionSpec(BS))  # alignment not a multiple of 48
    for groups in (GEMMA, QWEN, odd, (SlidingWindowSpec(2 * BS, 200), FullAttentionSpec(BS))):
        alignment = cache_hit_alignment(groups)
        for n_tokens, junction in ((1, 0), (352, 0), (400, 192), (9_999, 4_000), (240_000, 0)):
            got = dict(retained_prompt_blocks(groups, n_tokens, BS, junction=junction))
            bounds = reachable_boundaries(n_tokens, junction)
            for g, spec in enumerate(groups):
                full = n_tokens // spec.block_size
                mask = cacheable_mask(spec, alignment, bounds, 0, full)
                keep = range(full) if mask is None else [i for i in range(full) if mask[i]]
                r = spec.block_size // BS
                assert got[g] == [(i + 1) * r - 1 for i in keep], (groups, n_tokens, g)


def test_recorded_blocks_live_until_the_first_batch_after_the_answer() -> None:
    clock = Clock()
    spec = SpeculativeResidency(ttl_s=2.0, clock=clock)
    hashes = [101, 102, 103]
    held = spec.record("a", {0: hashes[:2], 5: hashes})
    assert sorted(held) == hashes
    res = spec.residency(hashes, ["a", "b"])
    assert res == {"a": {0: 0b011, 10: 0b111}}  # slot = group * 2 + GPU tier
    spec.flush("a")  # a batch before the answer changes nothing
    assert spec.residency(hashes, ["a"])
    spec.settle("a", held)
    assert spec.residency(hashes, ["a"])  # answered: still held until a batch lands
    spec.flush("b")
    assert spec.residency(hashes, ["a"])
    spec.flush("a")
    assert spec.residency(hashes, ["a"]) == {}


def test_an_entry_shared_by_two_requests_outlives_the_first() -> None:
    clock = Clock()
    spec = SpeculativeResidency(ttl_s=2.0, clock=clock)
    first = spec.record("a", {0: [7]})
    spec.record("a", {0: [7]})
    spec.settle("a", first)
    spec.flush("a")
    assert spec.residency([7], ["a"]) == {"a": {0: 1}}
    clock.t = 2.5  # the safety net: entries never outlive the TTL
    assert spec.residency([7], ["a"]) == {}


def test_engine_block_size_from_metrics_is_used_until_events_arrive() -> None:
    layouts = LayoutRegistry(default=InstanceLayout.full(16))
    layouts.hint_block_size("a", 128)
    assert layouts.get("a").hash_block_size == 128  # type: ignore[union-attr]
    assert "metrics" in layouts.source("a")
    assert layouts.get("b").hash_block_size == 16  # type: ignore[union-attr]
    layouts.forget("a")
    assert layouts.get("a").hash_block_size == 16  # type: ignore[union-attr]


def test_an_answered_request_past_its_ttl_never_releases_a_newer_ones_entries() -> None:
    """Released when it expires, not at a batch that comes later (or never: an instance
    publishing no events), when the same blocks may be held afresh by a request in flight."""
    clock = Clock()
    spec = SpeculativeResidency(ttl_s=2.0, clock=clock)
    old = spec.record("a", {0: [7, 8]})
    spec.settle("a", old)  # answered; no batch from "a" yet
    clock.t = 2.5
    spec.record("a", {0: [7, 8]})  # in flight, holding the same blocks anew
    spec.flush("a")
    assert spec.residency([7, 8], ["a"]) == {"a": {0: 0b11}}


def test_a_request_answered_after_its_ttl_is_released_at_once() -> None:
    """Purged before the answer: nothing would release it later on an instance that
    publishes no events, so the answer releases it (nothing is kept per request)."""
    clock = Clock()
    spec = SpeculativeResidency(ttl_s=2.0, clock=clock)
    for _ in range(100):  # answered late, on an instance publishing no events
        late = spec.record("a", {0: [1, 2]})
        clock.t += 3.0
        spec.record("b", {0: [5]})  # any record purges what expired
        spec.settle("a", late)
    assert spec._settled.get("a", {}) == {}  # nothing accumulates
    on_time = spec.record("a", {0: [1, 2]})
    spec.settle("a", on_time)  # answered within its TTL: held until a batch lands
    assert spec.residency([1, 2], ["a"]) == {"a": {0: 0b11}}
    assert len(spec._settled["a"]) == 1
    clock.t += 3.0
    spec.record("b", {0: [5]})
    assert spec._settled["a"] == {}  # expired: released by the purge
    assert spec.residency([1, 2], ["a"]) == {}
