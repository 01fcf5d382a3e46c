"""``kvroute bench replay`` and ``kvroute bench overhead`` (registered in ``bench_cmd``)."""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path

import typer

from kvroute_cli.extras import require_extras
from kvroute_cli.options import fields_from

__all__ = ["overhead", "replay"]

DEFAULT_ROUTERS = "ours:cost,ours:prefix_full_only,ours:round_robin,vllm-router,sglang-router"


def _command(name: str) -> str:
    """The command line as a user would type it, whatever entry point ran it."""
    argv = sys.argv
    rest = argv[argv.index(name) + 1 :] if name in argv else argv[1:]
    return shlex.join(["kvroute", "bench", name, *rest])


def _routers(text: str, extra: tuple[str, ...] = ()) -> list[str]:
    from bench.replay.config import parse_router

    names = [r.strip() for r in text.split(",") if r.strip()]
    try:
        for r in names:
            if r not in extra:
                parse_router(r)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--routers") from exc
    if not names:
        raise typer.BadParameter("no routers given", param_hint="--routers")
    return names


def replay(
    trace: Path = typer.Option(
        None, exists=True, dir_okay=False, help="Mooncake JSONL trace (else --workload)."
    ),
    workload: str = typer.Option(
        None, help="Generate instead of a trace: chat | agent | mixed (uses --seed)."
    ),
    sessions: int = typer.Option(100, help="Generated workload: sessions."),
    session_rate: float = typer.Option(1.0, help="Generated workload: session starts per s."),
    engines: int = typer.Option(8, min=1),
    profile: str = typer.Option(
        "swa-hybrid",
        help="full | swa-hybrid | mamba-hybrid | gemma3 | gpt-oss | qwen3-next | llama",
    ),
    routers: str = typer.Option(DEFAULT_ROUTERS, help="Comma-separated, in run order."),
    requests: int = typer.Option(None, min=1, help="Replay this many requests (default all)."),
    start: int = typer.Option(0, min=0, help="Skip this many requests first."),
    sample: float = typer.Option(
        None, help="Keep whole conversations with this probability (before --start/--requests)."
    ),
    time_scale: float = typer.Option(1.0, help="Arrivals and engine steps S times faster."),
    mode: str = typer.Option("live", help="live | sim | both (sim-vs-live agreement)."),
    out: Path = typer.Option(Path("bench-results/replay"), help="Report directory."),
    max_output_tokens: int = typer.Option(64, min=1, help="Cap on each request's output."),
    gpu_blocks: int = typer.Option(16_384, help="GPU KV blocks per engine."),
    cpu_blocks: int = typer.Option(65_536, help="CPU-tier blocks per engine (0 = off)."),
    blocks_per_chunk: int = typer.Option(1),
    sliding_window: int = typer.Option(1024),
    prefill_tokens_per_s: float = typer.Option(10_000.0),
    max_num_seqs: int = typer.Option(64),
    seed: int = typer.Option(0, help="Prompt text, workload and tie-breaking seed."),
    jobs: int = typer.Option(1, min=1, help="Sim mode: policies simulated in parallel."),
    deadline: float = typer.Option(900.0, help="Live mode: seconds per router before giving up."),
    suite: str = typer.Option(
        None,
        help="Run the routing-quality suite instead: 'all' or comma-separated workloads "
        "(bench/replay/suite_workloads.py); sim for every workload, live for --live-suite.",
    ),
    seeds: str = typer.Option("0,1,2", help="Suite: seeds per cell."),
    live_suite: str = typer.Option("", help="Suite: workloads also replayed live."),
    live_seeds: str = typer.Option("0", help="Suite: seeds of the live cells."),
    real_vllm_seeds: str = typer.Option(
        "",
        help="Suite: also run the live routers on 3 real vLLM CPU engines (a_real_shape's "
        "workload) for these seeds; needs the vLLM CPU venv (engine_adapter/vllm_cpu).",
    ),
) -> None:
    """Replay a trace through each router on fresh engines; write report.md, results.json and
    plots (TTFT CDF, hit ratio, load per instance) under --out."""
    require_extras("kvroute bench replay", "engine", "bench")  # engines, plots, peers
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from bench.replay.config import EngineConfig, ReplayConfig
    from bench.replay.run import MODES, ReplayJob, run_replay
    from bench.replay.workload import WORKLOAD_KINDS, WorkloadConfig

    if suite is not None:
        from bench.replay.suite import run_suite_cli

        logging.getLogger("httpx").setLevel(logging.WARNING)
        try:
            text = run_suite_cli(out, suite, seeds, live_suite, live_seeds, jobs,
                                 _command("replay"), real_vllm_seeds)  # fmt: skip
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--suite") from exc
        Console().print(text)
        return
    if (trace is None) == (workload is None):
        raise typer.BadParameter("give exactly one of --trace and --workload")
    if workload is not None and workload not in WORKLOAD_KINDS:
        raise typer.BadParameter(f"expected one of {WORKLOAD_KINDS}", param_hint="--workload")
    if mode not in MODES:
        raise typer.BadParameter(f"expected one of {MODES}", param_hint="--mode")
    if time_scale <= 0:
        raise typer.BadParameter("must be positive", param_hint="--time-scale")
    cfg = ReplayConfig(
        **fields_from(
            ReplayConfig, locals(), engine=EngineConfig(**fields_from(EngineConfig, locals()))
        )
    )
    wl = None
    if workload is not None:
        wl = WorkloadConfig(kind=workload, sessions=sessions, session_rate_per_s=session_rate)
    job = ReplayJob(**fields_from(ReplayJob, locals(), routers=_routers(routers), config=cfg,
                                  workload=wl, live_deadline_s=deadline,
                                  command=_command("replay")))  # fmt: skip
    console = Console()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    with Progress(console=console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=done)

        results = run_replay(job, progress)
    for mode_name, summaries in results["summaries"].items():
        table = Table(title=f"{mode_name}: {results['trace']['requests']} requests")
        for col in ("router", "ok", "hit", "GPU", "CPU", "TTFT p50", "p90", "p99 ms", "exact"):
            table.add_column(col, justify="right")
        for name, s in summaries.items():
            table.add_row(
                name,
                f"{s['ok']}/{s['requests']}",
                f"{100 * s['hit_ratio']:.1f}%",
                f"{100 * s['gpu_hit_ratio']:.1f}%",
                f"{100 * s['cpu_hit_ratio']:.1f}%",
                *(f"{s[k]:.0f}" if s[k] is not None else "-" for k in
                  ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms")),
                "-" if s["prediction_exact"] is None else f"{100 * s['prediction_exact']:.1f}%",
            )  # fmt: skip
        console.print(table)
    console.print(f"oracle hit ratio {100 * results['trace']['oracle_hit_ratio']:.1f}%")
    console.print(f"report: {out / 'report.md'}")


def overhead(
    out: Path = typer.Option(Path("bench-results/overhead"), help="Report directory."),
    routers: str = typer.Option(
        "ours:cost,vllm-router,sglang-router",
        help="Comma-separated routers to measure; python-floor adds bench.replay.floor "
        "(Python's cheapest proxy, deciding nothing) as a yardstick; ours:POLICY@CHECKOUT "
        "runs another checkout's router (CHECKOUT/.venv/bin/kvroute): before vs after.",
    ),
    rounds: int = typer.Option(20, min=1, help="Interleaved rounds."),
    per_batch: int = typer.Option(
        20, min=2, help="Requests per target per round (x clients/4 at 16 clients)."
    ),
    clients: str = typer.Option("1,4,16", help="Comma-separated client concurrencies."),
    upstreams: str = typer.Option("minimal,engine", help="minimal and/or engine."),
) -> None:
    """Latency each router adds per request vs calling an engine directly (p50/p99), and
    our in-process routing decision time."""
    require_extras("kvroute bench overhead", "engine")
    from rich.console import Console

    from bench.replay.config import PEERS
    from bench.replay.interleave import FLOOR
    from bench.replay.overhead import run_overhead

    names = _routers(routers, extra=(FLOOR,))
    if any(r in PEERS for r in names):
        require_extras("kvroute bench overhead with peer routers", "bench")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    conc = [int(c) for c in clients.split(",") if c.strip()]
    ups = [u.strip() for u in upstreams.split(",") if u.strip()]
    run_overhead(names, out, rounds=rounds, per_batch=per_batch, concurrency=conc, upstreams=ups,
                 command=_command("overhead"))  # fmt: skip
    Console().print((out / "report.md").read_text())
