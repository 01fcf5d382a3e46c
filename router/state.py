"""Everything a running router holds, built from settings, started and stopped together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx

from events.hashing import native_hashing
from events.structs import KVEventBatch
from router.admission import AdmissionConfig, AdmissionController
from router.affinity import AffinityConfig, SessionAffinity
from router.build import build_router, instrument
from router.config import InstanceSpec, RouterSettings, parse_instance, rank_specs
from router.decide import RouteDecision
from router.index import open_index
from router.ingest import IngestManager
from router.instances import Instance, InstanceRegistry
from router.layout import InstanceLayout, LayoutRegistry
from router.metrics import RouterMetrics
from router.models import ModelRegistry
from router.proxy import Forwarder
from router.tokenize import RoutingTokenizer
from router.upstream import UpstreamPool

__all__ = ["RouterState", "parse_layout"]

log = logging.getLogger(__name__)


def parse_layout(text: str, block_size: int) -> InstanceLayout:
    """``full`` | ``swa:WINDOW`` | ``mamba`` (each beside one full-attention group)."""
    from events.groups import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size)
    if text == "full":
        return InstanceLayout((full,))
    if text == "mamba":
        return InstanceLayout((full, MambaSpec(block_size)))
    if text.startswith("swa:") and text[4:].isdigit():
        return InstanceLayout((full, SlidingWindowSpec(block_size, int(text[4:]))))
    raise ValueError(f"default layout must be full, swa:WINDOW or mamba, got {text!r}")


class RouterState:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = s = settings
        self.metrics = RouterMetrics()
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(s.request_timeout_s, connect=s.connect_timeout_s),
            # Drop idle connections before the engines do (uvicorn, hence vLLM, closes them
            # after 5 s, httpx's default expiry too): reusing one the engine is closing
            # fails a forward and counts against the instance's health.
            limits=httpx.Limits(
                max_connections=4096, max_keepalive_connections=512, keepalive_expiry=2.0
            ),
        )
        redis_opts: dict[str, Any] = {}
        if s.index.startswith(("redis://", "rediss://", "unix://")):
            redis_opts = {"model": s.model, "hash_algo": s.hash_algo, "hash_seed": s.seed}
            if s.redis_block_ttl_s:
                redis_opts["block_ttl_s"] = s.redis_block_ttl_s
        self.index = instrument(open_index(s.index, **redis_opts), self.metrics)
        self.layouts = LayoutRegistry(default=parse_layout(s.default_layout, s.block_size))
        self.ingest = IngestManager(self.index, self.layouts, registry=self.metrics.registry)
        self.registry = InstanceRegistry(
            self.client,
            **s.section("health"),
            read_metrics=s.engine_metrics,
            on_change=self._health_changed,
            on_block_size=self.layouts.hint_block_size,
        )
        self.affinity = SessionAffinity(
            AffinityConfig(**s.section("session")), self.metrics.registry
        )
        self.router = build_router(
            s,
            index=self.index,
            layouts=self.layouts,
            registry=self.registry,
            metrics=self.metrics,
            tokenizer=RoutingTokenizer(s.tokenizer, self.client, self._any_healthy),
            affinity=self.affinity if self.affinity.config.enabled else None,
        )
        self.policy = self.router.policy
        self.scorer = self.router.scorer
        self.speculative = self.router.speculative
        self.ingest.on_applied = self.speculative.flush
        self.ingest.on_batch = self._on_batch
        self.admission = AdmissionController(
            AdmissionConfig(**s.section("admission")), self.metrics.registry
        )
        self.registry.on_probed = self.admission.notify
        self.models = ModelRegistry(self.client, s.health_timeout_s)
        self.registry.on_up = self.models.refresh
        self.forwarder = Forwarder(
            self.registry,
            self.policy,
            self.metrics,
            max_retries=s.max_retries,
            on_routed=self._routed,
            on_done=self._done,
        )
        self.forwarder.pool = UpstreamPool(
            connect_timeout_s=s.connect_timeout_s, request_timeout_s=s.request_timeout_s
        )
        self._layout_task: asyncio.Task[None] | None = None

    def _routed(self, decision: RouteDecision, url: str) -> None:
        self.router.routed(decision, url)
        if decision.ticket is not None:  # now counted in the instance's in-flight
            decision.ticket.release()

    def _done(self, decision: RouteDecision, url: str) -> None:
        self.router.settled(decision, url)
        self.admission.notify()  # a slot may have freed

    async def _health_changed(self, inst: Instance, up: bool) -> None:
        """A down instance's cache is unknown -- it may come back restarted, empty: drop
        its residency now and rebuild it from its events (replay, then the live stream)."""
        if up:
            return
        self.speculative.forget(inst.url)
        if inst.spec.events and inst.url in self.ingest.instances():
            self.ingest.resync(inst.url)

    def _any_healthy(self) -> str | None:
        healthy = self.registry.healthy()
        return healthy[0].http_url if healthy else None

    async def start(self) -> None:
        for text in self.settings.instances:
            await self.add_instance(parse_instance(text), probe=False)
        await self.registry.start()
        self._layout_task = asyncio.create_task(self._share_layouts(), name="layouts")
        log.info(
            "router: %d instances, policy %s, index %s, block hashing %s",
            len(self.registry.all()),
            self.policy.name,
            self.settings.index,
            "native" if native_hashing() else "pure Python (events._native not built)",
        )

    async def stop(self) -> None:
        if self._layout_task is not None:
            self._layout_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._layout_task
        await self.registry.close()
        await self.ingest.close()
        await self.index.close()
        await self.client.aclose()
        self.forwarder.pool.close()

    def _on_batch(self, name: str, batch: KVEventBatch) -> None:
        """Each batch, before it is applied: evictions end speculative credit and mark
        memory pressure."""
        self.speculative.observe(name, batch)
        if self.router.evictions is not None:
            self.router.evictions.observe(name, batch)

    async def add_instance(self, spec: InstanceSpec, *, probe: bool = True) -> Instance:
        """Register an instance (``dp=N``: one target per data-parallel rank, the first
        returned)."""
        targets = [await self._add_target(t, probe=probe) for t in rank_specs(spec)]
        return targets[0]

    async def _add_target(self, spec: InstanceSpec, *, probe: bool) -> Instance:
        inst = self.registry.add(spec)
        self.models.declare(spec.url, spec.models)
        if spec.cpu_chunk is not None:  # before its events: no batch is read without it
            self.layouts.configure_chunk(
                spec.url, blocks=spec.cpu_chunk.blocks, tokens=spec.cpu_chunk.tokens
            )
        if spec.events:
            # With a replay endpoint, start from the publisher's buffer (seq 0): a router
            # started after its engines then knows what they already hold.
            await self.ingest.add_instance(
                spec.url,
                spec.events,
                spec.replay,
                topic=spec.topic,
                start_seq=0 if spec.replay else None,
                bind=spec.bind,
            )
        if probe:
            await self.registry.probe(inst)
        return inst

    async def remove_instance(self, url: str) -> bool:
        """Remove a target, or every rank target of the instance at ``url``."""
        url = url.rstrip("/")
        names = [i.url for i in self.registry.all() if url in (i.url, i.http_url)]
        for name in names:
            await self._remove_target(name)
        return bool(names)

    async def _remove_target(self, url: str) -> None:
        inst = self.registry.remove(url)
        if inst is None:
            return
        if inst.spec.events:
            await self.ingest.remove_instance(inst.url)
        else:
            with contextlib.suppress(Exception):
                await self.index.clear(inst.url)
        self.speculative.forget(inst.url)
        self.models.forget(inst.url)
        self.layouts.configure_chunk(inst.url)

    async def _share_layouts(self) -> None:
        """Readers of a shared index learn layouts from the ingesting router."""
        while True:
            await asyncio.sleep(2.0)
            with contextlib.suppress(Exception):
                await self.layouts.refresh_from(self.index)

    def describe(self, inst: Instance) -> dict[str, Any]:
        return {
            "url": inst.url,
            "data_parallel_rank": inst.spec.dp_rank,
            "events": inst.spec.events,
            "replay": inst.spec.replay,
            "healthy": inst.healthy,
            "inflight_requests": inst.inflight_requests,
            "running_requests": inst.running_requests,
            "engine_waiting": inst.engine_waiting,
            "served": inst.served,
            "models": self.models.describe(inst.url),
            "last_seq": self.ingest.last_seq(inst.url) if inst.spec.events else None,
        }
