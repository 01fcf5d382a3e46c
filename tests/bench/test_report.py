"""Report: summaries from records, report.md / results.json / non-empty PNG plots."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bench.replay.records import RequestRecord, load_series, percentile, summarize
from bench.replay.report import agreement, targets, write_report
from bench.replay.trace import TraceRequest, save_mooncake


def _rec(i, inst, ttft, gpu, cpu=0, prompt=1000, pred=None, err=None):
    return RequestRecord(
        index=i, arrival_s=float(i), prompt_tokens=prompt, max_tokens=4, instance=inst,
        ttft_s=ttft, e2e_s=None if ttft is None else ttft + 0.5, completion_tokens=4,
        gpu_hit_tokens=gpu, cpu_hit_tokens=cpu, predicted_hit_tokens=pred, error=err,
    )  # fmt: skip


def test_percentile_nearest_rank():
    xs = [float(x) for x in range(1, 101)]
    assert percentile(xs, 50) == 50.0
    assert percentile(xs, 90) == 90.0
    assert percentile(xs, 99) == 99.0
    assert percentile([], 50) is None


def test_summary_counts_hits_errors_and_prediction_accuracy():
    recs = [
        _rec(0, "a", 0.1, 500, 100, pred=600),
        _rec(1, "b", 0.3, 0, 0, pred=200),
        _rec(2, "a", 0.2, 200, 0, pred=200),
        _rec(3, "a", None, 0, err="boom"),
    ]
    s = summarize(recs, ["a", "b", "c"])
    assert (s["requests"], s["ok"], s["errors"]) == (4, 3, 1)
    assert s["prompt_tokens"] == 3000
    assert s["hit_ratio"] == pytest.approx(800 / 3000)
    assert s["cpu_hit_ratio"] == pytest.approx(100 / 3000)
    assert s["ttft_p50_ms"] == pytest.approx(200)
    assert s["prediction_exact"] == pytest.approx(2 / 3)
    assert s["prediction_mae_tokens"] == pytest.approx(200 / 3)
    # r1's predicted 200 were gone at admission; r0 reused more than predicted (not lost)
    assert s["predicted_hit_lost_ratio"] == pytest.approx(200 / 3000)
    assert summarize([_rec(0, "a", 0.1, 500, 0)], ["a"])["predicted_hit_lost_ratio"] is None
    assert s["requests_per_instance"] == {"a": 2, "b": 1, "c": 0}
    assert s["imbalance_max_over_mean"] == pytest.approx(2.0)


def test_load_series_counts_requests_in_flight():
    recs = [_rec(0, "a", 0.1, 0), _rec(0, "a", 0.1, 0), _rec(1, "b", 0.1, 0)]
    times, series = load_series(recs, ["a", "b"], points=61)
    peak_a = max(series["a"])
    assert peak_a == 2 and max(series["b"]) == 1
    assert times[0] == 0.0 and times[-1] == pytest.approx(1.6)


def test_targets_and_agreement_are_computed_not_assumed():
    s = {
        "ours:cost": {"hit_ratio": 0.39, "ttft_p90_ms": 50.0},
        "vllm-router": {"hit_ratio": 0.30, "ttft_p90_ms": 100.0},
        "sglang-router": {"hit_ratio": 0.20, "ttft_p90_ms": 90.0},
    }
    t = {x["target"]: x for x in targets(s, "swa-hybrid")}
    assert t["reused prompt tokens >= 1.3x vllm-router"]["value"] == pytest.approx(1.3)
    assert t["TTFT p90 <= 0.6x best peer"]["value"] == pytest.approx(50 / 90)
    assert t["TTFT p90 <= 0.6x best peer"]["met"]
    agree = agreement({"ours:cost": {"hit_ratio": 0.5}}, {"ours:cost": {"hit_ratio": 0.4}})
    assert agree["ours:cost"]["hit_ratio"]["rel_diff"] == pytest.approx(0.25)


def test_report_files_written_with_non_empty_plots(tmp_path):
    runs = {
        "sim": {"ours:cost": ([_rec(i, f"e{i % 2}", 0.1 + i / 100, 300) for i in range(20)],
                              ["e0", "e1"])},
        "live": {
            "ours:cost": ([_rec(i, f"e{i % 2}", 0.12 + i / 100, 280) for i in range(20)],
                          ["e0", "e1"]),
            "vllm-router": ([_rec(i, "e0", 0.2 + i / 50, 100) for i in range(20)], ["e0", "e1"]),
        },
    }  # fmt: skip
    cfg = {"engines": 2, "engine": {"profile": "swa-hybrid"}, "time_scale": 5.0}
    trace = {"name": "tiny", "requests": 20, "prompt_tokens": 20000, "oracle_hit_ratio": 0.5}
    write_report(tmp_path, runs, command="kvroute bench replay --x", config=cfg, trace_info=trace)
    for name in ("ttft_cdf.png", "hit_ratio.png", "load_over_time.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    md = (tmp_path / "report.md").read_text()
    assert "kvroute bench replay --x" in md and "| vllm-router |" in md
    assert "sim vs live" in md and "oracle" in md
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["summaries"]["live"]["ours:cost"]["hit_ratio"] == pytest.approx(0.28)
    assert res["agreement"]["ours:cost"]["hit_ratio"]["rel_diff"] == pytest.approx(0.3 / 0.28 - 1)
    assert len(res["records"]["live"]["vllm-router"]) == 20


def test_cli_sim_mode_writes_a_report(tmp_path):
    import typer

    from kvroute_cli.bench_replay_cmd import replay

    app = typer.Typer()
    app.command()(replay)
    app.command("noop")(lambda: None)
    trace = tmp_path / "t.jsonl"
    reqs = [TraceRequest(i, i * 200.0, 700 + 50 * i, 4, (0, 1, 2 + i % 3)) for i in range(12)]
    save_mooncake(reqs, trace)
    out = tmp_path / "out"
    args = ["replay", "--trace", str(trace), "--mode", "sim", "--engines", "2", "--out", str(out)]
    args += ["--routers", "ours:cost,ours:round_robin,vllm-router", "--gpu-blocks", "512"]
    args += ["--cpu-blocks", "0", "--time-scale", "4"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    res = json.loads((out / "results.json").read_text())
    assert set(res["summaries"]["sim"]) == {"ours:cost", "ours:round_robin"}
    assert res["config"]["time_scale"] == 4.0 and res["trace"]["requests"] == 12
    assert "not simulated: vllm-router" in (out / "report.md").read_text()
    bad = CliRunner().invoke(app, ["replay", "--trace", str(trace), "--routers", "nginx"])
    assert bad.exit_code != 0
