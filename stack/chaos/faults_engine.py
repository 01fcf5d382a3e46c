"""Scenario: an engine is SIGKILLed mid-run, then comes back on the same ports."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable

import httpx

from stack.chaos.client import (
    StreamOutcome,
    healthy_is,
    holds,
    index_tokens,
    metrics_text,
    new_client,
    route_view,
    running_on,
    scrape,
    send_completion,
    wait_for,
)
from stack.chaos.results import EngineKillResult
from stack.procs import Fleet, start_engines


async def engine_kill(
    fleet: Fleet,
    *,
    requests: int = 40,
    spread_s: float = 3.0,
    max_tokens: int = 48,
    engine_args: tuple[str, ...] = ("--profile", "full", "--time-scale", "1"),
) -> EngineKillResult:
    """Two engines behind a router; streams arrive over ``spread_s``; engine A is killed
    while some of its streams run and more requests are still to come; then A restarts
    on the same ports."""
    a, b = start_engines(fleet, 2, *engine_args, "--gpu-blocks", "2048")
    token = uuid.uuid4().hex
    router = fleet.router([a, b], env={"KVROUTE_ADMIN_TOKEN": token})
    admin = {"authorization": f"Bearer {token}"}
    old_prompt = f"residency of the first incarnation {uuid.uuid4().hex} " * 6
    async with new_client(requests + 20) as client:
        # A holds prompts the router knows about (sent to A directly, not routed).
        for i in range(6):
            body = {"prompt": f"{i} {old_prompt}" if i else old_prompt, "max_tokens": 2}
            r = await client.post(f"{a.url}/v1/completions", json=body)
            r.raise_for_status()
        await wait_for(
            lambda: holds(client, router.url, old_prompt, a.url),
            30,
            what="the router to ingest A's blocks",
        )
        old_last_seq = await _admin_last_seq(client, router.url, admin, a.url)

        async def one(i: int) -> StreamOutcome:
            await asyncio.sleep(spread_s * i / requests)
            prompt = f"request {i} of the kill run; " * (2 + i % 5)
            return await send_completion(
                client, router.url, i, prompt, max_tokens, stream=i % 4 != 3
            )

        def streams_on_a() -> Awaitable[float]:
            return wait_for(
                lambda: running_on(client, router.url, a.url),
                spread_s * 3,
                interval=0.02,
                what="streams running on A",
            )

        t_start = time.monotonic()
        tasks = [asyncio.create_task(one(i)) for i in range(requests)]
        try:
            # Kill A once some of its streams are running, while later requests are pending.
            first_running_s = await streams_on_a()
            await asyncio.sleep(max(0.0, spread_s * 0.3 - (time.monotonic() - t_start)))
            await streams_on_a()
            t_kill = time.monotonic()
            a.kill()
            down_s = await wait_for(
                lambda: healthy_is(client, router.url, a.url, 0.0),
                15,
                interval=0.05,
                what="A to be marked down",
            )
            outcomes = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        metrics = await metrics_text(client, router.url)
        resyncs_after_kill = scrape(metrics, "kvroute_ingest_resyncs_total", instance=a.url)

        # A comes back on the same ports: a new incarnation, sequence from 0, empty cache.
        t_restart = time.monotonic()
        fleet.restart(a).wait_ready()
        restart_s = time.monotonic() - t_restart
        up_s = await wait_for(
            lambda: healthy_is(client, router.url, a.url, 1.0),
            20,
            interval=0.05,
            what="A to be marked up again",
        )
        # Before A publishes anything, the router must credit it with nothing.
        view = await route_view(client, router.url, old_prompt)
        old_after_restart = index_tokens(view, a.url)
        new_prompt = f"second incarnation {uuid.uuid4().hex} " * 6

        async def rebuilt() -> bool:
            r = await client.post(f"{a.url}/v1/completions", json={"prompt": new_prompt})
            r.raise_for_status()  # (repeats are cached: the new incarnation publishes once)
            return bool(await holds(client, router.url, new_prompt, a.url))

        rebuild_s = await wait_for(rebuilt, 20, interval=0.3, what="A's new events")
        view = await route_view(client, router.url, old_prompt)
        old_after_rebuild = index_tokens(view, a.url)
        new_last_seq = await _admin_last_seq(client, router.url, admin, a.url)
        recovery_s = time.monotonic() - t_restart
    return EngineKillResult(
        old_last_seq=old_last_seq,
        first_running_on_killed_s=first_running_s,
        kill_at_s=t_kill - t_start,
        requests=len(outcomes),
        sent_after_kill=sum(1 for o in outcomes if o.started_at > t_kill),
        running_at_kill=sum(1 for o in outcomes if o.started_at < t_kill and o.ended_at > t_kill),
        broken_streams=[o.index for o in outcomes if o.failed_cleanly],
        broken_streams_not_from_killed=[
            o.index for o in outcomes if o.failed_cleanly and o.instance != a.url
        ],
        lost=[o.describe() for o in outcomes if o.lost],
        served_by={u: sum(1 for o in outcomes if o.ok and o.instance == u) for u in (a.url, b.url)},
        detect_down_s=down_s,
        resyncs_after_kill=resyncs_after_kill,
        restart_s=restart_s,
        old_residency_after_restart=old_after_restart,
        old_residency_after_rebuild=old_after_rebuild,
        new_last_seq=new_last_seq,
        recovery_s=recovery_s,
        up_after_restart_s=up_s,
        rebuild_s=rebuild_s,
    )


async def _admin_last_seq(
    client: httpx.AsyncClient, router: str, headers: dict[str, str], instance: str
) -> int | None:
    r = await client.get(f"{router}/admin/instances", headers=headers)
    r.raise_for_status()
    for inst in r.json()["instances"]:
        if inst["url"] == instance:
            return inst["last_seq"]
    return None
