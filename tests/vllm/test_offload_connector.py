"""vLLM's real ``OffloadingConnector`` runs on the CPU build with our host-memory spec.

Why: the CPU tier's conformance (the differential test, the router's CPU exactness) rests
on this server being vLLM's connector, unchanged but for the worker's copy engine. Proven
here: the server starts with the connector; a prompt evicted from the GPU pool is served
from the CPU tier (``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}``)
and decoding on the loaded KV gives bit-identical logprobs to decoding on KV computed from
scratch (so the copies move the right bytes, sub-block addressing included); the
CPU-tier events are vLLM's placeholder shape (``medium="CPU"``, the chunk's last hash).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
from harness import CpuOffload, EventRecorder, bind_mode_config, free_port

from events.hashing import hash_request_blocks, wire_hashes
from events.structs import MEDIUM_CPU, BlockStored

pytestmark = pytest.mark.vllm
log = logging.getLogger(__name__)

BLOCK = 32
BPC = 2
GPU_BLOCKS = 24  # 768 tokens: the fillers below evict the first prompt from the GPU
MAX_MODEL_LEN = 736  # what 24 blocks hold beside the null block
# llama at block 32 has 16 KiB per block: 40 chunks of 2 blocks.
OFFLOAD = CpuOffload(40 * 2 * 16 * 1024, blocks_per_chunk=BPC, hold_polls=2)


def _text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.") for _ in range(n))


@pytest.mark.timeout(600)
def test_connector_serves_gpu_evicted_prompt_from_cpu_with_same_output(
    vllm_server: Any, event_recorder: Any
) -> None:
    cfg = bind_mode_config(f"offload-{free_port()}", replay_port=free_port())
    rec: EventRecorder = event_recorder(cfg)
    server = vllm_server(
        "llama",
        kv_events_config=cfg,
        block_size=BLOCK,
        num_gpu_blocks=GPU_BLOCKS,
        max_num_batched_tokens=256,
        max_model_len=MAX_MODEL_LEN,
        cpu_offload=OFFLOAD,
    )
    prompt = _text(1, 300)  # 9 full blocks: 4 whole chunks of 2
    first = server.complete(prompt, max_tokens=4, logprobs=3)
    assert first.cached_tokens == 0
    sent = first.prompt_tokens
    for seed in (2, 3, 4):  # 3 x 300 tokens through a 768-token pool
        sent += server.complete(_text(seed, 300), max_tokens=1).prompt_tokens
    before = server.wait_prompt_tokens(sent)
    again = server.complete(prompt, max_tokens=4, logprobs=3)
    after = server.wait_prompt_tokens(sent + again.prompt_tokens)
    gpu = after.get("local_cache_hit", 0) - before.get("local_cache_hit", 0)
    cpu = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
    log.info(
        "repeat after GPU eviction: cached %d = GPU %d + CPU %d", again.cached_tokens, gpu, cpu
    )
    assert gpu + cpu == again.cached_tokens
    assert cpu == 256, "the prompt's 4 chunks (8 blocks) come back from the CPU tier"
    logprobs = [r.raw["choices"][0]["logprobs"]["top_logprobs"] for r in (first, again)]
    assert logprobs[0] == logprobs[1], "decoding on loaded KV differs: bad copy"
    other = server.complete(_text(5, 300), max_tokens=4, logprobs=3)
    assert other.raw["choices"][0]["logprobs"]["top_logprobs"] != logprobs[0]

    chain = wire_hashes(hash_request_blocks(server.tokenize(prompt), BLOCK, "sha256_cbor"))
    rec.wait_until(lambda recs: any(e.medium == MEDIUM_CPU for r in recs for e in r.batch.events))
    cpu_stored = [e for e in rec.stored() if e.medium == MEDIUM_CPU]
    assert all(isinstance(e, BlockStored) for e in cpu_stored)
    # Placeholders (vLLM's default): the chunk's last hash, no tokens, no block size.
    assert {(len(e.block_hashes), e.block_size, len(e.token_ids)) for e in cpu_stored} == {
        (1, 0, 0)
    }
    named = {e.block_hashes[0] for e in cpu_stored}
    assert {chain[i] for i in (1, 3, 5, 7)} <= named, "the first prompt's chunk keys"
