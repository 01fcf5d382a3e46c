"""``kvroute up``'s settings, its per-request record, its error and its progress hooks."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from router.decision.policy.cost import POLICIES

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


@dataclass(frozen=True)
class DemoConfig:
    """The deployment and workload. Defaults: ~40 requests, well under a minute on 2 cores.

    Sizes are chosen so the demo means something on the swa-hybrid profile: system prompts
    are longer than the 1024-token window (so the sliding-window group decides the hit, not
    the full-attention one), and an engine's GPU pool holds about a third of all the
    conversations, so a router that spreads every conversation everywhere evicts into the
    CPU tier while one that keeps conversations together does not.
    """

    engines: int = 3
    # "sim": simulated engines (``profile``); "vllm": real vLLM CPU servers (own venv, a
    # tiny random-weight Gemma-3-like model: 5 sliding-window groups + 1 full attention).
    engine: str = "sim"
    profile: str = "swa-hybrid"
    index: str = "memory"  # memory | redis (private redis-server) | redis://...
    policies: tuple[str, ...] = ("cost",)
    conversations: int = 8
    turns: int = 5
    system_prompts: int = 3
    system_tokens: int = 1400  # the byte tokenizer: one char = one token
    user_tokens: int = 160
    max_tokens: int = 24
    think_s: float = 0.05  # pause between a reply and the next turn (wall seconds)
    stagger_s: float = 0.15  # conversation i starts at i * stagger_s
    gpu_blocks: int = 512
    cpu_blocks: int = 1024
    block_size: int | None = None  # None: the profile's (vLLM's choice for the family)
    hash_algo: str = "sha256_cbor"
    time_scale: float = 1.0
    seed: int = 0
    startup_timeout_s: float = 60.0
    request_timeout_s: float = 60.0
    stop_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError("engines must be >= 1")
        if self.conversations < 1 or self.turns < 1 or self.system_prompts < 1:
            raise ValueError("conversations, turns and system_prompts must be >= 1")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be positive")
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown or not self.policies:
            raise ValueError(f"unknown policies {unknown}; expected some of {POLICIES}")
        if self.engine not in ("sim", "vllm"):
            raise ValueError(f"engine must be sim or vllm, got {self.engine!r}")
        if self.profile not in LAYOUTS:
            raise ValueError(f"unknown profile {self.profile!r}; expected one of {list(LAYOUTS)}")
        if not (self.index in ("memory", "redis") or self.index.startswith("redis://")):
            raise ValueError(f"index must be memory, redis or redis://..., got {self.index!r}")

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
