"""Smoke test of the real-vLLM harness, one model at a time.

Why: every other test in tests/vllm trusts these facts -- the server starts with our flags,
its tokenizer is exactly our byte tokenizer, a repeated prompt hits the prefix cache in whole
blocks, and the events name one KV cache group per layer kind as documented. Both event
modes are exercised: vLLM connecting to a bound recorder (tcp loopback) and vLLM binding
(ipc + loopback replay).
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import pytest
from harness import (
    EventRecorder,
    bind_mode_config,
    connect_mode_config,
    fetch_replay,
    free_port,
)

from events.model_dir import ModelDirTokenizer
from events.structs import BlockStored

pytestmark = pytest.mark.vllm
logger = logging.getLogger(__name__)

PROMPT_TOKENS = 352
EXPECTED_KINDS: dict[str, list[str]] = {
    "gemma3": ["sliding_window"] * 5 + ["full_attention"],
    "qwen3next": ["mamba"] * 3 + ["full_attention"],
    "llama": ["full_attention"],
}
# Which event mode each model exercises (all three would triple the run time).
BIND_MODE = {"gemma3": True, "qwen3next": False, "llama": False}
TOKENIZE_PROBE = "héllo wörld\n<|user|> <eos><bos>  \t<0x41>"
# Text parts: vLLM joins them with a newline before the template sees them.
CHAT_PROBE = [
    {"role": "system", "content": "be brief <bos>"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "héllo"}, {"type": "text", "text": "wörld"}],
    },
]


def byte_prompt(n: int, seed: int) -> str:
    """``n`` ASCII characters, hence exactly ``n`` tokens with the byte tokenizer."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.") for _ in range(n))


def shape(ev: BlockStored, full_chain: list[Any], prompt_ids: list[int]) -> dict[str, Any]:
    """What a BlockStored looks like: sizes, and which full-attention blocks it names."""
    return {
        "block_positions": [full_chain.index(h) for h in ev.block_hashes],
        "token_ids_are_prompt_prefix": ev.token_ids == prompt_ids[: len(ev.token_ids)],
        "group_idx": ev.group_idx,
        "kind": ev.kv_cache_spec_kind,
        "window": ev.kv_cache_spec_sliding_window,
        "hashes": len(ev.block_hashes),
        "token_ids": len(ev.token_ids),
        "parent": ev.parent_block_hash is not None,
        "block_size": ev.block_size,
        "medium": ev.medium,
    }


