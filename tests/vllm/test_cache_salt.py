"""``cache_salt`` isolates tenants' prefixes; router and simulated engine key it as vLLM.

Why: vLLM mixes a request's ``cache_salt`` into its first block's hash, so a salted request
can reuse only blocks stored under the same salt. A router hashing every request unsalted
credits a tenant with another tenant's prefix (vLLM reuses 0). A real vLLM behind a real
router, and our ``EngineCore`` fed the same requests: the router's prediction and our
engine's ``cached_tokens`` must equal vLLM's for unsalted, salted and differently salted
repeats and branches.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from harness import bind_mode_config, free_port
from router_driver import RouterUnderTest
from workload import FORCED_TOKEN, Step, text

from engine_adapter.kv_cache_manager import KVCacheManager
from engine_adapter.profiles import get_profile
from engine_adapter.sim.core import EngineCore, SchedulerConfig
from engine_adapter.sim.timing import TimingModel
from events.tokenizer import ByteTokenizer

pytestmark = pytest.mark.vllm
log = logging.getLogger(__name__)


def _stream() -> list[Step]:
    import random

    rng = random.Random(5)
    doc = text(rng, 600)
    tail = text(rng, 90)
    plan = [
        (doc, None),  # cold
        (doc, None),  # unsalted repeat: hit
        (doc, "tenant-a"),  # same tokens, salted: a different first block, no hit
        (doc, "tenant-a"),  # salted repeat: hit
        (doc, "tenant-b"),  # another salt: no hit
        (doc + tail, "tenant-a"),  # branch under salt a: hits a's prefix
        (doc + tail, None),  # the same branch unsalted: hits the unsalted prefix
        (doc, "tenant-b"),  # b's repeat: hit
    ]
    return [Step("salt", prompt=p, max_tokens=4, cache_salt=s) for p, s in plan]


@pytest.mark.timeout(600)
def test_cache_salt_predictions_and_engine_hits_equal_vllms(
    vllm_server: Any, tmp_path: Any
) -> None:
    cfg = bind_mode_config("salt", replay_port=free_port())
    server = vllm_server("llama", kv_events_config=cfg, block_size=32, num_gpu_blocks=128)
    router = RouterUnderTest([server], tmp_path / "router").start()
    steps = _stream()
    try:
        rows = router.run_sequential(steps, {})
    finally:
        router.stop()
    ours = asyncio.run(_simulated(steps))
    for step, row, mine in zip(steps, rows, ours, strict=True):
        log.info(
            "salt %-8s prompt %d: vLLM %d, router %d, engine %d",
            step.cache_salt,
            len(step.prompt or ""),
            row.cached,
            row.predicted,
            mine,
        )
    assert [r.predicted for r in rows] == [r.cached for r in rows]
    assert ours == [r.cached for r in rows]
    hits = [r.cached > 0 for r in rows]
    assert hits == [False, True, False, True, False, True, True, True]


async def _simulated(steps: list[Step]) -> list[int]:
    kv = KVCacheManager(get_profile("llama", block_size=32), 128, allocate_kv=False)
    core = EngineCore(
        kv, timing=TimingModel(time_scale=1e9), scheduler=SchedulerConfig(128, 2048, 2048)
    )
    await core.start()
    out = []
    try:
        for i, step in enumerate(steps):
            ids = ByteTokenizer().encode(step.prompt or "")
            cached = 0
            async for o in core.submit(
                f"s{i}", ids, step.max_tokens, forced_token=FORCED_TOKEN, cache_salt=step.cache_salt
            ):
                cached = o.gpu_hit_tokens + o.cpu_hit_tokens
            out.append(cached)
    finally:
        await core.stop()
    return out
