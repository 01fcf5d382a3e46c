"""``kvroute up``'s arithmetic and its reading of the router, without processes."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from stack.demo import (
    DemoConfig,
    RequestRecord,
    Workload,
    prediction_accuracy_from_metrics,
    summarize,
)


def _rec(prompt: int, gpu: int, cpu: int, predicted: int | None, ttft: float, inst: str):
    return RequestRecord(
        conversation=0,
        turn=0,
        instance=inst,
        status=200,
        prompt_tokens=prompt,
        cached_tokens=gpu + cpu,
        gpu_hit_tokens=gpu,
        cpu_hit_tokens=cpu,
        predicted_hit_tokens=predicted,
        ttft_s=ttft,
    )


def test_summary_hit_ratio_is_cached_over_prompt_tokens_and_accuracy_counts_exact_predictions():
    records = [
        _rec(1000, 0, 0, 0, 0.100, "a"),  # cold, predicted 0: exact
        _rec(1000, 800, 0, 800, 0.020, "a"),  # exact
        _rec(1000, 0, 768, 800, 0.040, "b"),  # over-predicted (CPU chunk rounding)
        _rec(1000, 400, 0, 320, 0.060, "b"),  # under-predicted
    ]
    failed = RequestRecord(conversation=1, turn=0, status=503, error="no healthy instance")
    row = summarize("cost", [*records, failed])
    assert row["requests"] == 5 and row["errors"] == 1
    assert row["hit_ratio"] == pytest.approx((800 + 768 + 400) / 4000)
    assert (row["gpu_hit_tokens"], row["cpu_hit_tokens"]) == (1200, 768)
    assert row["prediction_accuracy"] == pytest.approx(0.5)
    assert (row["predicted_over"], row["predicted_under"]) == (1, 1)
    assert row["prediction_source"] == "header"
    # TTFTs 20, 40, 60, 100 ms: linear-interpolated median and p90.
    assert row["ttft_p50_ms"] == pytest.approx(50.0)
    assert row["ttft_p90_ms"] == pytest.approx(88.0)
    assert row["per_instance"] == {"a": 2, "b": 2}


def test_policies_that_do_not_score_get_no_accuracy_even_with_a_zero_header():
    records = [_rec(1000, 800, 0, 0, 0.02, "a")]
    assert summarize("round_robin", records)["prediction_accuracy"] is None
    assert summarize("least_loaded", records)["prediction_accuracy"] is None
    assert summarize("prefix_full_only", records)["prediction_accuracy"] == 0.0


def test_accuracy_falls_back_to_the_routers_prediction_counter():
    from router.metrics import RouterMetrics

    metrics = RouterMetrics()
    metrics.observe_prediction((800, 0), (800, 0))
    metrics.observe_prediction((0, 800), (0, 768))
    metrics.observe_prediction((64, 0), (64, 0))
    metrics.observe_prediction((0, 0), (16, 0))
    text = generate_latest(metrics.registry).decode()
    assert prediction_accuracy_from_metrics(text) == pytest.approx(0.5)
    no_header = [_rec(1000, 800, 0, None, 0.02, "a")]
    row = summarize("cost", no_header, text)
    assert (row["prediction_accuracy"], row["prediction_source"]) == (0.5, "metrics")
    assert (
        prediction_accuracy_from_metrics(generate_latest(RouterMetrics().registry).decode()) is None
    )


def test_workload_is_deterministic_in_the_seed_and_shares_system_prompts():
    cfg = DemoConfig(conversations=4, turns=2, system_prompts=2, seed=7)
    a, b = Workload.build(cfg), Workload.build(cfg)
    assert a == b
    assert Workload.build(DemoConfig(conversations=4, turns=2, system_prompts=2, seed=8)) != a
    assert a.system_for(0) == a.system_for(2) != a.system_for(1)
    assert all(len(s) == cfg.system_tokens for s in a.system)
    # Longer than the sliding window, so the window group decides what is reusable.
    assert cfg.system_tokens > 1024
    flat = [u for conv in a.users for u in conv]
    assert len(set(flat)) == len(flat) == 8


@pytest.mark.parametrize(
    "kwargs",
    [
        {"policies": ("nope",)},
        {"index": "mysql://x"},
        {"profile": "moe"},
        {"engines": 0},
        {"cpu_offload": True},  # vLLM's connector: only with --engine vllm
        {"cpu_offload": True, "engine": "vllm", "cpu_blocks": 0},
    ],
)
def test_demo_config_rejects_settings_it_cannot_run(kwargs):
    with pytest.raises(ValueError):
        DemoConfig(**kwargs)
