"""``--mode sim``: the whole side-by-side replay in one process on a virtual clock.

No re-implementation: each engine is the real ``KVCacheManager`` + ``EngineCore`` (the
scheduler the HTTP engine runs), and the router side is the real ``router.decision.decide.Router``
(tokenizer, vLLM block hashing, ``Scorer`` over a ``MemoryIndex``, speculative residency,
the policy), with the proxy's load accounting (in flight until the first token, running
until the last) and its TTFT feedback to the policy. What is left out is the wire: each
engine step's ``KVEventBatch`` is applied to the index at once (no ZMQ), requests reach
engines with no HTTP, and routing costs no time. ``VirtualClockLoop`` turns every
``asyncio.sleep`` into a jump of the clock, so a trace hours long replays in minutes.

Deterministic for a given seed: CPU-tier copies complete inline (not on a worker thread),
and the policy's tie-breaking generator is seeded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from bench.replay.config import ReplayConfig
from bench.replay.peer_models import make_peer_model
from bench.replay.records import RequestRecord
from bench.replay.trace import TraceRequest, compress_arrivals, prompt_text
from bench.replay.vclock import VirtualClockLoop
from engine_adapter.kv_cache_manager import KVCacheManager
from engine_adapter.offload.manager import OffloadConfig
from engine_adapter.profiles import get_profile
from engine_adapter.sim.core import FILLER_TEXT, EngineCore, SchedulerConfig
from events.publisher import EventPublisher
from events.structs import KVEventBatch
from router.build import build_router, eviction_tracker
from router.config import RouterSettings
from router.decision.layout import InstanceLayout, LayoutRegistry
from router.decision.policy import COST_POLICIES, CostRates, LeastLoadedPolicy, Policy, make_policy
from router.fleet.instances import Instance
from router.fleet.specs import InstanceSpec
from router.index.memory import MemoryIndex
from router.ingest.listener import IngestListener

__all__ = ["SimResult", "SimRouterSettings", "run_sim"]

log = logging.getLogger(__name__)


_LIVE = RouterSettings.model_construct()  # the defaults, without reading the environment


@dataclass(frozen=True)
class SimRouterSettings:
    """The live router's settings that shape decisions, defaulting to its own
    (``router.config.RouterSettings``, where they are written)."""

    prefill_s_per_token: float = _LIVE.cost.prefill_s_per_token
    load_s_per_token: float = _LIVE.cost.load_s_per_token
    request_overhead_s: float = _LIVE.cost.request_overhead_s
    speculative_ttl_s: float = _LIVE.speculative.ttl_s
    health_interval_s: float = _LIVE.health.interval_s  # how often engines' queues are read


@dataclass
class SimResult:
    policy: str
    records: list[RequestRecord]
    instances: list[str]
    wall_s: float
    virtual_s: float
    engine_stats: dict[str, dict[str, Any]] = field(default_factory=dict)


class _InlineExecutor:
    """Runs offload copies at once, so CPU-tier events do not depend on thread timing."""

    def submit(self, fn: Callable[..., None], *args: Any) -> Future[None]:
        fut: Future[None] = Future()
        try:
            fn(*args)
            fut.set_result(None)
        except BaseException as exc:  # surfaced by TransferEngine._finish
            fut.set_exception(exc)
        return fut

    def shutdown(self, wait: bool = True) -> None:
        return None


class _IndexFeed(EventPublisher):
    """The engine's publisher, short-circuited: what the router's ingest does per batch."""

    def __init__(
        self, name: str, index: MemoryIndex, layouts: LayoutRegistry, listener: IngestListener
    ) -> None:
        super().__init__()
        self.name, self.index, self.layouts = name, index, layouts
        self.listener: IngestListener | None = listener  # as IngestManager's
        self.seq = 0
        self.batches = 0

    def publish(self, batch: KVEventBatch) -> None:
        self.layouts.observe(self.name, batch)
        if self.listener is not None:
            self.listener.batch_learned(self.name, batch)
        self.index.apply_sync(self.name, batch, seq=self.seq)
        self.seq += 1
        self.batches += 1
        if self.listener is not None:
            self.listener.batch_applied(self.name)

    def shutdown(self) -> None:
        return None


class _Registry:
    def __init__(self, instances: list[Instance]) -> None:
        self._instances = instances

    def healthy(self) -> list[Instance]:
        return self._instances


def build_core(cfg: ReplayConfig, publisher: EventPublisher) -> EngineCore:
    """An engine wired as ``engine_adapter.sim.server.build_engine`` does, on CPU."""
    e = cfg.engine
    profile = get_profile(
        e.profile, block_size=e.block_size, sliding_window=e.sliding_window,
        page_bytes=e.page_bytes, layout=e.layout,
    )  # fmt: skip
    offload = None
    if e.cpu_blocks > 0:
        offload = OffloadConfig(
            num_cpu_chunks=max(1, e.cpu_blocks // e.blocks_per_chunk),
            blocks_per_chunk=e.blocks_per_chunk,
        )
    kv = KVCacheManager(profile, e.gpu_blocks, offload=offload, device="cpu", hash_algo=e.hash_algo)
    if kv.offload is not None:
        kv.offload.transfer._executor = _InlineExecutor()  # type: ignore[assignment]
    return EngineCore(
        kv,
        timing=e.timing(cfg.time_scale),
        scheduler=SchedulerConfig(e.max_num_seqs, e.max_num_batched_tokens),
        publisher=publisher,
        filler_token_ids=list(FILLER_TEXT.encode()),
        model_name=cfg.model,
    )


def sim_policy(
    name: str,
    rates: CostRates,
    temperature: float,
    seed: int,
    clock: Callable[[], float],
    roomy: Callable[[str], bool] | None = None,
) -> Policy:
    """``make_policy`` with a seeded generator for tie-breaking (reproducible runs) and the
    virtual clock (the cost policy drains its backlog model by it)."""
    rng = random.Random(seed)
    if name.startswith("model:"):
        return make_peer_model(name.split(":", 1)[1])
    if name in ("cost", "prefix_full_only"):
        return make_policy(
            name, temperature=temperature, settings=rates, clock=clock, rng=rng, roomy=roomy
        )
    if name == "least_loaded":
        return LeastLoadedPolicy(rng)
    return make_policy(name)


async def _simulate(
    requests: Sequence[TraceRequest],
    policy_name: str,
    cfg: ReplayConfig,
    rs: SimRouterSettings,
    progress: Callable[[int, int], None] | None,
) -> tuple[list[RequestRecord], list[str], dict[str, dict[str, Any]]]:
    loop = asyncio.get_running_loop()
    names = [f"engine-{i}" for i in range(cfg.engines)]
    index = MemoryIndex()
    layouts = LayoutRegistry(default=InstanceLayout.full(cfg.engine.block_size))
    insts = {n: Instance(InstanceSpec(n)) for n in names}
    settings = RouterSettings(
        # Peer models are scored by the cost policy's machinery, full-attention-only for
        # vLLM-router's (it scores group 0 only); the policy itself is the model.
        policy="cost" if policy_name.startswith("model:") else policy_name,
        block_size=cfg.engine.block_size,
        hash_algo=cfg.engine.hash_algo,
        tokenizer="byte",
        temperature=cfg.temperature,
        prefill_s_per_token=rs.prefill_s_per_token,
        load_s_per_token=rs.load_s_per_token,
        request_overhead_s=rs.request_overhead_s,
        speculative_ttl_s=rs.speculative_ttl_s,
    )
    rates = settings.cost  # the three rates above, the policy's other knobs at their defaults
    # The cost policy reads memory pressure (the peer models do not).
    evictions = eviction_tracker(settings, loop.time) if policy_name in COST_POLICIES else None
    router = build_router(
        settings,
        index=index,
        layouts=layouts,
        registry=_Registry(list(insts.values())),
        policy=sim_policy(
            policy_name,
            rates,
            cfg.temperature,
            cfg.seed,
            loop.time,
            evictions.roomy if evictions is not None else None,
        ),
        evictions=evictions,
        clock=loop.time,
        full_only=policy_name in ("prefix_full_only", "model:vllm-router"),
    )
    policy = router.policy
    feeds = {n: _IndexFeed(n, index, layouts, router.prediction) for n in names}
    cores = {n: build_core(cfg, feeds[n]) for n in names}
    for core in cores.values():
        await core.start()

    async def probe() -> None:  # the health checker's read of vllm:num_requests_waiting
        while True:
            await asyncio.sleep(rs.health_interval_s)
            for n in names:
                insts[n].engine_waiting = len(cores[n].waiting)

    prober = asyncio.create_task(probe())
    arrivals = compress_arrivals(requests, cfg.time_scale)
    records = [
        RequestRecord(r.index, arrivals[i], r.input_length, cfg.max_tokens(r.output_length))
        for i, r in enumerate(requests)
    ]
    done = 0

    async def one(req: TraceRequest, rec: RequestRecord) -> None:
        nonlocal done
        text = prompt_text(req, cfg.seed, cfg.block_chars)
        if getattr(policy, "wants_text", False):  # the sglang-router model matches text
            policy.text = text  # type: ignore[attr-defined]
        decision = await router.decide({"prompt": text}, "completion")
        assert decision is not None
        url = decision.decision.instance
        inst, core = insts[url], cores[url]
        rec.instance = rec.router_instance = url
        if policy.uses_scores:
            rec.predicted_hit_tokens = sum(decision.predicted(url))
        ids = list(text.encode())
        if len(ids) + rec.max_tokens > (cfg.engine.max_model_len or 1 << 30):
            rec.error = "prompt longer than max_model_len"
            return
        uncached = decision.uncached(url)
        inst.inflight_requests += 1
        inst.inflight_prefill_tokens += uncached
        first = True
        try:
            async for out in core.submit(f"r{req.index}", ids, rec.max_tokens):
                if first:
                    first = False
                    rec.ttft_s = loop.time() - rec.arrival_s
                    inst.inflight_requests -= 1
                    inst.inflight_prefill_tokens -= uncached
                    inst.running_requests += 1
                    part = decision.decision.breakdown.get(url)
                    if part is not None:
                        policy.observe(url, part, rec.ttft_s)
                if out.finished:
                    rec.e2e_s = loop.time() - rec.arrival_s
                    rec.completion_tokens = out.completion_tokens
                    rec.gpu_hit_tokens, rec.cpu_hit_tokens = out.gpu_hit_tokens, out.cpu_hit_tokens
        except RuntimeError as exc:
            rec.error = str(exc)
        finally:
            router.settled(decision, url)
            if first:
                inst.inflight_requests -= 1
                inst.inflight_prefill_tokens -= uncached
            else:
                inst.running_requests -= 1
            done += 1
            if progress is not None:
                progress(done, len(records))
            if done % 1000 == 0:
                log.info("sim %s: %d/%d requests, virtual %.0f s", policy_name, done,
                         len(records), loop.time())  # fmt: skip

    tasks = []
    for req, rec in zip(requests, records, strict=True):
        delay = rec.arrival_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req, rec)))
    await asyncio.gather(*tasks)
    prober.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await prober
    stats = {}
    for n in names:
        core = cores[n]
        stats[n] = {
            "steps": core.steps,
            "preemptions": int(
                core.registry.get_sample_value(
                    "vllm:num_preemptions_total", {"model_name": cfg.model}
                )
                or 0
            ),
            "event_batches": feeds[n].batches,
        }
        await core.stop(drain_timeout=0)
    return records, names, stats


def run_sim(
    requests: Sequence[TraceRequest],
    policy: str,
    cfg: ReplayConfig,
    router_settings: SimRouterSettings | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Replay ``requests`` through ``cfg.engines`` fresh engines routed by our ``policy``."""
    loop = VirtualClockLoop()
    t0 = time.perf_counter()
    try:
        records, names, stats = loop.run_until_complete(
            _simulate(requests, policy, cfg, router_settings or SimRouterSettings(), progress)
        )
        virtual = loop.time()
    finally:
        loop.close()
    return SimResult(policy, records, names, time.perf_counter() - t0, virtual, stats)
