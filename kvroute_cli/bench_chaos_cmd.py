"""``kvroute bench chaos`` (registered in ``bench_cmd``): faults injected, what they cost."""

from __future__ import annotations

from pathlib import Path

import typer

from kvroute_cli.extras import require_extras

__all__ = ["chaos"]

SCENARIOS = ("kill", "events", "redis", "fuzz", "http", "load")


def chaos(
    out: Path = typer.Option(Path("bench-results"), help="Directory for the JSON report."),
    streams: int = typer.Option(1000, help="Concurrent streams in the load scenario."),
    kill_requests: int = typer.Option(60, help="Requests in flight around the engine kill."),
    fuzz_payloads: int = typer.Option(10_000, help="msgpack payloads into subscriber+ingest."),
    hypothesis_examples: int = typer.Option(
        2000, help="How many of the payloads hypothesis generates (the rest: seeded mutator)."
    ),
    http_cases: int = typer.Option(300, help="Fuzzed HTTP requests per target (router, engine)."),
    only: str = typer.Option(None, help=f"Comma-separated subset of: {','.join(SCENARIOS)}."),
    seed: int = typer.Option(0),
    workdir: Path = typer.Option(None, help="Keep process logs here (default: a temp dir)."),
) -> None:
    """Engine SIGKILL mid-stream, dropped event batches, Redis restarted empty under load,
    msgpack and HTTP fuzzing, concurrent streams: requests lost and recovery times."""
    require_extras("kvroute bench chaos", "engine", "bench")
    from stack.chaos import run

    chosen = None
    if only:
        chosen = {s.strip() for s in only.split(",") if s.strip()}
        unknown = chosen - set(SCENARIOS)
        if unknown:
            raise typer.BadParameter(f"unknown scenarios {sorted(unknown)}", param_hint="--only")
    if streams <= 0 or kill_requests <= 0 or fuzz_payloads < hypothesis_examples:
        raise typer.BadParameter("counts must be positive, payloads >= hypothesis examples")
    run(
        out,
        streams=streams,
        kill_requests=kill_requests,
        fuzz_payloads=fuzz_payloads,
        hypothesis_examples=hypothesis_examples,
        http_cases_per_target=http_cases,
        seed=seed,
        only=chosen,
        workdir=workdir,
    )
