"""Live mode end to end: two real engines behind ``kvroute router --policy cost``."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from bench.replay.config import EngineConfig, ReplayConfig
from bench.replay.live import run_live
from bench.replay.records import summarize
from bench.replay.workload import WorkloadConfig, generate


@pytest.mark.timeout(90)
def test_live_replay_through_our_router_attributes_and_reuses(tmp_path):
    wl = WorkloadConfig(
        kind="chat", sessions=3, session_rate_per_s=1.0, chat_turns=(3, 4), think_time_s=15.0,
        response_time_s=5.0, system_blocks=(2, 3), user_tokens=(64, 300), output_tokens=(4, 8),
    )  # fmt: skip
    requests = generate(wl, 11)
    assert 9 <= len(requests) <= 12
    cfg = ReplayConfig(
        engines=2,
        engine=replace(EngineConfig(), gpu_blocks=2048, cpu_blocks=512),
        time_scale=5.0,
        max_output_tokens=4,
    )
    res = run_live(requests, "ours:cost", cfg, tmp_path, deadline_s=45)
    assert res.instances == ["engine-0", "engine-1"]
    assert "--policy" in res.command and "cost" in res.command
    for rec in res.records:
        assert rec.ok, rec.error
        assert rec.instance in res.instances  # from the engine's system_fingerprint
        assert rec.router_instance == rec.instance  # the router's header agrees
        assert rec.predicted_hit_tokens is not None
        assert 0 <= rec.hit_tokens < rec.prompt_tokens
        assert rec.completion_tokens == rec.max_tokens
    s = summarize(res.records, res.instances)
    assert s["hit_ratio"] > 0.2  # later turns reuse the conversation so far
    # Some turns come longer after the previous request than the router's 2 s speculative
    # TTL: predicting their hits exactly needs the engines' KV events to reach the router
    # (with the event stream cut, exactness drops to ~0.5).
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(res.records)]
    assert max(gaps) > 2.0
    assert s["prediction_exact"] >= 0.9
    assert any(r.predicted_hit_tokens and r.predicted_hit_tokens == r.hit_tokens for r in
               res.records if r.arrival_s > 4.0)  # fmt: skip
    # Every process logged to its own file under the run directory.
    logs = sorted(p.name for p in (tmp_path / "logs" / "ours-cost").iterdir())
    assert logs == ["engine-0.log", "engine-1.log", "ours-cost.log"]
