"""Our simulated engine as the differential suites run it beside real vLLM: built with
vLLM's limits, its events captured batch by batch and tallied for comparison.

A plain module on the test path beside ``harness`` (which drives real vLLM); the suites
import both.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from engine_adapter.kv_cache_manager import KVCacheManager
from engine_adapter.offload import OffloadConfig
from engine_adapter.profiles import ModelProfile
from engine_adapter.sim.core import EngineCore, SchedulerConfig
from engine_adapter.sim.timing import TimingModel
from events.publisher import NullEventPublisher
from events.structs import BlockRemoved, BlockStored, KVEventBatch

__all__ = [
    "CPU_DEFAULT_BUDGET",
    "CapturePublisher",
    "DiffCell",
    "OffloadCell",
    "offload_config",
    "run_stream",
    "serve_cell",
    "sim_engine",
    "tally",
]


CPU_DEFAULT_BUDGET = 2048  # vLLM's CPU build: --max-num-batched-tokens for the API server


class CapturePublisher(NullEventPublisher):
    """Keeps what the simulated engine publishes, batch by batch, for the differential
    suites to compare with what vLLM really sent."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)


class DiffCell(Protocol):
    """What a differential cell says about the real vLLM it runs against."""

    model: str
    vllm_block_size: int | None  # --block-size (None: vLLM picks)
    num_gpu_blocks: int
    chunk_budget: int | None  # --max-num-batched-tokens (None: vLLM's CPU default)


class OffloadCell(Protocol):
    """What a CPU-tier cell says about the tier (both engines get the same)."""

    blocks_per_chunk: int
    policy: str  # lru | arc
    self_describing: bool


def offload_config(cell: OffloadCell, num_chunks: int, **more: Any) -> OffloadConfig:
    """Our CPU tier as ``cell`` configures vLLM's, on vLLM's own ``num_chunks``; ``more``:
    other ``OffloadConfig`` fields (``vllm_version``, ``copy_delay_steps``)."""
    return OffloadConfig(
        num_chunks,
        blocks_per_chunk=cell.blocks_per_chunk,
        policy=cell.policy,
        self_describing=cell.self_describing,
        **more,
    )


def serve_cell(
    vllm_server: Callable[..., Any], cell: DiffCell, kv_events_config: Any, max_model_len: int,
    **options: Any,
) -> Any:  # fmt: skip
    """The real vLLM server for ``cell`` (the ``vllm_server`` fixture; blocking, so call it
    in a thread): the cell's model, block size, GPU pool and step budget, publishing as
    ``kv_events_config`` says. ``options``: more ``vllm_server`` keywords."""
    return vllm_server(
        cell.model,
        kv_events_config=kv_events_config,
        block_size=cell.vllm_block_size,
        num_gpu_blocks=cell.num_gpu_blocks,
        max_num_batched_tokens=cell.chunk_budget,
        max_model_len=max_model_len,
        **options,
    )


def sim_engine(
    profile: ModelProfile, num_blocks: int, budget: int, max_model_len: int, **kv_options: Any
) -> tuple[EngineCore, CapturePublisher]:
    """An engine core (not started) on ``num_blocks`` blocks hashed as vLLM's default
    ``sha256_cbor``, scheduling like vLLM's (128 running, ``budget`` tokens a step,
    ``max_model_len``) with the timing model out of the way (1e9x), publishing into the
    returned capture. ``kv_options``: more ``KVCacheManager`` keywords (``offload``,
    ``allocate_kv``)."""
    kv = KVCacheManager(
        profile,
        num_blocks,
        hash_algo="sha256_cbor",
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        **kv_options,
    )
    captured = CapturePublisher()
    core = EngineCore(
        kv,
        timing=TimingModel(time_scale=1e9),
        scheduler=SchedulerConfig(128, budget, max_model_len),
        publisher=captured,
    )
    return core, captured


def tally(
    batches: list[KVEventBatch], place: Callable[[BlockStored | BlockRemoved], tuple[Any, ...]]
) -> Counter[tuple[Any, ...]]:
    """(type, *place, hash) for every stored / removed hash, BlockStored events per place
    (vLLM emits one even when retention leaves it no hash), and other event types.
    ``place``: what of an event the comparison keys on (its group, its medium...)."""
    out: Counter[tuple[Any, ...]] = Counter()
    for batch in batches:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                out[("stored_events", *place(ev))] += 1
                out.update(("stored", *place(ev), h) for h in ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                out.update(("removed", *place(ev), h) for h in ev.block_hashes)
            else:
                out[(type(ev).__name__,)] += 1
    return out


async def run_stream(
    core: EngineCore,
    captured: CapturePublisher,
    requests: Sequence[dict[str, Any]],
    count: Callable[[list[KVEventBatch]], Counter[tuple[Any, ...]]],
    forced_token: int,
) -> list[tuple[int, int, Counter[tuple[Any, ...]]]]:
    """Starts ``core``, runs each request to its end, one at a time, and stops it. Per
    request (GPU hit, CPU hit, ``count`` of everything published so far), once its CPU
    copies have landed (their events come as the engine steps). A ``{"reset": "gpu" |
    "external"}`` entry resets the prefix cache instead and adds no row."""
    await core.start()
    rows = []
    try:
        for i, spec in enumerate(requests):
            if "reset" in spec:
                assert core.reset_prefix_cache(spec["reset"] == "external")
                continue
            gpu = cpu = -1
            ids, max_tokens = spec["prompt_token_ids"], spec["max_tokens"]
            async for out in core.submit(f"r{i}", ids, max_tokens, forced_token=forced_token):
                gpu, cpu = out.gpu_hit_tokens, out.cpu_hit_tokens
            deadline = time.monotonic() + 10
            while core.kv.has_pending_work and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            rows.append((gpu, cpu, count(captured.batches)))
    finally:
        await core.stop()
    return rows
