"""Helpers shared by benchmarks: timing (reports: ``stack.report``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from stack.report import machine_info, write_report

__all__ = ["machine_info", "summary_ms", "time_calls", "write_report"]


def time_calls(fn: Callable[[], object], repeats: int, warmup: int = 3) -> list[float]:
    """Wall time of each call in seconds, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def summary_ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered) * 1e3,
        "p10_ms": ordered[len(ordered) // 10] * 1e3,
        "p90_ms": ordered[(len(ordered) * 9) // 10] * 1e3,
    }
