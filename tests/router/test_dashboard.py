"""``/dashboard``: the engine-metrics parser, the decision reasons, the view's escaping, the
page, its JSON state and the decision explanation on a real router (2 simulated engines +
router processes on loopback), and ``KVROUTE_DASHBOARD=false`` turning it all off."""

from __future__ import annotations

import asyncio
import re
import time
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import httpx
from kvtest import engines, send_turns, start_router, wait_until

from router.dashboard.snapshot import Recorded, summarize_decision
from router.dashboard.view import render_cards, render_table
from router.decision.decide import RouteDecision
from router.decision.policy import Breakdown, Candidate, Decision
from router.fleet.engine_metrics import parse_engine_metrics

SWA = ("--profile", "swa-hybrid", "--time-scale", "20")
REPO = Path(__file__).resolve().parents[2]


def test_page_assets_are_package_data():
    """The image installs a wheel: the page's template, CSS and script must be in it."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"].get("package-data", {}).get("router.dashboard", [])
    assets = [p.name for p in (REPO / "router" / "dashboard").iterdir() if p.suffix != ".py"]
    assets = [a for a in assets if a != "__pycache__"]
    assert {"page.html", "dashboard.css", "dashboard.js"} <= set(assets)
    missing = [a for a in assets if not any(fnmatch(a, pat) for pat in patterns)]
    assert not missing, (
        f"{missing} not package data: add to pyproject.toml [tool.setuptools.package-data] "
        '"router.dashboard" = ["*.html", "*.css", "*.js"]'
    )


def test_engine_metrics_parser_sums_ranks_averages_usage_and_skips_nan():
    body = b"""# HELP vllm:kv_cache_usage_perc GPU KV cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 300.0
