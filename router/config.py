"""Router settings: flags > environment (``KVROUTE_*``) > YAML file > defaults.

Names follow vLLM where the concept is vLLM's (``block_size``, ``hash_algo`` =
``--prefix-caching-hash-algo``, ``seed`` = the NONE_HASH seed / PYTHONHASHSEED).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from router.policy import POLICIES

__all__ = [
    "CpuChunk",
    "InstanceSpec",
    "RouterSettings",
    "from_kv_events_config",
    "from_kv_transfer_config",
    "load_settings",
    "parse_instance",
    "rank_specs",
]


@dataclass(frozen=True, slots=True)
class CpuChunk:
    """An instance's CPU offload chunk as its ``--kv-transfer-config`` sets it: vLLM's
    ``kv_connector_extra_config`` takes ``blocks_per_chunk`` (GPU blocks per chunk) or
    ``block_size`` (tokens per chunk), one of them; neither means one block per chunk
    (``offloading/config.py``). Exactly one field is set."""

    blocks: int | None = None
    tokens: int | None = None


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """``URL[=EVENTS_ENDPOINT[,replay=ENDPOINT][,topic=T][,model=NAME]...[,dp=N]]`` or ``URL=<vLLM's
    --kv-events-config JSON>``, as the router's subscriber sees it.

    ``bind``: whether the router's SUB socket binds ``events`` (the engine connects to
    it) or connects; None keeps the subscriber's rule (bind a wildcard endpoint).
    """

    url: str
    events: str | None = None
    replay: str | None = None
    topic: str = ""
    bind: bool | None = None
    models: tuple[str, ...] = ()  # declared served models: override its /v1/models
    # ``dp=N``: the engine runs N data-parallel ranks; each becomes its own target
    # (``rank_specs``), named ``URL#dpR`` and reached with vLLM's X-data-parallel-rank.
    dp_size: int = 1
    dp_rank: int | None = None
    # ``kv_transfer_config=<JSON>``: the CPU chunk of the instance's OffloadingConnector
    # (None: not given, the router learns it from the events).
    cpu_chunk: CpuChunk | None = None

    @property
    def http_url(self) -> str:
        """Where the engine answers HTTP (a rank target's name without ``#dpR``)."""
        return self.url.partition("#")[0]


def rank_specs(spec: InstanceSpec) -> list[InstanceSpec]:
    """One target per data-parallel rank: vLLM's rank r publishes on the endpoint and
    replay endpoint offset by r (``offset_endpoint_port``: tcp port + r, inproc ``_dpR``).
    Without events the ranks cannot be told apart: the instance stays one target and
    vLLM balances its own ranks."""
    if spec.dp_size <= 1 or spec.events is None:
        return [spec]
    from events.publisher import offset_endpoint_port

    return [
        InstanceSpec(
            f"{spec.url}#dp{r}",
            offset_endpoint_port(spec.events, r),
            offset_endpoint_port(spec.replay, r),
            spec.topic,
            spec.bind,
            spec.models,
            dp_rank=r,
            cpu_chunk=spec.cpu_chunk,
        )
        for r in range(spec.dp_size)
    ]


def _check_endpoint(ep: str | None) -> None:
    if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"ZMQ endpoint must be tcp://, ipc:// or inproc://, got {ep!r}")


def _engine_binds(endpoint: str) -> bool:
    """vLLM's rule (``ZmqEventPublisher``): bind a wildcard, ipc or inproc endpoint,
    connect to anything else."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _towards(endpoint: str, host: str) -> str:
    """Where to reach an endpoint the engine binds: its wildcard host becomes ``host``."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    _, _, port = endpoint.rpartition(":")
    bound = endpoint[len("tcp://") : -len(port) - 1]
    if bound in ("*", "[::]", "::", "0.0.0.0"):
        bound = f"[{host}]" if ":" in host else host
    return f"tcp://{bound}:{port}"


def from_kv_events_config(url: str, text: str) -> InstanceSpec:
    """An instance from the exact ``--kv-events-config`` JSON its vLLM was started with.

    The engine binds ``tcp://*:P`` (or ipc): the router connects to the instance's host;
    an engine given a concrete address connects to it, so the router binds there. The
    replay endpoint is always bound by the engine. Data-parallel ranks other than 0 are
    not followed here.
    """
    from events.config import KVEventsConfig

    cfg = KVEventsConfig.from_json(text)
    if not cfg.enable_kv_cache_events or cfg.publisher == "null":
        return InstanceSpec(url)
    host = urlparse(url).hostname or "127.0.0.1"
    binds = _engine_binds(cfg.endpoint)
    events = _towards(cfg.endpoint, host) if binds else cfg.endpoint
    replay = _towards(cfg.replay_endpoint, host) if cfg.replay_endpoint else None
    for ep in (events, replay):
        _check_endpoint(ep)
    return InstanceSpec(url, events, replay, cfg.topic, bind=not binds)


