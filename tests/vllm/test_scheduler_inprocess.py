"""Scheduler-level differential: our ``EngineCore`` against vLLM's own ``Scheduler``, 0.32
and 0.33, driven in-process with canned model outputs.

Why: the server differential (``test_engine_differential.py``) can only run the CPU build,
0.32; GPU users run 0.33, whose wheel cannot serve here. Its scheduler and KV cache manager
are plain Python, so ``sched/driver.py`` runs them under the 0.32 venv's interpreter with
0.33's sources first on the path (``sched/install_vllm033.sh``), no model, no server: a few
seconds per stream. The same stream goes through 0.32 the same way, which also checks the
driver against the server differential's oracle. Per request: the same prefix hit, and the
same multiset of stored / removed (group, hash) entries so far.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from schedkit import driver_job, register_jobs, release_params
from simkit import run_stream, sim_engine
from workload import FORCED_TOKEN, mixed_stream, next_messages, record_reply

from engine_adapter.profiles import get_profile
from events.structs import BlockRemoved, BlockStored, KVEventBatch
from events.tokenizer import ByteTokenizer, apply_chat_template

# The timeout covers the session's driver processes (``driver_runs``), set up by the first test.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]
log = logging.getLogger(__name__)

MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class Case:
    layout: str  # the driver's layer set (driver.py: _layer_specs)
    profile: str  # the same layout for our engine (engine_adapter.profiles.parse_layout)
    block_size: int
    budget: int  # --max-num-batched-tokens
    num_blocks: int  # small enough that the stream's cold long prompts evict


CASES = {
    "llama-256": Case("full", "full", 32, 256, 96),
    "llama-2048": Case("full", "full", 32, 2048, 96),
    # Budgets above the block size: the align split (``_mamba_block_aligned_split``) ends
    # chunks at block boundaries, the prompt's last cacheable one and junctions; 480 is
    # not a multiple of the block.
    "qwen3next-2048": Case("mamba", "mamba*3,full", 256, 2048, 48),
    "qwen3next-480": Case("mamba", "mamba*3,full", 256, 480, 48),
    # A 2048 budget needs a bigger pool: vLLM sizes a window group for a whole chunk.
    "gemma3-2048": Case("swa", "swa:64*5,full", 32, 2048, 400),
}
# 0.33 on every case; 0.32 on one, which ties the driver to the server differential's oracle.
RUNS = [("0.33", name) for name in CASES] + [("0.32", "llama-2048")]


def _stream(n: int) -> list[tuple[list[int], int]]:
    tok = ByteTokenizer()
    chats: dict[int, list[dict[str, str]]] = {}
    out = []
    for step in mixed_stream(seed=21, n=n):
        if step.chat_key is not None:
            ids = tok.encode(apply_chat_template(next_messages(chats, step, None)))
        else:
            assert step.prompt is not None
            ids = tok.encode(step.prompt)
        record_reply(chats, step, chr(FORCED_TOKEN) * step.max_tokens)
        out.append((ids, step.max_tokens))
    return out


STREAM = _stream(40)


REQUESTS = [{"prompt_token_ids": ids, "max_tokens": m} for ids, m in STREAM]


def _job(model_dir: Path, case: Case) -> dict[str, Any]:
    return driver_job(model_dir, case, MAX_MODEL_LEN, REQUESTS, FORCED_TOKEN)


# vLLM's side runs in the session's driver processes (conftest ``driver_runs``); the model
# dir only feeds vLLM's config (no weights run), the layers are the driver's.
register_jobs(
    "scheduler", lambda models: [(v, n, _job(models / "llama", CASES[n])) for v, n in RUNS]
)


def _tally(batches: list[KVEventBatch]) -> Counter[tuple[Any, ...]]:
    out: Counter[tuple[Any, ...]] = Counter()
    for batch in batches:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                out[("stored_event", ev.group_idx, None)] += 1
            if isinstance(ev, BlockStored | BlockRemoved):
                kind = type(ev).__name__
                out.update((kind, ev.group_idx, h) for h in ev.block_hashes)
            else:
                out[(type(ev).__name__, None, None)] += 1
    return out


async def _run_ours(case: Case) -> list[tuple[int, Counter[tuple[Any, ...]]]]:
    """Our engine on ``STREAM``: per request (cached tokens, events so far)."""
    core, cap = sim_engine(
        get_profile(case.layout, layout=case.profile, block_size=case.block_size),
        case.num_blocks,
        case.budget,
        MAX_MODEL_LEN,
        allocate_kv=False,
    )
    rows = await run_stream(core, cap, REQUESTS, _tally, FORCED_TOKEN)
    return [(gpu + cpu, counted) for gpu, cpu, counted in rows]


@release_params(RUNS)
async def test_engine_matches_vllm_scheduler_in_process(
    version: str, name: str, driver_runs: dict[tuple[str, str, str], Any]
) -> None:
    case = CASES[name]
    stream = STREAM
    got = driver_runs[("scheduler", version, name)]
    assert got["version"].startswith(version), got["version"]
    assert got["block_size"] == case.block_size
    ours = await _run_ours(case)
    theirs: Counter[tuple[Any, ...]] = Counter()
    equal_hits = equal_events = 0
    for i, (res, (cached, tally)) in enumerate(zip(got["results"], ours, strict=True)):
        theirs.update(tuple(r) for r in res["events"])
        same = +theirs == +tally
        equal_hits += res["cached"] == cached
        equal_events += same
        if res["cached"] != cached or not same:
            log.error(
                "request %d: vLLM %s cached %d, ours %d; vLLM-only %s; ours-only %s",
                i,
                version,
                res["cached"],
                cached,
                dict(theirs - tally),
                dict(tally - theirs),
            )
    hits = sum(r["cached"] > 0 for r in got["results"])
    log.info(
        "vLLM %s %s: cached equal %d/%d, events equal %d/%d, %d with a hit",
        got["version"],
        name,
        equal_hits,
        len(stream),
        equal_events,
        len(stream),
        hits,
    )
    assert equal_hits == len(stream)
    assert equal_events == len(stream)
    # The stream must exercise hits, misses and evictions.
    assert 0 < hits < len(stream)
    assert any(k == "BlockRemoved" for k, _, _ in theirs)
