"""``kvroute bench replicas``: the same bursts through one router and split across replicas.

Three simulated Gemma-3-like engines (``--profile gemma3``, real-time prefill), one private
``redis-server`` holding the shared index, and 1, 2 or 3 router processes on it. Each burst
is six requests sharing a new prefix (2.5k characters), 50 ms apart, request i sent to
replica i mod R. Per setup: tokens the engines reused (their ``usage.kv_hit``), engines
per burst (1 is a burst that landed together), and exact predictions (the router's
``x-kvroute-predicted-hit`` == the engine's GPU hit). With ``--no-share`` the replicas
route as before this work (each sees only its own records and load), for comparison.
Also reported: the replica-share staleness (publish to receipt) the routers measured.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import write_report
from stack.procs import KVROUTE, Fleet, Proc, free_port

__all__ = ["run"]

log = logging.getLogger(__name__)

ENGINE_ARGS = ("--profile", "gemma3", "--time-scale", "1", "--gpu-blocks", "4096")
START_S = 300.0  # a loaded 2-core machine starts a process in tens of seconds


def _router(fleet: Fleet, engines: list[Proc], args: list[str], env: dict[str, str]) -> Proc:
    """A ``kvroute router`` launched, not yet waited for (``Fleet.router`` waits 60 s)."""
    port = free_port()
    cmd = [*KVROUTE, "--log-level", "WARNING", "router", "--port", str(port)]
    cmd += ["--health-interval", "0.5", "--log-level", "warning", *args]
    for e in engines:
        cmd += ["--instance", e.instance_arg()]
    p = Proc(f"router-{port}", cmd, port, fleet.dir / f"router-{port}.log", env)
    fleet.procs.append(p.launch())
    return p


def _prefix(rng: random.Random, chars: int) -> str:
    words = []
    n = 0
    while n < chars:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
        words.append(w)
        n += len(w) + 1
    return " ".join(words)[:chars]


async def _burst(
    client: httpx.AsyncClient, routers: list[Proc], prefix: str, size: int, gap_s: float, b: int
) -> list[dict[str, Any]]:
    async def one(i: int) -> dict[str, Any]:
        await asyncio.sleep(i * gap_s)
        router = routers[i % len(routers)]
        body = {"prompt": f"{prefix}\nQuestion {b}.{i}: what follows?", "max_tokens": 4}
        r = await client.post(f"{router.url}/v1/completions", json=body)
        r.raise_for_status()
        hit = r.json()["usage"].get("kv_hit") or {}
        return {
            "replica": i % len(routers),
            "instance": r.headers.get("x-kvroute-instance"),
            "predicted": int(r.headers.get("x-kvroute-predicted-hit", -1)),
            "gpu_hit": int(hit.get("gpu_tokens", 0)),
            "cpu_hit": int(hit.get("cpu_tokens", 0)),
        }

    return list(await asyncio.gather(*(one(i) for i in range(size))))


_BUCKET = re.compile(
    r'^kvroute_replica_share_staleness_seconds_bucket\{le="([^"]+)"\} (\S+)$', re.M
)
_SUM = re.compile(r"^kvroute_replica_share_staleness_seconds_sum (\S+)$", re.M)


def _staleness(routers: list[Proc]) -> dict[str, float] | None:
    """Publish-to-receipt lag the replicas measured (their histograms, summed): the mean,
    and the bucket bounds under which half and 99% of the messages arrived."""
    buckets: dict[float, float] = {}
    total = 0.0
    for r in routers:
        text = httpx.get(f"{r.url}/metrics", timeout=10).text
        for le, n in _BUCKET.findall(text):
            buckets[float(le)] = buckets.get(float(le), 0.0) + float(n)
        if m := _SUM.search(text):
            total += float(m.group(1))
    count = buckets.get(float("inf"), 0.0)
    if not count:
        return None

    def bound(q: float) -> float:
        return next(le for le, n in sorted(buckets.items()) if n >= q * count) * 1e3

    return {
        "messages": count,
        "mean_ms": 1e3 * total / count,
        "p50_le_ms": bound(0.5),
        "p99_le_ms": bound(0.99),
    }


async def _run_setup(
    routers: list[Proc], bursts: int, size: int, gap_s: float, chars: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    rows: list[list[dict[str, Any]]] = []
    async with httpx.AsyncClient(timeout=60) as client:
        for b in range(bursts):
            rows.append(await _burst(client, routers, _prefix(rng, chars), size, gap_s, b))
            await asyncio.sleep(0.3)  # the burst's events settle before the next
    flat = [r for burst in rows for r in burst]
    engines = [len({r["instance"] for r in burst}) for burst in rows]
    return {
        "requests": len(flat),
        "reused_tokens": sum(r["gpu_hit"] + r["cpu_hit"] for r in flat),
        "engines_per_burst_mean": statistics.mean(engines),
        "bursts_on_one_engine": sum(e == 1 for e in engines),
        "exact": sum(r["predicted"] == r["gpu_hit"] for r in flat),
        "staleness": _staleness(routers),
        "per_burst": rows,
    }


def run(
    out: Path,
    *,
    replicas: list[int],
    bursts: int = 10,
    size: int = 6,
    gap_s: float = 0.05,
    chars: int = 2500,
    share: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    results: dict[str, Any] = {}
    for n in replicas:
        with Fleet() as fleet:
            redis = fleet.redis()
            engines = [fleet.engine(*ENGINE_ARGS, wait=False) for _ in range(3)]
            log.info("%d replicas: starting 3 engines and the routers", n)
            engines = [e.wait_ready(START_S) for e in engines]
            args = ["--index", f"redis://127.0.0.1:{redis.port}/0", "--model", f"bench-{n}"]
            env = {} if share else {"KVROUTE_SHARE_REPLICAS": "false"}
            # One replica ingests; the others read the shared index (as --workers does).
            routers = [_router(fleet, engines, args, env)]
            for _ in range(n - 1):
                routers.append(_router(fleet, engines, args, {**env, "KVROUTE_INGEST": "false"}))
            routers = [r.wait_ready(START_S) for r in routers]
            t0 = time.monotonic()
            res = asyncio.run(_run_setup(routers, bursts, size, gap_s, chars, seed))
            res["wall_s"] = time.monotonic() - t0
            results[str(n)] = res
    head = f"{'replicas':>8} {'requests':>8} {'reused tok':>10} {'eng/burst':>9} "
    head += f"{'1-engine':>8} {'exact':>7} {'stale mean/p50 ms':>18}"
    print(head)
    for n, r in results.items():
        st = r["staleness"]
        stale = f"{st['mean_ms']:.1f}/<={st['p50_le_ms']:g}" if st else "-"
        print(
            f"{n:>8} {r['requests']:>8} {r['reused_tokens']:>10} "
            f"{r['engines_per_burst_mean']:>9.2f} {r['bursts_on_one_engine']:>8} "
            f"{r['exact']:>3}/{r['requests']:<3} {stale:>18}"
        )
    report = {
        "benchmark": "replicas",
        "share": share,
        "bursts": bursts,
        "burst_size": size,
        "gap_s": gap_s,
        "prefix_chars": chars,
        "engine_args": list(ENGINE_ARGS),
        "results": results,
    }
    path = write_report(out, "replicas" if share else "replicas-no-share", report)
    print(f"report: {path}")
    return report
