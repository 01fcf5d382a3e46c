"""``kvroute bench overhead``: what a router adds to each request, and our decision time.

Proxy overhead: two engines that compute almost nothing (time scale 1000), small
non-streaming completions (a shared 512-token prefix plus 512 tokens of their own,
``max_tokens=1``), sent directly to an engine and through each router, sequentially and
with a few concurrent clients; the added latency is the router's p50/p99 minus the
direct p50/p99 of the same phase. Decision time: ``Router.decide`` in-process (tokenize,
hash, score, choose) and ``Scorer.score`` + ``policy.choose`` alone, for an 8k-token
prompt over N instances whose index holds a shared prefix, longer matches on a few
instances (GPU and CPU tiers, both groups of the swa-hybrid layout) and unrelated blocks.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from bench.common import machine_info
from bench.replay.config import EngineConfig, ReplayConfig, parse_router
from bench.replay.procs import running_engines, running_router
from bench.replay.records import percentile
from bench.replay.trace import block_text
from events.groups import FullAttentionSpec, SlidingWindowSpec
from events.hashing import hash_request_blocks, wire_hash
from events.structs import BlockStored, KVEventBatch
from router.config import InstanceSpec
from router.decide import Router
from router.index.memory import MemoryIndex
from router.instances import Instance
from router.layout import InstanceLayout, LayoutRegistry
from router.metrics import RouterMetrics
from router.policy import Candidate, make_policy
from router.score import Scorer
from router.speculative import SpeculativeResidency
from router.tokenize import RoutingTokenizer

__all__ = ["decision_time", "proxy_overhead", "run_overhead"]


def _prompt(i: int) -> str:
    return block_text(0, 7) + block_text(1_000_000 + i, 7)


async def _latencies(
    urls: Sequence[str], model: str, n: int, concurrency: int, offset: int
) -> list[float]:
    """Wall seconds per request; request i goes to ``urls[i % len(urls)]``."""
    out: list[float] = []
    queue = list(range(n))
    async with httpx.AsyncClient(timeout=30.0) as client:

        async def worker() -> None:
            while queue:
                i = queue.pop()
                body = {"model": model, "prompt": _prompt(offset + i), "max_tokens": 1}
                t0 = time.perf_counter()
                r = await client.post(f"{urls[i % len(urls)]}/v1/completions", json=body)
                out.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {r.text[:200]}")

        for i in range(min(5, n)):  # warm connections and caches, untimed
            body = {"model": model, "prompt": _prompt(10_000_000 + i), "max_tokens": 1}
            await client.post(f"{urls[0]}/v1/completions", json=body)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def _stats(xs: list[float]) -> dict[str, float | None]:
    p50, p99 = percentile(xs, 50), percentile(xs, 99)
    return {"p50_ms": p50 * 1e3 if p50 else None, "p99_ms": p99 * 1e3 if p99 else None}


def proxy_overhead(
    routers: Sequence[str], out: Path, requests: int = 200, concurrency: int = 4
) -> dict[str, Any]:
    cfg = ReplayConfig(
        engines=2,
        engine=replace(EngineConfig(), profile="full", gpu_blocks=4096, cpu_blocks=0),
        time_scale=1000.0,
    )
    results: dict[str, Any] = {}
    with running_engines(cfg, out / "logs") as engines:
        urls = [e.url for e in engines]
        phases = {"sequential": 1, f"concurrent x{concurrency}": concurrency}
        direct = {
            p: asyncio.run(_latencies(urls, cfg.model, requests, c, 0)) for p, c in phases.items()
        }
        results["direct"] = {p: _stats(v) for p, v in direct.items()}
        for r in routers:
            kind, policy = parse_router(r)
            with running_router(kind, policy, engines, cfg, out / "logs") as (base, _):
                row: dict[str, Any] = {}
                for p, c in phases.items():
                    lat = asyncio.run(_latencies([base], cfg.model, requests, c, 100_000))
                    s, d = _stats(lat), results["direct"][p]
                    row[p] = {
                        **s,
                        "added_p50_ms": s["p50_ms"] - d["p50_ms"],
                        "added_p99_ms": s["p99_ms"] - d["p99_ms"],
                    }
                results[r] = row
    return results


class _StaticRegistry:
    """The one registry method ``Router.decide`` uses: every instance is healthy."""

    def __init__(self, names: Sequence[str]) -> None:
        self._instances = [Instance(InstanceSpec(n)) for n in names]

    def healthy(self) -> list[Instance]:
        return self._instances


def decision_time(
    instances: Sequence[int] = (8, 32), tokens: int = 8192, repeats: int = 300, seed: int = 0
) -> dict[str, Any]:
    """In-process routing decision time of our router (no HTTP)."""
    rng = random.Random(seed)
    text = "".join(block_text(b, 11) for b in range(tokens // 512))
    layout = InstanceLayout((FullAttentionSpec(16), SlidingWindowSpec(16, 1024)), 0, 64)
    return {
        f"{n} instances": asyncio.run(_decision_row(n, text, layout, rng, repeats))
        for n in instances
    }


async def _decision_row(
    n: int, text: str, layout: InstanceLayout, rng: random.Random, repeats: int
) -> dict[str, Any]:
    ids = list(text.encode())
    hashes = [wire_hash(h) for h in hash_request_blocks(ids, 16, "sha256_cbor", None)]
    index = MemoryIndex()
    names = [f"engine-{i}" for i in range(n)]
    for k, name in enumerate(names):
        m = rng.randint(len(hashes) // 2, len(hashes)) if k < 3 else 32  # system prompt
        evs = []
        for g in (0, 1):
            lo = 0 if g == 0 else max(0, m - 64)
            for medium, hi in (("GPU", m), ("CPU", min(len(hashes), m + 64))):
                evs.append(_stored(hashes[lo:hi], g, medium, layout))
        evs.append(_stored([rng.getrandbits(64) for _ in range(20_000)], 0, "GPU", layout))
        index.apply_sync(name, KVEventBatch(ts=1.0, events=evs))
    scorer = Scorer(index, LayoutRegistry(default=layout))
    policy = make_policy("cost")
    router = Router(
        registry=_StaticRegistry(names), scorer=scorer, index=index,  # type: ignore[arg-type]
        policy=policy, tokenizer=RoutingTokenizer("byte"), speculative=SpeculativeResidency(0.0),
        metrics=RouterMetrics(), block_size=16, hash_algo="sha256_cbor", seed=None,
    )  # fmt: skip

    async def full() -> None:
        await router.decide({"prompt": text}, "completion")

    async def score_choose() -> None:
        s = await scorer.score(hashes, len(ids), names)
        cands = [Candidate(k, v.gpu_tokens, v.cpu_tokens) for k, v in s.items()]
        policy.choose(cands, len(ids))

    return {
        "decide": _stats(await _time(full, repeats)),
        "score+choose": _stats(await _time(score_choose, repeats)),
    }


def _stored(hashes: list[int], group: int, medium: str, layout: InstanceLayout) -> BlockStored:
    spec = layout.groups[group]
    return BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
        medium=medium, lora_name=None, group_idx=group, kv_cache_spec_kind=spec.kind,
        kv_cache_spec_sliding_window=spec.sliding_window,
    )  # fmt: skip


async def _time(fn: Callable[[], Awaitable[None]], repeats: int) -> list[float]:
    for _ in range(10):
        await fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


def run_overhead(
    routers: Sequence[str],
    out: Path,
    requests: int = 200,
    concurrency: int = 4,
    command: str | None = None,
) -> dict[str, Any]:
    """Both measurements; writes ``overhead.json`` and ``overhead.md`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    report = {
        "command": command or " ".join(machine["argv"]),
        "machine": machine,
        "decision_time": decision_time(),
        "proxy": proxy_overhead(routers, out, requests, concurrency),
    }
    (out / "overhead.json").write_text(json.dumps(report, indent=1))
    (out / "overhead.md").write_text(overhead_markdown(report))
    return report


def overhead_markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "# kvroute bench overhead",
        "",
        f"Command: `{report.get('command') or ' '.join(m['argv'])}`",
        "",
        f"Machine: {m['processor']}, {m['cpus']} CPUs, {m['platform']}, {m['time']}.",
        "",
        "## Added latency per request (router minus direct engine call, ms)",
        "",
        "| router | phase | p50 | p99 | added p50 | added p99 |",
        "|---|---|---|---|---|---|",
    ]
    proxy = report["proxy"]
    for phase, s in proxy["direct"].items():
        lines.append(f"| direct | {phase} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | | |")
    for name, row in proxy.items():
        if name == "direct":
            continue
        for phase, s in row.items():
            lines.append(
                f"| {name} | {phase} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} "
                f"| {s['added_p50_ms']:.2f} | {s['added_p99_ms']:.2f} |"
            )
    lines += ["", "## Routing decision time, ours in-process (8,192-token prompt, ms)", ""]
    lines += ["| instances | step | p50 | p99 |", "|---|---|---|---|"]
    for n, row in report["decision_time"].items():
        for step, s in row.items():
            lines.append(f"| {n} | {step} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} |")
    return "\n".join(lines) + "\n"
