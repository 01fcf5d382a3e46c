"""``kvroute router``: the hybrid prefix-aware OpenAI routing proxy."""

from __future__ import annotations

from pathlib import Path

import typer

from kvroute_cli.options import fields_from


def router(
    host: str = typer.Option(None, help="Bind address [default 127.0.0.1]."),
    port: int = typer.Option(None, help="Port [default 8080]."),
    instance: list[str] = typer.Option(
        None,
        help="URL alone (vLLM 0.32+: endpoints and ranks read from its /kv_event_sources), "
        "URL=[EVENTS_ENDPOINT[,replay=ENDPOINT][,topic=T][,model=NAME][,dp=N]] or "
        "URL=<--kv-events-config JSON>[,model=NAME][,dp=N]; either explicit form may add "
        ",kv_transfer_config=<vLLM's --kv-transfer-config JSON> (its CPU chunk size); "
        "repeatable.",
    ),
    index: str = typer.Option(
        None, help="memory | redis://... | rediss://... | unix://... | redis+cluster://h:p,h:p"
    ),
    policy: str = typer.Option(
        None, help="cost | round_robin | least_loaded | prefix_full_only [default cost]"
    ),
    model: str = typer.Option(None, help="Model name (namespaces the Redis index)."),
    block_size: int = typer.Option(None, help="Engine hash block size [default 16]."),
    hash_algo: str = typer.Option(None, help="Engine --prefix-caching-hash-algo."),
    seed: str = typer.Option(None, help="NONE_HASH seed (the engines' PYTHONHASHSEED)."),
    tokenizer: str = typer.Option(
        None, help="byte | MODEL_DIR (vLLM's ids, in-process) | path/to/tokenizer.json | remote"
    ),
    default_layout: str = typer.Option(None, help="full | swa:WINDOW | mamba (until learned)"),
    temperature: float = typer.Option(None, help="Softmax temperature (0 = argmin)."),
    health_interval: float = typer.Option(None, help="Seconds between health probes."),
    dashboard: bool = typer.Option(
        None, "--dashboard/--no-dashboard", help="Serve GET /dashboard [default on]."
    ),
    admission_max_waiting: int = typer.Option(
        None, min=0, help="Admission: an instance is busy at this many engine-waiting requests."
    ),
    admission_max_kv_usage: float = typer.Option(
        None, min=0.0, max=1.0, help="Admission: busy at this engine KV usage (0-1]."
    ),
    admission_max_inflight: int = typer.Option(
        None, min=1, help="Admission: busy at this many router requests in flight to it."
    ),
    admission_queue_size: int = typer.Option(
        None, help="Admission: requests that may wait when all are busy [1024]."
    ),
    admission_timeout: float = typer.Option(
        None, min=0.0, help="Admission: seconds a request may wait before 429 [30]."
    ),
    session_header: str = typer.Option(
        None, help="Session affinity: the header naming a session, e.g. X-Session-ID."
    ),
    session_user_field: bool = typer.Option(
        None,
        "--session-user-field/--no-session-user-field",
        help="Session affinity: the OpenAI `user` field names a session [off].",
    ),
    session_max_extra_ttft: float = typer.Option(
        None, help="Session affinity: extra predicted TTFT (s) a session may cost [0.05]."
    ),
    config: Path = typer.Option(None, help="YAML file with the same settings.", exists=True),
    log_level: str = typer.Option(None, help="uvicorn log level."),
) -> None:
    """Route OpenAI requests to the instance with the best hybrid prefix hit and the lowest
    predicted time to first token. Settings: flags > KVROUTE_* env > --config YAML."""
    from pydantic import ValidationError

    from router.config import RouterSettings, load_settings
    from router.http.server import serve

    flags = fields_from(
        RouterSettings, locals(), instances=instance or None, health_interval_s=health_interval,
        admission_timeout_s=admission_timeout, session_max_extra_ttft_s=session_max_extra_ttft,
    )  # fmt: skip
    try:
        settings = load_settings(flags, config)
        from router.decision.layout import default_layout

        default_layout(settings.default_layout, settings.block_size)
    except (ValidationError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    serve(settings)
