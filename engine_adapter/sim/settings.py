"""``kvroute engine``'s settings, each default and bound written once.

The command's flags are generated from these fields (``kvroute_cli.options``), vLLM's flag
names where the concept is vLLM's (``--prefix-caching-hash-algo``, ``--kv-events-config``,
``--max-num-seqs``, ``--data-parallel-size``, ``--lora-modules``). Imports no torch, so
``kvroute --help`` stays light.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine_adapter.sim.timing import TimingModel
from events.config import KVEventsConfig

__all__ = ["PROFILE_NAMES", "VLLM_VERSIONS", "EngineSettings", "ProfileName", "VllmVersion"]

ProfileName = Literal[
    "full", "swa-hybrid", "mamba-hybrid", "gemma3", "gpt-oss", "qwen3-next", "llama"
]
PROFILE_NAMES: tuple[str, ...] = get_args(ProfileName)
# The vLLM release whose CPU offload tier the engine follows (docs/vllm-0.32-vs-0.33.md).
VllmVersion = Literal["0.32", "0.33"]
VLLM_VERSIONS: tuple[str, ...] = get_args(VllmVersion)


class EngineSettings(BaseModel):
    """Everything ``kvroute engine`` takes; ``build_engine`` reads nothing else."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    host: str = Field("127.0.0.1", description="Bind address (loopback by default).")
    port: int = Field(8000, ge=0, le=65535, description="Port.")
    model: str = Field("kvroute-sim", description="Served model name.")
    name: str | None = Field(None, description="How the engine names itself (unset: host:port).")
    profile: ProfileName = Field(
        "swa-hybrid", description="A 1:1 hybrid profile or a model family's layout."
    )
    layout: str | None = Field(
        None, description="KV cache groups in group_idx order, e.g. swa:64*5,full or mamba*3,full."
    )
    block_size: int | None = Field(
        None, gt=0, description="Block size vLLM uses (unset: the profile's)."
    )
    sliding_window: int = Field(1024, gt=0, description="Window of the swa-hybrid profile.")
    page_bytes: int = Field(4096, gt=0, description="Bytes per block per group in the KV tensors.")
    gpu_blocks: int = Field(2048, ge=1, description="GPU KV blocks (shared by all groups).")
    cpu_blocks: int = Field(0, ge=0, description="CPU offload tier size in GPU blocks; 0: off.")
    blocks_per_chunk: int = Field(
        1, ge=1, description="GPU blocks per offloaded chunk (vLLM's OffloadingConnector: 1)."
    )
    offload_policy: Literal["lru", "arc"] = Field("lru", description="CPU tier eviction.")
    self_describing_cpu_events: bool = Field(
        False,
        description="CPU events name every block of a full-attention chunk (vLLM's "
        "self_describing_kv_events; off: one placeholder hash per chunk, vLLM's default).",
    )
    vllm_version: VllmVersion = Field(
        "0.33",
        description="vLLM release whose CPU offload tier to follow: 0.33 (what GPU fleets "
        "run) or 0.32 (the CPU build the conformance suite runs); see "
        "docs/vllm-0.32-vs-0.33.md.",
    )
    kv_events: KVEventsConfig | None = Field(
        None,
        description="vLLM's --kv-events-config JSON (endpoint, replay_endpoint, topic, ...).",
        json_schema_extra={"flag": "kv-events-config"},
    )
    legacy_array_events: bool = Field(False, description="Publish the legacy array form.")
    hash_algo: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] = Field(
        "sha256_cbor",
        description="vLLM's prefix caching hash.",
        json_schema_extra={"flag": "prefix-caching-hash-algo"},
    )
    seed: str | None = Field(None, description="NONE_HASH seed (unset: vLLM's rule).")
    tokenizer: str | None = Field(None, description="Path to a tokenizer.json (unset: byte-level).")
    max_model_len: int | None = Field(
        None, gt=0, description="Context length (unset: the longest the GPU blocks hold)."
    )
    max_num_seqs: int = Field(64, ge=1, description="Requests running at once.")
    max_num_batched_tokens: int = Field(4096, ge=1, description="Tokens scheduled per step.")
    time_scale: float = Field(1.0, gt=0, description="Run the timing model X times faster.")
    prefill_tokens_per_s: float = Field(10_000.0, gt=0, description="Prefill throughput.")
    data_parallel_rank: int = Field(0, ge=0, description="The first rank this server runs.")
    data_parallel_size: int = Field(
        1, ge=1, description="Ranks behind this server, each with its own cache and events."
    )
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters as vLLM's --lora-modules NAME=PATH (no weights); repeatable.",
    )

    @property
    def timing(self) -> TimingModel:
        return TimingModel(
            prefill_s_per_token=1.0 / self.prefill_tokens_per_s, time_scale=self.time_scale
        )

    @field_validator("kv_events", mode="before")
    @classmethod
    def _kv_events(cls, v: Any) -> Any:
        return KVEventsConfig.from_json(v) if isinstance(v, str | bytes) else v

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _lora_modules(cls, v: Any) -> Any:
        """vLLM's ``NAME=PATH`` items (a list, as the flag repeats) or a mapping."""
        if not isinstance(v, list | tuple):
            return v
        out: dict[str, str] = {}
        for item in v:
            lora, sep, path = str(item).partition("=")
            if not sep or not lora or not path:
                raise ValueError(f"--lora-modules: expected NAME=PATH, got {item!r}")
            out[lora] = path
        return out

    @model_validator(mode="after")
    def _layout(self) -> EngineSettings:
        if self.layout is not None:
            from engine_adapter.profiles import parse_layout  # torch: only when given

            parse_layout(self.layout, self.block_size or 16)
        return self