def from_kv_transfer_config(text: str) -> CpuChunk | None:
    """The CPU chunk set by the exact ``--kv-transfer-config`` JSON an instance's vLLM was
    started with; None when it runs no ``OffloadingConnector`` (no CPU tier to read).
    Raises ValueError as vLLM would refuse the same settings."""
    try:
        cfg = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"bad --kv-transfer-config JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    if cfg.get("kv_connector") != "OffloadingConnector":
        return None
    extra = cfg.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("kv_connector_extra_config must be a JSON object")
    blocks, tokens = extra.get("blocks_per_chunk"), extra.get("block_size")
    if blocks is not None and tokens is not None:
        raise ValueError("specify only one of 'block_size' or 'blocks_per_chunk'")
    for key, value in (("blocks_per_chunk", blocks), ("block_size", tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        if value is not None and value <= 0:
            raise ValueError(f"{key} must be greater than 0, got {value}")
    if tokens is not None:
        return CpuChunk(tokens=tokens)
    return CpuChunk(blocks=blocks if blocks is not None else 1)


def _split_options(text: str, whole: str) -> list[str]:
    """``,key=value`` options after an instance's events part; a value that starts with
    ``{`` is a JSON object and may hold commas. Returns ``["", "key=value", ...]``."""
    parts = [""]
    i = 0
    while i < len(text):
        if text[i] != ",":
            raise ValueError(f"expected ',option=value' in {whole!r}")
        key, eq, _ = text[i + 1 :].partition("=")
        start = i + 1 + len(key) + len(eq)
        if eq and start < len(text) and text[start] == "{" and "," not in key:
            try:
                _, end = json.JSONDecoder().raw_decode(text, start)
            except ValueError as exc:
                raise ValueError(f"bad JSON for {key!r} in {whole!r}: {exc}") from None
        else:
            end = text.find(",", i + 1)
            end = len(text) if end < 0 else end
        parts.append(text[i + 1 : end])
        i = end
    return parts


def parse_instance(text: str) -> InstanceSpec:
    """Parse one ``--instance`` value; raises ValueError with the reason.

    ``URL=EVENTS[,replay=EP][,topic=T][,model=NAME]...[,dp=N]``, or ``URL=<vLLM's
    --kv-events-config JSON>`` optionally followed by ``,model=NAME`` / ``,dp=N``; either
    form may add ``,kv_transfer_config=<vLLM's --kv-transfer-config JSON>`` (the CPU
    offload chunk size, which placeholder CPU events do not carry).
    """
    url, _, rest = text.strip().partition("=")
    url = url.rstrip("/")
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"instance URL must be http(s)://host:port, got {url!r}")
    rest = rest.strip()
    if rest.startswith("{"):
        try:
            _, end = json.JSONDecoder().raw_decode(rest)
        except ValueError as exc:
            raise ValueError(f"bad --kv-events-config JSON in {text!r}: {exc}") from None
        base = from_kv_events_config(url, rest[:end])
        parts = _split_options(rest[end:], text)
        return _with_options(base, parts, text, allowed=("model", "dp", "kv_transfer_config"))
    events, _, options = rest.partition(",")
    parts = _split_options("," + options, text) if options else []
    _check_endpoint(events or None)
    return _with_options(InstanceSpec(url, events or None), parts or [events], text)


def _with_options(
    spec: InstanceSpec,
    parts: list[str],
    text: str,
    allowed: tuple[str, ...] = ("replay", "topic", "model", "dp", "kv_transfer_config"),
) -> InstanceSpec:
    """``spec`` with the ``key=value`` options of ``parts[1:]``."""
    replay, topic, models, dp = spec.replay, spec.topic, list(spec.models), spec.dp_size
    chunk = spec.cpu_chunk
    for part in parts[1:]:
        key, _, value = part.partition("=")
        if key not in allowed:
            raise ValueError(f"unknown instance option {key!r} in {text!r}")
        if key == "replay":
            replay = value or None
            _check_endpoint(replay)
        elif key == "topic":
            topic = value
        elif key == "model" and value:
            models.append(value)
        elif key == "dp":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"dp must be a positive rank count, got {value!r} in {text!r}")
            dp = int(value)
        elif key == "kv_transfer_config":
            try:
                chunk = from_kv_transfer_config(value)
            except ValueError as exc:
                raise ValueError(f"{exc} in {text!r}") from None
    spec = replace(
        spec, replay=replay, topic=topic, models=tuple(models), dp_size=dp, cpu_chunk=chunk
    )
    if dp > 1:
        rank_specs(spec)  # an endpoint that cannot be offset per rank fails here
    return spec


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVROUTE_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    instances: list[str] = Field(default_factory=list)
    index: str = "memory"
    policy: str = "cost"
    model: str = "kvroute-sim"
    block_size: int = Field(16, gt=0)
    hash_algo: str = "sha256_cbor"
    seed: str | None = None
    # "byte", a model dir (vLLM's ids in-process: tokenizer.json, BOS rules, chat template),
    # a tokenizer.json path, or "remote" (instances' /tokenize: one round trip per request)
    tokenizer: str = "byte"
    temperature: float = Field(0.0, ge=0.0)
    # Layout used until an instance's events teach it (e.g. engines that omit spec kinds):
    # "full", "swa:WINDOW" or "mamba" beside full attention.
    default_layout: str = "full"
    prefill_s_per_token: float = Field(1e-4, gt=0)
    load_s_per_token: float = Field(7e-6, ge=0)
    request_overhead_s: float = Field(0.005, ge=0)
    speculative_ttl_s: float = Field(2.0, ge=0)
    # An instance that evicted GPU blocks within this many seconds is short of KV memory;
    # the others have room, where the cost policy keeps continuations stickier. 0: off.
    eviction_window_s: float = Field(10.0, ge=0)
    health_interval_s: float = Field(2.0, gt=0)
    health_timeout_s: float = Field(2.0, gt=0)
    health_failures: int = Field(2, ge=1)
    health_successes: int = Field(1, ge=1)
    engine_metrics: bool = True  # poll instances' /metrics for their waiting queue
    request_timeout_s: float = Field(600.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    max_retries: int = Field(2, ge=0)
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0)
    admin_token: str | None = None  # KVROUTE_ADMIN_TOKEN; unset disables the admin API
    dashboard: bool = True  # GET /dashboard (read-only live view); KVROUTE_DASHBOARD=false: 404
    redis_block_ttl_s: int | None = None
    # Admission control (router.admission); no threshold set: off.
    admission_max_waiting: int | None = Field(None, ge=0)
    admission_max_kv_usage: float | None = Field(None, gt=0, le=1)
    admission_max_inflight: int | None = Field(None, ge=1)
    admission_queue_size: int = Field(1024, ge=0)
    admission_timeout_s: float = Field(30.0, ge=0)
    admission_retry_after_s: float | None = Field(None, ge=0)
    # Session affinity (router.affinity); no header and no user field: off.
    session_header: str | None = None  # e.g. "X-Session-ID"
    session_user_field: bool = False  # the OpenAI ``user`` field names the session
    session_max_extra_ttft_s: float = Field(0.05, ge=0)
    session_ttl_s: float = Field(3600.0, gt=0)
    session_max_sessions: int = Field(100_000, ge=1)
    log_level: str = "info"

    def section(self, prefix: str) -> dict[str, Any]:
        """The settings named ``<prefix>_<name>`` as ``{name: value}``: the config of one
        component (``health``, ``admission``, ``session``), whose fields bear those names."""
        cut = len(prefix) + 1
        return {k[cut:]: v for k, v in self if k.startswith(f"{prefix}_")}

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"unknown policy {v!r}; expected one of {POLICIES}")
        return v

    @field_validator("instances")
    @classmethod
    def _instances(cls, v: list[str]) -> list[str]:
        for text in v:
            parse_instance(text)
        return v

    @field_validator("index")
    @classmethod
    def _index(cls, v: str) -> str:
        if v not in ("memory", "memory://") and not v.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError("index must be memory, redis://, rediss:// or unix://")
        return v

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # init kwargs carry the flags (and the YAML underneath them, see load_settings).
        return (init_settings, env_settings)


def load_settings(flags: dict[str, Any], config: Path | None = None) -> RouterSettings:
    """Merge YAML (lowest) < env (KVROUTE_*) < flags (highest, only those given)."""
    from_file: dict[str, Any] = {}
    if config is not None:
        raw = yaml.safe_load(Path(config).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{config}: expected a mapping of settings")
        from_file = {k.replace("-", "_"): v for k, v in raw.items()}
    env = RouterSettings().model_dump(exclude_unset=True)  # what the environment set
    merged = {**from_file, **env, **{k: v for k, v in flags.items() if v is not None}}
    return RouterSettings(**merged)
