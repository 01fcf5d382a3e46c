"""``kvroute bench offload``: GPU<->CPU chunk copy bandwidth and block-pool throughput.

Copies: the offload tier's multi-group store (GPU->CPU) and load (CPU->GPU) of chunks whose
GPU blocks are scattered over the KV tensor (as after a while of serving), against one
plain ``copy_`` of the same number of bytes between contiguous tensors on the same devices
(the target is a ratio >= 0.8). On a machine without CUDA both sides are host memory.

Pool: requests admitted (GPU hit lookup), allocated, cached and freed through
``KVCacheManager`` with events on, per profile: blocks handed out per second and events
per second; with and without the CPU tier storing every new chunk.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench.common import write_report
from engine_adapter.kv_cache_manager import KVCacheManager
from engine_adapter.offload import OffloadConfig
from engine_adapter.offload.transfer import GroupCopy, TransferEngine
from engine_adapter.profiles import (
    PROFILE_NAMES,
    allocate_cpu_kv,
    allocate_gpu_kv,
    default_device,
    get_profile,
)

__all__ = ["bench_copies", "bench_pool", "run"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _interleaved(a: Callable[[], None], b: Callable[[], None], repeats: int) -> tuple[float, float]:
    """Median seconds of ``a`` and of ``b``, timed alternately after one warm-up each."""
    a()
    b()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, acc in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def bench_copies(
    *,
    profile: str = "full",
    page_bytes: int = 512 * 1024,
    num_blocks: int = 512,
    blocks_per_chunk: int = 4,
    repeats: int = 9,
    device: torch.device | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """GB/s of chunk stores/loads through ``TransferEngine`` vs a plain contiguous copy."""
    device = device or default_device()
    prof = get_profile(profile, page_bytes=page_bytes)
    gpu = allocate_gpu_kv(prof, num_blocks, device)
    for t in gpu:
        t.random_(0, 256)
    k = blocks_per_chunk
    num_chunks = num_blocks // k
    rows = num_chunks * k
    cpu = allocate_cpu_kv(prof, num_chunks, k)
    engine = TransferEngine(gpu, cpu)
    rng = random.Random(seed)
    src = [rng.sample(range(num_blocks), rows) for _ in gpu]
    dst = [rng.sample(range(num_blocks), rows) for _ in gpu]
    slots = list(range(rows))
    stores = [GroupCopy(g, src[g], slots) for g in range(len(gpu))]
    loads = [GroupCopy(g, dst[g], slots) for g in range(len(gpu))]
    nbytes = rows * sum(prof.page_bytes)
    job = iter(range(1, 1 << 30))

    # Correctness once: a scattered page comes back byte-exact through store and load.
    sample = [gpu[g][src[g][0]].clone() for g in range(len(gpu))]
    engine.submit(next(job), "store", stores)
    engine.wait_all()
    engine.submit(next(job), "load", loads)
    engine.wait_all()
    exact = all(torch.equal(gpu[g][dst[g][0]], sample[g]) for g in range(len(gpu)))

    non_blocking = device.type == "cuda"

    def ours(copies: list[GroupCopy], direction: str) -> None:
        engine.submit(next(job), direction, copies)  # type: ignore[arg-type]
        engine.wait_all()

    def plain(to_cpu: bool) -> None:
        for g_t, c_t in zip(gpu, cpu, strict=True):
            if to_cpu:
                c_t.copy_(g_t[:rows], non_blocking=non_blocking)
            else:
                g_t[:rows].copy_(c_t, non_blocking=non_blocking)
        _sync(device)

    out: dict[str, Any] = {"bytes_per_transfer": nbytes, "byte_exact": exact, "directions": {}}
    for name, copies, direction, to_cpu in (
        ("store GPU->CPU", stores, "store", True),
        ("load CPU->GPU", loads, "load", False),
    ):
        # Alternate the two so that noise from other processes hits both alike.
        t_ours, t_plain = _interleaved(
            lambda c=copies, d=direction: ours(c, d), lambda t=to_cpu: plain(t), repeats
        )
        out["directions"][name] = {
            "ours_gbps": nbytes / t_ours / 1e9,
            "plain_gbps": nbytes / t_plain / 1e9,
            "ratio": t_plain / t_ours,
        }
    engine.close()
    return out


def bench_pool(
    *,
    profile: str,
    num_blocks: int = 8192,
    num_requests: int = 400,
    prompt_tokens: int = 2048,
    offload_chunks: int = 0,
    seed: int = 0,
) -> dict[str, Any]:
    """Admit/allocate/cache/free ``num_requests`` prompts (half share a prefix)."""
    rng = random.Random(seed)
    prof = get_profile(profile, page_bytes=256)
    offload = (
        OffloadConfig(num_cpu_chunks=offload_chunks, blocks_per_chunk=4) if offload_chunks else None
    )
    kv = KVCacheManager(prof, num_blocks, offload=offload, allocate_kv=False, device="cpu")
    prefixes = [[rng.randrange(150_000) for _ in range(prompt_tokens // 2)] for _ in range(8)]
    requests = []
    for i in range(num_requests):  # hashing happens here, outside the timed loop
        tail = [rng.randrange(150_000) for _ in range(prompt_tokens // 2)]
        requests.append(kv.new_request(f"r{i}", [*rng.choice(prefixes), *tail]))
    events = hashes = hit_tokens = 0
    t0 = time.perf_counter()
    for req in requests:
        gpu, cpu = kv.lookup(req)
        start = min(gpu + cpu, req.num_tokens - 1)
        if not kv.allocate_slots(req, req.num_tokens - start, gpu, cpu):
            raise RuntimeError("pool too small for one request")
        hit_tokens += gpu + cpu
        batch = kv.step_events()
        kv.free(req)
        if batch is not None:
            events += len(batch.events)
            hashes += sum(len(getattr(e, "block_hashes", ())) for e in batch.events)
    kv.flush()
    elapsed = time.perf_counter() - t0
    allocated = sum(p.num_allocated for p in kv._unique_pools)
    kv.close()
    return {
        "profile": profile,
        "offload": bool(offload_chunks),
        "requests_per_s": num_requests / elapsed,
        "blocks_per_s": allocated / elapsed,
        "events_per_s": events / elapsed,
        "event_hashes_per_s": hashes / elapsed,
        "hit_fraction": hit_tokens / (num_requests * prompt_tokens),
    }


def run(
    out: Path,
    *,
    profile: str = "full",
    page_bytes: int = 512 * 1024,
    num_blocks: int = 512,
    blocks_per_chunk: int = 4,
    repeats: int = 9,
    pool_blocks: int = 8192,
    pool_requests: int = 400,
    prompt_tokens: int = 2048,
    device: str | None = None,
) -> dict[str, Any]:
    """Run both parts, print tables, write ``out/offload.json``; returns the report."""
    dev = torch.device(device) if device else default_device()
    copies = bench_copies(
        profile=profile,
        page_bytes=page_bytes,
        num_blocks=num_blocks,
        blocks_per_chunk=blocks_per_chunk,
        repeats=repeats,
        device=dev,
    )
    pools = [
        bench_pool(
            profile=name,
            num_blocks=pool_blocks,
            num_requests=pool_requests,
            prompt_tokens=prompt_tokens,
            offload_chunks=chunks,
        )
        for name in PROFILE_NAMES
        for chunks in (0, pool_blocks)
    ]
    report = {
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "torch": torch.__version__,
        "params": {
            "profile": profile,
            "page_bytes": page_bytes,
            "num_blocks": num_blocks,
            "blocks_per_chunk": blocks_per_chunk,
            "repeats": repeats,
            "pool_blocks": pool_blocks,
            "pool_requests": pool_requests,
            "prompt_tokens": prompt_tokens,
        },
        "copies": copies,
        "pool": pools,
    }
    console = Console()
    t1 = Table(title=f"chunk copies on {dev} ({copies['bytes_per_transfer'] / 2**20:.0f} MiB)")
    for col in ("direction", "ours GB/s", "plain copy GB/s", "ratio"):
        t1.add_column(col, justify="right" if col != "direction" else "left")
    for name, row in copies["directions"].items():
        t1.add_row(
            name, f"{row['ours_gbps']:.2f}", f"{row['plain_gbps']:.2f}", f"{row['ratio']:.2f}"
        )
    console.print(t1)
    t2 = Table(title=f"block pool, {prompt_tokens}-token prompts (events on)")
    for col in ("profile", "CPU tier", "requests/s", "blocks/s", "events/s", "hit"):
        t2.add_column(col, justify="right" if col not in ("profile", "CPU tier") else "left")
    for row in pools:
        t2.add_row(
            row["profile"],
            "yes" if row["offload"] else "no",
            f"{row['requests_per_s']:.0f}",
            f"{row['blocks_per_s']:.0f}",
            f"{row['events_per_s']:.0f}",
            f"{row['hit_fraction']:.2f}",
        )
    console.print(t2)
    path = write_report(out, "offload", report)
    console.print(f"report: {path}")
    return report
