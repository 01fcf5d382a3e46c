"""The demo's results: one table row per policy from the request records."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from router.decision.policy import make_policy
from stack.demo.config import RequestRecord


def _quantile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def prediction_accuracy_from_metrics(text: str) -> float | None:
    """Share of exact predictions from the router's ``kvroute_router_predictions_total``
    counter (``result`` = exact | over | under); None when it has seen no request."""
    from prometheus_client.parser import text_string_to_metric_families

    by_result: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        if family.name != "kvroute_router_predictions":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                by_result[sample.labels.get("result", "")] += int(sample.value)
    total = sum(by_result.values())
    return by_result["exact"] / total if total else None


def summarize(
    policy: str, records: Sequence[RequestRecord], metrics_text: str | None = None
) -> dict[str, Any]:
    """One table row: hit ratio, TTFT percentiles, prediction accuracy, spread."""
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    # Policies that ignore the index (round_robin, least_loaded) predict nothing; a "0"
    # header from them says nothing about the index, so no accuracy for them.
    predicts = make_policy(policy).uses_scores
    with_pred = [r for r in ok if r.predicted_hit_tokens is not None] if predicts else []
    accuracy: float | None = None
    source: str | None = None
    errors = [
        (r.predicted_hit_tokens or 0) - r.gpu_hit_tokens - r.cpu_hit_tokens for r in with_pred
    ]
    if with_pred:
        accuracy, source = sum(e == 0 for e in errors) / len(with_pred), "header"
    elif metrics_text and predicts:
        accuracy = prediction_accuracy_from_metrics(metrics_text)
        source = "metrics" if accuracy is not None else None
    p50, p90 = _quantile(ttfts, 0.5), _quantile(ttfts, 0.9)
    return {
        "policy": policy,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "gpu_hit_tokens": sum(r.gpu_hit_tokens for r in ok),
        "cpu_hit_tokens": sum(r.cpu_hit_tokens for r in ok),
        "hit_ratio": cached / prompt if prompt else 0.0,
        "ttft_p50_ms": None if p50 is None else p50 * 1e3,
        "ttft_p90_ms": None if p90 is None else p90 * 1e3,
        "ttft_mean_ms": statistics.fmean(ttfts) * 1e3 if ttfts else None,
        "prediction_accuracy": accuracy,
        "prediction_source": source,
        "predicted_requests": len(with_pred),
        "predicted_over": sum(e > 0 for e in errors),  # router credited more than reused
        "predicted_under": sum(e < 0 for e in errors),
        "per_instance": dict(sorted(Counter(r.instance or "?" for r in ok).items())),
    }
