"""``--instance URL`` alone in front of the simulated engine, which serves vLLM 0.32's
``GET /kv_event_sources``: the router finds the event and replay endpoints there and
predicts the engine's reuse. (Real vLLM: ``tests/vllm/test_discovery.py``.)"""

from __future__ import annotations

import json
import time

import httpx
from kvtest import debug_route, start_router

from stack.procs import KVROUTE, Proc, free_port, ipc_endpoint


def test_a_router_given_only_the_engine_url_follows_its_events(tmp_path):
    port, replay = free_port(), free_port()
    cfg = {
        "enable_kv_cache_events": True,
        "endpoint": ipc_endpoint(f"zero-config-{port}"),  # the engine binds it
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }
    cmd = [
        *KVROUTE, "engine", "--port", str(port), "--kv-events-config", json.dumps(cfg),
        "--profile", "full", "--time-scale", "50",
    ]  # fmt: skip
    eng = Proc(f"engine-{port}", cmd, port, tmp_path / f"engine-{port}.log").launch().wait_ready()
    try:
        sources = httpx.get(f"{eng.url}/kv_event_sources").json()
        assert list(sources) == ["0"]
        assert sources["0"]["endpoint"] == cfg["endpoint"]
        assert sources["0"]["replay_endpoint"] == cfg["replay_endpoint"]
        router = start_router(tmp_path, [], "--instance", eng.url)
        try:
            prompt = "a prompt the engine computes once and then holds in its cache. " * 4
            r = httpx.post(f"{router.url}/v1/completions", json={"prompt": prompt}, timeout=30)
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 15
            while debug_route(router, {"prompt": prompt})["candidates"][0]["gpu_tokens"] == 0:
                assert time.monotonic() < deadline, "the engine's events never arrived"
                time.sleep(0.1)
            r = httpx.post(f"{router.url}/v1/completions", json={"prompt": prompt}, timeout=30)
            reported = r.json()["usage"]["kv_hit"]["gpu_tokens"]
            assert reported > 0 and int(r.headers["x-kvroute-predicted-hit"]) == reported
        finally:
            router.stop()
    finally:
        eng.stop()
