"""``kvroute bench ...``: each benchmark lives in ``bench/`` and returns its report dict."""

from __future__ import annotations

from pathlib import Path

import typer

from kvroute_cli.bench_chaos_cmd import chaos
from kvroute_cli.bench_replay_cmd import overhead as bench_overhead
from kvroute_cli.bench_replay_cmd import replay as bench_replay
from kvroute_cli.extras import require_extras

app = typer.Typer(no_args_is_help=True)

OUT = typer.Option(Path("bench-results"), help="Directory for the JSON report.")


@app.command("hash")
def bench_hash(
    out: Path = OUT,
    tokens: int = typer.Option(8192, help="Prompt length in tokens."),
    block_size: int = typer.Option(16),
    repeats: int = typer.Option(200, help="Timed repetitions per variant."),
) -> None:
    """Block hashing: our fast path vs a naive cbor2 loop, per algorithm."""
    from bench.hashing import run

    run(out=out, num_tokens=tokens, block_size=block_size, repeats=repeats)


@app.command("offload")
def bench_offload(
    out: Path = OUT,
    profile: str = typer.Option("full", help="full | swa-hybrid | mamba-hybrid"),
    page_bytes: int = typer.Option(512 * 1024, help="Bytes per block per group."),
    num_blocks: int = typer.Option(512, help="Blocks copied per direction."),
    blocks_per_chunk: int = typer.Option(4),
    repeats: int = typer.Option(9),
    pool_blocks: int = typer.Option(8192, help="GPU blocks in the allocation benchmark."),
    pool_requests: int = typer.Option(400),
    prompt_tokens: int = typer.Option(2048),
    device: str = typer.Option(None, help="cuda | cpu (default: CUDA when present)."),
) -> None:
    """GPU<->CPU chunk copy bandwidth vs a plain torch copy, and pool blocks/s."""
    require_extras("kvroute bench offload", "engine")
    from bench.offload import run

    run(
        out,
        profile=profile,
        page_bytes=page_bytes,
        num_blocks=num_blocks,
        blocks_per_chunk=blocks_per_chunk,
        repeats=repeats,
        pool_blocks=pool_blocks,
        pool_requests=pool_requests,
        prompt_tokens=prompt_tokens,
        device=device,
    )


@app.command("index")
def bench_index(
    out: Path = OUT,
    ingest_events: int = typer.Option(1_000_000, help="Block events for the in-memory rate."),
    redis_events: int = typer.Option(300_000, help="Block events for the Redis rate."),
    memory_entries: int = typer.Option(1_000_000, help="Entries for the bytes/entry figure."),
    repeats: int = typer.Option(1000, help="Score calls timed per backend."),
    redis: bool = typer.Option(True, help="Also benchmark Redis (private redis-server)."),
    seed: int = typer.Option(0),
    runs: int = typer.Option(3, min=1, help="Whole runs; every figure is their median."),
    cluster: bool = typer.Option(
        False, help="Also the sharded index on a private Redis Cluster beside one node."
    ),
) -> None:
    """Index ingest rate, score latency (512 blocks x 32 instances) and bytes per entry."""
    from bench.index import run

    run(
        out,
        ingest_events=ingest_events,
        redis_events=redis_events,
        memory_entries=memory_entries,
        repeats=repeats,
        redis=redis,
        seed=seed,
        runs=runs,
        cluster=cluster,
    )


app.command("chaos")(chaos)
app.command("replay")(bench_replay)
app.command("overhead")(bench_overhead)
