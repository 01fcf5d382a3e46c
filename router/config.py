"""Router settings, each default and bound written once: flags > environment > YAML > defaults
(the layers: ``kvroute_cli.options.load_layered``).

``RouterSettings`` holds the router process's own settings at the top level and one
section per component (``cost``, ``health``, ``admission``, ``session``, ``upstream``,
``speculative``, ``eviction``, ``redis``). A setting has one name everywhere:
``<section>_<field>`` flat (YAML ``admission_max_waiting: 8``, environment
``KVROUTE_ADMISSION_MAX_WAITING=8``, flag ``--admission-max-waiting 8``) or nested in YAML
(``admission: {max_waiting: 8}``). ``kvroute router``'s flags are generated from these
fields (``kvroute_cli.options``), so their help shows the defaults and bounds written here.

Names follow vLLM where the concept is vLLM's (``block_size``, ``hash_algo`` =
``--prefix-caching-hash-algo``, ``seed`` = the NONE_HASH seed / PYTHONHASHSEED).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

__all__ = [
    "POLICIES",
    "AdmissionSettings",
    "CostSettings",
    "EvictionSettings",
    "HealthSettings",
    "PolicyName",
    "RedisSettings",
    "RouterSettings",
    "SessionSettings",
    "SpeculativeSettings",
    "UpstreamSettings",
    "nest",
]


PolicyName = Literal["cost", "round_robin", "least_loaded", "prefix_full_only"]
POLICIES: tuple[str, ...] = get_args(PolicyName)


class Section(BaseModel):
    """One component's settings: immutable, unknown names refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class CostSettings(Section):
    """The cost policy (``router.policy.CostPolicy``): raw rates before the per-instance
    fit scales them (an 8B-class model on one H100, the simulated engine's timing model),
    and the ranking's knobs (the policy's docstring says what each one bends)."""

    prefill_s_per_token: float = Field(1e-4, gt=0, description="Prefill seconds per token.")
    load_s_per_token: float = Field(
        7e-6, ge=0, description="Seconds per token loaded from the CPU tier."
    )
    request_overhead_s: float = Field(0.005, ge=0, description="Fixed seconds per request.")
    step_s: float = Field(0.004, ge=0, description="Seconds per engine step.")
    decode_step_s: float = Field(
        0.012, ge=0, description="Seconds per step while decode streams run."
    )
    decode_s_per_seq: float = Field(
        2.5e-4, ge=0, description="Seconds per running stream per step."
    )
    step_tokens: int = Field(
        4096, gt=0, description="Prefill tokens per step (the engines' max_num_batched_tokens)."
    )
    load_exponent: float = Field(
        1.5, ge=0, description="Load stretch exponent for a request mostly new to the fleet."
    )
    continuation_fraction: float = Field(
        0.9, ge=0, le=1, description="Share of a prompt some instance holds: a continuation."
    )
    continuation_exponent: float = Field(
        1.0, ge=0, description="Load stretch exponent for a continuation."
    )
    roomy_continuation_fraction: float = Field(
        0.7, ge=0, le=1, description="Continuation share on a holder with KV room."
    )
    roomy_continuation_exponent: float = Field(
        0.5, ge=0, description="Load stretch exponent for a continuation on a roomy holder."
    )
    junction_credit: float = Field(
        1.0, ge=0, le=1, description="Credit for the full-attention-only prefix beyond any hit."
    )
    stick_margin: float = Field(
        0.25, ge=0, description="The holder keeps a request within 1 + this of the best cost."
    )
    min_sticky_fraction: float = Field(
        0.1, ge=0, le=1, description="Share of the prompt a holder must hold to stick."
    )
    fit_decay: float = Field(
        0.95, gt=0, le=1, description="Per-observation decay of the TTFT fits."
    )
    recent_half_life_s: float = Field(
        30.0, gt=0, description="Half-life of the uncached tokens routed lately (tie-break)."
    )


class HealthSettings(Section):
    """Health probes (``router.instances.HealthChecker``)."""

    interval_s: float = Field(2.0, gt=0, description="Seconds between health probes.")
    timeout_s: float = Field(2.0, gt=0, description="Seconds a probe may take.")
    failures: int = Field(2, ge=1, description="Failed probes in a row that mark it down.")
    successes: int = Field(1, ge=1, description="Good probes in a row that mark it up.")
    models_interval_s: float = Field(
        10.0, ge=0, description="Served models (/v1/models) re-read on coming up and this often."
    )


