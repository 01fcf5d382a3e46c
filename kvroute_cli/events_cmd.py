"""``kvroute events ...`` (placeholder until the subscriber lands)."""

import typer

app = typer.Typer(no_args_is_help=True)
