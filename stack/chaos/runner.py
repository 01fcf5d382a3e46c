"""``kvroute bench chaos``'s whole run: every scenario, the table and ``chaos.json``."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from stack.chaos.faults_engine import engine_kill
from stack.chaos.faults_events import dropped_events
from stack.chaos.faults_index import redis_outage
from stack.chaos.fuzz_events import fuzz_events, hypothesis_payloads, random_payloads
from stack.chaos.fuzz_http import fuzz_http, http_cases, oversize_checks
from stack.chaos.load import stream_load
from stack.chaos.results import ChaosResult, HttpFuzzRun, MsgpackFuzzRun
from stack.procs import Fleet, start_engines
from stack.report import write_report


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if v < 0.1 else f"{v:.2f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """In-process scenarios log a warning per fault they inject: keep the table readable."""
    import logging

    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


async def _run_all(
    workdir: Path,
    *,
    streams: int,
    kill_requests: int,
    fuzz_payloads: int,
    hypothesis_examples: int,
    http_cases_per_target: int,
    seed: int,
    only: set[str] | None,
) -> list[ChaosResult]:
    results: list[ChaosResult] = []

    def want(name: str) -> bool:
        return only is None or name in only

    if want("kill"):
        with Fleet(workdir / "kill") as fleet:
            results.append(await engine_kill(fleet, requests=kill_requests))
    if want("events"):
        for buffer_steps in (10_000, 8):
            with _quiet("events.subscriber", "router.ingest", "router.decision.layout"):
                results.append(await dropped_events(drop=20, buffer_steps=buffer_steps, seed=seed))
    if want("redis"):
        with Fleet(workdir / "redis") as fleet:
            results.append(await redis_outage(fleet))
    if want("fuzz"):
        hyp = hypothesis_payloads(hypothesis_examples, seed) if hypothesis_examples else []
        payloads = hyp + random_payloads(fuzz_payloads - len(hyp), seed)
        tcp_n = min(1000, len(payloads) // 10)
        with _quiet("events.subscriber", "router.ingest", "router.decision.layout"):
            inproc = await fuzz_events(payloads[tcp_n:], transport="inproc")
            tcp = await fuzz_events(payloads[:tcp_n], transport="tcp")
        results.append(MsgpackFuzzRun(len(hyp), inproc, tcp))
    if want("http"):
        with Fleet(workdir / "http") as fleet:
            (eng,) = start_engines(
                fleet, 1, "--profile", "full", "--time-scale", "50", "--max-model-len", "1024"
            )
            router = fleet.router([eng], env={"KVROUTE_MAX_BODY_BYTES": str(1 << 20)})
            for name, proc in (("router", router), ("engine", eng)):
                cases = http_cases(http_cases_per_target, seed + (name == "engine"))
                fuzzed = await fuzz_http(proc.url, cases)
                limit = 1 << 20 if name == "router" else 16 << 20
                over = await asyncio.to_thread(oversize_checks, proc.port, "/v1/completions", limit)
                results.append(HttpFuzzRun(name, limit, fuzzed, over))
    if want("load"):
        with Fleet(workdir / "load") as fleet:
            results.append(await stream_load(fleet, streams=streams, rounds=2))
    return results


def run(
    out: Path,
    *,
    streams: int = 1000,
    kill_requests: int = 60,
    fuzz_payloads: int = 10_000,
    hypothesis_examples: int = 2000,
    http_cases_per_target: int = 300,
    seed: int = 0,
    only: set[str] | None = None,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """Run the fault scenarios (``only``: a subset of kill, events, redis, fuzz, http,
    load), print the table and write ``out/chaos.json``."""
    from rich.console import Console
    from rich.table import Table

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvroute-chaos-") as tmp:
        base = Path(workdir or tmp)
        for sub in ("kill", "redis", "http", "load"):
            (base / sub).mkdir(parents=True, exist_ok=True)
        results = asyncio.run(
            _run_all(
                base,
                streams=streams,
                kill_requests=kill_requests,
                fuzz_payloads=fuzz_payloads,
                hypothesis_examples=hypothesis_examples,
                http_cases_per_target=http_cases_per_target,
                seed=seed,
                only=only,
            )
        )
    rows = [r.row() for r in results]
    report = {
        "figures": [asdict(row) for row in rows],
        "details": [
            {"fault": row.fault, **asdict(r)} for row, r in zip(rows, results, strict=True)
        ],
        "wall_s": time.monotonic() - t0,
    }
    path = write_report(out, "chaos", report)
    table = Table(title="kvroute bench chaos: faults injected and what they cost")
    for col in ("fault", "injected", "requests", "lost", "recovery s", "notes"):
        table.add_column(col, justify="left" if col in ("fault", "notes") else "right")
    for row in rows:
        table.add_row(
            row.fault,
            _fmt(row.injected),
            _fmt(row.requests),
            _fmt(row.lost),
            _fmt(row.recovery_s),
            row.notes,
        )
    console = Console(width=200)
    console.print(table)
    console.print(f"report: {path}")
    return report
