"""What each router adds per request, measured in one interleaved run.

Targets: the upstream called directly, and each router in front of it, all started at once.
Each round sends a batch to every target in rotating order, at every client concurrency,
so the machine's noise (2 shared cores) falls on all alike; the added latency is a
router's p50/p99 minus the direct p50/p99 of the same cell. Two upstreams: a minimal one
(``bench.replay.upstream``: answers in microseconds; half the requests stream) and one
simulated engine (time scale 1000, non-streaming). A router's CPU seconds per request come
from the scheduler's run time of its threads and its children's
(``bench.replay.procs.cpu_seconds``: nanoseconds, not 10 ms ticks), read around its own
batches only; each batch starts once every router is idle again (``_settled``), so the
work one batch leaves behind is charged to no one's window. ``python-floor``
(``bench.replay.floor``) may stand among the routers: the cheapest proxy Python has,
deciding nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench.replay.config import EngineConfig, ReplayConfig, parse_router
from bench.replay.procs import (
    Proc,
    cpu_seconds,
    pid_listening,
    router_pid,
    running_engines,
    running_router,
    spawn,
    wait_healthy,
)
from bench.replay.records import percentile
from bench.replay.trace import block_text
from stack.procs import free_port

__all__ = ["FLOOR", "proxy_overhead"]

log = logging.getLogger(__name__)

FLOOR = "python-floor"  # bench.replay.floor: a yardstick, not a router


def _prompt(i: int) -> str:
    return block_text(0, 7) + block_text(1_000_000 + i, 7)


@dataclass
class _Target:
    name: str
    url: str
    pid: int | None
    lat: dict[int, list[float]] = field(default_factory=dict)
    cpu_s: dict[int, float] = field(default_factory=dict)
    wall_s: dict[int, float] = field(default_factory=dict)  # its batches, end to end
    count: dict[int, int] = field(default_factory=dict)


async def _batch(
    session: aiohttp.ClientSession, t: _Target, model: str, n: int, conc: int, offset: int,
    stream_every: int,
) -> None:  # fmt: skip
    queue = list(range(offset, offset + n))
    lat = t.lat.setdefault(conc, [])

    async def worker() -> None:
        while queue:
            i = queue.pop()
            body: dict[str, Any] = {"model": model, "prompt": _prompt(i), "max_tokens": 1}
            if stream_every and i % stream_every == 0:
                body["stream"] = True
            t0 = time.perf_counter()
            async with session.post(f"{t.url}/v1/completions", json=body) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"{t.name}: {r.status}")
            lat.append(time.perf_counter() - t0)

    cpu0 = cpu_seconds(t.pid) if t.pid else 0.0
    w0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    t.wall_s[conc] = t.wall_s.get(conc, 0.0) + time.perf_counter() - w0
    if t.pid:
        t.cpu_s[conc] = t.cpu_s.get(conc, 0.0) + cpu_seconds(t.pid) - cpu0
    t.count[conc] = t.count.get(conc, 0) + n


async def _settled(
    targets: Sequence[_Target], interval_s: float = 0.02, busy: float = 0.05, limit_s: float = 1.0
) -> None:
    """Return once every router is idle (together under ``busy`` of a core each over
    ``interval_s``), or after ``limit_s``. A batch leaves work behind -- the engine
    publishes its last events after its answers, and every router ingests them -- which
    otherwise lands in the next target's window, and not evenly: without this wait the
    same router code read 2-6% more CPU per request when started first (three copies
    side by side: the first above the other two in every run; with it, no order)."""
    pids = [t.pid for t in targets if t.pid]
    if not pids:
        return
    deadline = time.perf_counter() + limit_s
    last = sum(cpu_seconds(p) for p in pids)
    while time.perf_counter() < deadline:
        await asyncio.sleep(interval_s)
        now = sum(cpu_seconds(p) for p in pids)
        if now - last < busy * interval_s * len(pids):
            return
        last = now


async def _rounds(
    targets: list[_Target], model: str, rounds: int, per_batch: int,
    concurrency: Sequence[int], stream_every: int,
) -> None:  # fmt: skip
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(connector=conn) as session:
        for t in targets:  # warm connections and caches, untimed
            await _batch(session, t, model, 8, 4, 50_000_000, stream_every)
            t.lat.clear(), t.cpu_s.clear(), t.count.clear(), t.wall_s.clear()
        offset = 0
        for r in range(rounds):
            order = targets[r % len(targets) :] + targets[: r % len(targets)]
            for conc in concurrency:
                for t in order:
                    n = per_batch * max(1, conc // 4)
                    await _settled(targets)
                    await _batch(session, t, model, n, conc, offset, stream_every)
                    offset += n


@contextlib.contextmanager
def _minimal_upstream(logdir: Path) -> Iterator[tuple[str, Proc]]:
    port = free_port()
    proc = spawn("upstream", [sys.executable, "-m", "bench.replay.upstream", str(port)], logdir)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, 30)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.stop()


@contextlib.contextmanager
def _floor(upstream: str, logdir: Path) -> Iterator[str]:
    """``bench.replay.floor`` in front of ``upstream``: Python's cheapest proxy."""
    port = free_port()
    cmd = [sys.executable, "-m", "bench.replay.floor", str(port), upstream]
    proc = spawn(FLOOR, cmd, logdir)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, 30)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


