"""``kvroute up``: engines + router on loopback, a multi-turn demo workload, a results table.

The logic lives in :mod:`stack.demo`; this module only draws (Rich progress bar and table)
and turns SIGTERM into the same clean shutdown as Ctrl-C. Its flags are generated from
``stack.demo.config.DemoConfig``; the same settings come from the environment
(``KVROUTE_UP_<FIELD>``) and a ``--config`` YAML file, as the router's do.
"""

from __future__ import annotations

import inspect
import json
import logging
import signal
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import typer

from kvroute_cli.extras import require_extras
from kvroute_cli.options import SettingsCommand, config_parameter, load_layered

if TYPE_CHECKING:  # imported with the command's settings model, when it is built
    from pydantic import BaseModel

__all__ = ["ENV_PREFIX", "up"]

ENV_PREFIX = "KVROUTE_UP_"


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


def _fmt_tokens(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def _table(report: dict[str, Any]) -> Any:
    """One row per policy; narrow enough for an 80-column terminal."""
    from rich import box
    from rich.table import Table

    cfg = report["config"]
    rows = report["rows"]
    sources = sorted({r["prediction_source"] for r in rows if r["prediction_source"]})
    table = Table(
        box=box.SIMPLE_HEAD,
        title=f"kvroute up: {cfg['conversations']} conversations x {cfg['turns']} turns",
        caption=(
            (
                f"{cfg['engines']} real vLLM CPU engines (tiny Gemma-3-like model, "
                f"{cfg['gpu_blocks']} KV blocks"
                + (
                    f", vLLM's OffloadingConnector with {cfg['cpu_blocks']} CPU blocks)"
                    if cfg.get("cpu_offload")
                    else ")"
                )
                if cfg.get("engine") == "vllm"
                else f"{cfg['engines']} {cfg['profile']} engines ({cfg['gpu_blocks']} GPU / "
                f"{cfg['cpu_blocks']} CPU blocks, time x{cfg['time_scale']:g})"
            )
            + f", index {cfg['index']}. hit: cached / prompt tokens (engine-reported); "
            "GPU/CPU tok: tokens reused from each tier; TTFT at the client; exact: share of "
            "requests whose predicted hit (router"
            + (f", from {' and '.join(sources)}" if sources else "")
            + ") equals the actual hit (engine); spread: requests per engine."
        ),
    )
    table.add_column("policy", style="bold", no_wrap=True)
    table.add_column("hit", justify="right")
    table.add_column("GPU/CPU tok", justify="right")
    table.add_column("TTFT p50", justify="right")
    table.add_column("TTFT p90", justify="right")
    table.add_column("exact", justify="right")
    table.add_column("spread", justify="right")
    for row in rows:
        acc = row["prediction_accuracy"]
        spread = "/".join(str(n) for n in sorted(row["per_instance"].values(), reverse=True))
        table.add_row(
            row["policy"],
            f"{row['hit_ratio']:.1%}",
            f"{_fmt_tokens(row['gpu_hit_tokens'])}/{_fmt_tokens(row['cpu_hit_tokens'])}",
            _fmt_ms(row["ttft_p50_ms"]),
            _fmt_ms(row["ttft_p90_ms"]),
            "n/a" if acc is None else f"{acc:.0%}",
            spread,
        )
    return table


def _model() -> type[BaseModel]:
    from stack.demo.config import DemoConfig

    return DemoConfig


def _up(
    given: dict[str, Any], keep_logs: bool, out: Path | None, keep: bool, config: Path | None
) -> None:
    """Start engines and the router on 127.0.0.1, run a short multi-turn chat workload per
    policy (fresh engines each), print hit ratio, TTFT and prediction accuracy, stop all."""
    from pydantic import ValidationError

    from stack.demo import DemoConfig

    try:  # DemoConfig checks the settings (e.g. an unknown profile)
        cfg = load_layered(DemoConfig, given, config, env_prefix=ENV_PREFIX)
    except (ValidationError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
    if cfg.engine == "sim":
        require_extras("kvroute up", "engine")  # it starts `kvroute engine` processes
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TaskID,
        TextColumn,
        TimeElapsedColumn,
    )

    from stack.demo import DemoError, Observer, RequestRecord, run_up

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request
    console = Console()

    class _Bar(Observer):
        """One line per policy: what it is doing, and its requests done so far."""

        def __init__(self, progress: Progress) -> None:
            self.progress = progress
            self.tasks: dict[str, TaskID] = {}

        def round_started(self, policy: str, total_requests: int) -> None:
            self.tasks[policy] = self.progress.add_task(policy, total=total_requests)

        def phase(self, policy: str, text: str) -> None:
            self.progress.update(self.tasks[policy], description=f"{policy}: {text}")

        def request_done(self, policy: str, record: RequestRecord) -> None:
            self.progress.advance(self.tasks[policy])

        def stack_up(self, policy: str, router_url: str, engines: list[str]) -> None:
            self.progress.console.print(f"dashboard for {policy}: {router_url}/dashboard")

    def _hold(report: dict[str, Any], progress: Progress) -> None:
        """--keep: the table now, then wait for Ctrl-C (or SIGTERM) with the stack up."""
        progress.stop()
        console.print(_table(report))
        row = report["rows"][-1]
        console.print(
            f"[bold]kept up:[/bold] router {row['router']}, dashboard "
            f"[bold]{row['router']}/dashboard[/bold], {len(row['engines'])} engines. "
            "Ctrl-C stops everything."
        )
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            console.print("stopping engines and router")

    def _sigterm(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        with Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as progress:
            hold = (lambda report: _hold(report, progress)) if keep else None
            report = run_up(cfg, observer=_Bar(progress), keep_logs=keep_logs, hold=hold)
    except DemoError as exc:
        console.print(f"[red]kvroute up failed:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; engines and router stopped[/yellow]")
        raise typer.Exit(130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    if not keep:  # --keep printed it before waiting
        console.print(_table(report))
    console.print(
        f"all {len(report['pids'])} child processes stopped; total {report['wall_s']:.1f} s"
    )
    if report["log_dir"]:
        console.print(f"logs: {report['log_dir']}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        console.print(f"report: {out}")


up = SettingsCommand(
    _model,
    _up,
    name="up",
    doc="Start engines and the router on 127.0.0.1, run a short multi-turn chat workload per "
    "policy (fresh engines each), print hit ratio, TTFT and prediction accuracy, stop all. "
    "Each round prints its router's live dashboard URL; --keep leaves the last one up. "
    "Settings: flags > KVROUTE_UP_* environment > --config YAML, one name each "
    "(--conversations = KVROUTE_UP_CONVERSATIONS = conversations in YAML).",
    extra=[
        inspect.Parameter(
            "keep_logs",
            inspect.Parameter.KEYWORD_ONLY,
            default=typer.Option(False, help="Keep child process logs (always on failure)."),
            annotation=bool,
        ),
        inspect.Parameter(
            "out",
            inspect.Parameter.KEYWORD_ONLY,
            default=typer.Option(None, help="Also write the full report (per request) as JSON."),
            annotation=Path,
        ),
        inspect.Parameter(
            "keep",
            inspect.Parameter.KEYWORD_ONLY,
            default=typer.Option(
                False,
                help="Keep the last policy's engines and router up (/dashboard) until Ctrl-C.",
            ),
            annotation=bool,
        ),
        config_parameter(),
    ],
)
