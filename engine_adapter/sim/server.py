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
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI

from engine_adapter.coordinator import KVCacheManager
from engine_adapter.offload.manager import OffloadConfig
from engine_adapter.profiles import get_profile
from engine_adapter.sim.app import create_app
from engine_adapter.sim.core import FILLER_TEXT, EngineCore, SchedulerConfig
from engine_adapter.sim.timing import TimingModel
from events.config import KVEventsConfig
from events.publisher import create_publisher
from events.tokenizer import load_tokenizer

__all__ = ["EngineSettings", "build_engine", "serve"]

logger = logging.getLogger(__name__)


@dataclass
class EngineSettings:
    """Everything ``kvroute engine`` takes (flag names in the CLI match the field names)."""

    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "kvroute-sim"
    name: str | None = None  # how the engine names itself in responses; default host:port
    profile: str = "swa-hybrid"
    block_size: int = 16
    sliding_window: int = 1024
    page_bytes: int = 4096
    gpu_blocks: int = 2048
    cpu_blocks: int = 0  # 0 disables the CPU offload tier
    blocks_per_chunk: int = 4
    offload_policy: str = "lru"
    self_describing_cpu_events: bool = True
    kv_events: KVEventsConfig | None = None
    legacy_array_events: bool = False
    hash_algo: str = "sha256_cbor"
    seed: str | None = None  # NONE_HASH seed (vLLM: PYTHONHASHSEED)
    tokenizer: str | None = None  # None/"byte" or a tokenizer.json path
    max_model_len: int = 131_072
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    timing: TimingModel = field(default_factory=TimingModel)
    data_parallel_rank: int = 0


def build_engine(settings: EngineSettings) -> tuple[FastAPI, EngineCore]:
    """The ASGI app and its core; the app's lifespan starts and drains the core."""
    profile = get_profile(
        settings.profile,
        block_size=settings.block_size,
        sliding_window=settings.sliding_window,
        page_bytes=settings.page_bytes,
    )
    offload = None
    if settings.cpu_blocks > 0:
        offload = OffloadConfig(
            num_cpu_chunks=max(1, settings.cpu_blocks // settings.blocks_per_chunk),
            blocks_per_chunk=settings.blocks_per_chunk,
            policy=settings.offload_policy,
            self_describing=settings.self_describing_cpu_events,
        )
    kv = KVCacheManager(
        profile,
        settings.gpu_blocks,
        offload=offload,
        hash_algo=settings.hash_algo,
        hash_seed=settings.seed,
        enable_kv_cache_events=settings.kv_events is not None
        and settings.kv_events.enable_kv_cache_events,
    )
    publisher = create_publisher(
        settings.kv_events,
        settings.data_parallel_rank,
        form="array" if settings.legacy_array_events else "map",
    )
    tokenizer = load_tokenizer(settings.tokenizer)
    filler = tokenizer.encode(FILLER_TEXT)
    core = EngineCore(
        kv,
        timing=settings.timing,
        scheduler=SchedulerConfig(settings.max_num_seqs, settings.max_num_batched_tokens),
        publisher=publisher,
        filler_token_ids=filler,
        model_name=settings.model,
    )
    name = settings.name or f"{settings.host}:{settings.port}"
    app = create_app(core, tokenizer, settings.model, name, settings.max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await core.start()
        logger.info(
            "engine %s: model %s, profile %s, %d GPU blocks, %d CPU blocks, events %s",
            name,
            settings.model,
            settings.profile,
            settings.gpu_blocks,
            settings.cpu_blocks,
            getattr(publisher, "endpoint", "off"),
        )
        try:
            yield
        finally:
            await core.stop()

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
