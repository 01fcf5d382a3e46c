"""Prometheus metrics for any ``BlockIndex``, as a decorator rather than branches inside
the backends (the llm-d ``InstrumentedIndex`` pattern). Per-event counts by type and status
live in ``router.ingest``, which knows the instance."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from events.structs import KVEventBatch
from router.index.base import ApplyResult, BlockIndex, Residency, SeqBatch
from router.metrics import FastObserve

__all__ = ["IndexMetrics", "InstrumentedIndex"]

_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


class IndexMetrics:
    """The index's metric families, registered once per registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = registry if registry is not None else REGISTRY
        self.blocks = Counter(
            "kvroute_index_block_ops",
            "Block entries stored / removed / removals of unknown entries.",
            ["op"],
            registry=reg,
        )
        self.apply_seconds = Histogram(
            "kvroute_index_apply_seconds",
            "Time to apply one batch (a pipelined run of batches: its time per batch).",
            buckets=_BUCKETS,
            registry=reg,
        )
        self.lookup_seconds = FastObserve(  # once per routed request
            Histogram(
                "kvroute_index_lookup_seconds",
                "Time for one lookup.",
                buckets=_BUCKETS,
                registry=reg,
            )
        )


class InstrumentedIndex:
    """Wraps a ``BlockIndex``; every other attribute passes through to it."""

    def __init__(self, inner: BlockIndex, metrics: IndexMetrics) -> None:
        self.inner = inner
        self.metrics = metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def apply(
        self, instance: str, batch: KVEventBatch, *, seq: int | None = None, reset: bool = False
    ) -> ApplyResult:
        t0 = time.perf_counter()
        res = await self.inner.apply(instance, batch, seq=seq, reset=reset)
        self.metrics.apply_seconds.observe(time.perf_counter() - t0)
        self._count(res)
        return res

    async def apply_many(
        self, instance: str, items: Sequence[SeqBatch], *, reset: bool = False
    ) -> list[ApplyResult]:
        t0 = time.perf_counter()
        results = await self.inner.apply_many(instance, items, reset=reset)
        if results:  # one round trip: each batch gets its share of the time
            per_batch = (time.perf_counter() - t0) / len(results)
            for res in results:
                self.metrics.apply_seconds.observe(per_batch)
                self._count(res)
        return results

    def _count(self, res: ApplyResult) -> None:
        m = self.metrics
        if res.stored:
            m.blocks.labels("stored").inc(res.stored)
        if res.removed:
            m.blocks.labels("removed").inc(res.removed)
        if res.unknown:
            m.blocks.labels("unknown_removed").inc(res.unknown)

    async def lookup(
        self, block_hashes: Sequence[int], instances: Sequence[str] | None = None
    ) -> dict[str, Residency]:
        t0 = time.perf_counter()
        try:
            return await self.inner.lookup(block_hashes, instances)
        finally:
            self.metrics.lookup_seconds.observe(time.perf_counter() - t0)

    async def clear(self, instance: str) -> None:
        await self.inner.clear(instance)

    async def instances(self) -> list[str]:
        return await self.inner.instances()

    async def cursor(self, instance: str) -> tuple[float, int] | None:
        return await self.inner.cursor(instance)

    async def touch(self, instance: str) -> None:
        await self.inner.touch(instance)

    async def put_layout(self, instance: str, layout: dict[str, Any] | None) -> None:
        await self.inner.put_layout(instance, layout)

    async def get_layouts(self) -> dict[str, dict[str, Any]]:
        return await self.inner.get_layouts()

    async def close(self) -> None:
        await self.inner.close()