@dataclass
class _Handle:  # what running_router needs of an engine
    url: str
    events: str
    replay: str


def _stats(t: _Target, direct: _Target, conc: int) -> dict[str, Any]:
    xs, ds = t.lat.get(conc, []), direct.lat.get(conc, [])
    p50, p99 = percentile(xs, 50) * 1e3, percentile(xs, 99) * 1e3
    row: dict[str, Any] = {"n": len(xs), "p50_ms": p50, "p99_ms": p99}
    if t.wall_s.get(conc):  # closed loop at ``conc`` clients: at 16, about saturation
        row["requests_per_s"] = t.count.get(conc, len(xs)) / t.wall_s[conc]
    if t is not direct:
        row["added_p50_ms"] = p50 - percentile(ds, 50) * 1e3
        row["added_p99_ms"] = p99 - percentile(ds, 99) * 1e3
        if t.pid and t.count.get(conc):
            row["cpu_ms_per_request"] = t.cpu_s[conc] / t.count[conc] * 1e3
    return row


def _measure(
    routers: Sequence[str], handles: Sequence[Any], direct_url: str, cfg: ReplayConfig,
    logdir: Path, rounds: int, per_batch: int, concurrency: Sequence[int], stream_every: int,
) -> dict[str, Any]:  # fmt: skip
    with contextlib.ExitStack() as stack:
        targets = [_Target("direct", direct_url, None)]
        for r in routers:
            if r == FLOOR:
                base = stack.enter_context(_floor(direct_url, logdir))
                targets.append(_Target(r, base, pid_listening(base)))
                continue
            kind, policy = parse_router(r)
            base, _ = stack.enter_context(
                running_router(kind, policy, handles, cfg, logdir, settle_s=0.5)
            )
            targets.append(_Target(r, base, router_pid(base)))
        asyncio.run(_rounds(targets, cfg.model, rounds, per_batch, concurrency, stream_every))
        stages = {t.name: _stages(t.url) for t in targets if t.name.startswith("ours")}
    out: dict[str, Any] = {
        f"x{c}": {t.name: _stats(t, targets[0], c) for t in targets} for c in concurrency
    }
    out["stages_ms"] = stages
    return out


_STAGE = re.compile(r'^kvroute_router_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)$', re.M)


def _stages(base: str) -> dict[str, float]:
    """Our router's mean time per stage over the run (its /metrics), ms."""
    try:
        text = httpx.get(f"{base}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for kind, stage, value in _STAGE.findall(text):
        (sums if kind == "sum" else counts)[stage] = float(value)
    return {k: sums[k] / counts[k] * 1e3 for k in sums if counts.get(k)}


def proxy_overhead(
    routers: Sequence[str],
    out: Path,
    rounds: int = 20,
    per_batch: int = 20,
    concurrency: Sequence[int] = (1, 4, 16),
    upstreams: Sequence[str] = ("minimal", "engine"),
) -> dict[str, Any]:
    """``{upstream: {"x<clients>": {target: stats}}}``; see the module docstring."""
    logs = out / "logs"
    results: dict[str, Any] = {}
    cfg = ReplayConfig(
        engines=1,
        engine=replace(EngineConfig(), profile="full", gpu_blocks=4096, cpu_blocks=0),
        time_scale=1000.0,
    )
    if "minimal" in upstreams:
        with _minimal_upstream(logs) as (url, _):
            # No engine events here: the routers' subscribers connect to an idle port.
            idle = f"tcp://127.0.0.1:{free_port()}"
            handle = _Handle(url, idle, f"tcp://127.0.0.1:{free_port()}")
            results["minimal"] = _measure(
                routers, [handle], url, cfg, logs, rounds, per_batch, concurrency, 2
            )
    if "engine" in upstreams:
        with running_engines(cfg, logs) as engines:
            results["engine"] = _measure(
                routers, engines, engines[0].url, cfg, logs, rounds, per_batch, concurrency, 0
            )
    return results
