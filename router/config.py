"""Router settings: flags > environment (``KVROUTE_*``) > YAML file > defaults.

Names follow vLLM where the concept is vLLM's (``block_size``, ``hash_algo`` =
``--prefix-caching-hash-algo``, ``seed`` = the NONE_HASH seed / PYTHONHASHSEED).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from router.decision.policy import POLICIES
from router.fleet.specs import parse_instance

__all__ = ["RouterSettings", "load_settings"]


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
    # Served models (/v1/models) are re-read when an instance comes up and this often.
    health_models_interval_s: float = Field(10.0, ge=0)
    engine_metrics: bool = True  # poll instances' /metrics for their waiting queue
    request_timeout_s: float = Field(600.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    max_retries: int = Field(2, ge=0)
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0)
    admin_token: str | None = None  # KVROUTE_ADMIN_TOKEN; unset disables the admin API
    dashboard: bool = True  # GET /dashboard (read-only live view); KVROUTE_DASHBOARD=false: 404
    redis_block_ttl_s: int | None = None
    # Replicas on one Redis index share predict-on-route records and in-flight load
    # (router.prediction.shared); off: each replica sees only its own.
    share_replicas: bool = True
    # Ingest the instances' events (off: a replica that reads the shared index only, as
    # the workers after the first of ``--workers N`` do).
    ingest: bool = True
    # Router processes on one port (SO_REUSEPORT); more than one needs a Redis index.
    workers: int = Field(1, ge=1)
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
