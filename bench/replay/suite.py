"""``kvroute bench replay --suite``: every workload x router x seed, with intervals.

Each cell is one replay on fresh engines (same arrival times and tokens for every router
of a workload and seed). Sim mode runs whole workloads for our policies and the peer
models (``peer_models``); live mode runs the real peer routers and ours on a bounded
subset (the workloads and seeds named), since a live replay costs real processes and
wall time. Per (mode, workload, router) the report gives the mean and 95% interval
(Student t over seeds) of reused prompt tokens, TTFT p50/p90/p99 and throughput, the
issue's targets against the best peer, and plots (``suite_hits.png``, ``suite_ttft.png``).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.replay.config import ReplayConfig, parse_router
from bench.replay.records import summarize
from bench.replay.suite_workloads import SUITE, SuiteWorkload
from bench.replay.trace import TraceRequest, load_mooncake, reindex

__all__ = ["METRICS", "aggregate", "run_suite", "suite_requests"]

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]
METRICS = (
    "hit_ratio",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "throughput_req_s",
    "predicted_hit_lost_ratio",
)
SIM_ROUTERS = (
    "ours:cost",
    "ours:prefix_full_only",
    "ours:round_robin",
    "model:vllm-router",
    "model:sglang-router",
)
LIVE_ROUTERS = ("ours:cost", "vllm-router", "sglang-router")
# two-sided 95% Student t quantiles by degrees of freedom
_T95 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306}


def suite_requests(w: SuiteWorkload, seed: int) -> list[TraceRequest]:
    if w.generate is not None:
        return w.generate(seed)
    assert w.trace is not None
    reqs = load_mooncake(ROOT / w.trace)
    end = None if w.requests is None else w.start + w.requests
    return reindex(reqs[w.start : end])


def suite_config(w: SuiteWorkload, seed: int) -> ReplayConfig:
    return ReplayConfig(
        engines=w.engines,
        engine=w.engine,
        time_scale=w.time_scale,
        max_output_tokens=w.max_output_tokens,
        seed=seed,
        block_chars=w.block_chars,
    )


def _sim_cell(key: str, seed: int, router: str) -> dict[str, Any]:
    from bench.replay.sim import run_sim

    w = SUITE[key]
    res = run_sim(suite_requests(w, seed), parse_router(router)[1], suite_config(w, seed))
    s = summarize(res.records, res.instances)
    s["wall_s"] = res.wall_s
    return s


def _live_cell(key: str, seed: int, router: str, out: Path) -> dict[str, Any]:
    from bench.replay.live import run_live

    w = SUITE[key]
    cfg = suite_config(w, seed)
    res = run_live(suite_requests(w, seed), router, cfg, out / "live" / key, deadline_s=300)
    s = summarize(res.records, res.instances)
    s["wall_s"] = res.wall_s
    return s


def interval(xs: Sequence[float]) -> dict[str, float | None]:
    """Mean and 95% half-width (Student t over seeds); half-width None for one value."""
    if not xs:
        return {"mean": None, "ci95": None, "n": 0}
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return {"mean": m, "ci95": None, "n": len(xs)}
    t = _T95.get(len(xs) - 1, 1.96)
    return {"mean": m, "ci95": t * statistics.stdev(xs) / math.sqrt(len(xs)), "n": len(xs)}


def aggregate(cells: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per metric: mean, 95% half-width, n, the per-seed values."""
    out = {}
    for k in METRICS:
        xs = [c[k] for c in cells if c.get(k) is not None]
        out[k] = {**interval(xs), "values": xs}
    out["errors"] = sum(c["errors"] for c in cells)
    return out


def _targets(agg: dict[str, dict[str, Any]], key: str) -> dict[str, Any] | None:
    """The issue's targets for ``ours:cost`` against the best peer (or peer model)."""
    ours = agg.get("ours:cost")
    peers = {r: a for r, a in agg.items() if parse_router(r)[0] not in ("ours",)}
    if ours is None or not peers:
        return None
    hit = max(peers, key=lambda r: peers[r]["hit_ratio"]["mean"] or 0)
    p50 = min(peers, key=lambda r: peers[r]["ttft_p50_ms"]["mean"] or math.inf)
    p90 = min(peers, key=lambda r: peers[r]["ttft_p90_ms"]["mean"] or math.inf)
    m = {k: ours[k]["mean"] for k in METRICS}
    t = {
        "best_peer_hit": hit,
        "hit_ratio_x": m["hit_ratio"] / peers[hit]["hit_ratio"]["mean"]
        if peers[hit]["hit_ratio"]["mean"]
        else None,
        "best_peer_p50": p50,
        "ttft_p50_x": m["ttft_p50_ms"] / peers[p50]["ttft_p50_ms"]["mean"],
        "best_peer_p90": p90,
        "ttft_p90_x": m["ttft_p90_ms"] / peers[p90]["ttft_p90_ms"]["mean"],
    }
    t["met"] = (t["hit_ratio_x"] or 0) >= 1 and t["ttft_p50_x"] <= 1 and t["ttft_p90_x"] <= 1
    if key.startswith(("c_", "d_")):
        t["met_1_3x"] = (t["hit_ratio_x"] or 0) >= 1.3 or t["ttft_p90_x"] <= 0.7
    return t


