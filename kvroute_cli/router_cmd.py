"""``kvroute router``: the hybrid prefix-aware OpenAI routing proxy.

Its flags are generated from ``router.config.RouterSettings`` (``kvroute_cli.options``);
only ``--config`` is written here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from kvroute_cli.options import SettingsCommand, config_parameter, load_layered

if TYPE_CHECKING:  # imported with the command's settings model, when it is built
    from pydantic import BaseModel

__all__ = ["ENV_PREFIX", "router"]

ENV_PREFIX = "KVROUTE_"  # RouterSettings' own (its model_config)


def _run(given: dict[str, Any], config: Path | None) -> None:
    from pydantic import ValidationError

    from router.config import RouterSettings, nest
    from router.decision.layout import default_layout
    from router.http.server import serve

    try:
        settings = load_layered(
            RouterSettings, given, config, env_prefix=ENV_PREFIX,
            nest=lambda data: nest(RouterSettings, data),
        )  # fmt: skip
        default_layout(settings.default_layout, settings.block_size)
        from router.http.workers import check_workers

        check_workers(settings)
    except (ValidationError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    serve(settings)


def _model() -> type[BaseModel]:
    from router.config import RouterSettings

    return RouterSettings


router = SettingsCommand(
    _model,
    _run,
    name="router",
    doc="Route OpenAI requests to the instance with the best hybrid prefix hit and the "
    "lowest predicted time to first token. Settings: flags > KVROUTE_* environment > "
    "--config YAML, one name each (--admission-max-waiting = KVROUTE_ADMISSION_MAX_WAITING "
    "= admission_max_waiting or admission: {max_waiting: ...} in YAML).",
    extra=[config_parameter()],
)
