"""``kvroute bench index``: block index ingest rate, score latency and bytes per entry.

Measured for the in-memory index and for Redis (a private ``redis-server`` started on a
free port with persistence off, killed afterwards):

* ingest: block events/s, one process, realistic batches (2-8 events of 16-64 blocks
  each, 70 % stores, 30 % removals of stored blocks). For Redis, three figures:
  ``ingest_redis_apply_per_s`` -- one ``apply`` (one round trip) per batch, the lower
  bound; ``ingest_redis_per_s`` -- ``apply_many`` over the backlog ingest drains at once,
  ``PIPELINE_BATCHES`` = 16 batches per round trip (an engine publishes one batch per
  step; 16 queue up within ~20 ms of steps, or after any hiccup, and ingest drains up to
  64); ``ingest_redis_manager_per_s`` -- the whole ingest path: a publisher process sends
  the batches over ZMQ as fast as it can, the router's subscriber and ``IngestManager``
  apply them (it drains whatever queued up while the previous chunk was applied). The
  last two are checked against the in-memory index's final state;
* score: latency of ``Scorer.score`` for an 8,192-token prompt (512 blocks) over 32
  instances with 2 groups (full attention + 1024-token sliding window), hashing excluded,
  in two scenarios: ``shared-prefix`` (every instance holds a shared system prompt, a few
  hold the conversation, some have CPU copies; 20,000 unrelated blocks each) and
  ``adversarial`` (every instance holds a different prefix with CPU extensions);
* memory: bytes per resident (instance, group, tier, block) entry (tracemalloc for the
  memory index, ``INFO memory`` for Redis);
* with ``cluster``: the sharded index on a Redis Cluster beside one Redis node, ingest of
  several instances at once and score latency (``bench.index_cluster``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import time
import tracemalloc
from pathlib import Path
from typing import Any

from events.groups import FullAttentionSpec, SlidingWindowSpec
from events.structs import BlockRemoved, BlockStored, KVEventBatch
from router.decision.layout import InstanceLayout, LayoutRegistry
from router.decision.score import Scorer
from router.index.memory import MemoryIndex

__all__ = ["ingest_workload", "run"]

PIPELINE_BATCHES = 16
LAYOUT = InstanceLayout((FullAttentionSpec(16), SlidingWindowSpec(16, 1024)), tokens_per_chunk=64)
TARGETS = {
    "ingest_memory_per_s": 1_000_000,
    "ingest_redis_per_s": 300_000,
    "ingest_redis_manager_per_s": 300_000,
    "score_memory_p50_ms": 0.3,
    "score_redis_p50_ms": 2.0,
    "memory_bytes_per_entry": 150,
}


def stored_event(hashes: list[int], group: int, medium: str = "GPU") -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=group,
        kv_cache_spec_kind=LAYOUT.groups[group].kind,
        kv_cache_spec_sliding_window=LAYOUT.groups[group].sliding_window,
    )


def ingest_workload(num_events: int, seed: int = 0) -> tuple[list[KVEventBatch], int]:
    """Batches of 2-8 events, 16-64 blocks each; 70 % stores, 30 % removals of live
    blocks. Returns (batches, block events)."""
    rng = random.Random(seed)
    live: list[tuple[int, int]] = []
    batches: list[KVEventBatch] = []
    total = 0
    while total < num_events:
        events: list[Any] = []
        for _ in range(rng.randint(2, 8)):
            n = rng.randint(16, 64)
            group = rng.randrange(2)
            if rng.random() < 0.3 and len(live) > n:
                cut = rng.randrange(len(live) - n)
                gone, live[cut : cut + n] = live[cut : cut + n], []
                for g in (0, 1):
                    hs = [h for h, gg in gone if gg == g]
                    if hs:
                        events.append(BlockRemoved(block_hashes=hs, medium="GPU", group_idx=g))
            else:
                hs = [rng.getrandbits(64) for _ in range(n)]
                live.extend((h, group) for h in hs)
                events.append(stored_event(hs, group))
            total += n
        batches.append(KVEventBatch(ts=float(len(batches)), events=events))
    return batches, total


def _populate(scenario: str, instances: int, noise: int, rng: random.Random):
    """(prompt hashes, {instance: [batches]}) for a scoring scenario."""
    prompt = [rng.getrandbits(64) for _ in range(512)]
    system = 64
    out: dict[str, list[KVEventBatch]] = {}
    for k in range(instances):
        if scenario == "adversarial":
            n = rng.randint(0, 512)
            cpu = k % 2 == 1
        else:
            n = rng.randint(256, 512) if k < 4 else system
            cpu = k % 4 == 0
        events = [stored_event(prompt[:n], 0), stored_event(prompt[max(0, n - 64) : n], 1)]
        if cpu:
            m = min(512, n + 64)
            events += [
                stored_event(prompt[:m], 0, "CPU"),
                stored_event(prompt[max(0, m - 64) : m], 1, "CPU"),
            ]
        noise_hs = [rng.getrandbits(64) for _ in range(noise)]
        events += [stored_event(noise_hs, 0)]
        out[f"inst{k:02d}"] = [KVEventBatch(ts=1.0, events=events)]
    return prompt, out


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _score_latency(index, prompt: list[int], names: list[str], repeats: int) -> dict:
    layouts = LayoutRegistry(default=LAYOUT)
    out = {}
    for label, full_only in (("hybrid", False), ("full_only", True)):
        scorer = Scorer(index, layouts, full_only=full_only)
        for _ in range(min(50, repeats)):  # warm up caches and the script
            await scorer.score(prompt, 8192, names)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            await scorer.score(prompt, 8192, names)
            times.append(time.perf_counter() - t0)
        out[label] = {
            "p50_ms": statistics.median(times) * 1e3,
            "p90_ms": _pct(times, 0.9) * 1e3,
            "p99_ms": _pct(times, 0.99) * 1e3,
        }
    return out


def _memory_bytes_per_entry(entries: int, seed: int) -> float:
    """tracemalloc over ``entries`` single-holder entries (the least shared case)."""
    rng = random.Random(seed)
    tracemalloc.start()
    try:
        idx = MemoryIndex()
        base = tracemalloc.get_traced_memory()[0]
        for i in range(0, entries, 1000):
            b = KVEventBatch(
                ts=float(i), events=[stored_event([rng.getrandbits(64) for _ in range(1000)], 0)]
            )
            idx.apply_sync("a", b, seq=i)
        del b
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    return used / idx.stats()["entries"]


async def _bench(
    ingest_events: int, redis_events: int, memory_entries: int, repeats: int, noise: int,
    use_redis: bool, seed: int, use_cluster: bool = False,
) -> dict[str, Any]:  # fmt: skip
    report: dict[str, Any] = {"targets": TARGETS}
    batches, n_events = ingest_workload(ingest_events, seed)
    idx = MemoryIndex()
    t0 = time.perf_counter()
    for i, b in enumerate(batches):
        idx.apply_sync("bench", b, seq=i)
    dt = time.perf_counter() - t0
    report["ingest_memory_per_s"] = n_events / dt
    report["memory_bytes_per_entry"] = _memory_bytes_per_entry(memory_entries, seed)
    rng = random.Random(seed)
    scenarios = {name: _populate(name, 32, noise, rng) for name in ("shared-prefix", "adversarial")}
    report["score_memory"] = {}
    for name, (prompt, per_inst) in scenarios.items():
        mem = MemoryIndex()
        for inst, bs in per_inst.items():
            for b in bs:
                mem.apply_sync(inst, b)
        report["score_memory"][name] = await _score_latency(mem, prompt, list(per_inst), repeats)
    if use_redis:
        from bench.index_redis import private_redis, redis_ingest
        from router.index.redis_index import RedisIndex

        with private_redis() as url:
            report.update(await redis_ingest(url, redis_events, seed + 1))
            report["score_redis"] = {}
            for name, (prompt, per_inst) in scenarios.items():
                r = RedisIndex(url, namespace=f"kvr:{{bench-{name}}}")
                for inst, bs in per_inst.items():
                    for b in bs:
                        await r.apply(inst, b)
                lat = await _score_latency(r, prompt, list(per_inst), repeats)
                report["score_redis"][name] = lat
                await r.close()
    if use_cluster:
        from bench.index_cluster import cluster_vs_single

        report["cluster"] = await cluster_vs_single(
            redis_events, seed + 2, repeats, scenarios["shared-prefix"]
        )
    return report


def _print(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    runs = len(report.get("runs", ())) or 1
    t = Table(title=f"kvroute bench index (median of {runs} run{'s' * (runs > 1)})")
    for col in ("metric", "value", "target"):
        t.add_column(col)
    t.add_row(
        "ingest, memory (block events/s)", f"{report['ingest_memory_per_s']:,.0f}", ">= 1,000,000"
    )
    if "ingest_redis_per_s" in report:
        for key, label, target in (
            ("apply", "one apply per batch", "-"),
            ("", f"apply_many, {PIPELINE_BATCHES} batches per round trip", ">= 300,000"),
            ("manager", "publisher -> ZMQ -> IngestManager", ">= 300,000"),
            ("stores_only", f"stores only, {PIPELINE_BATCHES} per round trip", "-"),
        ):
            rate = report["_".join(filter(None, ("ingest_redis", key, "per_s")))]
            t.add_row(f"ingest, Redis, {label} (block events/s)", f"{rate:,.0f}", target)
    t.add_row("bytes / entry, memory", f"{report['memory_bytes_per_entry']:.1f}", "<= 150")
    if "redis_bytes_per_entry" in report:
        t.add_row(
            "bytes / entry, Redis (used_memory)", f"{report['redis_bytes_per_entry']:.1f}", "-"
        )
    for backend, target in (("memory", "p50 <= 0.3 ms"), ("redis", "p50 <= 2 ms")):
        for scen, by_scorer in report.get(f"score_{backend}", {}).items():
            for scorer, lat in by_scorer.items():
                t.add_row(
                    f"score {backend} {scen} {scorer} (ms p50/p90/p99)",
                    f"{lat['p50_ms']:.3f} / {lat['p90_ms']:.3f} / {lat['p99_ms']:.3f}",
                    target if scorer == "hybrid" else "-",
                )
    c = report.get("cluster")
    if c:
        n = c["cluster_instances"]
        for backend in ("single", "cluster"):
            label = "one Redis node" if backend == "single" else "Redis Cluster (3 masters)"
            t.add_row(
                f"ingest, {label}, {n} instances at once (block events/s)",
                f"{c[f'ingest_{backend}_per_s']:,.0f}",
                "-",
            )
            lat = c[f"score_{backend}"]
            t.add_row(
                f"score {label} shared-prefix hybrid (ms p50/p90/p99)",
                f"{lat['p50_ms']:.3f} / {lat['p90_ms']:.3f} / {lat['p99_ms']:.3f}",
                "-",
            )
    Console().print(t)


def median_report(reports: list[Any]) -> Any:
    """Leaf-wise median of same-shaped reports (numbers; anything else from the first)."""
    first = reports[0]
    if isinstance(first, dict):
        return {k: median_report([r[k] for r in reports]) for k in first}
    if isinstance(first, int | float) and not isinstance(first, bool):
        return statistics.median(reports)
    return first


def _machine() -> dict[str, Any]:
    """What the figures were measured on: they only compare within one machine."""
    redis_server = shutil.which("redis-server")
    version = ""
    if redis_server:
        with contextlib.suppress(Exception):
            version = subprocess.run(
                [redis_server, "--version"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": model or platform.processor(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "redis_server": version,
    }


def run(
    out: Path,
    *,
    ingest_events: int = 1_000_000,
    redis_events: int = 300_000,
    memory_entries: int = 1_000_000,
    repeats: int = 1000,
    noise_blocks: int = 20_000,
    redis: bool = True,
    seed: int = 0,
    runs: int = 3,
    cluster: bool = False,
) -> dict[str, Any]:
    """Run the index benchmarks ``runs`` times, print the medians, write ``out/index.json``
    (medians at the top level, each run under ``runs``); return the report."""
    if runs < 1:
        raise ValueError("runs must be >= 1")
    each = [
        asyncio.run(
            _bench(
                ingest_events,
                redis_events,
                memory_entries,
                repeats,
                noise_blocks,
                redis,
                seed,
                cluster,
            )
        )
        for _ in range(runs)
    ]
    report = median_report(each)
    report["runs"] = each
    report["machine"] = _machine()
    report["params"] = {
        "runs": runs,
        "ingest_events": ingest_events,
        "redis_events": redis_events,
        "memory_entries": memory_entries,
        "repeats": repeats,
        "noise_blocks": noise_blocks,
        "instances": 32,
        "prompt_blocks": 512,
        "groups": LAYOUT.to_dict()["groups"],
    }
    _print(report)
    out.mkdir(parents=True, exist_ok=True)
    (out / "index.json").write_text(json.dumps(report, indent=2))
    return report
