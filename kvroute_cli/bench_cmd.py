"""``kvroute bench ...``: each benchmark lives in ``bench/`` and returns its report dict."""

from __future__ import annotations

from pathlib import Path

import typer

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