def run_suite(
    out: Path,
    *,
    workloads: Sequence[str] = tuple(SUITE),
    seeds: Sequence[int] = (0, 1, 2),
    sim_routers: Sequence[str] = SIM_ROUTERS,
    live_workloads: Sequence[str] = (),
    live_seeds: Sequence[int] = (0,),
    live_routers: Sequence[str] = LIVE_ROUTERS,
    real_vllm_seeds: Sequence[int] = (),
    jobs: int = 1,
    command: str = "",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the suite; write ``report.md``, ``results.json`` and plots under ``out``.
    ``real_vllm_seeds``: also run ``live_routers`` on real vLLM CPU engines
    (``bench.replay.real_vllm``: ``a_real_shape``'s workload), per seed."""
    for k in (*workloads, *live_workloads):
        if k not in SUITE:
            raise ValueError(f"unknown suite workload {k!r}; expected one of {list(SUITE)}")
    out.mkdir(parents=True, exist_ok=True)
    cells: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {"sim": {}, "live": {}}
    jobs_list = [(k, s, r) for k in workloads for s in seeds for r in sim_routers]
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futs = [(j, pool.submit(_sim_cell, *j)) for j in jobs_list]
            results = [(j, f.result()) for j, f in futs]
    else:
        results = [(j, _sim_cell(*j)) for j in jobs_list]
    for (k, _s, r), summary in results:
        cells["sim"].setdefault(k, {}).setdefault(r, []).append(summary)
    if progress is not None:
        progress(f"sim: {len(results)} cells")
    for k in live_workloads:
        for s in live_seeds:
            for r in live_routers:
                try:
                    summary = _live_cell(k, s, r, out)
                except (RuntimeError, TimeoutError, OSError) as exc:
                    log.error("live %s %s seed %d failed: %s", k, r, s, exc)
                    continue
                cells["live"].setdefault(k, {}).setdefault(r, []).append(summary)
                if progress is not None:
                    progress(f"live {k} seed {s} {r}: hit {summary['hit_ratio']:.3f}")
    real = None
    if real_vllm_seeds:
        from bench.replay.real_vllm import run_real

        real = run_real(out, live_routers, real_vllm_seeds)
        if progress is not None:
            progress(f"real vLLM: {len(real_vllm_seeds)} seeds")
    agg = {
        mode: {k: {r: aggregate(cs) for r, cs in per.items()} for k, per in ws.items()}
        for mode, ws in cells.items()
    }
    targets = {mode: {k: _targets(per, k) for k, per in ws.items()} for mode, ws in agg.items()}
    results_json = {
        "command": command,
        "seeds": list(seeds),
        "live_seeds": list(live_seeds),
        "workloads": {
            k: {
                "description": SUITE[k].description,
                "engines": SUITE[k].engines,
                "engine": SUITE[k].engine.to_dict(),
                "time_scale": SUITE[k].time_scale,
            }
            for k in dict.fromkeys((*workloads, *live_workloads))
        },
        "aggregate": agg,
        "targets": targets,
        "cells": cells,
        "real_vllm": real,
    }
    (out / "results.json").write_text(json.dumps(results_json, indent=1, default=str))
    from bench.replay.suite_report import plot_suite, suite_markdown

    plots = plot_suite(agg, out)
    (out / "report.md").write_text(suite_markdown(results_json, plots))
    return results_json


def run_suite_cli(
    out: Path, suite: str, seeds: str, live: str, live_seeds: str, jobs: int, command: str,
    real_vllm_seeds: str = "",
) -> str:  # fmt: skip
    """``kvroute bench replay --suite``: parse the flags, run, return the report text."""

    def ints(text: str) -> list[int]:
        try:
            return [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"seeds must be integers, got {text!r}") from None

    workloads = list(SUITE) if suite == "all" else [w.strip() for w in suite.split(",") if w]
    live_w = list(SUITE) if live == "all" else [w.strip() for w in live.split(",") if w]
    if not ints(seeds):
        raise ValueError("no seeds given")
    run_suite(
        out,
        workloads=workloads,
        seeds=ints(seeds),
        live_workloads=live_w,
        live_seeds=ints(live_seeds),
        real_vllm_seeds=ints(real_vllm_seeds),
        jobs=jobs,
        command=command,
        progress=lambda msg: log.info("%s", msg),
    )
    return (out / "report.md").read_text()


def with_engine(w: SuiteWorkload, **changes: Any) -> SuiteWorkload:
    """A copy of ``w`` with engine settings changed (tests shrink workloads with it)."""
    return replace(w, engine=replace(w.engine, **changes))
