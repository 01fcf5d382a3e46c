"""Admission control end to end: real engines, a real router, real HTTP.

A request holds its instance's in-flight slot while its stream is open; closing the
client's stream frees it, so these tests control busy-ness exactly without timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
from kvtest import engines, start_router

SLOW = ("--profile", "full", "--time-scale", "1")
LONG = {"prompt": "hold the only slot for a while", "max_tokens": 2000, "stream": True}


async def _until(cond, timeout: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await cond()
        if value:
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.asynccontextmanager
async def _holding(client: httpx.AsyncClient, url: str):
    """An open streaming completion through the router (its first chunk read)."""
    async with client.stream("POST", f"{url}/v1/completions", json=LONG) as resp:
        assert resp.status_code == 200
        chunks = resp.aiter_raw()  # kept: a collected iterator would close the stream
        await chunks.__anext__()
        yield resp


async def _admission(client: httpx.AsyncClient, url: str) -> dict:
    r = await client.post(f"{url}/debug/route", json={"prompt": "probe"})
    assert r.status_code == 200, r.text
    return r.json()["admission"]


async def test_requests_queue_while_every_instance_is_busy_then_pass_or_get_429(tmp_path):
    with engines(tmp_path, 1, *SLOW) as (eng,):
        router = start_router(
            tmp_path, [eng], "--admission-max-inflight", "1", "--admission-queue-size", "1"
        )
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                url = router.url
                assert (await _admission(client, url))["has_room"] is True
                async with _holding(client, url):
                    state = await _admission(client, url)
                    assert state["has_room"] is False
                    assert state["busy"][eng.url].startswith("inflight 1 >= 1")
                    queued = asyncio.create_task(
                        client.post(f"{url}/v1/completions", json={"prompt": "queued one"})
                    )
                    await _until(
                        lambda: _depth_is(client, url, 1), what="the second request to queue"
                    )
                    full = await client.post(f"{url}/v1/completions", json={"prompt": "third"})
                    assert full.status_code == 429
                    assert int(full.headers["retry-after"]) >= 1
                    err = full.json()["error"]
                    assert err["type"] == "RateLimitError" and err["code"] == 429
                    assert "queue full" in err["message"]
                    assert not queued.done()
                # The held stream closed: its slot goes to the queued request.
                r = await asyncio.wait_for(queued, 30)
                assert r.status_code == 200, r.text
                assert (await _admission(client, url))["queue_depth"] == 0
                metrics = (await client.get(f"{url}/metrics")).text
            assert 'kvroute_router_admission_rejections_total{reason="queue_full"} 1.0' in metrics
            assert "kvroute_router_admission_queue_depth 0.0" in metrics
            assert "kvroute_router_admission_wait_seconds_count 2.0" in metrics  # held, queued
        finally:
            router.stop()


async def _depth_is(client: httpx.AsyncClient, url: str, depth: int) -> bool:
    return (await _admission(client, url))["queue_depth"] == depth


async def test_a_request_queued_past_its_timeout_gets_429_with_retry_after(tmp_path):
    with engines(tmp_path, 1, *SLOW) as (eng,):
        router = start_router(
            tmp_path,
            [eng],
            "--admission-max-inflight", "1", "--admission-timeout", "0.3",
        )  # fmt: skip
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                async with _holding(client, router.url):
                    r = await client.post(
                        f"{router.url}/v1/completions", json={"prompt": "waits too long"}
                    )
                assert r.status_code == 429
                assert r.headers["retry-after"] == "1"  # the timeout, rounded up
                assert "busy" in r.json()["error"]["message"]
                ok = await client.post(f"{router.url}/v1/completions", json={"prompt": "later"})
                assert ok.status_code == 200
                metrics = (await client.get(f"{router.url}/metrics")).text
            assert 'kvroute_router_admission_rejections_total{reason="timeout"} 1.0' in metrics
        finally:
            router.stop()


async def test_engine_waiting_queue_and_kv_usage_from_metrics_mark_an_instance_busy(tmp_path):
    """One sequence at a time: a second request waits in the engine (``vllm:num_requests_
    waiting`` 1) and the first holds KV blocks (``vllm:kv_cache_usage_perc`` > 0)."""
    cfg = tmp_path / "router.yaml"
    cfg.write_text("admission_max_kv_usage: 0.001\nadmission_timeout_s: 0.2\n")
    with engines(tmp_path, 1, *SLOW, "--max-num-seqs", "1") as (eng,):
        by_waiting = start_router(
            tmp_path, [eng], "--admission-max-waiting", "1", "--admission-timeout", "0.2"
        )
        by_kv = start_router(tmp_path, [eng], "--config", str(cfg))
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                async with _holding(client, eng.url), _holding_later(client, eng.url):
                    for router, reason in ((by_waiting, "engine_waiting"), (by_kv, "kv_usage")):

                        async def busy(router=router, reason=reason):
                            why = (await _admission(client, router.url))["busy"][eng.url]
                            return why is not None and why.startswith(reason)

                        await _until(busy, what=f"{reason} read from the engine's /metrics")
                        r = await client.post(
                            f"{router.url}/v1/completions", json={"prompt": "turned away"}
                        )
                        assert r.status_code == 429
                for router in (by_waiting, by_kv):

                    async def free(router=router):
                        return (await _admission(client, router.url))["has_room"]

                    await _until(free, what="the instance to be free again")
        finally:
            by_waiting.stop()
            by_kv.stop()


@contextlib.asynccontextmanager
async def _holding_later(client: httpx.AsyncClient, url: str):
    """A second stream that waits in the engine behind the first (no chunk until then)."""
    task = asyncio.create_task(client.post(f"{url}/v1/completions", json=LONG))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await task


async def test_a_busy_instance_is_no_candidate_while_another_is_free(tmp_path):
    with engines(tmp_path, 2, *SLOW) as engs:
        router = start_router(tmp_path, engs, "--admission-max-inflight", "1")
        try:
            async with (
                httpx.AsyncClient(timeout=30) as client,
                _holding(client, router.url) as held,
            ):
                busy = held.headers["x-kvroute-instance"]
                free = next(e.url for e in engs if e.url != busy)
                # The held prompt's blocks are predicted on the busy instance, yet the same
                # prompt goes to the free one.
                body = {"prompt": LONG["prompt"], "max_tokens": 2}
                view = (await client.post(f"{router.url}/debug/route", json=body)).json()
                assert sorted(view["model"]["pool"]) == sorted(e.url for e in engs)
                assert [c["instance"] for c in view["candidates"]] == [free]
                assert view["admission"]["busy"][busy].startswith("inflight")
                r = await client.post(f"{router.url}/v1/completions", json=body)
                assert r.status_code == 200 and r.headers["x-kvroute-instance"] == free
        finally:
            router.stop()
