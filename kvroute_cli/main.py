"""``kvroute`` entry point. Sub-commands import their packages lazily so that, e.g.,
``kvroute events tail`` never loads torch; the commands whose flags are generated from a
settings model (``router``, ``engine``, ``up``) are built only when run (or asked for their
own help): ``kvroute --help`` lists them from their one-line docs without importing their
settings models."""

from __future__ import annotations

import logging
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from kvroute_cli.bench_cmd import app as bench_app
from kvroute_cli.engine_cmd import engine
from kvroute_cli.events_cmd import app as events_app
from kvroute_cli.router_cmd import router
from kvroute_cli.up_cmd import up

_GENERATED = {"engine": engine, "router": router, "up": up}


class _Group(TyperGroup):
    """``kvroute``'s commands, the generated ones built on first use.

    ``get_command`` (what the group's help lists) gives a generated command as a stub with
    its doc and no flags; ``resolve_command`` (what running it, or its own ``--help``,
    goes through) builds it from its settings model."""

    def list_commands(self, ctx: Any) -> list[str]:
        return [*super().list_commands(ctx), *_GENERATED]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = _GENERATED.get(cmd_name)
        if command is None:
            return super().get_command(ctx, cmd_name)
        return TyperCommand(cmd_name, help=command.__doc__)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        name, command, rest = super().resolve_command(ctx, args)
        generated = _GENERATED.get(name or "")
        if generated is not None:
            single = typer.Typer()
            single.command(name)(generated)
            command = typer.main.get_command(single)
        return name, command, rest


app = typer.Typer(
    cls=_Group, no_args_is_help=True, help="KV event streaming and hybrid prefix-aware routing."
)
app.add_typer(events_app, name="events", help="Inspect vLLM KV event streams.")
app.add_typer(bench_app, name="bench", help="Benchmarks that print numbers and write a report.")


@app.callback()
def _main(log_level: str = typer.Option("INFO", help="Python logging level.")) -> None:
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


if __name__ == "__main__":
    app()