class AdmissionSettings(Section):
    """Admission control (``router.admission``): no threshold set, off."""

    max_waiting: int | None = Field(
        None, ge=0, description="An instance is busy at this many engine-waiting requests."
    )
    max_kv_usage: float | None = Field(
        None, gt=0, le=1, description="An instance is busy at this engine KV usage."
    )
    max_inflight: int | None = Field(
        None, ge=1, description="An instance is busy at this many router requests in flight."
    )
    queue_size: int = Field(1024, ge=0, description="Requests that may wait when all are busy.")
    timeout_s: float = Field(30.0, ge=0, description="Seconds a request may wait before 429.")
    retry_after_s: float | None = Field(
        None, ge=0, description="Retry-After of a 429 (unset: the queue timeout)."
    )

    @property
    def enabled(self) -> bool:
        return (self.max_waiting, self.max_kv_usage, self.max_inflight) != (None, None, None)


class SessionSettings(Section):
    """Session affinity (``router.affinity``): no header and no user field, off."""

    header: str | None = Field(None, description="The header naming a session (X-Session-ID).")
    user_field: bool = Field(False, description="The OpenAI `user` field names a session.")
    max_extra_ttft_s: float = Field(
        0.05, ge=0, description="Extra predicted TTFT (s) keeping a session may cost."
    )
    ttl_s: float = Field(3600.0, gt=0, description="Seconds a session is remembered.")
    max_sessions: int = Field(100_000, ge=1, description="Sessions remembered at most.")

    @property
    def enabled(self) -> bool:
        return bool(self.header) or self.user_field


class UpstreamSettings(Section):
    """The HTTP client towards the engines (``router.upstream``, ``router.proxy``)."""

    request_timeout_s: float = Field(600.0, gt=0, description="Seconds a request may take.")
    connect_timeout_s: float = Field(2.0, gt=0, description="Seconds to connect to an engine.")
    max_retries: int = Field(
        2, ge=0, description="Other instances tried when one fails before its first byte."
    )


class SpeculativeSettings(Section):
    """Predict-on-route (``router.speculative``)."""

    ttl_s: float = Field(
        2.0, ge=0, description="Seconds a routed prompt counts as cached before its events."
    )


class EvictionSettings(Section):
    """KV pressure (``router.pressure.EvictionTracker``)."""

    window_s: float = Field(
        10.0,
        ge=0,
        description="An instance that evicted GPU blocks this recently is short of KV memory "
        "(the cost policy keeps continuations stickier on the others); 0: off.",
    )


class RedisSettings(Section):
    """The Redis index (``router.index.redis``)."""

    block_ttl_s: int | None = Field(
        None, gt=0, description="Expiry of block entries (unset: none)."
    )


# Names a setting had before it moved into its component's section.
_MOVED = {
    "prefill_s_per_token": ("cost", "prefill_s_per_token"),
    "load_s_per_token": ("cost", "load_s_per_token"),
    "request_overhead_s": ("cost", "request_overhead_s"),
    "request_timeout_s": ("upstream", "request_timeout_s"),
    "connect_timeout_s": ("upstream", "connect_timeout_s"),
    "max_retries": ("upstream", "max_retries"),
}


