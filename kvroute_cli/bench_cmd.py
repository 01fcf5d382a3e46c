"""``kvroute bench ...``: each benchmark lives in ``bench/`` and returns its report dict.

A command's flags are named like its benchmark's ``run`` parameters, which take them by
name (``kvroute_cli.options.fields_from``)."""

from __future__ import annotations

from pathlib import Path

import typer

from kvroute_cli.bench_chaos_cmd import chaos
from kvroute_cli.bench_replay_cmd import overhead as bench_overhead
from kvroute_cli.bench_replay_cmd import replay as bench_replay
from kvroute_cli.extras import require_extras
from kvroute_cli.options import fields_from

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


@app.command("replicas")
def bench_replicas(
    out: Path = OUT,
    replicas: str = typer.Option("1,2,3", help="Router replica counts to compare."),
    bursts: int = typer.Option(10, help="Bursts per setup."),
    size: int = typer.Option(6, help="Requests per burst."),
    gap: float = typer.Option(0.05, help="Seconds between a burst's requests."),
    chars: int = typer.Option(2500, help="Characters of each burst's new shared prefix."),
    share: bool = typer.Option(True, "--share/--no-share", help="Replicas share (item 2)."),
) -> None:
    """Bursts through one router vs split across replicas on one Redis index: reused
    tokens, engines per burst, exact predictions, share staleness."""
    from bench.replicas import run

    counts = [int(x) for x in replicas.split(",") if x.strip()]
    run(out, replicas=counts, bursts=bursts, size=size, gap_s=gap, chars=chars, share=share)


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

    run(**fields_from(run, locals()))


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

    run(**fields_from(run, locals()))


@app.command("fleet")
def bench_fleet(
    out: Path = OUT,
    instances: list[int] = typer.Option([96, 256], help="Fleet sizes, one row each."),
    entries: int = typer.Option(5_000_000, help="(instance, group, tier, block) entries."),
    prompt_tokens: int = typer.Option(240_000, help="Tokens of each routed prompt."),
    decisions: int = typer.Option(60, help="Decisions timed (and checked) per fleet."),
    proxy_requests: int = typer.Option(40, help="Requests through the proxy and direct."),
    idle_s: float = typer.Option(10.0, help="Seconds the idle router's CPU is measured."),
    redis: bool = typer.Option(True, help="Also ingest into a private redis-server."),
    redis_instances: int = typer.Option(16, help="Instances the Redis ingest follows."),
    churn_minutes: int = typer.Option(
        0, help="Simulated minutes of store/evict churn, RSS sampled after each (60: an hour)."
    ),
    churn_rate: float = typer.Option(
        1000.0, help="Churn block events per instance per simulated second."
    ),
    small: bool = typer.Option(False, help="CI scale: 4 and 6 instances, 4k-token prompts."),
    seed: int = typer.Option(0),
) -> None:
    """A router cold in front of a fleet: decision time, added latency, RSS, ingest rates,
    idle probing CPU; every decision checked (full scale: the defaults)."""
    from bench.fleet import run

    if small:
        run(out, instances=(4, 6), entries=40_000, prompt_tokens=4096, decisions=8,
            proxy_requests=6, idle_s=1.0, redis=redis, redis_instances=2,
            churn_minutes=churn_minutes, churn_rate=churn_rate,
            seed=seed, system_blocks=16, step_blocks=64, noise_blocks=256)  # fmt: skip
        return
    run(**fields_from(run, locals(), instances=tuple(instances)))


app.command("chaos")(chaos)
app.command("replay")(bench_replay)
app.command("overhead")(bench_overhead)
