"""Session affinity end to end: a session stays on its instance within a cost bound."""

from __future__ import annotations

import time

import httpx
from kvtest import debug_route, engines, start_router

FAST = ("--profile", "full", "--time-scale", "50")


def test_a_session_stays_on_its_instance_until_another_is_cheaper_by_more_than_the_bound(
    tmp_path,
):
    with engines(tmp_path, 2, *FAST) as engs:
        tight = start_router(
            tmp_path, engs, "--session-header", "X-Session-ID", "--session-user-field"
        )
        loose = start_router(
            tmp_path, engs, "--config", str(_yaml(tmp_path, "session_max_extra_ttft_s: 10"))
        )
        try:
            s1 = {"x-session-id": "s1"}
            first = httpx.post(
                f"{tight.url}/v1/completions", json={"prompt": "turn 0"}, headers=s1, timeout=30
            )
            home = first.headers["x-kvroute-instance"]
            other = next(e for e in engs if e.url != home)
            # Unrelated prompts, equal cost everywhere: the session keeps its instance.
            for turn in range(1, 6):
                r = httpx.post(
                    f"{tight.url}/v1/completions",
                    json={"prompt": f"unrelated turn {turn} " * (turn + 1)},
                    headers=s1,
                    timeout=30,
                )
                assert r.headers["x-kvroute-instance"] == home
            view = debug_route(tight, {"prompt": "next"}, s1)["affinity"]
            assert view["pinned"] == home and view["outcome"] == "kept"
            # A long prompt the other instance has cached: staying would cost ~0.2 s of
            # prefill, over the 0.05 s bound, so the session moves.
            long = "a long document the other instance already holds. " * 40
            r = httpx.post(f"{other.url}/v1/completions", json={"prompt": long}, timeout=30)
            assert r.status_code == 200

            def other_holds() -> bool:
                cands = debug_route(tight, {"prompt": long})["candidates"]
                return any(c["instance"] == other.url and c["gpu_tokens"] > 0 for c in cands)

            deadline = time.monotonic() + 15
            while not other_holds():
                assert time.monotonic() < deadline, "the router never saw the cached prompt"
                time.sleep(0.1)
            moved = debug_route(tight, {"prompt": long}, s1)
            assert moved["instance"] == other.url
            assert moved["affinity"]["outcome"] == "moved"
            assert moved["affinity"]["extra_ttft_s"] > 0.05
            # The OpenAI ``user`` field names a session too (no header).
            r = httpx.post(
                f"{tight.url}/v1/completions", json={"prompt": "u", "user": "alice"}, timeout=30
            )
            alice = debug_route(tight, {"prompt": long, "user": "alice"})["affinity"]
            assert alice["pinned"] == r.headers["x-kvroute-instance"]
            # A loose bound keeps the session even so (header default X-Session-ID in YAML).
            r = httpx.post(
                f"{loose.url}/v1/completions", json={"prompt": "turn 0"}, headers=s1, timeout=30
            )
            pinned = r.headers["x-kvroute-instance"]
            kept = debug_route(loose, {"prompt": long}, s1)
            assert kept["instance"] == pinned and kept["affinity"]["outcome"] in ("kept",)
            assert "kvroute_router_session_affinity_total" in httpx.get(f"{tight.url}/metrics").text
            assert debug_route(tight, {"prompt": "no session"})["affinity"] is None
        finally:
            tight.stop()
            loose.stop()


def _yaml(tmp_path, extra: str):
    path = tmp_path / "router.yaml"
    path.write_text(f"session_header: X-Session-ID\n{extra}\n")
    return path
