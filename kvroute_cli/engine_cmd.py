"""``kvroute engine``: a simulated vLLM-like OpenAI server that publishes KV events.

Its flags are generated from ``engine_adapter.sim.settings.EngineSettings``
(``kvroute_cli.options``); only ``--log-level`` is written here. The same settings come
from the environment (``KVROUTE_ENGINE_<FIELD>``) and a ``--config`` YAML file (field
names), as the router's do: flags > environment > file.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from kvroute_cli.extras import require_extras
from kvroute_cli.options import SettingsCommand, config_parameter, load_layered

if TYPE_CHECKING:  # imported with the command's settings model, when it is built
    from pydantic import BaseModel

__all__ = ["ENV_PREFIX", "engine"]

ENV_PREFIX = "KVROUTE_ENGINE_"


def _model() -> type[BaseModel]:
    from engine_adapter.sim.settings import EngineSettings  # pydantic only, no torch

    return EngineSettings


def _run(given: dict[str, Any], log_level: str, config: Path | None) -> None:
    require_extras("kvroute engine", "engine")
    from pydantic import ValidationError

    from engine_adapter.sim.server import serve
    from engine_adapter.sim.settings import EngineSettings

    try:
        settings = load_layered(EngineSettings, given, config, env_prefix=ENV_PREFIX)
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
    "hybrid KV cache, publishing vLLM KV events over ZMQ. Settings: flags > "
    "KVROUTE_ENGINE_* environment > --config YAML, one name each (--gpu-blocks = "
    "KVROUTE_ENGINE_GPU_BLOCKS = gpu_blocks in YAML).",
    extra=[
        inspect.Parameter(
            "log_level",
            inspect.Parameter.KEYWORD_ONLY,
            default=typer.Option("info", help="uvicorn log level."),
            annotation=str,
        ),
        config_parameter(),
    ],
)
