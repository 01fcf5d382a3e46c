"""``kvroute bench index --cluster``: the sharded index on a Redis Cluster (3 masters + 3
replicas on loopback) beside one Redis node, same workload, same process, interleaved.

* ingest: ``INSTANCES`` instances each apply their own stream of realistic batches
  (``ingest_workload``) concurrently, ``PIPELINE_BATCHES`` per ``apply_many`` (one round
  trip each), as ``IngestManager`` does for a fleet; block events/s over all of them. On
  the cluster each instance's batches go to its shard's master, so the masters work in
  parallel; checked against the in-memory index's entry count.
* score: ``Scorer.score`` latency for the ``shared-prefix`` scenario of ``bench.index``
  (512 blocks, 32 instances): one node runs one lookup script, the cluster one per shard,
  concurrently.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from bench.index_redis import private_redis
from router.index.memory import MemoryIndex
from router.index.redis_cluster import RedisClusterIndex
from router.index.redis_index import RedisIndex

__all__ = ["cluster_vs_single"]

INSTANCES = 6


async def _ingest(make, streams: dict[str, list], depth: int) -> tuple[float, int]:
    idx = make("ingest")
    try:
        for name in streams:  # columns and scripts in place before the clock starts
            await idx.apply(name, streams[name][0], seq=0)

        async def one(name: str) -> None:
            items = [(b, i) for i, b in enumerate(streams[name])][1:]
            for k in range(0, len(items), depth):
                await idx.apply_many(name, items[k : k + depth])

        t0 = time.perf_counter()
        await asyncio.gather(*(one(n) for n in streams))
        dt = time.perf_counter() - t0
        entries = sum(sum(per_slot.values()) for per_slot in (await idx.column_counts()).values())
        return dt, entries
    finally:
        await idx.close()


async def _score(make, label: str, prompt: list[int], per_inst: dict, repeats: int) -> dict:
    from bench.index import _score_latency

    idx = make(label)
    try:
        for inst, bs in per_inst.items():
            for b in bs:
                await idx.apply(inst, b)
        return (await _score_latency(idx, prompt, list(per_inst), repeats))["hybrid"]
    finally:
        await idx.close()


async def cluster_vs_single(events: int, seed: int, repeats: int, scenario: tuple) -> dict:
    """The figures above for one node and for the cluster; ``scenario`` is ``bench.index``'s
    (prompt, {instance: batches}) of the shared-prefix case."""
    from bench.index import PIPELINE_BATCHES, ingest_workload
    from stack.redis_cluster import private_redis_cluster

    streams = {
        f"inst{k}": ingest_workload(events // INSTANCES, seed + k)[0] for k in range(INSTANCES)
    }
    n_events = sum(
        len(getattr(e, "block_hashes", ()))
        for bs in streams.values()
        for b in bs[1:]
        for e in b.events
    )
    want = 0
    for name, bs in streams.items():
        mem = MemoryIndex()
        for i, b in enumerate(bs):
            mem.apply_sync(name, b, seq=i)
        want += mem.stats()["entries"]
    prompt, per_inst = scenario
    out: dict[str, Any] = {"cluster_instances": INSTANCES}
    with private_redis() as url, private_redis_cluster() as cluster:
        makers = {
            "single": lambda label: RedisIndex(url, namespace=f"kvr:{{c-{label}}}"),
            "cluster": lambda label: RedisClusterIndex(cluster.url, namespace=f"kvr:{{c-{label}}}"),
        }
        rates: dict[str, list[float]] = {"single": [], "cluster": []}
        for rnd in range(2):  # interleaved: single, cluster, cluster, single
            for backend in ("single", "cluster") if rnd == 0 else ("cluster", "single"):
                dt, entries = await _ingest(
                    lambda label, b=backend, r=rnd: makers[b](f"{label}{r}"), streams,
                    PIPELINE_BATCHES,
                )  # fmt: skip
                if entries != want:
                    raise AssertionError(f"{backend} ingest: {entries} entries != {want}")
                rates[backend].append(n_events / dt)
        for backend in ("single", "cluster"):
            out[f"ingest_{backend}_per_s"] = statistics.median(rates[backend])
            out[f"score_{backend}"] = await _score(
                makers[backend], f"score-{backend}", prompt, per_inst, repeats
            )
    return out
