"""Settings shared by live and simulated replays: one engine config, one replay config.

Both modes build their engines from ``EngineConfig`` (live: ``kvroute engine`` flags from
``cli_args``; sim: the same ``KVCacheManager``/``EngineCore`` objects in-process), so "same
profile, same seed, same capacities" holds by construction.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.replay.trace import TRACE_BLOCK_TOKENS
from engine_adapter.sim.timing import TimingModel

__all__ = [
    "OURS_POLICIES",
    "PEERS",
    "EngineConfig",
    "ReplayConfig",
    "checkout_kvroute",
    "parse_router",
]

OURS_POLICIES = ("cost", "prefix_full_only", "round_robin", "least_loaded")
PEERS = ("vllm-router", "sglang-router")


@dataclass(frozen=True)
class EngineConfig:
    """Simulated engine settings. Defaults: an 8B-class engine on one H100 (timing model
    defaults), ~262k tokens of GPU KV cache and ~1M tokens of CPU tier per engine -- a few
    minutes of Mooncake conversation traffic per engine, shorter than most reuse gaps,
    so where a conversation lands decides whether it hits. ``page_bytes`` is tiny on
    purpose: KV contents are not timed (the timing model charges bytes per token), so
    small pages keep memory and copies cheap."""

    profile: str = "swa-hybrid"
    gpu_blocks: int = 16_384
    cpu_blocks: int = 65_536
    blocks_per_chunk: int = 1  # vLLM OffloadingConnector default
    block_size: int | None = None  # None: the profile's (vLLM's choice for that family)
    sliding_window: int = 1024
    page_bytes: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    prefill_tokens_per_s: float = 10_000.0
    max_model_len: int | None = None  # None: what the engine's GPU blocks hold
    hash_algo: str = "sha256_cbor"
    layout: str | None = None  # groups overriding the profile's, e.g. "swa:64*5,full"

    def __post_init__(self) -> None:
        if self.block_size is None:
            from engine_adapter.profiles import get_profile

            object.__setattr__(self, "block_size", get_profile(self.profile).block_size)

    def timing(self, time_scale: float) -> TimingModel:
        return TimingModel(
            prefill_s_per_token=1.0 / self.prefill_tokens_per_s, time_scale=time_scale
        )

    def cli_args(self, time_scale: float) -> list[str]:
        """``kvroute engine`` flags for these settings (ports and events added by caller)."""
        args = {
            "--profile": self.profile,
            "--gpu-blocks": self.gpu_blocks,
            "--cpu-blocks": self.cpu_blocks,
            "--blocks-per-chunk": self.blocks_per_chunk,
            "--block-size": self.block_size,
            "--sliding-window": self.sliding_window,
            "--layout": self.layout,
            "--page-bytes": self.page_bytes,
            "--max-num-seqs": self.max_num_seqs,
            "--max-num-batched-tokens": self.max_num_batched_tokens,
            "--prefill-tokens-per-s": self.prefill_tokens_per_s,
            "--max-model-len": self.max_model_len,
            "--prefix-caching-hash-algo": self.hash_algo,
            "--time-scale": time_scale,
        }
        return [str(x) for kv in args.items() if kv[1] is not None for x in kv]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ReplayConfig:
    """One side-by-side replay. ``time_scale`` divides the trace's arrival gaps and the
    engines' step times alike, so results are in replay-clock seconds at that scale."""

    engines: int = 8
    engine: EngineConfig = field(default_factory=EngineConfig)
    time_scale: float = 1.0
    max_output_tokens: int = 64
    seed: int = 0  # prompt text and policy tie-breaking
    model: str = "kvroute-sim"
    # characters (byte tokens) of text per trace block: 128 for the real-vLLM harness's
    # prompts, which its tiny models' 2,048-token context must hold
    block_chars: int = TRACE_BLOCK_TOKENS
    temperature: float = 0.0

    def max_tokens(self, output_length: int) -> int:
        return max(1, min(output_length, self.max_output_tokens))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["engine"] = self.engine.to_dict()
        return d


def parse_router(spec: str) -> tuple[str, str]:
    """``ours:POLICY`` -> ("ours", POLICY); ``ours:POLICY*N`` -> ("ours", "POLICY*N"): N
    workers on one port (``--workers N``, on a private Redis index); a peer name -> (name,
    its policy); ``model:PEER`` -> ("model", "model:PEER") (``bench.replay.peer_models``).
    ``ours:POLICY@CHECKOUT`` (live runs only) -> ("ours", "POLICY@CHECKOUT"): the router of
    another checkout of kvroute (its own ``CHECKOUT/.venv/bin/kvroute``, from
    ``scripts/setup.sh``), e.g. the commit before a change beside it in one interleaved
    ``kvroute bench overhead`` run."""
    spec = spec.strip()
    if spec.startswith("ours:"):
        policy = spec.split(":", 1)[1]
        body, _, checkout = policy.partition("@")
        if checkout and not checkout_kvroute(checkout).is_file():
            raise ValueError(f"{spec!r}: no {checkout_kvroute(checkout)} (scripts/setup.sh there)")
        base, _, workers = body.partition("*")
        if workers and (not workers.isdigit() or int(workers) < 1):
            raise ValueError(f"workers in {spec!r} must be a positive integer")
        if base not in OURS_POLICIES:
            raise ValueError(f"unknown policy in {spec!r}; expected one of {OURS_POLICIES}")
        return "ours", policy
    if spec.startswith("model:"):  # a peer's in-process model (sim mode only)
        peer = spec.split(":", 1)[1]
        if peer not in PEERS:
            raise ValueError(f"unknown peer model in {spec!r}; expected model:{'|'.join(PEERS)}")
        return "model", spec
    if spec == "vllm-router":
        return spec, "kv_aware"
    if spec == "sglang-router":
        return spec, "cache_aware"
    raise ValueError(f"unknown router {spec!r}: use ours:POLICY, vllm-router or sglang-router")


def checkout_kvroute(checkout: str) -> Path:
    """The ``kvroute`` command of another checkout (``ours:POLICY@CHECKOUT``)."""
    return Path(checkout).expanduser() / ".venv" / "bin" / "kvroute"
