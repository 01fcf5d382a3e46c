"""Per-request records of a replay and the per-router summary computed from them.

Live and simulated replays produce the same ``RequestRecord``; everything in the report
(tables, plots, sim-vs-live agreement) is computed here from records alone, so the two
modes cannot be summarised differently.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["RequestRecord", "load_series", "percentile", "summarize"]


@dataclass(slots=True)
class RequestRecord:
    """One replayed request. Times are seconds on the replay clock (wall clock in live
    mode, the virtual clock in sim mode), ``arrival_s`` from the start of the replay."""

    index: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    instance: str | None = None  # the engine that served it (its own name for itself)
    ttft_s: float | None = None
    e2e_s: float | None = None
    completion_tokens: int = 0
    gpu_hit_tokens: int = 0  # what the engine reports it reused
    cpu_hit_tokens: int = 0
    predicted_hit_tokens: int | None = None  # our router's prediction (None: unknown)
    router_instance: str | None = None  # what our router says it chose (header)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    @property
    def hit_tokens(self) -> int:
        return self.gpu_hit_tokens + self.cpu_hit_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        return cls(**d)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = max(0, min(len(xs) - 1, math.ceil(q / 100.0 * len(xs)) - 1))
    return xs[k]


def summarize(records: Sequence[RequestRecord], instances: Sequence[str]) -> dict[str, Any]:
    """Hit ratios, latency percentiles, throughput, prediction accuracy and balance."""
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    gpu = sum(r.gpu_hit_tokens for r in ok)
    cpu = sum(r.cpu_hit_tokens for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    ends = [r.arrival_s + r.e2e_s for r in ok if r.e2e_s is not None]
    makespan = max(ends) if ends else 0.0
    predicted = [r for r in ok if r.predicted_hit_tokens is not None]
    exact = sum(1 for r in predicted if r.predicted_hit_tokens == r.hit_tokens)
    abs_err = sum(abs((r.predicted_hit_tokens or 0) - r.hit_tokens) for r in predicted)
    # Hits the router saw at the instance it chose that the engine no longer had when it
    # admitted the request (evicted while it queued): routing cannot reuse what is gone.
    lost = sum(max((r.predicted_hit_tokens or 0) - r.hit_tokens, 0) for r in predicted)
    predicted_prompt = sum(r.prompt_tokens for r in predicted)
    per_instance = {name: 0 for name in instances}
    for r in ok:
        if r.instance is not None:
            per_instance[r.instance] = per_instance.get(r.instance, 0) + 1
    counts = list(per_instance.values())
    mean_count = sum(counts) / len(counts) if counts else 0.0

    def ms(v: float | None) -> float | None:
        return None if v is None else v * 1e3

    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "prompt_tokens": prompt,
        "gpu_hit_tokens": gpu,
        "cpu_hit_tokens": cpu,
        "hit_ratio": (gpu + cpu) / prompt if prompt else 0.0,
        "gpu_hit_ratio": gpu / prompt if prompt else 0.0,
        "cpu_hit_ratio": cpu / prompt if prompt else 0.0,
        "ttft_p50_ms": ms(percentile(ttft, 50)),
        "ttft_p90_ms": ms(percentile(ttft, 90)),
        "ttft_p99_ms": ms(percentile(ttft, 99)),
        "ttft_mean_ms": ms(sum(ttft) / len(ttft)) if ttft else None,
        "e2e_p50_ms": ms(percentile(e2e, 50)),
        "e2e_p99_ms": ms(percentile(e2e, 99)),
        "makespan_s": makespan,
        "throughput_req_s": len(ok) / makespan if makespan else 0.0,
        "prompt_tokens_per_s": prompt / makespan if makespan else 0.0,
        "predicted": len(predicted),
        "prediction_exact": exact / len(predicted) if predicted else None,
        "prediction_mae_tokens": abs_err / len(predicted) if predicted else None,
        "predicted_hit_lost_ratio": lost / predicted_prompt if predicted_prompt else None,
        "requests_per_instance": per_instance,
        "imbalance_max_over_mean": max(counts) / mean_count if mean_count else None,
    }


def load_series(
    records: Sequence[RequestRecord], instances: Sequence[str], points: int = 200
) -> tuple[list[float], dict[str, list[int]]]:
    """Requests in flight per instance (arrival to last byte), sampled at ``points`` times."""
    spans = [
        (r.instance, r.arrival_s, r.arrival_s + r.e2e_s)
        for r in records
        if r.ok and r.instance is not None and r.e2e_s is not None
    ]
    if not spans:
        return [], {name: [] for name in instances}
    end = max(s[2] for s in spans)
    times = [end * i / max(points - 1, 1) for i in range(points)]
    series = {name: [0] * points for name in instances}
    for name, a, b in spans:
        row = series.setdefault(name, [0] * points)
        lo = math.ceil(a / end * (points - 1)) if end else 0
        hi = math.floor(b / end * (points - 1)) if end else 0
        for i in range(max(lo, 0), min(hi, points - 1) + 1):
            row[i] += 1
    return times, series