@pytest.mark.timeout(900)
@pytest.mark.parametrize("model", ["llama", "gemma3", "qwen3next"])
def test_server_cache_hit_and_groups(
    model: str, vllm_server: Any, vllm_models: Path, event_recorder: Any, tmp_path: Path
) -> None:
    replay_port = free_port()
    if BIND_MODE[model]:
        cfg = bind_mode_config(f"smoke-{model}", replay_port=replay_port)
    else:
        cfg = connect_mode_config(free_port(), replay_port=replay_port)
    rec: EventRecorder = event_recorder(cfg)  # binds first in connect mode
    server = vllm_server(
        model,
        kv_events_config=cfg,
        num_gpu_blocks=240,
        max_num_batched_tokens=256,
    )
    logger.info("%s ready in %.1f s", model, server.startup_s)

    probe = server.tokenize(TOKENIZE_PROBE)
    assert probe == list(TOKENIZE_PROBE.encode("utf-8"))

    prompt = byte_prompt(PROMPT_TOKENS, seed=1)
    assert server.tokenize(prompt) == list(prompt.encode())
    kinds = EXPECTED_KINDS[model]

    first = server.complete(prompt, max_tokens=1)
    assert first.prompt_tokens == PROMPT_TOKENS
    assert first.prompt_token_ids == list(prompt.encode())
    assert first.cached_tokens == 0

    def every_group_stored(recs: list[Any]) -> bool:
        seen = {e.group_idx for r in recs for e in r.batch.events if isinstance(e, BlockStored)}
        return seen >= set(range(len(kinds)))

    rec.wait_until(every_group_stored, timeout=30)
    after_first = rec.mark()
    stored = rec.stored()
    block_sizes = {e.block_size for e in stored}
    assert len(block_sizes) == 1, block_sizes
    block_size = block_sizes.pop()

    second = server.complete(prompt, max_tokens=1)
    assert second.prompt_tokens == PROMPT_TOKENS
    assert 0 < second.cached_tokens < PROMPT_TOKENS
    assert second.cached_tokens % block_size == 0

    # One KV cache group per layer kind, numbered 0..N-1, tagged as documented.
    by_group = {e.group_idx: e for e in stored}
    assert sorted(by_group) == list(range(len(kinds)))
    assert [by_group[g].kv_cache_spec_kind for g in range(len(kinds))] == kinds
    for g, kind in enumerate(kinds):
        window = by_group[g].kv_cache_spec_sliding_window
        assert (window == 64) if kind == "sliding_window" else window is None
    # At most one BlockStored per group per batch (one batch per engine step).
    for r in rec.batches():
        groups = [e.group_idx for e in r.batch.events if isinstance(e, BlockStored)]
        assert len(groups) == len(set(groups)), (r.seq, groups)
    # Hashes depend on tokens, not on the group: every group's hashes are full-attention ones
    # (the window and Mamba groups keep only some of them).
    full_chain = [
        h for e in stored if e.kv_cache_spec_kind == "full_attention" for h in e.block_hashes
    ]
    for ev in stored:
        assert set(ev.block_hashes) <= set(full_chain), ev.group_idx
        assert ev.medium == "GPU"
        assert len(ev.token_ids) >= len(ev.block_hashes) * block_size
        assert bytes(ev.token_ids) in prompt.encode()  # a contiguous run of the prompt
    # The window groups of one step carry the very same hashes (same tokens, same window).
    for r in rec.batches():
        windows = {
            tuple(e.block_hashes)
            for e in r.batch.events
            if isinstance(e, BlockStored) and e.kv_cache_spec_kind == "sliding_window"
        }
        assert len(windows) <= 1, r.seq

    # The replay ROUTER (loopback) hands back what the live stream carried.
    replayed = fetch_replay(cfg["replay_endpoint"], 0)
    live = [(r.seq, r.batch) for r in rec.batches()]
    assert replayed[: len(live)] == live

    report = {
        "model": model,
        "startup_s": round(server.startup_s or 0.0, 1),
        "block_size": block_size,
        "bind_mode": BIND_MODE[model],
        "first_request_events": [
            {
                "seq": r.seq,
                "stored": [
                    shape(e, full_chain, list(prompt.encode()))
                    for e in r.batch.events
                    if isinstance(e, BlockStored)
                ],
            }
            for r in rec.batches()[:after_first]
        ],
        "second_request_events": [
            {"seq": r.seq, "events": [type(e).__name__ for e in r.batch.events]}
            for r in rec.batches(after_first)
        ],
        "second_cached_tokens": second.cached_tokens,
    }
    logger.info("%s facts: %s", model, json.dumps(report))

    # The router's --tokenizer MODEL_DIR gives this server's ids, for a completion's prompt
    # and for a chat (/tokenize and the generation path alike). Last: the chat is too short
    # to store a block, and the event checks above are done.
    local = ModelDirTokenizer(vllm_models / model)
    assert local.encode_prompt(TOKENIZE_PROBE) == probe
    chat_ids = server.tokenize_chat(CHAT_PROBE)
    assert local.encode_chat(CHAT_PROBE) == chat_ids
    assert server.chat(CHAT_PROBE).prompt_token_ids == chat_ids
    assert bytes(chat_ids).decode().count("héllo\nwörld") == 1
    (tmp_path / f"facts-{model}.json").write_text(json.dumps(report, indent=2))
