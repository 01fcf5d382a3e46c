"""Data-parallel ranks: one engine server running two ranks, each its own routing target
(its own event stream at vLLM's port offset, its own cache), chosen with vLLM's
``X-data-parallel-rank`` header."""

from __future__ import annotations

import json
import time

import httpx
from eventskit import free_port
from kvtest import debug_route, start_router

from stack.procs import KVROUTE, Proc


def _dp_engine(tmp_path, size: int) -> tuple[Proc, dict]:
    port, events, replay = free_port(2), free_port(2), free_port(2)
    # A concrete address: the engine's ranks connect to P+r, the router binds there.
    cfg = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{events}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
    }
    cmd = [
        *KVROUTE, "engine", "--port", str(port), "--kv-events-config", json.dumps(cfg),
        "--profile", "full", "--time-scale", "50", "--data-parallel-size", str(size),
    ]  # fmt: skip
    eng = Proc(f"engine-dp-{port}", cmd, port, tmp_path / f"engine-dp-{port}.log")
    eng.events, eng.replay = cfg["endpoint"], cfg["replay_endpoint"]
    return eng.launch().wait_ready(), cfg


def test_each_rank_is_a_target_and_requests_reach_the_rank_that_holds_their_prefix(tmp_path):
    eng, cfg = _dp_engine(tmp_path, 2)
    try:
        # The engine: per-rank series, vLLM's range check on the header.
        metrics = httpx.get(f"{eng.url}/metrics").text
        assert 'engine="0"' in metrics and 'engine="1"' in metrics
        bad = httpx.post(
            f"{eng.url}/v1/completions",
            json={"prompt": "x"},
            headers={"X-data-parallel-rank": "2"},
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["message"] == "data_parallel_rank 2 is out of range [0, 2)."
        router = start_router(tmp_path, [], "--instance", f"{eng.url}={json.dumps(cfg)},dp=2")
        try:
            r0, r1 = f"{eng.url}#dp0", f"{eng.url}#dp1"
            prompt = "a prefix only rank one has computed, not rank zero. " * 5
            r = httpx.post(
                f"{eng.url}/v1/completions",
                json={"prompt": prompt},
                headers={"X-data-parallel-rank": "1"},
                timeout=30,
            )
            assert r.status_code == 200
            deadline = time.monotonic() + 60  # events of a loaded machine may lag
            while True:
                cands = {
                    c["instance"]: c for c in debug_route(router, {"prompt": prompt})["candidates"]
                }
                if cands[r1]["gpu_tokens"] > 0:
                    break
                assert time.monotonic() < deadline, "rank 1's events never arrived"
                time.sleep(0.1)
            assert set(cands) == {r0, r1} and cands[r0]["gpu_tokens"] == 0
            # Through the router: sent to rank 1 with the header, and rank 1 reuses it.
            r = httpx.post(f"{router.url}/v1/completions", json={"prompt": prompt}, timeout=30)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-instance"] == r1
            reported = r.json()["usage"]["kv_hit"]["gpu_tokens"]
            assert reported > 0 and int(r.headers["x-kvroute-predicted-hit"]) == reported
            listed = httpx.get(f"{router.url}/v1/models").json()["data"]
            assert [m["id"] for m in listed] == ["kvroute-sim"]
        finally:
            router.stop()
    finally:
        eng.stop()