vllm:prefix_cache_hits_total{model_name="m"} 250.0
vllm:prefix_cache_hits_created{model_name="m"} 1.7e+09
kvroute:cpu_prefix_cache_hits_total{model_name="m"} 40.0
kvroute:cpu_kv_cache_usage_perc{model_name="m"} NaN
vllm:num_requests_waiting 3.0
vllm:num_requests_waiting_other 9.0
"""
    assert parse_engine_metrics(body) == {
        "kv_gpu_usage": 0.5,
        "prefix_queries": 400.0,
        "gpu_hits": 250.0,
        "cpu_hits": 40.0,
        "waiting": 3.0,
    }
    assert parse_engine_metrics(b"") == {}


def _decision(
    cands: list[Candidate], parts: dict[str, Breakdown], *, index_ok=True, ranked=None, reason=""
):
    if ranked is None:
        ranked = sorted(parts, key=lambda n: parts[n].ttft_s) if parts else [c.name for c in cands]
    return RouteDecision(
        Decision(ranked[0], ranked, parts, reason),
        prompt_tokens=1000,
        hashes={16: []},
        hash_size={},
        scores={},
        speculative_blocks={},
        candidates={c.name: c for c in cands},
        index_ok=index_ok,
        elapsed_s=0.001,
    )


def _reason(dec: RouteDecision, policy: str = "cost", uses_scores: bool = True) -> str:
    return summarize_decision(Recorded(1, time.time(), "chat", dec), policy, uses_scores)["reason"]


def test_a_long_prompt_is_kept_packed_and_without_its_tokens_a_short_one_as_decided():
    """The ring of recent decisions never holds a long prompt (#30's memory bound) and
    costs a short one no copy; ``explainable`` gives the hashes back as lists either way."""
    from dataclasses import replace

    from router.dashboard.snapshot import KEEP_AS_IS_TOKENS

    a = "http://a:1"
    base = _decision([Candidate(a)], {a: Breakdown(0.0, 0.01, 0.0)})
    for tokens in (KEEP_AS_IS_TOKENS, KEEP_AS_IS_TOKENS + 1):
        ids = list(range(tokens))
        hashes = {16: [(1 << 63) + i for i in range(tokens // 16)]}
        dec = replace(base, prompt_tokens=tokens, hashes=hashes, hash_input=(ids, None, None))
        rec = Recorded.of(1, 0.0, "completion", dec)
        long = tokens > KEEP_AS_IS_TOKENS
        assert (rec.decision is dec) is not long
        assert (rec.decision.hash_input is None) is long
        assert all((type(v) is list) is not long for v in rec.decision.hashes.values())
        assert rec.explainable().hashes == hashes


def test_reasons_name_what_decided():
    a, b = "http://a:1", "http://b:1"
    hit = _decision(
        [Candidate(a, gpu_tokens=800, cpu_tokens=64), Candidate(b)],
        {a: Breakdown(0.02, 0.014, 0.001), b: Breakdown(0.0, 0.1, 0.0)},
    )
    assert _reason(hit) == (
        "prefix hit: 864 cached tokens (incl. CPU) vs 0 on the runner-up, "
        "despite a 20 ms longer queue"
    )
    summary = summarize_decision(Recorded(7, 0.0, "chat", hit), "cost", True)
    assert summary["instance"] == a and summary["runner_up"]["instance"] == b
    assert round(summary["predicted_ttft_ms"]) == 35 and summary["gpu_tokens"] == 800

    load = _decision(
        [Candidate(a, gpu_tokens=800), Candidate(b, gpu_tokens=400)],
        {a: Breakdown(0.5, 0.02, 0.0), b: Breakdown(0.0, 0.06, 0.0)},
    )
    assert (
        _reason(load) == "load: the runner-up holds 400 more cached tokens, "
        "but its queue is 500 ms longer"
    )
    tie = _decision(
        [Candidate(a), Candidate(b)], {a: Breakdown(0, 0.1, 0), b: Breakdown(0, 0.1, 0)}
    )
    assert _reason(tie).startswith("tie:")
    queue = _decision(
        [Candidate(a), Candidate(b)], {a: Breakdown(0.001, 0.1, 0), b: Breakdown(0.01, 0.1, 0)}
    )
    assert _reason(queue) == "lower queue: 9 ms less than the runner-up (same hit)"
    # Kept for its cache with a longer predicted TTFT than the runner-up (the ranking is
    # by objective): a prefix hit, not a sample.
    held = _decision(
        [Candidate(a, gpu_tokens=900), Candidate(b)],
        {a: Breakdown(0.3, 0.01, 0), b: Breakdown(0.0, 0.1, 0)},
        ranked=[a, b], reason="sticky",
    )  # fmt: skip
    assert _reason(held) == (
        "prefix hit: 900 cached tokens vs 0 on the runner-up, despite a 300 ms longer queue"
    )
    sampled = _decision(
        [Candidate(a), Candidate(b)], {a: Breakdown(0, 0.2, 0), b: Breakdown(0, 0.1, 0)},
        ranked=[a, b], reason="sampled",
    )  # fmt: skip
    assert _reason(sampled).startswith("sampled (temperature)")
    busier = _decision(
        [Candidate(a), Candidate(b)], {a: Breakdown(0.02, 0.1, 0), b: Breakdown(0.01, 0.1, 0)},
        ranked=[a, b], reason="min_cost",
    )  # fmt: skip
    assert _reason(busier).startswith("lower load:")
    only = _decision([Candidate(a)], {a: Breakdown(0, 0.1, 0)})
    assert _reason(only) == "only healthy instance"
    down = _decision(
        [Candidate(a), Candidate(b)],
        {a: Breakdown(0, 0.1, 0), b: Breakdown(0, 0.2, 0)},
        index_ok=False,
    )
    assert _reason(down) == "index unreachable: routed on load only"
    rr = _decision([Candidate(a), Candidate(b)], {})
    assert _reason(rr, "round_robin", False) == "round robin: next in turn"


def test_server_rendering_escapes_every_text():
    evil = '<img src=x onerror="alert(1)">'
    html = render_table(
        {
            "cols": [evil],
            "rows": [{"k": evil, "cells": [evil, {"t": evil, "title": evil, "h": "x?a=<b>"}]}],
            "empty": "",
        }
    ) + render_cards([{"k": "x", "label": evil, "v": evil, "sub": evil, "c": evil}])
    assert "<img" not in html and 'onerror="' not in html
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in html


def _state(router) -> dict:
    r = httpx.get(f"{router.url}/dashboard/state", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_page_names_every_instance_state_updates_and_decisions_explain(tmp_path):
    with engines(tmp_path, 2, *SWA) as engs:
        router = start_router(tmp_path, engs)
        try:
            urls = {e.url for e in engs}
            t0 = time.perf_counter()
            page = httpx.get(f"{router.url}/dashboard", timeout=10)
            load_ms = (time.perf_counter() - t0) * 1e3
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            html = page.text
            for url in urls:  # server-rendered: every instance named before any script runs
                assert f'data-k="{url}"' in html, url
            # Self-contained: no external script, style, font or image, and a CSP that says so.
            assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)
            assert "@import" not in html and "url(" not in html
            csp = page.headers["content-security-policy"]
            assert "default-src 'none'" in csp and "connect-src 'self'" in csp
            assert "unsafe-inline" not in csp
            assert load_ms < 2000, f"first paint took {load_ms:.0f} ms"

            before = _state(router)
            assert {i["url"] for i in before["instances"]} == urls
            assert before["totals"]["requests"].get("ok", 0) == 0 and before["decisions"] == []
            assert set(before["view"]["tables"]) == {
                "instances",
                "residency",
                "ingest",
                "decisions",
            }

            prompt = "A long shared system prompt for the dashboard test. " * 30
            holder = send_turns(router.url, prompt)

            def updated() -> dict | None:
                s = _state(router)
                inst = {i["url"]: i for i in s["instances"]}[holder]
                ok = s["totals"]["requests"].get("ok", 0) == 3 and len(s["decisions"]) == 3
                blocks = sum(b["blocks"] for b in inst["blocks"] or [])
                # The engine's hits as of a probe after the later turns (every 2 s).
                has_engine = "kv_gpu_usage" in inst["engine"] and inst["hit_ratio"]["gpu"]
                return (
                    s
                    if ok and blocks and has_engine and inst["ingest"]["last_seq"] is not None
                    else None
                )

            s = wait_until(updated, what="the state to reflect the traffic")
            inst = {i["url"]: i for i in s["instances"]}[holder]
            assert inst["served"] == 3 and inst["hit_ratio"]["gpu"] > 0
            assert {b["tier"] for b in inst["blocks"]} <= {"gpu", "cpu"}
            assert {b["group"] for b in inst["blocks"]} == {0, 1}  # full + sliding window
            assert [g["kind"] for g in inst["layout"]["groups"]] == [
                "full_attention",
                "sliding_window",
            ]
            assert inst["ingest"]["events_applied"].get("BlockStored", 0) > 0
            newest = s["decisions"][0]
            assert newest["instance"] == holder and newest["reason"].startswith("prefix hit")
            assert s["totals"]["predictions"]["exact"] >= 2

            # The view's explain link: the /debug/route explanation of that decision.
            row = s["view"]["tables"]["decisions"]["rows"][0]
            link = row["cells"][-1]["h"]
            assert link == f"dashboard/decisions/{newest['id']}"
            ex = httpx.get(f"{router.url}/{link}", timeout=10)
            assert ex.status_code == 200, ex.text
            body = ex.json()
            assert body["instance"] == holder and body["policy"] == "cost"
            assert {c["instance"] for c in body["candidates"]} == urls
            assert httpx.get(f"{router.url}/dashboard/decisions/99999").status_code == 404
        finally:
            router.stop()


def test_kvroute_dashboard_false_serves_nothing(monkeypatch):
    from fastapi.testclient import TestClient

    from router.config import RouterSettings
    from router.http.app import create_app
    from router.state import RouterState

    monkeypatch.setenv("KVROUTE_DASHBOARD", "false")
    settings = RouterSettings()
    assert settings.dashboard is False
    state = RouterState(settings)
    try:
        client = TestClient(create_app(state))  # no lifespan: nothing to start for a 404
        for path in ("/dashboard", "/dashboard/state", "/dashboard/decisions/1"):
            assert client.get(path).status_code == 404, path
        assert client.get("/metrics").status_code == 200  # the rest of the app is there
    finally:
        asyncio.run(state.stop())
