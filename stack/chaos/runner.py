"""``kvroute bench chaos``'s whole run: every scenario, the table and ``chaos.json``."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stack.chaos.faults_engine import engine_kill
from stack.chaos.faults_events import dropped_events
from stack.chaos.faults_index import redis_outage
from stack.chaos.fuzz_events import fuzz_events, hypothesis_payloads, random_payloads
from stack.chaos.fuzz_http import fuzz_http, http_cases, oversize_checks
from stack.chaos.load import stream_load
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
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def want(name: str) -> bool:
        return only is None or name in only

    if want("kill"):
        with Fleet(workdir / "kill") as fleet:
            r = await engine_kill(fleet, requests=kill_requests)
        r["notes"] = (
            f"{len(r['broken_streams'])} started streams ended with an error chunk, "
            f"{r['sent_after_kill']} requests sent after the kill; down detected in "
            f"{r['detect_down_s']:.2f}s; recovery = restart -> index rebuilt (engine start "
            f"{r['restart_s']:.1f}s)"
        )
        rows.append(r)
    if want("events"):
        for buffer_steps in (10_000, 8):
            with _quiet("events.subscriber", "router.ingest", "router.layout"):
                r = await dropped_events(drop=20, buffer_steps=buffer_steps, seed=seed)
            r["requests"] = r["batches"]
            r["notes"] = (
                f"requests = batches published; lost = stale index entries; right after the "
                f"gap {r['missing_after_gap']} entries missing (history), at the end "
                f"{r['missing']}/{r['truth_entries']}; gaps {r['gaps']:.0f}, resyncs "
                f"{r['resyncs']:.0f}"
            )
            rows.append(r)
    if want("redis"):
        with Fleet(workdir / "redis") as fleet:
            r = await redis_outage(fleet)
        r["notes"] = (
            f"fallback to load-only seen: {r['fallback_seen']}; lookups back after "
            f"{r['index_back_s']:.2f}s; recovery = restart -> history rebuilt"
        )
        rows.append(r)
    if want("fuzz"):
        hyp = hypothesis_payloads(hypothesis_examples, seed) if hypothesis_examples else []
        payloads = hyp + random_payloads(fuzz_payloads - len(hyp), seed)
        tcp_n = min(1000, len(payloads) // 10)
        with _quiet("events.subscriber", "router.ingest", "router.layout"):
            a = await fuzz_events(payloads[tcp_n:], transport="inproc")
            b = await fuzz_events(payloads[:tcp_n], transport="tcp")
        rows.append(
            {
                "fault": "msgpack fuzz -> subscriber + ingest",
                "injected": a["injected"] + b["injected"],
                "requests": None,
                "lost_count": a["lost_count"] + b["lost_count"],
                "recovery_s": None,
                "notes": (
                    f"{len(hyp)} from hypothesis; {a['decoded'] + b['decoded']} decoded, "
                    f"{a['undecodable'] + b['undecodable']} counted undecodable, "
                    f"{a['invalid_events'] + b['invalid_events']:.0f} invalid events dropped; "
                    f"lost = uncounted + feed errors"
                ),
                "inproc": a,
                "tcp": b,
            }
        )
    if want("http"):
        with Fleet(workdir / "http") as fleet:
            (eng,) = start_engines(
                fleet, 1, "--profile", "full", "--time-scale", "50", "--max-model-len", "1024"
            )
            router = fleet.router([eng], env={"KVROUTE_MAX_BODY_BYTES": str(1 << 20)})
            for name, proc in (("router", router), ("engine", eng)):
                cases = http_cases(http_cases_per_target, seed + (name == "engine"))
                r = await fuzz_http(proc.url, cases)
                limit = 1 << 20 if name == "router" else 16 << 20
                over = await asyncio.to_thread(oversize_checks, proc.port, "/v1/completions", limit)
                refused = [over[k]["status"] == 413 for k in ("announced", "chunked")]
                r.update(
                    fault=f"HTTP fuzz -> {name}",
                    requests=len(cases),
                    recovery_s=None,
                    oversize=over,
                    notes=(
                        f"statuses {r['statuses']}; oversize bodies refused with 413: "
                        f"{sum(refused)}/2 (chunked: after {over['chunked']['sent_bytes'] >> 20}"
                        f" MiB of a {limit >> 20} MiB limit)"
                    ),
                )
                r["lost_count"] += refused.count(False)
                rows.append(r)
    if want("load"):
        with Fleet(workdir / "load") as fleet:
            r = await stream_load(fleet, streams=streams, rounds=2)
        after = " / ".join(f"{v:.0f}" for v in r["rss_after_mb"])
        r["fault"] = f"{streams} concurrent streams, twice"
        r["notes"] = (
            f"{r['distinct_ids']} distinct response ids; router RSS {r['rss_baseline_mb']:.0f}"
            f" MB warm -> peak {r['rss_peak_mb']:.0f} -> {after} MB after each round; wall "
            + " / ".join(f"{w:.1f}s" for w in r["wall_s"])
        )
        rows.append(r)
    return rows


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
        rows = asyncio.run(
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
    report = {
        "figures": [
            {
                "fault": r["fault"],
                "injected": r.get("injected"),
                "requests": r.get("requests"),
                "lost": r.get("lost_count"),
                "recovery_s": r.get("recovery_s"),
                "notes": r.get("notes", ""),
            }
            for r in rows
        ],
        "details": rows,
        "wall_s": time.monotonic() - t0,
    }
    path = write_report(out, "chaos", report)
    table = Table(title="kvroute bench chaos: faults injected and what they cost")
    for col in ("fault", "injected", "requests", "lost", "recovery s", "notes"):
        table.add_column(col, justify="left" if col in ("fault", "notes") else "right")
    for f in report["figures"]:
        table.add_row(
            f["fault"],
            _fmt(f["injected"]),
            _fmt(f["requests"]),
            _fmt(f["lost"]),
            _fmt(f["recovery_s"]),
            f["notes"],
        )
    console = Console(width=200)
    console.print(table)
    console.print(f"report: {path}")
    return report
