"""Everything a running router holds, built from settings, started and stopped together."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx

from events.native import native_paths
from router.build import build_router, instrument
from router.config import RouterSettings
from router.decision.layout import LayoutRegistry, default_layout
from router.decision.tokenize import RoutingTokenizer
from router.fleet.admission import AdmissionController
from router.fleet.affinity import SessionAffinity
from router.fleet.discovery import Discovery, DiscoveryError
from router.fleet.instances import Instance, InstanceRegistry
from router.fleet.models import ModelRegistry
from router.fleet.specs import InstanceSpec, parse_instance, rank_specs
from router.http.forward import Forwarder
from router.http.upstream import UpstreamPool
from router.index import open_index
from router.index.redis_cluster import RedisClusterIndex
from router.index.redis_index import RedisIndex
from router.ingest import IngestManager
from router.metrics import RouterMetrics
from router.prediction.shared import SharedPredictions
from router.prediction.speculative import SpeculativeResidency

__all__ = ["RouterState"]

log = logging.getLogger(__name__)


class RouterState:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = s = settings
        self.metrics = RouterMetrics()
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                s.upstream.request_timeout_s, connect=s.upstream.connect_timeout_s
            ),
            # Drop idle connections before the engines do (uvicorn, hence vLLM, closes them
            # after 5 s, httpx's default expiry too): reusing one the engine is closing
            # fails a forward and counts against the instance's health.
            limits=httpx.Limits(
                max_connections=4096, max_keepalive_connections=512, keepalive_expiry=2.0
            ),
        )
        redis_opts: dict[str, Any] = {}
        if s.index.startswith(("redis://", "rediss://", "unix://", "redis+cluster://")):
            redis_opts = {"model": s.model, "hash_algo": s.hash_algo, "hash_seed": s.seed}
            if s.redis.block_ttl_s:
                redis_opts["block_ttl_s"] = s.redis.block_ttl_s
        self.index = instrument(open_index(s.index, **redis_opts), self.metrics)
        self.layouts = LayoutRegistry(default=default_layout(s.default_layout, s.block_size))
        self.admission = AdmissionController(s.admission, self.metrics.registry)
        # Probes on the data plane's keep-alive client: kept connections (below uvicorn's
        # 5 s idle close) and no pool scans (router.fleet.instances).
        self.prober = UpstreamPool(
            connect_timeout_s=s.health.timeout_s,
            request_timeout_s=s.health.timeout_s,
            keepalive_s=min(4.0, s.health.interval_s + 1.0),
        )
        self.registry = InstanceRegistry(
            self.client,
            prober=self.prober,
            **s.health.model_dump(),
            read_metrics=s.engine_metrics,
            listener=self,  # router.fleet.instances.HealthListener
        )
        # Served models read through the prober too (probed_up runs only once started).
        self.models = ModelRegistry(self.client, s.health.timeout_s, fetch=self.registry.fetch)
        # Instances named by URL alone: their event sources read from vLLM.
        self.discovery = Discovery(
            self.client,
            s.health.timeout_s,
            lambda spec: self._add_target(spec, probe=False),
            self._remove_target,
        )
        self.affinity = SessionAffinity(s.session, self.metrics.registry)
        self.router = build_router(
            s,
            index=self.index,
            layouts=self.layouts,
            registry=self.registry,
            metrics=self.metrics,
            tokenizer=RoutingTokenizer(s.tokenizer, self.client, self._any_healthy),
            affinity=self.affinity if self.affinity.config.enabled else None,
            shared=self._shared_predictions,
        )
        self.policy = self.router.policy
        self.scorer = self.router.scorer
        self.prediction = self.router.prediction
        self.ingest = IngestManager(
            self.index, self.layouts, registry=self.metrics.registry, listener=self.prediction
        )
        self.forwarder = Forwarder(
            self.registry,
            self.policy,
            self.metrics,
            UpstreamPool(
                connect_timeout_s=s.upstream.connect_timeout_s,
                request_timeout_s=s.upstream.request_timeout_s,
            ),
            max_retries=s.upstream.max_retries,
        )
        self._layout_task: asyncio.Task[None] | None = None
        self.shared = self.prediction.shared

    def _shared_predictions(self, store: SpeculativeResidency) -> SharedPredictions | None:
        """Replicas on one Redis index share predictions and load through it
        (``router.prediction.shared``); a memory index is one replica: None."""
        inner = getattr(self.index, "inner", self.index)
        if not self.settings.share_replicas:
            return None
        client: Any
        if isinstance(inner, RedisIndex):
            client = inner.redis
        elif isinstance(inner, RedisClusterIndex):
            client = inner.pubsub_client()  # one node at a time (cluster pub/sub is broadcast)
        else:
            return None
        registry = self.registry

        def load() -> dict[str, tuple[int, int, int]]:
            return {
                i.url: (i.inflight_requests, i.inflight_prefill_tokens, i.running_requests)
                for i in registry.all()
                if i.inflight_requests or i.running_requests or i.inflight_prefill_tokens
            }

        def set_peer_load(sums: dict[str, tuple[int, int, int]]) -> None:
            for i in registry.all():
                req, tok, run = sums.get(i.url, (0, 0, 0))
                i.peer_inflight_requests = req
                i.peer_inflight_prefill_tokens = tok
                i.peer_running_requests = run

        return SharedPredictions(
            client,
            f"{inner.prefix}:replicas",
            ttl_s=self.settings.speculative.ttl_s,
            load=load,
            set_peer_load=set_peer_load,
            on_applied=store.flush,
            metrics=self.metrics,
        )

    # ---- router.fleet.instances.HealthListener -----------------------------------------

    async def probed_up(self, inst: Instance) -> None:
        """After a good probe: an instance named by URL alone whose sources could not be
        read yet is read now; then its served models."""
        if inst.http_url in self.discovery.pending:
            await self.discovery.refresh(inst.http_url)
        if self.registry.get(inst.url) is inst:
            await self.models.refresh(inst)

    async def health_changed(self, inst: Instance, up: bool) -> None:
        """A down instance's cache is unknown -- it may come back restarted, empty: drop
        its residency now and rebuild it from its events (replay, then the live stream).
        One named by URL alone is read again when it is back: a restarted vLLM may
        publish elsewhere."""
        if up:
            if inst.http_url in self.discovery:
                await self.discovery.refresh(inst.http_url)
            return
        self.prediction.forget(inst.url)
        if inst.spec.events and inst.url in self.ingest.instances():
            self.ingest.resync(inst.url)

    def block_size_seen(self, url: str, block_size: int) -> None:
        self.layouts.hint_block_size(url, block_size)

    def probe_round_done(self) -> None:
        self.admission.notify()  # thresholds re-checked

    def _any_healthy(self) -> str | None:
        healthy = self.registry.healthy()
        return healthy[0].http_url if healthy else None

    async def start(self) -> None:
        for text in self.settings.instances:
            try:
                await self.add_instance(parse_instance(text), probe=False)
            except DiscoveryError as exc:  # the operator's fix, said once, not in a traceback
                log.error("cannot follow %s: %s", text, exc)
                raise
        await self.registry.start()
        if self.shared is not None:
            await self.shared.start()
        self._layout_task = asyncio.create_task(self._share_layouts(), name="layouts")
        paths = native_paths()
        log.info(
            "router: %d instances, policy %s, index %s; native: %s; pure Python: %s",
            len(self.registry.all()),
            self.policy.name,
            self.settings.index,
            ", ".join(n for n, ok in paths.items() if ok) or "none",
            ", ".join(n for n, ok in paths.items() if not ok) or "none",
        )

    async def stop(self) -> None:
        if self._layout_task is not None:
            self._layout_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._layout_task
        if self.shared is not None:
            await self.shared.close()
        await self.registry.close()
        await self.ingest.close()
        await self.index.close()
        await self.client.aclose()
        self.forwarder.pool.close()
        self.prober.close()

    async def add_instance(self, spec: InstanceSpec, *, probe: bool = True) -> Instance:
        """Register an instance (``dp=N``: one target per data-parallel rank, the first
        returned; a URL alone: as its ``/kv_event_sources`` says)."""
        if spec.discover:
            specs = await self.discovery.add(spec)
            targets = [i for s in specs if (i := self.registry.get(s.url)) is not None]
            if probe:
                for inst in targets:
                    await self.registry.probe(inst)
            return targets[0]
        targets = [await self._add_target(t, probe=probe) for t in rank_specs(spec)]
        return targets[0]

    async def _add_target(self, spec: InstanceSpec, *, probe: bool) -> Instance:
        inst = self.registry.add(spec)
        self.models.declare(spec.url, spec.models)
        if spec.cpu_chunk is not None:  # before its events: no batch is read without it
            self.layouts.configure_chunk(
                spec.url, blocks=spec.cpu_chunk.blocks, tokens=spec.cpu_chunk.tokens
            )
        if spec.events and self.settings.ingest:
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
        self.discovery.forget(url)
        for name in names:
            await self._remove_target(name)
        return bool(names)

    async def _remove_target(self, url: str) -> None:
        inst = self.registry.remove(url)
        if inst is None:
            return
        if inst.spec.events:
            if inst.url in self.ingest.instances():  # a reader leaves the index alone
                await self.ingest.remove_instance(inst.url)
        else:
            with contextlib.suppress(Exception):
                await self.index.clear(inst.url)
        self.prediction.forget(inst.url)
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
            "last_seq": (
                self.ingest.last_seq(inst.url) if inst.url in self.ingest.instances() else None
            ),
            "view": self.ingest.view(inst.url),
        }
