"""Replicas act as one (real processes on loopback: a private redis-server, simulated
engines, router processes): what one replica routed and has in flight, the other sees
through the shared Redis index's channel; a replica killed leaves nothing behind; and
``--workers 2`` is two such replicas on one port."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys

import httpx
import pytest
import redis
from kvtest import child_pids, debug_route, engines, start_redis, start_router, wait_until

# A slow prefill keeps a request in flight for about a second: long enough to look.
SLOW = ("--profile", "swa-hybrid", "--sliding-window", "64", "--prefill-tokens-per-s", "2000")


def _candidates(router, prompt: str) -> dict[str, dict]:
    return {c["instance"]: c for c in debug_route(router, {"prompt": prompt})["candidates"]}


def _post(router, prompt: str) -> httpx.Response:
    return httpx.post(
        f"{router.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60
    )


@pytest.mark.timeout(300)  # five processes started on a shared 2-core machine
def test_a_burst_split_across_replicas_lands_together_and_a_dead_replica_leaves_nothing(
    tmp_path,
):
    redis_proc, port = start_redis()
    index = ("--index", f"redis://127.0.0.1:{port}/0", "--model", "replicas-e2e")
    try:
        with engines(tmp_path, 3, *SLOW) as engs:
            a = start_router(tmp_path, engs, *index)
            b = start_router(tmp_path, engs, *index, "--no-ingest")
            pool = concurrent.futures.ThreadPoolExecutor(4)
            try:
                prompt = "A burst's new shared prefix, routed first by replica A. " * 36
                first = pool.submit(_post, a, prompt + " Q1")

                def b_sees_it():  # A's request in flight, as B's /debug/route shows it
                    seen = [c for c in _candidates(b, prompt).values() if c["inflight_requests"]]
                    return seen if seen and seen[0]["gpu_tokens"] > 0 else None

                (held,) = wait_until(b_sees_it, timeout=30, what="B to see A's request")
                assert held["speculative_blocks"] > 0  # A's record, not the index
                assert held["inflight_requests"] == 1
                assert debug_route(b, {"prompt": prompt})["instance"] == held["instance"]
                second = _post(b, prompt + " Q2")
                assert second.status_code == 200, second.text
                r1 = first.result(60)
                assert r1.headers["x-kvroute-instance"] == held["instance"]
                assert second.headers["x-kvroute-instance"] == held["instance"]
                # B predicted the hit from A's record, and the engine reused it.
                hit = second.json()["usage"]["kv_hit"]["gpu_tokens"]
                assert hit > 0
                assert int(second.headers["x-kvroute-predicted-hit"]) == hit

                # A dies with a request in flight: B keeps neither its load nor its record.
                other = "Another new prefix, in flight on A when A is killed. " * 36
                pool.submit(_post, a, other + " Q1")
                wait_until(
                    lambda: any(c["inflight_requests"] for c in _candidates(b, other).values()),
                    timeout=30,
                    what="B to see A's second request",
                )
                a.kill()

                def nothing_left():
                    cands = _candidates(b, other).values()
                    return all(
                        c["inflight_requests"] == 0 and c["speculative_blocks"] == 0 for c in cands
                    )

                wait_until(nothing_left, timeout=15, what="A's load and records to expire at B")
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
                for r in (a, b):
                    if r.alive:
                        r.stop()
    finally:
        redis_proc.kill()
        redis_proc.wait()


@pytest.mark.timeout(300)
def test_workers_share_one_port_as_replicas(tmp_path):
    redis_proc, port = start_redis()
    try:
        with engines(tmp_path, 2, "--profile", "swa-hybrid", "--sliding-window", "64") as engs:
            router = start_router(
                tmp_path, engs, "--index", f"redis://127.0.0.1:{port}/0", "--workers", "2"
            )
            try:
                workers = child_pids(router.pid)
                assert len([p for p in workers if p != router.pid]) >= 2
                client = redis.Redis(port=port)
                channels = client.pubsub_channels("*:replicas")
                assert len(channels) == 1
                # Both workers subscribed: two replicas on the channel.
                wait_until(
                    lambda: client.pubsub_numsub(channels[0])[0][1] == 2,
                    what="both workers subscribed",
                )
                prompt = "Served by whichever worker accepts the connection. " * 10
                for _ in range(6):  # new connections: the kernel spreads them
                    r = _post(router, prompt)
                    assert r.status_code == 200, r.text
                # Worker 0 ingests for both: every worker's decisions see the engine's blocks.
                wait_until(
                    lambda: all(
                        max(c["gpu_tokens"] for c in _candidates(router, prompt).values()) > 0
                        for _ in range(4)
                    ),
                    what="the shared index to serve every worker",
                )
            finally:
                router.stop()
    finally:
        redis_proc.kill()
        redis_proc.wait()


def test_workers_without_a_redis_index_are_refused():
    out = subprocess.run(
        [sys.executable, "-m", "kvroute_cli.main", "router", "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "needs a Redis index" in out.stdout + out.stderr
