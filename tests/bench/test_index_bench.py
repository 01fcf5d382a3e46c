"""``kvroute bench index``: the Redis ingest figures (per batch, pipelined, through the whole
ingest path) are all produced, on a small workload, and each ends in the same index state
as the in-memory index (``_redis_ingest`` raises otherwise)."""

from __future__ import annotations

import json

from bench.index import _print, ingest_workload, median_report, run
from bench.index_redis import private_redis, redis_ingest


async def test_redis_ingest_figures_cover_every_path_and_agree_with_the_memory_index(capsys):
    with private_redis() as url:
        report = await redis_ingest(url, 20_000, seed=3)
    for key in ("apply", "", "manager", "stores_only"):
        assert report["_".join(filter(None, ("ingest_redis", key, "per_s")))] > 0
    # Every published batch (plus the empty seq 0 the subscriber starts from) was applied
    # through IngestManager, live or healed by replay.
    batches = report["ingest_redis_manager_batches"]
    assert batches["live"] + batches["replay"] == len(ingest_workload(20_000, 3)[0]) + 1
    assert 20 < report["redis_bytes_per_entry"] < 2000
    _print({"ingest_memory_per_s": 1.0, "memory_bytes_per_entry": 1.0, **report})
    out = capsys.readouterr().out
    assert "apply_many" in out and "IngestManager" in out


def test_median_report_takes_each_numeric_leaf_median_and_keeps_the_rest():
    runs = [
        {"rate": 3.0, "lat": {"p50_ms": 0.2}, "ok": True, "name": "a"},
        {"rate": 1.0, "lat": {"p50_ms": 0.4}, "ok": False, "name": "b"},
        {"rate": 2.0, "lat": {"p50_ms": 0.3}, "ok": False, "name": "c"},
    ]
    assert median_report(runs) == {"rate": 2.0, "lat": {"p50_ms": 0.3}, "ok": True, "name": "a"}


def test_bench_index_reports_the_median_of_its_runs_and_the_machine(tmp_path, capsys):
    report = run(
        tmp_path, ingest_events=3000, memory_entries=2000, repeats=5, noise_blocks=50,
        redis=False, runs=3,
    )  # fmt: skip
    written = json.loads((tmp_path / "index.json").read_text())
    assert len(written["runs"]) == 3 and written["params"]["runs"] == 3
    rates = sorted(r["ingest_memory_per_s"] for r in written["runs"])
    assert written["ingest_memory_per_s"] == rates[1] == report["ingest_memory_per_s"]
    assert written["machine"]["cpus"] >= 1
    assert "median of 3 runs" in capsys.readouterr().out


async def test_cluster_figures_beside_one_node_agree_with_the_memory_index(capsys):
    """``--cluster``: both backends ingest several instances at once into the same state
    as the memory index (``cluster_vs_single`` raises otherwise) and both score."""
    import random

    from bench.index import _populate
    from bench.index_cluster import cluster_vs_single

    scenario = _populate("shared-prefix", 8, 50, random.Random(0))
    c = await cluster_vs_single(6000, seed=1, repeats=5, scenario=scenario)
    for backend in ("single", "cluster"):
        assert c[f"ingest_{backend}_per_s"] > 0
        assert c[f"score_{backend}"]["p50_ms"] > 0
    _print({"ingest_memory_per_s": 1.0, "memory_bytes_per_entry": 1.0, "cluster": c})
    assert "Redis Cluster (3 masters)" in capsys.readouterr().out
