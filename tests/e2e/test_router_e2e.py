"""End to end on loopback with real processes: engines, routers, Redis, HTTP, ZMQ."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest
from kvtest import debug_route, engines, start_redis, start_router, wait_until

SWA = ("--profile", "swa-hybrid", "--sliding-window", "64", "--time-scale", "50")


def _debug(router, prompt: str) -> dict:
    return debug_route(router, {"prompt": prompt})


def _by_instance(debug: dict) -> dict[str, dict]:
    return {c["instance"]: c for c in debug["candidates"]}


def test_repeated_prompt_lands_on_the_instance_that_has_it(tmp_path):
    with engines(tmp_path, 3, *SWA, "--gpu-blocks", "512") as engs:
        router = start_router(tmp_path, engs)
        try:
            prompt = "A system prompt that only the second engine has seen. " * 10
            holder = engs[1]
            r = httpx.post(f"{holder.url}/v1/completions", json={"prompt": prompt}, timeout=30)
            assert r.status_code == 200
            wait_until(
                lambda: _by_instance(_debug(router, prompt))[holder.url]["gpu_tokens"] > 0,
                what="the router to ingest the holder's events",
            )
            for _ in range(3):
                r = httpx.post(f"{router.url}/v1/completions", json={"prompt": prompt}, timeout=30)
                assert r.status_code == 200
                assert r.headers["x-kvroute-instance"] == holder.url
                hit = r.json()["usage"]["kv_hit"]
                assert hit["gpu_tokens"] > 0
                assert int(r.headers["x-kvroute-predicted-hit"]) == hit["gpu_tokens"]
            metrics = httpx.get(f"{router.url}/metrics").text
            assert 'kvroute_router_predictions_total{result="exact"} 3.0' in metrics
        finally:
            router.stop()


def test_hybrid_router_picks_the_instance_that_kept_its_window_blocks(tmp_path):
    """A holds the longest full-attention prefix but its window blocks were evicted; B holds
    a shorter prefix in both groups. Our cost policy picks B; a full-attention-only view
    (what peer routers do) picks A, whose hit vLLM's coordinator would not honour."""
    with engines(tmp_path, 2, *SWA, "--gpu-blocks", "200") as (a, b):
        hybrid = start_router(tmp_path, [a, b])
        full_only = start_router(tmp_path, [a, b], "--policy", "prefix_full_only")
        try:
            base = "".join(
                f"<{i:03d}> shared context line for the hybrid test.\n" for i in range(12)
            )
            longer = base + "".join(f"[{i:03d}] only A has this extra part....\n" for i in range(4))
            for eng, prompt in ((a, longer), (b, base)):
                r = httpx.post(
                    f"{eng.url}/v1/completions", json={"prompt": prompt, "max_tokens": 4}
                )
                assert r.status_code == 200
            # Churn A (directly) until its window blocks for `longer` are gone while its
            # full-attention prefix is still there: window blocks are freed as soon as they
            # leave the window, so they are evicted first.
            for i in range(12):
                view = _by_instance(_debug(hybrid, longer))
                ga = view[a.url]["groups"]
                if (
                    view[a.url]["gpu_tokens"] < view[b.url]["gpu_tokens"]
                    and ga.get("group0.gpu", {}).get("prefix_blocks", 0) > len(base) // 16
                ):
                    break
                churn = f"churn {i} " + "x" * 300 + f" {i}"
                r = httpx.post(f"{a.url}/v1/completions", json={"prompt": churn, "max_tokens": 1})
                assert r.status_code == 200
                time.sleep(0.3)
            else:
                pytest.fail(f"could not evict A's window blocks only: {view}")
            debug = _debug(hybrid, longer)
            assert debug["instance"] == b.url
            cand = _by_instance(debug)
            assert cand[a.url]["groups"]["group0.gpu"]["prefix_blocks"] > len(base) // 16
            assert cand[b.url]["gpu_tokens"] > cand[a.url]["gpu_tokens"]
            assert _debug(full_only, longer)["instance"] == a.url
            # And the engines agree: B really reuses more for this prompt than A would.
            r = httpx.post(f"{hybrid.url}/v1/completions", json={"prompt": longer})
            assert r.headers["x-kvroute-instance"] == b.url
            assert r.json()["usage"]["kv_hit"]["gpu_tokens"] == cand[b.url]["gpu_tokens"]
        finally:
            hybrid.stop()
            full_only.stop()


