"""``--mode live``: real engines, a real router, HTTP and ZMQ, arrivals on the wall clock.

For each router: fresh engines (same profile, capacities and seed), the router in front,
the requests sent at ``timestamp / time_scale`` as streaming ``/v1/completions`` with
``stream_options.include_usage`` (clean OpenAI bodies: peers must see nothing
non-standard), then everything stopped before the next router. Per request the client
measures TTFT (first SSE chunk) and end-to-end latency and reads which engine served it
(``system_fingerprint``), what it reused (``usage.kv_hit``) and, behind our router, what
was predicted (``x-kvroute-predicted-hit``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.replay.config import ReplayConfig, parse_router
from bench.replay.procs import EngineHandle, running_engines, running_router
from bench.replay.records import RequestRecord
from bench.replay.trace import TraceRequest, compress_arrivals, prompt_text

__all__ = ["LiveResult", "replay_http", "run_live"]

log = logging.getLogger(__name__)
FINGERPRINT = "kvroute-engine:"


@dataclass
class LiveResult:
    router: str
    records: list[RequestRecord]
    instances: list[str]
    wall_s: float
    command: list[str]


def _body(cfg: ReplayConfig, text: str, max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": cfg.model,
            "prompt": text,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


async def _one(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    rec: RequestRecord,
    names: dict[str, str],
    timeout: float,
) -> None:
    """Send one request and fill ``rec``; never raises (errors go into the record)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        async with asyncio.timeout(timeout):
            req = client.build_request(
                "POST", url, content=body, headers={"content-type": "application/json"}
            )
            resp = await client.send(req, stream=True)
            try:
                if resp.status_code != 200:
                    await resp.aread()
                    rec.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                    return
                inst = resp.headers.get("x-kvroute-instance")
                if inst is not None:
                    rec.router_instance = names.get(inst.rstrip("/"), inst)
                pred = resp.headers.get("x-kvroute-predicted-hit")
                if pred is not None and pred.isdigit():
                    rec.predicted_hit_tokens = int(pred)
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        rec.error = str(chunk["error"].get("message", chunk["error"]))[:200]
                        return
                    fp = chunk.get("system_fingerprint") or ""
                    if rec.instance is None and fp.startswith(FINGERPRINT):
                        host = fp[len(FINGERPRINT) :]
                        rec.instance = names.get(host, host)
                    if chunk.get("choices") and rec.ttft_s is None:
                        rec.ttft_s = loop.time() - t0
                    usage = chunk.get("usage")
                    if usage:
                        rec.completion_tokens = int(usage.get("completion_tokens", 0))
                        hit = usage.get("kv_hit") or {}
                        rec.gpu_hit_tokens = int(hit.get("gpu_tokens", 0))
                        rec.cpu_hit_tokens = int(hit.get("cpu_tokens", 0))
                rec.e2e_s = loop.time() - t0
                if rec.ttft_s is None:
                    rec.error = "stream ended without a token"
            finally:
                await resp.aclose()
    except TimeoutError:
        rec.error = f"timed out after {timeout:.0f}s"
    except (httpx.HTTPError, ValueError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]


async def replay_http(
    base_url: str,
    requests: Sequence[TraceRequest],
    cfg: ReplayConfig,
    names: dict[str, str],
    *,
    concurrency: int = 512,
    request_timeout_s: float = 300.0,
    deadline_s: float = 900.0,
    progress: Callable[[int, int], None] | None = None,
) -> list[RequestRecord]:
    """Send ``requests`` to ``base_url`` on the trace's (compressed) arrival times."""
    arrivals = compress_arrivals(requests, cfg.time_scale)
    bodies = [
        _body(cfg, prompt_text(r, cfg.seed, cfg.block_chars), cfg.max_tokens(r.output_length))
        for r in requests
    ]
    records = [
        RequestRecord(r.index, arrivals[i], r.input_length, cfg.max_tokens(r.output_length))
        for i, r in enumerate(requests)
    ]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(request_timeout_s, connect=10.0)
    sem = asyncio.Semaphore(concurrency)
    done = 0
    url = f"{base_url}/v1/completions"
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def go(i: int) -> None:
            nonlocal done
            delay = start + arrivals[i] - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                records[i].arrival_s = loop.time() - start  # when it was really sent
                await _one(client, url, bodies[i], records[i], names, request_timeout_s)
            done += 1
            if progress is not None:
                progress(done, len(records))

        tasks = [asyncio.create_task(go(i)) for i in range(len(requests))]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for rec in records:
            if rec.ttft_s is None and rec.error is None:
                rec.error = f"not finished within the {deadline_s:.0f}s deadline"
    return records


def _names(engines: Sequence[EngineHandle]) -> dict[str, str]:
    """Both ways an engine is named on the wire (fingerprint host:port, router URL)."""
    out = {}
    for e in engines:
        out[e.host_port] = e.name
        out[e.url] = e.name
    return out


def run_live(
    requests: Sequence[TraceRequest],
    router: str,
    cfg: ReplayConfig,
    workdir: Path,
    *,
    deadline_s: float = 900.0,
    progress: Callable[[int, int], None] | None = None,
) -> LiveResult:
    """One router's live replay on fresh engines; everything is stopped on return."""
    kind, policy = parse_router(router)
    logdir = workdir / "logs" / router.replace(":", "-")
    t0 = time.perf_counter()
    with (
        running_engines(cfg, logdir) as engines,
        running_router(kind, policy, engines, cfg, logdir) as (base, cmd),
    ):
        records = asyncio.run(
            replay_http(
                base, requests, cfg, _names(engines), deadline_s=deadline_s, progress=progress
            )
        )
    if kind != "ours" or policy in ("round_robin", "least_loaded"):
        for rec in records:  # only our scoring policies predict anything
            rec.predicted_hit_tokens = None
    names = [e.name for e in engines]
    return LiveResult(router, records, names, time.perf_counter() - t0, cmd)
