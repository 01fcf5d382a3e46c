"""``kvroute bench index``: the Redis ingest figures (per batch, pipelined, through the whole
ingest path) are all produced, on a small workload, and each ends in the same index state
as the in-memory index (``_redis_ingest`` raises otherwise)."""

from __future__ import annotations

from bench.index import _print, ingest_workload
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
