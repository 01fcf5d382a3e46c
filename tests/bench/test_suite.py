"""The routing-quality suite: generators, peer models, intervals and the written report."""

from __future__ import annotations

import json

import pytest

from bench.replay.peer_models import SglangCacheAwareModel, VllmKvAwareModel
from bench.replay.suite import interval, run_suite
from bench.replay.suite_workloads import SUITE, agent_chat, agent_chat_real_shape
from bench.replay.trace import TRACE_BLOCK_TOKENS, prompt_text
from router.decision.policy import Candidate


def test_generators_are_deterministic_and_share_whole_blocks():
    a, b = agent_chat(3), agent_chat(3)
    assert a == b and a != agent_chat(4)
    assert len(a) == 6 * 4 + 8 * 5
    # every agent call starts with the same 10-block (5,120-token) context
    firsts = {r.hash_ids[:10] for r in a if r.input_length > 5200 and r.hash_ids[0] == 0}
    assert len(firsts) == 1
    for key, w in SUITE.items():
        if w.generate is None:
            continue
        for r in w.generate(0):
            assert len(r.hash_ids) * TRACE_BLOCK_TOKENS >= r.input_length, key


def test_real_shape_is_agent_chat_4x_down_with_its_prefixes_still_shared():
    """What the real-vLLM harness sends, and the suite's ``a_real_shape`` simulates."""
    w = SUITE["a_real_shape"]
    reqs = agent_chat_real_shape(0)
    texts = [prompt_text(r, 0, w.block_chars) for r in reqs]
    assert [len(t) for t in texts] == [r.input_length // 4 for r in agent_chat(0)]
    assert max(map(len, texts)) + w.max_output_tokens <= 2048  # the tiny models' context
    agents = [t for r, t in zip(reqs, texts, strict=True) if r.hash_ids[0] == 0]
    assert len({t[: 10 * w.block_chars] for t in agents}) == 1  # the shared context


def test_interval_is_a_student_t_half_width():
    iv = interval([1.0, 2.0, 3.0])
    assert iv["mean"] == 2.0
    assert iv["ci95"] == pytest.approx(4.303 * 1.0 / 3**0.5, rel=1e-3)
    assert interval([5.0])["ci95"] is None


def test_vllm_model_multiplies_new_tokens_by_squared_load_and_ties_go_first():
    m = VllmKvAwareModel()
    # b: 1000 new x 1 = 1000; a: 500 new x (1+1)^2 = 2000
    d = m.choose([Candidate("a", gpu_tokens=1500, running_requests=1), Candidate("b", 1000)], 2000)
    assert d.instance == "b"
    assert m.choose([Candidate("b"), Candidate("a")], 2000).instance == "a"  # tie: first


def test_sglang_model_follows_the_longest_text_match_above_the_threshold():
    m = SglangCacheAwareModel()
    cands = [Candidate("a"), Candidate("b", running_requests=1)]
    m.text = "x" * 1000
    assert m.choose(cands, 1000).instance == "a"  # cold: least loaded
    m.text = "x" * 1000 + "y" * 500
    busy = [Candidate("a", running_requests=3), Candidate("b")]
    assert m.choose(busy, 1500).instance == "a"  # 2/3 matched on a: sticky despite load
    m.text = "z" * 1000
    assert m.choose(busy, 1000).instance == "b"  # no match: least loaded


def test_suite_writes_report_results_and_plots(tmp_path):
    res = run_suite(
        tmp_path,
        workloads=["a_agent_chat"],
        seeds=[0, 1],
        sim_routers=["ours:cost", "model:vllm-router"],
        command="test",
    )
    agg = res["aggregate"]["sim"]["a_agent_chat"]
    assert agg["ours:cost"]["hit_ratio"]["n"] == 2
    assert 0 < agg["ours:cost"]["hit_ratio"]["mean"] < 1
    assert agg["ours:cost"]["ttft_p90_ms"]["mean"] >= agg["ours:cost"]["ttft_p50_ms"]["mean"]
    t = res["targets"]["sim"]["a_agent_chat"]
    assert t["best_peer_hit"] == "model:vllm-router"
    assert json.loads((tmp_path / "results.json").read_text())["seeds"] == [0, 1]
    report = (tmp_path / "report.md").read_text()
    assert "| ours:cost |" in report and "±" in report
    assert (tmp_path / "suite_hits.png").stat().st_size > 1000


def test_report_has_the_real_vllm_section_when_it_ran():
    from bench.replay.suite import interval
    from bench.replay.suite_report import suite_markdown

    base = {"command": "c", "seeds": [0], "live_seeds": [0], "workloads": {},
            "aggregate": {}, "targets": {}}  # fmt: skip
    assert "## real vLLM" not in suite_markdown({**base, "real_vllm": None}, [])
    cells = [{"reused_ratio": 0.8, "uncached_tokens": 15000.0, "ttft_p50_ms": 3000.0},
             {"reused_ratio": 0.84, "uncached_tokens": 12000.0, "ttft_p50_ms": 2000.0}]  # fmt: skip
    row = {k: interval([c[k] for c in cells]) for k in cells[0]}
    real = {"seeds": [0, 1], "ours_tokenizer": "model", "ours:cost": {**row, "cells": cells},
            "sglang-router": {"error": "x"}}  # fmt: skip
    md = suite_markdown({**base, "real_vllm": real}, [])
    assert "## real vLLM" in md and "seeds [0, 1]" in md
    assert "| ours:cost | 82.0 ± 25.4% | 13500 ± 19065 | 2500 ± 6355 | - |" in md
    assert "sglang-router" not in md.split("## real vLLM")[1]  # no cells: no row
