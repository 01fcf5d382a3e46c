"""``kvroute`` entry point. Sub-commands import their packages lazily so that, e.g.,
``kvroute events tail`` never loads torch."""

from __future__ import annotations

import logging

import typer

from kvroute_cli.bench_cmd import app as bench_app
from kvroute_cli.engine_cmd import engine
from kvroute_cli.events_cmd import app as events_app
from kvroute_cli.router_cmd import router
from kvroute_cli.up_cmd import up

app = typer.Typer(no_args_is_help=True, help="KV event streaming and hybrid prefix-aware routing.")
app.add_typer(events_app, name="events", help="Inspect vLLM KV event streams.")
app.command("engine")(engine)
app.command("router")(router)
app.command("up")(up)
app.add_typer(bench_app, name="bench", help="Benchmarks that print numbers and write a report.")


@app.callback()
def _main(log_level: str = typer.Option("INFO", help="Python logging level.")) -> None:
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


if __name__ == "__main__":
    app()
