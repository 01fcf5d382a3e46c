"""``kvroute bench replay``: load or generate the requests, run every router, write the report.

Modes: ``live`` (real processes, every router), ``sim`` (in-process, our policies only: a
peer has no in-process model) and ``both`` (live for every router, then the simulator on
the very same requests, with a sim-vs-live agreement table for our policies).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.replay.config import ReplayConfig, parse_router
from bench.replay.records import RequestRecord
from bench.replay.report import write_report
from bench.replay.trace import TraceRequest, load_mooncake, oracle_hits, reindex, sample_sessions
from bench.replay.workload import WorkloadConfig, generate

__all__ = ["ReplayJob", "load_requests", "run_replay"]

log = logging.getLogger(__name__)
MODES = ("live", "sim", "both")


@dataclass
class ReplayJob:
    out: Path
    routers: list[str]
    config: ReplayConfig
    mode: str = "live"
    trace: Path | None = None
    workload: WorkloadConfig | None = None
    requests: int | None = None
    start: int = 0
    sample: float | None = None
    jobs: int = 1
    live_deadline_s: float = 900.0
    command: str = field(default_factory=lambda: " ".join(sys.argv))


def load_requests(job: ReplayJob) -> tuple[list[TraceRequest], dict[str, Any]]:
    """The replayed requests and a description of where they came from."""
    if job.trace is not None:
        reqs = load_mooncake(job.trace)
        name = job.trace.name
    elif job.workload is not None:
        reqs = generate(job.workload, job.config.seed)
        name = f"generated {job.workload.kind} workload"
    else:
        raise ValueError("give a trace or a workload")
    if job.sample is not None:
        reqs = sample_sessions(reqs, job.sample, job.config.seed)
    end = None if job.requests is None else job.start + job.requests
    reqs = reindex(reqs[job.start : end])
    hits = oracle_hits(reqs)
    prompt = sum(r.input_length for r in reqs)
    span = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000 if reqs else 0.0
    info = {
        "name": name,
        "path": str(job.trace) if job.trace else None,
        "workload": job.workload.to_dict() if job.workload else None,
        "start": job.start,
        "sample_sessions": job.sample,
        "requests": len(reqs),
        "prompt_tokens": prompt,
        "trace_span_s": span,
        "oracle_hit_tokens": sum(hits),
        "oracle_hit_ratio": sum(hits) / prompt if prompt else 0.0,
    }
    return reqs, info


def _sim_one(
    requests: Sequence[TraceRequest], policy: str, cfg: ReplayConfig
) -> tuple[list[RequestRecord], list[str], float, dict]:
    from bench.replay.sim import run_sim

    res = run_sim(requests, policy, cfg)
    return res.records, res.instances, res.wall_s, res.engine_stats


def run_sims(
    requests: Sequence[TraceRequest],
    routers: Sequence[str],
    cfg: ReplayConfig,
    jobs: int = 1,
    on_done: Callable[[str, float], None] | None = None,
) -> tuple[dict[str, tuple[list[RequestRecord], list[str]]], dict[str, Any]]:
    """Our policies and the peer models through the simulator (in ``jobs`` processes);
    real peers are skipped."""
    ours = [r for r in routers if parse_router(r)[0] in ("ours", "model")]
    runs: dict[str, tuple[list[RequestRecord], list[str]]] = {}
    meta: dict[str, Any] = {}
    if jobs > 1 and len(ours) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futs = {r: pool.submit(_sim_one, requests, parse_router(r)[1], cfg) for r in ours}
            results = {r: f.result() for r, f in futs.items()}
    else:
        results = {}
        for r in ours:
            results[r] = _sim_one(requests, parse_router(r)[1], cfg)
            if on_done is not None:
                on_done(r, results[r][2])
    for r in ours:
        records, names, wall, stats = results[r]
        runs[r] = (records, names)
        meta[r] = {"wall_s": wall, "engines": stats}
    return runs, meta


def run_replay(
    job: ReplayJob, progress: Callable[[str, int, int], None] | None = None
) -> dict[str, Any]:
    """Run the job and write its report; returns the results dict."""
    if job.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    for r in job.routers:
        parse_router(r)  # fail fast on a bad name
    requests, info = load_requests(job)
    if not requests:
        raise ValueError("no requests to replay")
    log.info("%d requests, oracle hit ratio %.3f", len(requests), info["oracle_hit_ratio"])
    runs: dict[str, dict[str, tuple[list[RequestRecord], list[str]]]] = {}
    extra: dict[str, Any] = {"wall_s": {}, "commands": {}}
    notes: list[str] = []
    if job.mode in ("live", "both"):
        from bench.replay.live import run_live

        runs["live"] = {}
        for r in job.routers:

            def prog(done: int, total: int, r: str = r) -> None:
                if progress is not None:
                    progress(f"live {r}", done, total)

            try:
                res = run_live(
                    requests, r, job.config, job.out, deadline_s=job.live_deadline_s, progress=prog
                )
            except (RuntimeError, TimeoutError, OSError) as exc:  # one router down, not the run
                log.error("live %s failed: %s", r, exc)
                notes.append(f"live {r} did not run: {str(exc).splitlines()[0][:200]}")
                continue
            runs["live"][r] = (res.records, res.instances)
            extra["wall_s"][f"live {r}"] = res.wall_s
            extra["commands"][r] = " ".join(res.command)
            log.info("live %s done in %.0fs", r, res.wall_s)
        walls = ", ".join(f"{r} {extra['wall_s'][f'live {r}']:.0f} s" for r in runs["live"])
        notes.append(f"live wall time per router (engines and router start included): {walls}")
    if job.mode in ("sim", "both"):
        sims, meta = run_sims(requests, job.routers, job.config, job.jobs)
        runs["sim"] = sims
        for r, m in meta.items():
            extra["wall_s"][f"sim {r}"] = m["wall_s"]
        extra["sim_engines"] = {r: m["engines"] for r, m in meta.items()}
        walls = ", ".join(f"{r} {m['wall_s']:.0f} s" for r, m in meta.items())
        notes.append(f"sim wall time per policy ({job.jobs} in parallel): {walls}")
        skipped = [r for r in job.routers if parse_router(r)[0] not in ("ours", "model")]
        if skipped:
            notes.append(f"sim mode models our router only; not simulated: {', '.join(skipped)}")
    if job.config.max_output_tokens:
        notes.append(
            f"output lengths capped at {job.config.max_output_tokens} tokens "
            "(trace output_length otherwise)"
        )
    if "sim" in runs and "live" in runs:
        runs = {"sim": runs["sim"], "live": runs["live"]}
    return write_report(
        job.out,
        runs,
        command=job.command,
        config=job.config.to_dict(),
        trace_info=info,
        notes=notes,
        extra=extra,
    )
