"""``kvroute bench overhead``: what a router adds to each request, and our decision time.

Proxy overhead (``bench.replay.interleave``): the upstream called directly and through
each router, interleaved round by round at 1, 4 and 16 clients, in front of a minimal
upstream and of one simulated engine; added p50/p99 and router CPU per request. Small
completions (a shared 512-token prefix plus 512 tokens of their own, ``max_tokens=1``).
Decision time: ``Router.decide`` in-process (tokenize, hash, score, choose; for a new
prompt and for one whose prefix the router hashed before) and ``Scorer.score`` +
``policy.choose`` alone, for an 8k-token prompt over N instances whose index holds a
shared prefix, longer matches on a few instances (GPU and CPU tiers, both groups of the
swa-hybrid layout) and unrelated blocks.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from bench.common import machine_info
from bench.replay.interleave import proxy_overhead
from bench.replay.records import percentile
from bench.replay.trace import block_text
from events.groups import FullAttentionSpec, SlidingWindowSpec
from events.hashing import hash_request_blocks, wire_hash
from events.structs import BlockStored, KVEventBatch
from router.build import build_router
from router.config import RouterSettings
from router.decision.layout import InstanceLayout, LayoutRegistry
from router.decision.policy import Candidate
from router.decision.prompt_hashes import PromptHashes
from router.fleet.instances import Instance
from router.fleet.specs import InstanceSpec
from router.index.memory import MemoryIndex

__all__ = ["decision_time", "proxy_overhead", "run_overhead"]


def _stats(xs: list[float]) -> dict[str, float | None]:
    p50, p99 = percentile(xs, 50), percentile(xs, 99)
    return {"p50_ms": p50 * 1e3 if p50 else None, "p99_ms": p99 * 1e3 if p99 else None}


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
    settings = RouterSettings(policy="cost", block_size=16, hash_algo="sha256_cbor",
                              tokenizer="byte", speculative_ttl_s=0.0)  # fmt: skip
    router = build_router(
        settings, index=index, layouts=LayoutRegistry(default=layout),
        registry=_StaticRegistry(names),
    )  # fmt: skip
    scorer, policy = router.scorer, router.policy

    async def full() -> None:  # a prompt not seen before: every block hashed
        router.prompt_hashes = PromptHashes(settings.hash_algo, settings.seed)
        await router.decide({"prompt": text}, "completion")

    async def repeated() -> None:  # its prefix seen before (next turn, shared system prompt)
        await router.decide({"prompt": text}, "completion")

    async def score_choose() -> None:
        s = await scorer.score(hashes, len(ids), names)
        cands = [Candidate(k, v.gpu_tokens, v.cpu_tokens) for k, v in s.items()]
        policy.choose(cands, len(ids))

    return {
        "decide": _stats(await _time(full, repeats)),
        "decide, prefix seen before": _stats(await _time(repeated, repeats)),
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
    routers: Sequence[str], out: Path, *, command: str | None = None, **proxy: Any
) -> dict[str, Any]:
    """Both measurements; writes ``results.json`` and ``report.md`` under ``out``.
    ``proxy``: ``proxy_overhead``'s settings (rounds, per_batch, concurrency, upstreams)."""
    out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    report = {
        "command": command or " ".join(machine["argv"]),
        "machine": machine,
        "decision_time": decision_time(),
        "proxy": proxy_overhead(routers, out, **proxy),
    }
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(overhead_markdown(report))
    return report


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def overhead_markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "# kvroute bench overhead",
        "",
        f"Command: `{report.get('command') or ' '.join(m['argv'])}`",
        "",
        f"Machine: {m['processor']}, {m['cpus']} CPUs, {m['platform']}, {m['time']}.",
        "",
        "## Added latency per request (router minus direct, same interleaved run, ms)",
        "",
        "Targets interleaved round by round in rotating order, each batch once every router",
        "is idle again. CPU: the router process's",
        "run time per request, all threads (all its workers for ours:cost*N). req/s: requests over",
        "the batches' wall time (closed loop: at 16 clients about saturation).",
        "vs sglang: our added p50 over sglang-router's.",
        "",
        "| upstream | clients | router | p50 | p99 | added p50 | added p99 | CPU ms/req | req/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for upstream, cells in report["proxy"].items():
        for conc, row in cells.items():
            if conc == "stages_ms":
                continue
            for name, s in row.items():
                lines.append(
                    f"| {upstream} | {conc} | {name} | {_f(s['p50_ms'])} | {_f(s['p99_ms'])} "
                    f"| {_f(s.get('added_p50_ms'))} | {_f(s.get('added_p99_ms'))} "
                    f"| {_f(s.get('cpu_ms_per_request'))} | {_f(s.get('requests_per_s'))} |"
                )
    stage_rows = [
        (upstream, name, st)
        for upstream, cells in report["proxy"].items()
        for name, st in cells.get("stages_ms", {}).items()
        if st
    ]
    if stage_rows:
        names = list(stage_rows[0][2])
        lines += ["", "## Our router's mean time per stage over the run (ms)", ""]
        lines += ["`kvroute_router_stage_seconds`; upstream_* include the upstream's time.", ""]
        lines += ["| upstream | router | " + " | ".join(names) + " |"]
        lines += ["|---|---|" + "---|" * len(names)]
        for upstream, name, st in stage_rows:
            row_ = " | ".join(_f(st.get(k), 3) for k in names)
            lines.append(f"| {upstream} | {name} | {row_} |")
    lines += ["", "## Routing decision time, ours in-process (8,192-token prompt, ms)", ""]
    lines += ["| instances | step | p50 | p99 |", "|---|---|---|---|"]
    for n, row in report["decision_time"].items():
        for step, s in row.items():
            lines.append(f"| {n} | {step} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} |")
    return "\n".join(lines) + "\n"
