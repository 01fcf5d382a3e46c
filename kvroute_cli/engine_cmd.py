"""``kvroute engine``: a simulated vLLM-like OpenAI server that publishes KV events.

Its flags are generated from ``engine_adapter.sim.settings.EngineSettings``
(``kvroute_cli.options``); only ``--log-level`` is written here.
"""

from __future__ import annotations

import inspect
from typing import Any

import typer
from pydantic import BaseModel

from kvroute_cli.extras import require_extras
from kvroute_cli.options import SettingsCommand

__all__ = ["engine"]


def _model() -> type[BaseModel]:
    from engine_adapter.sim.settings import EngineSettings  # pydantic only, no torch

    return EngineSettings


def _run(given: dict[str, Any], log_level: str) -> None:
    require_extras("kvroute engine", "engine")
    from pydantic import ValidationError

    from engine_adapter.sim.server import serve
    from engine_adapter.sim.settings import EngineSettings

    try:
        settings = EngineSettings(**given)
    except (ValidationError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    try:
        serve(settings, log_level=log_level)
    except ValueError as exc:  # e.g. max_model_len does not fit the pool (vLLM's check)
        raise typer.BadParameter(str(exc)) from exc


engine = SettingsCommand(
    _model,
    _run,
    name="engine",
    doc="Serve /v1/completions, /v1/chat/completions, /tokenize, /metrics over a simulated "
    "hybrid KV cache, publishing vLLM KV events over ZMQ.",
    extra=[
        inspect.Parameter(
            "log_level",
            inspect.Parameter.KEYWORD_ONLY,
            default=typer.Option("info", help="uvicorn log level."),
            annotation=str,
        )
    ],
)
