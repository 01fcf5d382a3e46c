"""``kvroute up``'s settings, its per-request record, its error and its progress hooks."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine_adapter.sim.settings import ProfileName
from router.config import POLICIES, PolicyName

logger = logging.getLogger("stack.demo")


MODEL = "kvroute-sim"
# The layout the router assumes for an instance until its events teach it the real one.
LAYOUTS = {
    "full": "full",
    "swa-hybrid": "swa:1024",
    "mamba-hybrid": "mamba",
    "llama": "full",
    "gemma3": "swa:1024",
    "gpt-oss": "swa:128",
    "qwen3-next": "mamba",
}


class DemoError(RuntimeError):
    """The deployment could not start or the workload failed; ``log_dir`` has the logs."""

    def __init__(self, message: str, log_dir: Path | None = None) -> None:
        super().__init__(f"{message} (logs: {log_dir})" if log_dir else message)
        self.log_dir = log_dir


class DemoConfig(BaseModel):
    """The deployment and workload; ``kvroute up``'s flags are generated from these fields.
    Defaults: ~40 requests, well under a minute on 2 cores.

    Sizes are chosen so the demo means something on the swa-hybrid profile: system prompts
    are longer than the 1024-token window (so the sliding-window group decides the hit, not
    the full-attention one), and an engine's GPU pool holds about a third of all the
    conversations, so a router that spreads every conversation everywhere evicts into the
    CPU tier while one that keeps conversations together does not.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    engines: int = Field(3, ge=1, le=16, description="Engines to start.")
    engine: Literal["sim", "vllm"] = Field(
        "sim",
        description="sim: simulated engines (--profile); vllm: real vLLM CPU servers with a "
        "tiny Gemma-3-like model (own venv, installed on first use; minutes to start).",
    )
    cpu_offload: bool = Field(
        False,
        description="--engine vllm: run vLLM's OffloadingConnector with a CPU tier of "
        "--cpu-blocks blocks (our host-memory spec on the CPU build), one block per chunk, "
        "LRU (vLLM's defaults); GPU/CPU reuse from vLLM's metrics.",
    )
    profile: ProfileName = Field("swa-hybrid", description="The simulated engines' profile.")
    index: str = Field(
        "memory", description="memory | redis (a private redis-server) | redis://host:port/db"
    )
    policies: tuple[PolicyName, ...] = Field(
        ("cost",),
        min_length=1,
        description="Comma list of routing policies, or all; one round each.",
    )
    conversations: int = Field(8, ge=1, description="Concurrent conversations.")
    turns: int = Field(5, ge=1, description="Turns per conversation.")
    system_prompts: int = Field(3, ge=1, description="Distinct system prompts.")
    system_tokens: int = Field(
        1400, ge=1, description="System prompt length (the byte tokenizer: a char a token)."
    )
    user_tokens: int = Field(160, ge=1, description="Tokens a user adds per turn.")
    max_tokens: int = Field(24, ge=1, description="Tokens generated per turn.")
    think_s: float = Field(
        0.05, ge=0, description="Wall seconds between a reply and the next turn."
    )
    stagger_s: float = Field(0.15, ge=0, description="Conversation i starts at i * this.")
    gpu_blocks: int = Field(512, ge=1, description="GPU KV blocks per engine (small: evicts).")
    cpu_blocks: int = Field(1024, ge=0, description="CPU offload blocks per engine; 0: off.")
    block_size: int | None = Field(
        None, gt=0, description="Block size (unset: the profile's, vLLM's choice for it)."
    )
    hash_algo: str = Field("sha256_cbor", description="The engines' prefix caching hash.")
    time_scale: float = Field(1.0, ge=0.01, description="Engines run X times real time.")
    seed: int = Field(0, description="Workload seed (same seed, same prompts).")
    startup_timeout_s: float = Field(60.0, gt=0, description="Seconds the stack may take to start.")
    request_timeout_s: float = Field(60.0, gt=0, description="Seconds a request may take.")
    stop_timeout_s: float = Field(10.0, gt=0, description="Seconds a process may take to stop.")

    @field_validator("policies", mode="before")
    @classmethod
    def _policies(cls, v: Any) -> Any:
        """A comma list (or several), ``all`` for every policy; repeats dropped."""
        if isinstance(v, str):
            v = [v]
        names: list[str] = []
        for item in v:
            for name in str(item).split(","):
                name = name.strip()
                names.extend(POLICIES if name == "all" else [name] if name else [])
        return tuple(dict.fromkeys(names))

    @field_validator("index")
    @classmethod
    def _index(cls, v: str) -> str:
        if not (v in ("memory", "redis") or v.startswith("redis://")):
            raise ValueError(f"index must be memory, redis or redis://..., got {v!r}")
        return v

    @model_validator(mode="after")
    def _cpu_offload(self) -> DemoConfig:
        if self.cpu_offload and (self.engine != "vllm" or self.cpu_blocks <= 0):
            raise ValueError("cpu_offload needs engine vllm and cpu_blocks > 0")
        return self

    @property
    def total_requests(self) -> int:
        return self.conversations * self.turns


@dataclass
class RequestRecord:
    """One chat request as the client saw it."""

    conversation: int
    turn: int
    instance: str | None = None
    status: int = 0
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    predicted_hit_tokens: int | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


class Observer:
    """Progress hooks (the CLI draws a Rich bar from them); the default only logs."""

    def round_started(self, policy: str, total_requests: int) -> None:
        logger.info("[%s] %d requests against fresh engines", policy, total_requests)

    def phase(self, policy: str, text: str) -> None:
        logger.info("[%s] %s", policy, text)

    def stack_up(self, policy: str, router_url: str, engines: list[str]) -> None:
        """The round's engines and router are healthy: its live view is at ``/dashboard``."""
        logger.info("[%s] dashboard: %s/dashboard", policy, router_url)

    def request_done(self, policy: str, record: RequestRecord) -> None:
        logger.debug("[%s] conversation %d turn %d done", policy, record.conversation, record.turn)
