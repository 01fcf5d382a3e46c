"""Zero-config instances against real vLLM: ``kvroute router --instance URL`` alone.

vLLM 0.32 serves ``GET /kv_event_sources`` (its publisher's resolved config per
data-parallel rank). The router reads it, the models (``/v1/models``) and the block size
(``/metrics``, then the events), follows every rank's events and replay endpoints (one
routing target per rank, reached with vLLM's ``X-data-parallel-rank``), predicts exactly
what each rank reuses, and reads the sources again when vLLM comes back from a restart with
other endpoints. One server with two data-parallel ranks (vLLM offsets each rank's ports by
its rank, so the endpoints are ``tcp://*:P``, which the router reaches at the server's
host), restarted once.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from eventskit import free_port
from harness import LOOPBACK, wait_for
from router_driver import RouterUnderTest
from workload import mixed_stream

pytestmark = pytest.mark.vllm
log = logging.getLogger(__name__)

COMMON = {
    "num_gpu_blocks": 64,
    "max_num_batched_tokens": 256,
    "max_model_len": 2048,
    "extra_args": ("--data-parallel-size", "2"),
}
START_S = 600.0  # a loaded 2-core machine has taken more than the harness's 240 s


def _dp_config() -> dict[str, Any]:
    """Both sockets bound by vLLM on every interface (data parallelism needs tcp)."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{free_port(2)}",
        "replay_endpoint": f"tcp://*:{free_port(2)}",
    }


def _offset(endpoint: str, rank: int) -> str:
    head, port = endpoint.rsplit(":", 1)
    return f"{head}:{int(port) + rank}"


def _reached(endpoint: str, rank: int) -> str:
    """Where the router connects for ``rank``: the wildcard is the server's host."""
    return _offset(endpoint, rank).replace("*", LOOPBACK)


@pytest.mark.timeout(1800)
def test_router_given_only_the_url_follows_vllm_and_rereads_after_a_restart(
    vllm_server: Any, vllm_models: Path, tmp_path: Path
) -> None:
    cfg = _dp_config()
    a = vllm_server("llama", kv_events_config=cfg, timeout=START_S, **COMMON)
    # What vLLM 0.32 itself says: each rank's publisher, its ports offset by its rank.
    sources = httpx.get(f"{a.url}/kv_event_sources", timeout=10).json()
    assert sorted(sources) == ["0", "1"], sources
    for rank in (0, 1):
        assert sources[str(rank)]["endpoint"] == _offset(cfg["endpoint"], rank)
        assert sources[str(rank)]["replay_endpoint"] == _offset(cfg["replay_endpoint"], rank)
    ranks = [f"{a.url}#dp{r}" for r in (0, 1)]

    router = RouterUnderTest([a], tmp_path / "router", zero_config=True).start()
    try:
        got = router.instances()
        for rank, name in enumerate(ranks):  # a wildcard endpoint is reached at vLLM's host
            assert got[name]["events"] == _reached(cfg["endpoint"], rank)
            assert got[name]["replay"] == _reached(cfg["replay_endpoint"], rank)
        models = httpx.get(f"{router.url}/v1/models", timeout=5).json()["data"]
        assert [m["id"] for m in models] == [a.served_model_name]
        # The block size vLLM chose, from its /metrics before any event.
        size, _ = wait_for(lambda: router.layouts()[ranks[0]], lambda v: "metrics" in v[1], 60.0)
        rows = router.run_sequential(mixed_stream(seed=21, n=14), {})
        exact = sum(r.exact for r in rows)
        hits = sum(r.cached > 0 for r in rows)
        log.info("zero-config: %d/%d exact, %d with a hit", exact, len(rows), hits)
        assert exact == len(rows), [(r.instance, r.predicted, r.cached) for r in rows]
        assert hits >= 3
        assert {r.instance for r in rows} == set(ranks)  # both ranks served, each exact
        assert router.layouts()[ranks[1]][0] == size  # what the events then said

        # vLLM comes back with other endpoints: the router reads them again.
        a.stop()
        new_cfg = _dp_config()
        a.start(
            vllm_models / "llama", port=a.port, kv_events_config=new_cfg, timeout=START_S, **COMMON
        )
        router.forget_seqs(a)
        got = wait_for(
            lambda: router.instances().get(ranks[1], {}),
            lambda i: i.get("events") == _reached(new_cfg["endpoint"], 1),
            60.0,
        )
        assert got["replay"] == _reached(new_cfg["replay_endpoint"], 1)
        rows = router.run_sequential(mixed_stream(seed=22, n=8), {})
        assert sum(r.exact for r in rows) == len(rows), [(r.predicted, r.cached) for r in rows]
        assert sum(r.cached > 0 for r in rows) >= 1
    finally:
        router.stop()
    text = router.log_path.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert "event sources now" in text, text[-3000:]