class RouterSettings(BaseSettings):
    """``kvroute router``: the process's settings, then one section per component."""

    model_config = SettingsConfigDict(
        env_prefix="KVROUTE_",
        env_nested_delimiter="_",
        env_nested_max_split=1,  # KVROUTE_ADMISSION_MAX_WAITING -> admission.max_waiting
        extra="forbid",
    )

    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(8080, ge=0, le=65535, description="Port.")
    instances: list[str] = Field(
        default_factory=list,
        description="URL alone (vLLM 0.32+: endpoints and ranks read from its "
        "/kv_event_sources), "
        "URL=[EVENTS_ENDPOINT[,replay=ENDPOINT][,topic=T][,model=NAME][,dp=N]] or "
        "URL=<--kv-events-config JSON>[,model=NAME][,dp=N]; either explicit form may add "
        ",kv_transfer_config=<vLLM's --kv-transfer-config JSON> (its CPU chunk size); "
        "repeatable.",
        json_schema_extra={"flag": "instance"},
    )
    index: str = Field(
        "memory",
        description="memory | redis://... | rediss://... | unix://... | redis+cluster://h:p,h:p",
    )
    policy: PolicyName = Field("cost", description="The routing policy.")
    model: str = Field("kvroute-sim", description="Model name (namespaces the Redis index).")
    block_size: int = Field(16, gt=0, description="The engines' hash block size.")
    hash_algo: str = Field("sha256_cbor", description="The engines' --prefix-caching-hash-algo.")
    seed: str | None = Field(None, description="NONE_HASH seed (the engines' PYTHONHASHSEED).")
    tokenizer: str = Field(
        "byte",
        description="byte | MODEL_DIR (vLLM's ids in-process: tokenizer.json, BOS rules, chat "
        "template) | path/to/tokenizer.json | remote (the instances' /tokenize).",
    )
    temperature: float = Field(0.0, ge=0.0, description="Softmax temperature (0: argmin).")
    default_layout: str = Field(
        "full",
        description="Layout until an instance's events teach it: full | swa:WINDOW | mamba.",
    )
    engine_metrics: bool = Field(True, description="Poll the instances' /metrics queues.")
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0, description="Largest request body.")
    admin_token: str | None = Field(
        None, description="Bearer token of the admin API (unset: the admin API is off)."
    )
    dashboard: bool = Field(True, description="Serve GET /dashboard, a read-only live view.")
    log_level: str = Field("info", description="uvicorn log level.")
    share_replicas: bool = Field(
        True,
        description="On a Redis index: share predict-on-route records and in-flight load with "
        "the other replicas (router.prediction.shared).",
    )
    ingest: bool = Field(
        True,
        description="Ingest the instances' events (off: a replica that reads the shared index "
        "only, as the workers after the first of --workers N do).",
    )
    workers: int = Field(
        1, ge=1, description="Router processes on one port (SO_REUSEPORT); >1 needs a Redis index."
    )
    cost: CostSettings = CostSettings()
    health: HealthSettings = HealthSettings()
    admission: AdmissionSettings = AdmissionSettings()
    session: SessionSettings = SessionSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    speculative: SpeculativeSettings = SpeculativeSettings()
    eviction: EvictionSettings = EvictionSettings()
    redis: RedisSettings = RedisSettings()

    @model_validator(mode="before")
    @classmethod
    def _flat_names(cls, data: Any) -> Any:
        """``admission_max_waiting`` is ``admission.max_waiting`` (see the module docstring)."""
        return nest(cls, data) if isinstance(data, Mapping) else data

    @field_validator("instances")
    @classmethod
    def _instances(cls, v: list[str]) -> list[str]:
        from router.fleet.specs import parse_instance  # the grammar; loads events.publisher

        for text in v:
            parse_instance(text)
        return v

    @field_validator("index")
    @classmethod
    def _index(cls, v: str) -> str:
        if v not in ("memory", "memory://") and not v.startswith(
            ("redis://", "rediss://", "unix://", "redis+cluster://")
        ):
            raise ValueError(
                "index must be memory, redis://, rediss://, unix:// or redis+cluster://"
            )
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
        # init kwargs carry the flags and the YAML underneath them
        # (kvroute_cli.options.load_layered).
        return (init_settings, env_settings)


def sections(model: type[BaseModel]) -> dict[str, type[Section]]:
    """``model``'s section fields: name -> section type."""
    out = {}
    for name, info in model.model_fields.items():
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, Section):
            out[name] = kind
    return out


def nest(model: type[BaseModel], data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with flat ``<section>_<name>`` keys (and dashes for underscores) moved into
    their sections; a section given as a model or a mapping is merged with them."""
    parts = sections(model)
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        section, _, name = key.partition("_")
        if key in _MOVED and model is RouterSettings:
            section, name = _MOVED[key]
        elif key in model.model_fields or section not in parts:
            if key in parts and key in out:
                value = {**_as_dict(value), **out[key]}
            out[key] = value
            continue
        into = out.get(section, {})
        out[section] = {**_as_dict(into), name: value}
    return out


def _as_dict(value: Any) -> Any:
    return value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value
