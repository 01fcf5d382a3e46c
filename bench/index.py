"""``kvroute bench index``: block index ingest rate, score latency and bytes per entry.

Measured for the in-memory index and for Redis (a private ``redis-server`` started on a
free port with persistence off, killed afterwards):

* ingest: block events/s through ``apply`` -- realistic batches (a few events of 16-64
  blocks each, 70 % stores, 30 % removals of stored blocks), one process;
* score: latency of ``Scorer.score`` for an 8,192-token prompt (512 blocks) over 32
  instances with 2 groups (full attention + 1024-token sliding window), hashing excluded,
  in two scenarios: ``shared-prefix`` (every instance holds a shared system prompt, a few
  hold the conversation, some have CPU copies; 20,000 unrelated blocks each) and
  ``adversarial`` (every instance holds a different prefix with CPU extensions);
* memory: bytes per resident (instance, group, tier, block) entry (tracemalloc for the
  memory index, ``INFO memory`` for Redis).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from events.groups import FullAttentionSpec, SlidingWindowSpec
from events.structs import BlockRemoved, BlockStored, KVEventBatch
from router.index.memory import MemoryIndex
from router.layout import InstanceLayout, LayoutRegistry
from router.score import Scorer

__all__ = ["private_redis", "run"]

LAYOUT = InstanceLayout((FullAttentionSpec(16), SlidingWindowSpec(16, 1024)), tokens_per_chunk=64)
TARGETS = {
    "ingest_memory_per_s": 1_000_000,
    "ingest_redis_per_s": 300_000,
    "score_memory_p50_ms": 0.3,
    "score_redis_p50_ms": 2.0,
    "memory_bytes_per_entry": 150,
}


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A throw-away redis-server on a free port; yields its URL, kills it on exit."""
    tmp = tempfile.mkdtemp(prefix="kvroute-bench-redis-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen([*cmd, "--dir", tmp], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def _stored(hashes: list[int], group: int, medium: str = "GPU") -> BlockStored:
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
                events.append(_stored(hs, group))
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
        events = [_stored(prompt[:n], 0), _stored(prompt[max(0, n - 64) : n], 1)]
        if cpu:
            m = min(512, n + 64)
            events += [_stored(prompt[:m], 0, "CPU"), _stored(prompt[max(0, m - 64) : m], 1, "CPU")]
        noise_hs = [rng.getrandbits(64) for _ in range(noise)]
        events += [_stored(noise_hs, 0)]
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
                ts=float(i), events=[_stored([rng.getrandbits(64) for _ in range(1000)], 0)]
            )
            idx.apply_sync("a", b, seq=i)
        del b
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    return used / idx.stats()["entries"]


async def _bench(
    ingest_events: int, redis_events: int, memory_entries: int, repeats: int, noise: int,
    use_redis: bool, seed: int,
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
        from router.index.redis_index import RedisIndex

        with private_redis() as url:
            rb, rn = ingest_workload(redis_events, seed + 1)
            ridx = RedisIndex(url, namespace="kvr:{bench-ingest}")
            await ridx.apply("warm", KVEventBatch(ts=0.0, events=[_stored([1], 0)]))
            before = (await ridx.redis.info("memory"))["used_memory"]
            t0 = time.perf_counter()
            for i, b in enumerate(rb):
                await ridx.apply("bench", b, seq=i)
            dt = time.perf_counter() - t0
            report["ingest_redis_per_s"] = rn / dt
            after = (await ridx.redis.info("memory"))["used_memory"]
            entries = (await ridx.stats())["entries"] - 1
            report["redis_bytes_per_entry"] = (after - before) / max(entries, 1)
            # Stores only (no removals): the cheaper half of the mix, for reference.
            stores = [
                KVEventBatch(ts=1e6 + i, events=[e for e in b.events if type(e) is BlockStored])
                for i, b in enumerate(rb)
            ]
            n_stores = sum(len(e.block_hashes) for b in stores for e in b.events)
            await ridx.clear("bench")
            t0 = time.perf_counter()
            for i, b in enumerate(stores):
                await ridx.apply("bench", b, seq=i)
            report["ingest_redis_stores_only_per_s"] = n_stores / (time.perf_counter() - t0)
            await ridx.close()
            report["score_redis"] = {}
            for name, (prompt, per_inst) in scenarios.items():
                r = RedisIndex(url, namespace=f"kvr:{{bench-{name}}}")
                for inst, bs in per_inst.items():
                    for b in bs:
                        await r.apply(inst, b)
                lat = await _score_latency(r, prompt, list(per_inst), repeats)
                report["score_redis"][name] = lat
                await r.close()
    return report


def _print(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="kvroute bench index")
    for col in ("metric", "value", "target"):
        t.add_column(col)
    t.add_row(
        "ingest, memory (block events/s)", f"{report['ingest_memory_per_s']:,.0f}", ">= 1,000,000"
    )
    if "ingest_redis_per_s" in report:
        t.add_row(
            "ingest, Redis (block events/s)", f"{report['ingest_redis_per_s']:,.0f}", ">= 300,000"
        )
        rate = report["ingest_redis_stores_only_per_s"]
        t.add_row("ingest, Redis, stores only (block events/s)", f"{rate:,.0f}", "-")
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
    Console().print(t)


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
) -> dict[str, Any]:
    """Run the index benchmarks, print a table, write ``out/index.json``; return the report."""
    report = asyncio.run(
        _bench(ingest_events, redis_events, memory_entries, repeats, noise_blocks, redis, seed)
    )
    report["params"] = {
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
