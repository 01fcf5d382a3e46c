"""Predict-on-route before an instance's first events is redone under the layout they teach.

Until an engine publishes, the router knows only its default layout (full attention
alone), so it records a just-routed prompt's blocks as one full-attention group. On a
hybrid engine that is wrong twice over: the groups the events later name as sliding
window hold nothing in the prediction, so the conversation's next turn scored no hit on
the engine computing its prefix and was sent away (75% reused vs sglang-router's 84% on
real vLLM). When the layout changes, what was predicted for requests still in flight is
recorded again as vLLM retains it under the new layout.
"""

from __future__ import annotations

from routerkit import StaticRegistry, batch, stored

from router.build import build_router
from router.config import RouterSettings
from router.decision.layout import InstanceLayout, LayoutRegistry
from router.index.memory import MemoryIndex

BS = 32  # vLLM's CPU block size; the tiny Gemma-3-like model: 5 windows of 64 + full
TURN = "".join(chr(65 + (i * 7) % 26) for i in range(1400))


def gemma_events(bs: int = BS) -> list:
    """An engine's first batch: each group's spec, on blocks of another prompt."""
    evs = [stored([9000 + g], g, block_size=bs, kind="sliding_window", window=64) for g in range(5)]
    return [*evs, stored([9100], 5, block_size=bs, kind="full_attention")]


def setup() -> tuple[LayoutRegistry, object]:
    layouts = LayoutRegistry(default=InstanceLayout.full(BS))
    settings = RouterSettings(policy="cost", block_size=BS, tokenizer="byte")
    router = build_router(
        settings, index=MemoryIndex(), layouts=layouts, registry=StaticRegistry("a")
    )
    return layouts, router


async def test_next_turn_hits_the_prefix_predicted_before_the_layout_was_known() -> None:
    layouts, router = setup()
    first = await router.decide({"prompt": TURN}, "completion")
    assert layouts.observe("a", batch(*gemma_events()))
    assert layouts.source("a") == "learned from events"
    nxt = await router.decide({"prompt": TURN + "next turn" * 10}, "completion", record=False)
    # full attention: blocks 0..42; each window group: the tail before floor(1399/32)*32
    assert nxt.candidates["a"].gpu_tokens == 1376
    router.settled(first, "a")
    assert router.prediction.inflight("a") == 0  # in flight only: nothing kept once answered


async def test_predictions_are_hashed_again_at_the_block_size_the_events_name() -> None:
    # Routed at the configured 32; vLLM on CPU chose 128 for this model (its events say).
    layouts, router = setup()
    first = await router.decide({"prompt": TURN}, "completion")
    layouts.observe("a", batch(*gemma_events(128)))
    assert router.hash_block_size("a") == 128
    assert first.hash_size["a"] == BS  # the decision stays as it was made
    nxt = await router.decide({"prompt": TURN + "next turn" * 10}, "completion", record=False)
    assert nxt.candidates["a"].gpu_tokens == 1280  # floor(1399 / 128) * 128


async def test_without_relayout_the_old_prediction_scores_no_hit() -> None:
    layouts, router = setup()
    await router.decide({"prompt": TURN}, "completion")
    layouts.observe("a", batch(*gemma_events()))
    router.prediction._version = layouts.version  # as if unseen: keep the default's one
    nxt = await router.decide({"prompt": TURN + "next turn" * 10}, "completion", record=False)
    assert nxt.candidates["a"].gpu_tokens == 0


def test_layout_changes_move_the_version_once() -> None:
    layouts = LayoutRegistry(default=InstanceLayout.full(BS))
    assert layouts.version == 0
    assert layouts.observe("a", batch(*gemma_events()))
    assert layouts.version == 1
    assert not layouts.observe("a", batch(*gemma_events()))  # nothing new
    layouts.set_learned("b", layouts.get("a"))  # type: ignore[arg-type]
    layouts.set_learned("b", layouts.get("a"))  # type: ignore[arg-type]
    assert layouts.version == 2


async def test_a_decision_never_forwarded_is_not_kept_past_its_ttl() -> None:
    """Recorded at decision time but never settled (the client left before forwarding):
    dropped once its speculative entries expire, when the next one is recorded."""
    t = [0.0]
    layouts = LayoutRegistry(default=InstanceLayout.full(BS))
    settings = RouterSettings(policy="cost", block_size=BS, tokenizer="byte")
    router = build_router(settings, index=MemoryIndex(), layouts=layouts,
                          registry=StaticRegistry("a"), clock=lambda: t[0])  # fmt: skip
    for i in range(50):
        await router.decide({"prompt": f"{i} {TURN}"}, "completion")
        t[0] += settings.speculative.ttl_s / 4
    assert router.prediction.inflight("a") <= 5


async def test_a_branch_predicted_before_the_layout_keeps_its_resume_point() -> None:
    """A branch routed while only the default layout was known scored a hit where it left
    the trunk; under the learned layout that hit is a junction, where vLLM keeps the
    window tail for the next sibling. Re-recorded without it, the sibling scored none."""
    layouts, router = setup()
    await router.decide({"prompt": TURN}, "completion")
    branch = await router.decide({"prompt": TURN[:800] + "a branch" * 40}, "completion")
    assert branch.candidates["a"].gpu_tokens == 800  # full attention alone: a hit
    layouts.observe("a", batch(*gemma_events()))
    sibling = await router.decide(
        {"prompt": TURN[:800] + "its sibling" * 30}, "completion", record=False
    )
    assert sibling.candidates["a"].gpu_tokens == 800


async def test_routing_counts_for_the_cold_tie_break_once() -> None:
    """Routed work counts toward the cold tie-break (``CostPolicy.assigned``); a look that
    routes nothing (``/debug/route``) and a relayout's re-recording do not."""
    layouts, router = setup()
    await router.decide({"prompt": TURN}, "completion", record=False)
    assert router.policy.models.get("a") is None or router.policy.models["a"].recent == 0
    await router.decide({"prompt": TURN}, "completion")
    counted = router.policy.models["a"].recent
    assert counted == 1400  # the whole prompt was uncached
    layouts.observe("a", batch(*gemma_events()))  # relayout records the prediction again
    assert router.policy.models["a"].recent == counted
