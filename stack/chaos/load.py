"""Scenario: many concurrent streams through one router, each checked token for token."""

from __future__ import annotations

import asyncio
import time

from stack.chaos.client import metrics_text, new_client, scrape, send_completion
from stack.chaos.results import StreamLoadResult
from stack.procs import Fleet, rss_mb, start_engines


async def stream_load(
    fleet: Fleet,
    *,
    streams: int = 1000,
    rounds: int = 1,
    engines: int = 4,
    max_tokens: int = 8,
    engine_args: tuple[str, ...] = ("--profile", "full", "--time-scale", "50"),
    router_env: dict[str, str] | None = None,
) -> StreamLoadResult:
    """``streams`` concurrent streaming completions through one router over ``engines``
    engines, ``rounds`` times; each stream's text must be what its engine's deterministic
    filler gives for its prompt, with one response id and one engine throughout."""
    procs = start_engines(fleet, engines, *engine_args, "--max-num-seqs", "512")
    router = fleet.router(procs, env=router_env)
    async with new_client(streams + 10, timeout=120) as client:
        warm = [
            send_completion(client, router.url, i, f"warm-up {i} " * (1 + i % 7), max_tokens)
            for i in range(40)
        ]
        warm_lost = [o.describe() for o in await asyncio.gather(*warm) if not o.ok]
        await asyncio.sleep(1.0)
        baseline = rss_mb(router.pid)
        lost: list[str] = []
        wall: list[float] = []
        after: list[float] = []
        ids: set[str] = set()
        total = 0
        peaks: list[float] = [baseline]

        async def sample(done: asyncio.Event) -> None:
            while not done.is_set():
                peaks.append(rss_mb(router.pid))
                await asyncio.sleep(0.1)

        for rnd in range(rounds):
            done = asyncio.Event()
            sampler = asyncio.create_task(sample(done))
            t0 = time.monotonic()
            outcomes = await asyncio.gather(
                *(
                    send_completion(
                        client,
                        router.url,
                        i,
                        f"round {rnd} stream {i}: " + "x" * (i % 97),
                        max_tokens,
                    )
                    for i in range(streams)
                )
            )
            wall.append(time.monotonic() - t0)
            done.set()
            await sampler
            total += len(outcomes)
            lost += [o.describe() for o in outcomes if not o.ok]
            for o in outcomes:
                ids |= o.ids
            await asyncio.sleep(2.0)  # settle: connections close, buffers go
            after.append(rss_mb(router.pid))
        metrics = await metrics_text(client, router.url)
    return StreamLoadResult(
        streams=streams,
        rounds=rounds,
        requests=total,
        lost=lost,
        warm_lost=warm_lost,
        distinct_ids=len(ids),
        wall_s=wall,
        rss_baseline_mb=baseline,
        rss_peak_mb=max(peaks),
        rss_after_mb=after,
        running_after={
            p.url: scrape(metrics, "kvroute_router_running_requests", instance=p.url) for p in procs
        },
        inflight_after={
            p.url: scrape(metrics, "kvroute_router_inflight_requests", instance=p.url)
            for p in procs
        },
    )
