"""CPU-tier differential in process: our engine against vLLM's own ``OffloadingConnector``,
0.33 (what GPU fleets run) and 0.32 (the CPU build), no server.

Why: the server differential (``test_offload_differential.py``) can only run 0.32, whose
LRU ranks, null-block rule, placeholders and restart rule differ from 0.33's
(docs/vllm-0.32-vs-0.33.md rows 16-22). The connector's scheduler side and its
``CPUOffloadingManager`` are plain Python, so ``sched/driver.py`` runs them beside vLLM's
``Scheduler`` with canned model outputs (0.33's sources over the 0.32 venv, as
``test_scheduler_inprocess.py`` does), its worker side over a worker that copies nothing.
The same stream goes to our ``EngineCore`` with ``vllm_version`` set to the same release.
Per request: the same (GPU, CPU) split of the hit, and the same multiset of
(type, medium, group, hash) event entries so far, CPU stores and removals included, and
the same shape of every BlockStored (kind, window, tokens, block size).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from schedkit import driver_job, offload_rows, register_jobs, release_params
from simkit import offload_config, run_stream, sim_engine
from test_offload_differential import stream as offload_stream
from workload import FORCED_TOKEN

from engine_adapter.profiles import get_profile
from engine_adapter.sim.core import EngineCore
from events.structs import KVEventBatch

# The timeout covers the session's driver processes (``driver_runs``), set up by the first test.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Case:
    layout: str  # the driver's layer set (driver.py: _layer_specs)
    profile: str  # the same layout for our engine
    block_size: int
    budget: int
    num_blocks: int
    max_model_len: int
    blocks_per_chunk: int
    policy: str
    self_describing: bool
    cpu_chunks: int  # target; vLLM's own num_chunks is read back
    kv_bytes_per_block: int  # vLLM's per block: sizes cpu_bytes_to_use for ``cpu_chunks``
    doc_len: tuple[int, int]
    n: int


CASES = {
    # vLLM's defaults (1 block per chunk, LRU, placeholders) on a tier smaller than one
    # prompt: a running request evicts its own chunks -- 0.32 its
    # head first (insertion order), 0.33 its tail first (the request's provisional rank).
    "llama-bpc1-lru-tiny": Case(
        "full", "full", 32, 32, 24, 736, 1, "lru", False, 6, 16384, (150, 330), 24
    ),
    "llama-bpc2-lru-selfdesc": Case(
        "full", "full", 32, 256, 24, 736, 2, "lru", True, 20, 16384, (150, 330), 36
    ),
    "llama-bpc2-arc": Case(
        "full", "full", 32, 256, 24, 736, 2, "arc", False, 20, 16384, (150, 330), 36
    ),
    # Five window-64 groups + full at block 32, two blocks per chunk: window chunks with
    # a skipped (null) block (row 19); self-describing placeholders (row 20).
    "gemma3-bpc2-lru-selfdesc": Case(
        "swa", "swa:64*5,full", 32, 64, 400, 1024, 2, "lru", True, 60, 16384, (250, 600), 30
    ),
}
# ARC is the same code in both releases; the 0.32 run checks the driver against the
# server differential's oracle and row 16 from the other side.
RUNS = [("0.33", name) for name in CASES] + [("0.32", "llama-bpc1-lru-tiny")]


def _requests(case: Case) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for step in offload_stream(7, case.n, case.doc_len, case.max_model_len):
        if step.kind.startswith("reset"):
            out.append({"reset": "external" if step.kind == "reset_external" else "gpu"})
        else:
            out.append({"prompt_token_ids": list(step.prompt.encode()), "max_tokens": 2})
    return out


def _job(model_dir: Path, case: Case) -> dict[str, Any]:
    per_chunk = -(-case.kv_bytes_per_block * case.blocks_per_chunk // 4096) * 4096
    offload = {
        "cpu_bytes_to_use": case.cpu_chunks * per_chunk,
        "blocks_per_chunk": case.blocks_per_chunk,
        "eviction_policy": case.policy,
        "self_describing_kv_events": case.self_describing,
    }
    return driver_job(
        model_dir, case, case.max_model_len, _requests(case), FORCED_TOKEN, offload=offload
    )


# vLLM's side runs in the session's driver processes (conftest ``driver_runs``); the model
# dir only feeds vLLM's config (no weights run), the layers are the driver's.
register_jobs("offload", lambda models: [(v, n, _job(models / "llama", CASES[n])) for v, n in RUNS])


def tally(batches: list[KVEventBatch]) -> Counter[tuple[Any, ...]]:
    """The driver's ``offload_rows`` of our events, counted."""
    return Counter(tuple(r) for r in offload_rows(list(batches)))


async def _run_ours(
    case: Case, version: str, num_chunks: int, requests: list[dict[str, Any]]
) -> list[tuple[int, int, Counter[tuple[Any, ...]]]]:
    core: EngineCore
    core, cap = sim_engine(
        get_profile(case.layout, layout=case.profile, block_size=case.block_size, page_bytes=64),
        case.num_blocks,
        case.budget,
        case.max_model_len,
        offload=offload_config(case, num_chunks, vllm_version=version),
    )
    return await run_stream(core, cap, requests, tally, FORCED_TOKEN)


@release_params(RUNS)
async def test_cpu_tier_matches_vllm_connector_in_process(
    version: str, name: str, driver_runs: dict[tuple[str, str, str], Any]
) -> None:
    case = CASES[name]
    requests = _requests(case)
    got = driver_runs[("offload", version, name)]
    assert got["version"].startswith(version), got["version"]
    assert got["block_size"] == case.block_size
    ours = await _run_ours(case, version, got["num_chunks"], requests)
    theirs: Counter[tuple[Any, ...]] = Counter()
    equal = 0
    for i, (res, (gpu, cpu, tallied)) in enumerate(zip(got["results"], ours, strict=True)):
        theirs.update(tuple(r) for r in res["events"])
        v_split = (res["cached"] - res["cpu"], res["cpu"])
        same = +theirs == +tallied
        equal += v_split == (gpu, cpu) and same
        if v_split != (gpu, cpu) or not same:
            log.error(
                "request %d: vLLM %s split %s, ours %s; vLLM-only %s; ours-only %s",
                i,
                version,
                v_split,
                (gpu, cpu),
                dict(theirs - tallied),
                dict(tallied - theirs),
            )
    n = len(got["results"])
    cpu_hits = sum(r["cpu"] > 0 for r in got["results"])
    log.info(
        "vLLM %s %s: equal %d/%d (split and events), %d chunks, CPU hits on %d",
        got["version"],
        name,
        equal,
        n,
        got["num_chunks"],
        cpu_hits,
    )
    assert equal == n
    # The stream must exercise what it claims: CPU hits and CPU evictions.
    assert cpu_hits > 0
    assert any(k[0] == "removed" and k[1] == "CPU" for k in theirs)
