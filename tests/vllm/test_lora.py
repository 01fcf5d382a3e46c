"""A LoRA adapter's blocks are its own; the router keys them as vLLM does.

Why: vLLM 0.33 puts ``("lora", name, path)`` in every block's extra keys, so a request for an
adapter reuses only blocks computed under that adapter, never the base model's (nor another
adapter's) for the same tokens. A router hashing adapter requests like base requests credits
one with the other's prefix. A real vLLM CPU server serves a tiny adapter made at test time
(``engine_adapter/vllm_cpu/make_lora.py``); the router learns it from ``/v1/models`` (its
``parent`` and ``root``) and must predict exactly what vLLM reuses.
"""

from __future__ import annotations

import logging
import random
import subprocess
from typing import Any

import pytest
from harness import bind_mode_config, free_port
from router_driver import RouterUnderTest
from workload import Step, text

from engine_adapter.vllm_cpu import MAKE_LORA

pytestmark = pytest.mark.vllm
log = logging.getLogger(__name__)


@pytest.mark.timeout(600)
def test_adapter_requests_reuse_only_their_adapters_blocks_as_the_router_predicts(
    vllm_server: Any, vllm_python: Any, tmp_path: Any
) -> None:
    adapter = tmp_path / "sql-adapter"
    subprocess.run([str(vllm_python), str(MAKE_LORA), str(adapter)], check=True, timeout=120)
    cfg = bind_mode_config("lora", replay_port=free_port())
    lora_args = ["--enable-lora", "--lora-modules", f"sql={adapter}", "--max-lora-rank", "8"]
    server = vllm_server(
        "llama", kv_events_config=cfg, block_size=32, num_gpu_blocks=128, extra_args=lora_args
    )
    rng = random.Random(11)
    doc, tail = text(rng, 500), text(rng, 90)
    plan = [
        (doc, "sql"),  # cold under the adapter
        (doc, "sql"),  # the adapter's repeat: hit
        (doc, None),  # the same tokens on the base model: its own blocks, no hit
        (doc, None),  # the base model's repeat: hit
        (doc + tail, "sql"),  # a branch under the adapter: the adapter's prefix
        (doc + tail, None),  # the same branch on the base model: the base prefix
    ]
    steps = [Step("lora", prompt=p, max_tokens=4, model=m) for p, m in plan]
    router = RouterUnderTest([server], tmp_path / "router").start()
    try:
        rows = router.run_sequential(steps, {})
    finally:
        router.stop()
    for step, row in zip(steps, rows, strict=True):
        log.info("model %-4s prompt %d: vLLM %d, router %d", step.model, len(step.prompt or ""),
                 row.cached, row.predicted)  # fmt: skip
    assert [r.predicted for r in rows] == [r.cached for r in rows]
    assert [r.cached > 0 for r in rows] == [False, True, False, True, True, True]
