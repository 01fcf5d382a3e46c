"""Scenario: Redis (the shared block index) dies under load and comes back empty."""

from __future__ import annotations

import asyncio
import time
import uuid

from stack.chaos.client import (
    StreamOutcome,
    holds,
    index_ok,
    metrics_text,
    new_client,
    route_view,
    scrape,
    send_completion,
    wait_for,
)
from stack.chaos.results import RedisOutageResult
from stack.procs import LOOPBACK, Fleet, start_engines


async def redis_outage(
    fleet: Fleet,
    *,
    downtime_s: float = 3.0,
    concurrency: int = 4,
    max_tokens: int = 4,
    engine_args: tuple[str, ...] = ("--profile", "swa-hybrid", "--time-scale", "20"),
) -> RedisOutageResult:
    """Two engines, a router on a Redis index, a steady load; Redis is SIGKILLed, stays
    down ``downtime_s`` (shorter than ingest's retry budget, so the feed never gives up on
    its own), and comes back empty. A prompt cached before the outage is never sent again:
    only a replay from seq 0 can bring its residency back -- as long as the engine still
    holds it: the load allocates several hundred blocks a second per engine, and with 4,096
    blocks the probe was evicted (correctly dropped from the rebuilt index) on a slow run."""
    redis = fleet.redis()
    engines = start_engines(fleet, 2, *engine_args, "--gpu-blocks", "32768")
    router = fleet.router(engines, "--index", f"redis://{LOOPBACK}:{redis.port}/0")
    probe = f"history that only a replay can restore {uuid.uuid4().hex} " * 6
    stop = asyncio.Event()
    outcomes: list[StreamOutcome] = []
    async with new_client(concurrency + 10) as client:
        r = await client.post(f"{router.url}/v1/completions", json={"prompt": probe})
        r.raise_for_status()
        holder = r.headers["x-kvroute-instance"]
        await wait_for(
            lambda: holds(client, router.url, probe, holder), 30, what="the probe in Redis"
        )

        async def worker(w: int) -> None:
            i = 0
            while not stop.is_set():
                prompt = f"load {w}-{i} under a redis outage; " * (1 + i % 4)
                outcomes.append(
                    await send_completion(
                        client, router.url, len(outcomes), prompt, max_tokens, stream=i % 2 == 0
                    )
                )
                i += 1
                await asyncio.sleep(0)

        workers = [asyncio.create_task(worker(w)) for w in range(concurrency)]
        try:
            await asyncio.sleep(1.0)
            before = len(outcomes)
            redis.kill()
            t_kill = time.monotonic()
            fallback_seen = False
            while time.monotonic() - t_kill < downtime_s:
                view = await route_view(client, router.url, probe)
                fallback_seen = fallback_seen or view["index_ok"] is False
                await asyncio.sleep(0.2)
            during = len(outcomes) - before
            await asyncio.to_thread(lambda: fleet.restart(redis).wait_ready(15))
            t_up = time.monotonic()
            index_back_s = await wait_for(
                lambda: index_ok(client, router.url, probe), 30, what="lookups to work again"
            )
            await wait_for(
                lambda: holds(client, router.url, probe, holder), 30, what="the probe rebuilt"
            )
            recovery_s = time.monotonic() - t_up

            async def all_resynced() -> bool:
                text = await metrics_text(client, router.url)
                resyncs = "kvroute_ingest_resyncs_total"
                return all(scrape(text, resyncs, instance=e.url) >= 1 for e in engines)

            # An instance that got no batch since Redis came back finds its cursor gone
            # only at ingest's next cursor check (every 2 s): wait for it, not a guess.
            await wait_for(all_resynced, 30, what="every instance's history replayed")
            view = await route_view(client, router.url, probe)
            await asyncio.sleep(0.5)
        finally:
            stop.set()
            await asyncio.gather(*workers, return_exceptions=True)
        metrics = await metrics_text(client, router.url)
    return RedisOutageResult(
        requests=len(outcomes),
        requests_during_outage=during,
        lost=[o.describe() for o in outcomes if not o.ok],
        fallback_seen=fallback_seen,
        index_back_s=index_back_s,
        recovery_s=recovery_s,
        probe_holder=holder,
        probe_view={c["instance"]: c["index_score"] for c in view["candidates"]},
        index_errors=scrape(metrics, "kvroute_router_index_errors_total"),
        resyncs={
            e.url: scrape(metrics, "kvroute_ingest_resyncs_total", instance=e.url) for e in engines
        },
    )
