"""Zero-config instances against real vLLM: ``kvroute router --instance URL`` alone.

vLLM 0.32 serves ``GET /kv_event_sources`` (its publisher's resolved config per
data-parallel rank). The router reads it, the models (``/v1/models``) and the block size
(``/metrics``, then the events), follows the events and replay endpoints, predicts exactly
what vLLM reuses, and reads the sources again when vLLM comes back from a restart with
other endpoints. One server, restarted once (about a minute of CI on top of start-up).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import bind_mode_config, free_port, wait_for
from router_driver import RouterUnderTest
from workload import mixed_stream

pytestmark = pytest.mark.vllm
log = logging.getLogger(__name__)

COMMON = {"num_gpu_blocks": 64, "max_num_batched_tokens": 256, "max_model_len": 2048}
START_S = 600.0  # a loaded 2-core machine has taken more than the harness's 240 s


@pytest.mark.timeout(1800)
def test_router_given_only_the_url_follows_vllm_and_rereads_after_a_restart(
    vllm_server: Any, vllm_models: Path, tmp_path: Path
) -> None:
    cfg = bind_mode_config("zeroconf-a", replay_port=free_port())
    a = vllm_server("llama", kv_events_config=cfg, timeout=START_S, **COMMON)
    # What vLLM 0.32 itself says: rank 0's publisher, endpoints as resolved.
    sources = httpx.get(f"{a.url}/kv_event_sources", timeout=10).json()
    assert list(sources) == ["0"], sources
    assert sources["0"]["endpoint"] == cfg["endpoint"]
    assert sources["0"]["replay_endpoint"] == cfg["replay_endpoint"]

    router = RouterUnderTest([a], tmp_path / "router", zero_config=True).start()
    try:
        got = router.instances()[a.url]
        assert (got["events"], got["replay"]) == (cfg["endpoint"], cfg["replay_endpoint"])
        models = httpx.get(f"{router.url}/v1/models", timeout=5).json()["data"]
        assert [m["id"] for m in models] == [a.served_model_name]
        # The block size vLLM chose, from its /metrics before any event.
        size, _ = wait_for(lambda: router.layouts()[a.url], lambda v: "metrics" in v[1], 60.0)
        rows = router.run_sequential(mixed_stream(seed=21, n=14), {})
        exact = sum(r.exact for r in rows)
        hits = sum(r.cached > 0 for r in rows)
        log.info("zero-config: %d/%d exact, %d with a hit", exact, len(rows), hits)
        assert exact == len(rows), [(r.predicted, r.cached) for r in rows]
        assert hits >= 3
        assert router.layouts()[a.url][0] == size  # what the events then said

        # vLLM comes back with other endpoints: the router reads them again.
        a.stop()
        new_cfg = bind_mode_config("zeroconf-b", replay_port=free_port())
        a.start(
            vllm_models / "llama", port=a.port, kv_events_config=new_cfg, timeout=START_S, **COMMON
        )
        router.forget_seqs(a)
        got = wait_for(
            lambda: router.instances().get(a.url, {}),
            lambda i: i.get("events") == new_cfg["endpoint"],
            60.0,
        )
        assert got["replay"] == new_cfg["replay_endpoint"]
        rows = router.run_sequential(mixed_stream(seed=22, n=8), {})
        assert sum(r.exact for r in rows) == len(rows), [(r.predicted, r.cached) for r in rows]
        assert sum(r.cached > 0 for r in rows) >= 1
    finally:
        router.stop()
    text = router.log_path.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert "event sources now" in text, text[-3000:]
