"""Build and serve a simulated engine: KV cache + scheduler + publisher + HTTP app.

``kvroute engine`` calls :func:`serve`; tests and benchmarks call :func:`build_engine` to
get an ASGI app (uvicorn in-process) with the same wiring.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI

from engine_adapter.kv_cache_manager import KVCacheManager
from engine_adapter.offload.manager import OffloadConfig
from engine_adapter.profiles import ModelProfile, get_profile
from engine_adapter.sim.app import create_app
from engine_adapter.sim.core import FILLER_TEXT, EngineCore, SchedulerConfig
from engine_adapter.sim.settings import EngineSettings
from events.groups import MambaSpec, SlidingWindowSpec
from events.publisher import create_publisher
from events.tokenizer import load_tokenizer

__all__ = ["EngineSettings", "build_engine", "serve"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 131_072


def blocks_for(profile: ModelProfile, max_model_len: int, max_num_batched_tokens: int) -> int:
    """Blocks one request of ``max_model_len`` tokens may hold at once (vLLM's start-up
    sizing): every block for full attention, the admission cap for a sliding window (the
    window plus one step's tokens), the states for Mamba."""
    need = 0
    for spec in profile.specs:
        blocks = -(-max_model_len // spec.block_size)
        if isinstance(spec, SlidingWindowSpec):
            span = min(spec.sliding_window - 1 + max_num_batched_tokens, max_model_len)
            blocks = -(-span // spec.block_size) + 1
        elif isinstance(spec, MambaSpec):
            blocks = 2
        need += blocks
    return need


def resolve_max_model_len(profile: ModelProfile, settings: EngineSettings) -> int:
    """vLLM's start-up check: a request of ``max_model_len`` tokens must fit the pool, so
    one that passes the length check never waits forever for blocks. Unset, it is the
    longest that fits (up to ``DEFAULT_MAX_MODEL_LEN``); set too large, it is an error with
    vLLM's advice."""
    usable = settings.gpu_blocks - 1  # block 0 is the null block
    budget = settings.max_num_batched_tokens
    if settings.max_model_len is None:
        lo, hi = 0, DEFAULT_MAX_MODEL_LEN
        while lo < hi:  # the longest length that fits
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if blocks_for(profile, mid, budget) <= usable else (lo, mid - 1)
        if lo <= 0:
            raise ValueError(f"{settings.gpu_blocks} GPU blocks cannot hold any request")
        return lo
    need = blocks_for(profile, settings.max_model_len, budget)
    if need > usable:
        raise ValueError(
            f"To serve at least one request with the model's max seq len "
            f"({settings.max_model_len}), {need} KV blocks are needed, which is more than "
            f"the {usable} available. Try increasing --gpu-blocks or decreasing "
            "--max-model-len."
        )
    return settings.max_model_len


def build_engine(settings: EngineSettings) -> tuple[FastAPI, EngineCore]:
    """The ASGI app and its core; the app's lifespan starts and drains the core."""
    profile = get_profile(
        settings.profile,
        block_size=settings.block_size,
        sliding_window=settings.sliding_window,
        page_bytes=settings.page_bytes,
        layout=settings.layout,
    )
    max_model_len = resolve_max_model_len(profile, settings)
    offload = None
    if settings.cpu_blocks > 0:
        offload = OffloadConfig(
            num_cpu_chunks=max(1, settings.cpu_blocks // settings.blocks_per_chunk),
            blocks_per_chunk=settings.blocks_per_chunk,
            policy=settings.offload_policy,
            self_describing=settings.self_describing_cpu_events,
            vllm_version=settings.vllm_version,
        )
    tokenizer = load_tokenizer(settings.tokenizer)
    filler = tokenizer.encode(FILLER_TEXT)
    events_on = settings.kv_events is not None and settings.kv_events.enable_kv_cache_events
    cores = []
    # --data-parallel-size N: N engine cores behind one server, rank r publishing on the
    # endpoints offset by r (vLLM's ``offset_endpoint_port``), batches tagged with r.
    first = settings.data_parallel_rank
    for rank in range(first, first + settings.data_parallel_size):
        kv = KVCacheManager(
            profile,
            settings.gpu_blocks,
            offload=offload,
            hash_algo=settings.hash_algo,
            hash_seed=settings.seed,
            enable_kv_cache_events=events_on,
            max_model_len=max_model_len,
            max_num_batched_tokens=settings.max_num_batched_tokens,
        )
        publisher = create_publisher(
            settings.kv_events, rank, form="array" if settings.legacy_array_events else "map"
        )
        cores.append(
            EngineCore(
                kv,
                timing=settings.timing,
                scheduler=SchedulerConfig(
                    settings.max_num_seqs, settings.max_num_batched_tokens, max_model_len
                ),
                publisher=publisher,
                filler_token_ids=filler,
                model_name=settings.model,
                data_parallel_rank=rank,
            )
        )
    core = cores[0]
    name = settings.name or f"{settings.host}:{settings.port}"
    app = create_app(cores, tokenizer, settings.model, name, max_model_len, settings.lora_modules)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for c in cores:
            await c.start()
        logger.info(
            "engine %s: model %s, profile %s, %d GPU blocks, %d CPU blocks, events %s",
            name,
            settings.model,
            settings.profile,
            settings.gpu_blocks,
            settings.cpu_blocks,
            [getattr(c.publisher, "endpoint", "off") for c in cores],
        )
        try:
            yield
        finally:
            for c in cores:
                await c.stop()

    app.router.lifespan_context = lifespan
    return app, core


def serve(settings: EngineSettings, log_level: str = "info") -> None:
    """Run until SIGINT/SIGTERM; uvicorn's shutdown runs the lifespan drain."""
    app, _ = build_engine(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=10,
    )
    # uvicorn re-raises the captured signal after its graceful shutdown; exit 0 instead, so
    # supervisors see a clean stop.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    uvicorn.Server(config).run()
