"""Differential test: the simulated engine against real vLLM, request by request.

Why: every benchmark, the demo and the chaos suite run on the simulated engine; if its KV
cache manager is not vLLM's, their numbers mean nothing. The same sequential stream goes to
a real vLLM (tiny random-weight model) and to our ``EngineCore`` with the same layout, block
size, pool size and chunk budget. After every request both must report the same
``cached_tokens`` and must have published the same multiset of ``BlockStored`` /
``BlockRemoved`` (group, block hash) entries -- which pins down allocation, sparse retention,
eviction order and chunking, not just the hit.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from harness import EventRecorder, RecordedBatch, bind_mode_config, free_port
from simkit import CPU_DEFAULT_BUDGET, serve_cell, sim_engine, tally
from workload import FORCED_TOKEN, SAMPLING, Step, mixed_stream, next_messages, record_reply

from engine_adapter.profiles import get_profile
from engine_adapter.sim.core import EngineCore
from events.structs import BlockRemoved, BlockStored
from events.tokenizer import ByteTokenizer, apply_chat_template

pytestmark = pytest.mark.vllm
log = logging.getLogger(__name__)

MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class Case:
    model: str
    layout: str
    # What vLLM picks (asserted from its events); None: read from the server's
    # vllm:cache_config_info (a Mamba hybrid's depends on the model's state size).
    block_size: int | None
    vllm_block_size: int | None  # the --block-size flag given to vLLM
    num_gpu_blocks: int
    chunk_budget: int | None = 256  # --max-num-batched-tokens; None: vLLM's CPU default

    @property
    def budget(self) -> int:
        return self.chunk_budget or CPU_DEFAULT_BUDGET


CASES = {
    # --block-size 16 becomes 32 on CPU (sliding-window layers want multiples of 32).
    "gemma3": Case("gemma3", "swa:64*5,full", 32, 16, 240),
    # vLLM enlarges the attention block to hold a Mamba state when its default (128 on
    # CPU) is too small: which it is depends on the state size transformers' Qwen3-Next
    # config gives the tiny model (256 with earlier releases, 128 now).
    "qwen3next": Case("qwen3next", "mamba*3,full", None, None, 48),
    # A chunk budget above the block size (vLLM's CPU default, 2048): prefill chunks
    # span several blocks, so Mamba's align split (``_mamba_block_aligned_split``) and
    # the window's per-chunk tail decide what is cached, not the budget.
    # vLLM sizes each window group for a whole 2048-token chunk: 240 blocks do not start.
    "gemma3-default-budget": Case("gemma3", "swa:64*5,full", 32, 16, 400, None),
    "qwen3next-default-budget": Case("qwen3next", "mamba*3,full", 256, 256, 48, None),
    "llama-default-budget": Case("llama", "full", 128, None, 64, None),
}


def by_group(ev: BlockStored | BlockRemoved) -> tuple[int | None]:
    """What the GPU-only comparison keys events on: the KV cache group."""
    return (ev.group_idx,)


def _vllm_tally(recs: list[RecordedBatch]) -> Counter[tuple[Any, ...]]:
    return tally([r.batch for r in recs], by_group)


async def _ours(core: EngineCore, rid: str, ids: list[int], max_tokens: int) -> tuple[int, str]:
    out_ids: list[int] = []
    cached = 0
    async for out in core.submit(rid, ids, max_tokens, forced_token=FORCED_TOKEN):
        out_ids.extend(out.new_token_ids)
        cached = out.gpu_hit_tokens + out.cpu_hit_tokens
    return cached, ByteTokenizer().decode(out_ids)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", list(CASES))
async def test_simulated_engine_matches_vllm_request_by_request(
    model: str, vllm_server: Any, event_recorder: Any
) -> None:
    case = CASES[model]
    cfg = bind_mode_config(f"diff-{case.model}", replay_port=free_port())
    rec: EventRecorder = event_recorder(cfg)
    server = await asyncio.to_thread(serve_cell, vllm_server, case, cfg, MAX_MODEL_LEN)
    block_size = case.block_size or await asyncio.to_thread(server.block_size)
    core, captured = sim_engine(
        get_profile(case.model, layout=case.layout, block_size=block_size),
        case.num_gpu_blocks,
        case.budget,
        MAX_MODEL_LEN,
        allocate_kv=False,
    )
    await core.start()
    tok = ByteTokenizer()
    chats: dict[int, list[dict[str, str]]] = {}
    steps: list[Step] = mixed_stream(seed=7, n=60)
    rows: list[tuple[str, int, int, bool]] = []
    try:
        for i, step in enumerate(steps):
            if step.chat_key is not None:
                msgs = next_messages(chats, step, None)
                res = await asyncio.to_thread(
                    server.chat, msgs, step.max_tokens, ignore_eos=True, **SAMPLING
                )
                ids = tok.encode(apply_chat_template(msgs))
            else:
                assert step.prompt is not None
                res = await asyncio.to_thread(
                    server.complete, step.prompt, step.max_tokens, **SAMPLING
                )
                ids = tok.encode(step.prompt)
            assert res.prompt_token_ids in (None, ids), "tokenizers disagree"
            cached, reply = await _ours(core, f"r{i}", ids, step.max_tokens)
            assert reply == res.text == chr(FORCED_TOKEN) * step.max_tokens
            record_reply(chats, step, res.text)
            want = tally(captured.batches, by_group)
            try:
                rec.wait_until(lambda recs, w=want: _vllm_tally(recs) == w, timeout=10)
                same_events = True
            except TimeoutError:
                same_events = False
                got = _vllm_tally(rec.batches())
                log.error(
                    "request %d (%s): events differ; vLLM-only %s; ours-only %s",
                    i,
                    step.kind,
                    dict(got - want),
                    dict(want - got),
                )
            rows.append((step.kind, res.cached_tokens, cached, same_events))
            log.info(
                "%2d %-13s prompt %4d vLLM cached %4d ours %4d events %s",
                i,
                step.kind,
                len(ids),
                res.cached_tokens,
                cached,
                "=" if same_events else "DIFFER",
            )
            if not same_events:
                break  # later requests would differ by construction
    finally:
        await core.stop()
    sizes = {e.block_size for e in rec.stored()}
    assert sizes == {block_size}, f"vLLM chose block size {sizes}"
    equal_hits = sum(v == o for _, v, o, _ in rows)
    equal_events = sum(same for *_, same in rows)
    log.info(
        "%s: cached_tokens equal %d/%d, events equal %d/%d, vLLM hits on %d requests",
        model,
        equal_hits,
        len(rows),
        equal_events,
        len(rows),
        sum(v > 0 for _, v, _, _ in rows),
    )
    assert len(rows) == len(steps), f"stopped at request {len(rows) - 1}: events differ"
    assert equal_hits == len(steps), [r for r in rows if r[1] != r[2]]
    # The stream must exercise what it claims to: hits, misses and evictions.
    assert 0 < sum(v > 0 for _, v, _, _ in rows) < len(rows)
    assert rec.removed(), "the pool was never small enough to evict"
