"""``kvroute bench fleet`` at CI scale: a cold router in front of small fleets publishing
through vLLM's publisher, its report complete and its decisions all correct (the expected
holder, exactly the expected GPU and CPU tokens credited), the index exactly as large as
the workload, ingest into a private Redis as large as its share."""

from __future__ import annotations

import json

from bench.fleet import run
from bench.fleet_workload import FleetShape, instance_batches, queries

SMALL = dict(system_blocks=16, step_blocks=64, noise_blocks=256)


def test_workload_queries_name_the_longest_holder_and_its_credited_tokens():
    shape = FleetShape(instances=5, entries=20_000, prompt_tokens=4096, **SMALL)
    for q in queries(shape, 4):
        holders = shape.holders_of(q.doc)
        assert q.holder == holders[0] and len(set(holders)) == len(holders)
        held = [shape.hold_blocks(q.doc, r) for r in range(len(holders))]
        assert held[0] == max(held) and q.gpu_tokens == held[0] * shape.block_size
        assert q.gpu_tokens < len(q.tokens) == shape.prompt_tokens
    batches, entries, blocks = instance_batches(shape, 0)
    assert batches and 0 < entries <= blocks


def test_bench_fleet_small_reports_every_figure_and_every_decision_is_correct(tmp_path, capsys):
    report = run(
        tmp_path, instances=(4,), entries=30_000, prompt_tokens=4096, decisions=6,
        proxy_requests=4, idle_s=0.5, redis=True, redis_instances=2, churn_minutes=3,
        churn_rate=50.0, **SMALL,
    )  # fmt: skip
    written = json.loads((tmp_path / "fleet.json").read_text())
    assert written["fleets"][0]["instances"] == 4 == report["fleets"][0]["instances"]
    row = written["fleets"][0]
    checks = row["checks"]
    assert checks["entries_exact"] and row["entries"] == row["entries_expected"] > 20_000
    assert checks["every_decision_correct"], row["decision"]["wrong"]
    assert row["decision"]["checked"] == 6 + 4 and row["decision"]["timed"] == 6
    assert checks["all_healthy"]
    for key in ("ingest_memory_per_s", "ingest_redis_per_s", "peak_rss_mb", "bytes_per_entry"):
        assert row[key] > 0, key
    assert row["redis_entries"] > 0 and row["redis_instances"] == 2
    assert 0 <= row["idle_probe_cpu_share"] < 1
    assert row["proxy"]["requests"] == 2 and row["proxy"]["router_p50_ms"] > 0
    churn = row["churn"]
    assert churn["block_events"] >= 3 * 4 * 50 * 60 and len(churn["rss_mb_per_minute"]) == 3
    assert churn["entries_after"] == churn["entries_before"] == row["entries"]
    assert written["machine"]["cpus"] >= 1
    out = capsys.readouterr().out
    assert "kvroute bench fleet" in out and "4 instances: " in out
