"""The few series of an engine's ``/metrics`` the router shows (``/dashboard``).

vLLM's names where vLLM has them (``vllm:kv_cache_usage_perc``, before v0.10
``vllm:gpu_cache_usage_perc``; ``vllm:prefix_cache_queries`` / ``_hits``), the simulated
engine's ``kvroute:`` extensions for the CPU offload tier. Series of one name are summed
over their label sets (data-parallel ranks), usages averaged.
"""

from __future__ import annotations

import math
import re

__all__ = ["ENGINE_SERIES", "parse_engine_metrics"]

# exported name -> our key
ENGINE_SERIES = {
    "vllm:kv_cache_usage_perc": "kv_gpu_usage",
    "vllm:gpu_cache_usage_perc": "kv_gpu_usage",
    "kvroute:cpu_kv_cache_usage_perc": "kv_cpu_usage",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "gpu_hits",
    "kvroute:cpu_prefix_cache_hits_total": "cpu_hits",
}
_MEAN = {"kv_gpu_usage", "kv_cpu_usage"}
_LINE = re.compile(
    rb"^(" + b"|".join(re.escape(n.encode()) for n in ENGINE_SERIES) + rb")"
    rb"(?:\{[^}]*\})?[ \t]+([0-9.eE+-]+|NaN)",
    re.M,
)


def parse_engine_metrics(body: bytes) -> dict[str, float]:
    """``{key: value}`` for the series of ``ENGINE_SERIES`` found in a Prometheus text body."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for name, value in _LINE.findall(body):
        try:
            v = float(value)
        except ValueError:
            continue
        if math.isnan(v):
            continue
        key = ENGINE_SERIES[name.decode()]
        sums[key] = sums.get(key, 0.0) + v
        counts[key] = counts.get(key, 0) + 1
    return {k: v / counts[k] if k in _MEAN else v for k, v in sums.items()}