async def test_killed_engine_loses_no_request_that_had_not_started(tmp_path):
    with engines(tmp_path, 2, *SWA) as (a, b):
        router = start_router(tmp_path, [a, b], "--policy", "round_robin")
        try:
            a.stop(signal.SIGKILL)  # the router has not noticed yet: its next forwards fail
            async with httpx.AsyncClient(timeout=30) as client:
                bodies = [{"prompt": f"request {i} " * 20, "max_tokens": 2} for i in range(12)]
                resps = await asyncio.gather(
                    *(client.post(f"{router.url}/v1/completions", json=body) for body in bodies)
                )
            assert [r.status_code for r in resps] == [200] * len(bodies)
            assert {r.headers["x-kvroute-instance"] for r in resps} == {b.url}
            metrics = httpx.get(f"{router.url}/metrics").text
            assert "kvroute_router_retries_total" in metrics
            wait_until(
                lambda: (
                    f'kvroute_router_instance_healthy{{instance="{a.url}"}} 0.0'
                    in httpx.get(f"{router.url}/metrics").text
                ),
                what="the killed engine to be marked down",
            )
        finally:
            router.stop()


def test_redis_killed_requests_still_served_then_cache_routing_resumes(tmp_path):
    redis_proc, port = start_redis()
    try:
        with engines(tmp_path, 2, *SWA) as engs:
            router = start_router(tmp_path, engs, "--index", f"redis://127.0.0.1:{port}/0")
            try:
                prompt = "cache-aware routing through a shared redis index. " * 8
                r = httpx.post(f"{router.url}/v1/completions", json={"prompt": prompt})
                assert r.status_code == 200
                wait_until(lambda: _debug(router, prompt)["candidates"][0]["gpu_tokens"] > 0,
                      what="redis-backed hit")  # fmt: skip
                redis_proc.kill()
                redis_proc.wait()
                for i in range(5):
                    r = httpx.post(f"{router.url}/v1/completions", json={"prompt": f"{i} {prompt}"})
                    assert r.status_code == 200
                assert _debug(router, prompt)["index_ok"] is False
                redis_proc, _ = start_redis(port)
                wait_until(lambda: _debug(router, prompt)["index_ok"], what="redis recovery")
                r = httpx.post(f"{router.url}/v1/completions", json={"prompt": prompt})
                assert r.status_code == 200
            finally:
                router.stop()
    finally:
        redis_proc.kill()
        redis_proc.wait()


def test_admin_api_requires_the_bearer_token(tmp_path):
    with engines(tmp_path, 2, *SWA) as (a, b):
        open_router = start_router(tmp_path, [a])
        router = start_router(tmp_path, [a], env={"KVROUTE_ADMIN_TOKEN": "s3cret"})
        try:
            assert httpx.get(f"{open_router.url}/admin/instances").status_code == 404
            url = f"{router.url}/admin/instances"
            assert httpx.get(url).status_code == 401
            assert httpx.get(url, headers={"authorization": "Bearer wrong"}).status_code == 401
            auth = {"authorization": "Bearer s3cret"}
            listed = httpx.get(url, headers=auth).json()["instances"]
            assert [i["url"] for i in listed] == [a.url]
            spec = f"{b.url}={b.events},replay={b.replay}"
            assert httpx.post(url, json={"instance": spec}).status_code == 401
            r = httpx.post(url, json={"instance": spec}, headers=auth)
            assert r.status_code == 201 and r.json()["healthy"] is True
            bad = httpx.post(url, json={"instance": "ftp://x"}, headers=auth)
            assert bad.status_code == 400
            r = httpx.delete(url, params={"url": a.url}, headers=auth)
            assert r.status_code == 200
            served = httpx.post(f"{router.url}/v1/completions", json={"prompt": "after"})
            assert served.headers["x-kvroute-instance"] == b.url
        finally:
            router.stop()
            open_router.stop()


def test_bad_requests_get_openai_errors_and_streams_pass_through(tmp_path):
    with engines(tmp_path, 1, "--profile", "full", "--time-scale", "2") as (eng,):
        router = start_router(tmp_path, [eng])
        try:
            url = f"{router.url}/v1/completions"
            for content, status in (
                (b"{oops", 400),
                (b"[]", 400),
                (b'{"max_tokens": 3}', 400),
                (b'{"prompt": 7}', 400),
                (b'{"prompt": "x", "stream": "yes"}', 400),
                (b'{"prompt": "' + b"a" * (17 * 1024 * 1024) + b'"}', 413),
            ):
                r = httpx.post(url, content=content, headers={"content-type": "application/json"})
                assert r.status_code == status
                assert r.json()["error"]["code"] == status
            chat = httpx.post(f"{router.url}/v1/chat/completions", json={"messages": []})
            assert chat.status_code == 400
            # Streaming: chunks arrive as the engine makes them, not all at the end.
            body = {"prompt": "stream through the router", "max_tokens": 12, "stream": True}
            arrivals = []
            with httpx.stream("POST", url, json=body, timeout=30) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        arrivals.append((time.monotonic(), line))
            assert arrivals[-1][1] == "data: [DONE]"
            spread = arrivals[-2][0] - arrivals[0][0]
            assert spread > 0.02, "chunks were buffered instead of streamed"
        finally:
            router.stop()
