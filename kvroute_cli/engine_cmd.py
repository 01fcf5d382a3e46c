"""``kvroute engine``: a simulated vLLM-like OpenAI server that publishes KV events."""

from __future__ import annotations

import typer

from kvroute_cli.extras import require_extras
from kvroute_cli.options import fields_from


def engine(
    host: str = typer.Option("127.0.0.1", help="Bind address (loopback by default)."),
    port: int = typer.Option(8000),
    model: str = typer.Option("kvroute-sim", help="Served model name."),
    name: str = typer.Option(None, help="How the engine names itself (default host:port)."),
    profile: str = typer.Option(
        "swa-hybrid",
        help="full | swa-hybrid | mamba-hybrid, or a model family: gemma3 | gpt-oss | "
        "qwen3-next | llama",
    ),
    layout: str = typer.Option(
        None, help="KV cache groups in group_idx order, e.g. swa:64*5,full or mamba*3,full."
    ),
    block_size: int = typer.Option(None, help="Block size vLLM uses [profile's default]."),
    sliding_window: int = typer.Option(1024, help="Window of the swa-hybrid profile (tokens)."),
    page_bytes: int = typer.Option(4096, help="Bytes per block per group in the KV tensors."),
    gpu_blocks: int = typer.Option(2048, help="GPU KV blocks (shared by all groups)."),
    cpu_blocks: int = typer.Option(0, help="CPU offload tier size in GPU blocks; 0 = off."),
    blocks_per_chunk: int = typer.Option(1, help="GPU blocks per offloaded chunk (vLLM: 1)."),
    offload_policy: str = typer.Option("lru", help="lru | arc"),
    self_describing_cpu_events: bool = typer.Option(
        False, help="CPU events name every block (vLLM's self_describing_kv_events)."
    ),
    kv_events_config: str = typer.Option(
        None, help="vLLM's --kv-events-config JSON (endpoint, replay_endpoint, topic, ...)."
    ),
    legacy_array_events: bool = typer.Option(False, help="Publish the legacy array form."),
    prefix_caching_hash_algo: str = typer.Option(
        "sha256_cbor", help="sha256 | sha256_cbor | xxhash | xxhash_cbor"
    ),
    seed: str = typer.Option(None, help="NONE_HASH seed (default: vLLM's rule)."),
    tokenizer: str = typer.Option(None, help="Path to a tokenizer.json (default byte-level)."),
    max_model_len: int = typer.Option(
        None, help="Context length [the longest the GPU blocks hold, up to 131072]."
    ),
    max_num_seqs: int = typer.Option(64),
    max_num_batched_tokens: int = typer.Option(4096),
    time_scale: float = typer.Option(1.0, help="Run the timing model X times faster."),
    prefill_tokens_per_s: float = typer.Option(10_000.0),
    data_parallel_rank: int = typer.Option(0),
    data_parallel_size: int = typer.Option(
        1, min=1, help="Ranks behind this server, each with its own cache and event stream."
    ),
    lora_modules: list[str] = typer.Option(
        None, help="LoRA adapters as vLLM's --lora-modules NAME=PATH (no weights); repeatable."
    ),
    log_level: str = typer.Option("info"),
) -> None:
    """Serve /v1/completions, /v1/chat/completions, /tokenize, /metrics over a simulated
    hybrid KV cache, publishing vLLM KV events over ZMQ."""
    require_extras("kvroute engine", "engine")
    from engine_adapter.sim.server import EngineSettings, serve
    from engine_adapter.sim.timing import TimingModel
    from events.config import KVEventsConfig

    try:
        events = KVEventsConfig.from_json(kv_events_config) if kv_events_config else None
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--kv-events-config") from exc
    if layout is not None:
        from engine_adapter.profiles import parse_layout

        try:
            parse_layout(layout, block_size or 16)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--layout") from exc
    loras: dict[str, str] = {}
    for item in lora_modules or []:
        lora, sep, path = item.partition("=")  # not `name`: that is the engine's own
        if not sep or not lora or not path:
            raise typer.BadParameter(
                f"expected NAME=PATH, got {item!r}", param_hint="--lora-modules"
            )
        loras[lora] = path
    if time_scale <= 0 or prefill_tokens_per_s <= 0:
        raise typer.BadParameter("--time-scale and --prefill-tokens-per-s must be positive")
    timing = TimingModel(prefill_s_per_token=1.0 / prefill_tokens_per_s, time_scale=time_scale)
    hash_algo = prefix_caching_hash_algo  # vLLM's flag name; the setting's shorter one
    settings = EngineSettings(
        **fields_from(EngineSettings, locals(), kv_events=events, lora_modules=loras)
    )
    try:
        serve(settings, log_level=log_level)
    except ValueError as exc:  # e.g. max_model_len does not fit the pool (vLLM's check)
        raise typer.BadParameter(str(exc)) from exc
