"""LoRA adapters as extra keys: a request naming an adapter is hashed with vLLM's
``("lora", name, path)`` key on every block, learned from ``/v1/models``."""

from __future__ import annotations

import time

import httpx
from kvtest import debug_route, engines, start_router

FAST = ("--profile", "full", "--time-scale", "50", "--model", "base")
LORAS = ("--lora-modules", "sql=/adapters/sql", "--lora-modules", "chat=/adapters/chat")


def _hit(router, body: dict, url: str) -> int:
    return next(
        c["gpu_tokens"] for c in debug_route(router, body)["candidates"] if c["instance"] == url
    )


def test_an_adapter_request_is_credited_only_with_blocks_stored_under_that_adapter(tmp_path):
    with engines(tmp_path, 1, *FAST, *LORAS) as (a,), engines(tmp_path, 1, *FAST) as (b,):
        router = start_router(tmp_path, [a, b])
        try:
            cards = {m["id"]: m for m in httpx.get(f"{router.url}/v1/models").json()["data"]}
            assert sorted(cards) == ["base", "chat", "sql"]
            assert cards["sql"]["parent"] == "base" and cards["sql"]["root"] == "/adapters/sql"
            # Only the instance that serves the adapter is in its pool.
            view = debug_route(router, {"model": "sql", "prompt": "x"})
            assert view["model"] == {"requested": "sql", "pool": [a.url], "lora": "sql"}
            prompt = "SELECT the rows this adapter was asked about before; " * 6
            r = httpx.post(f"{a.url}/v1/completions", json={"model": "sql", "prompt": prompt})
            assert r.status_code == 200 and r.json()["model"] == "sql"
            deadline = time.monotonic() + 15
            while _hit(router, {"model": "sql", "prompt": prompt}, a.url) == 0:
                assert time.monotonic() < deadline, "the router never saw the adapter's blocks"
                time.sleep(0.1)
            # Same tokens, other keys: the base model and another adapter reuse nothing.
            assert _hit(router, {"model": "base", "prompt": prompt}, a.url) == 0
            assert _hit(router, {"model": "chat", "prompt": prompt}, a.url) == 0
            # And the engine agrees, request by request.
            for model in ("sql", "base", "chat"):
                r = httpx.post(
                    f"{router.url}/v1/completions",
                    json={"model": model, "prompt": prompt, "max_tokens": 2},
                    timeout=30,
                )
                assert r.status_code == 200, r.text
                if r.headers["x-kvroute-instance"] == a.url:
                    reported = r.json()["usage"]["kv_hit"]["gpu_tokens"]
                    assert int(r.headers["x-kvroute-predicted-hit"]) == reported
                    assert (reported > 0) == (model == "sql")
        finally:
            router.stop()
