"""Trace loading: deterministic block text, prompts cut to input_length, the oracle."""

from __future__ import annotations

import json

import pytest

from bench.replay.trace import (
    TRACE_BLOCK_TOKENS,
    TraceRequest,
    block_text,
    compress_arrivals,
    load_mooncake,
    oracle_hits,
    prompt_text,
    sample_sessions,
    save_mooncake,
)
from events.tokenizer import ByteTokenizer


def _req(i: int, ids: list[int], n: int, ts: float = 0.0) -> TraceRequest:
    return TraceRequest(i, ts, n, 10, tuple(ids))


def test_block_text_same_id_same_text_and_512_byte_tokens():
    block_text.cache_clear()
    a = block_text(42, 0)
    block_text.cache_clear()
    assert block_text(42, 0) == a
    assert len(ByteTokenizer().encode(a)) == TRACE_BLOCK_TOKENS
    assert a.isascii() and a.isprintable()


def test_block_text_different_ids_and_seeds_differ():
    texts = {block_text(i, 0) for i in range(200)}
    assert len(texts) == 200
    assert block_text(5, 0) != block_text(5, 1)


def test_prompt_is_blocks_cut_to_input_length():
    r = _req(0, [7, 8, 9], 1100)
    text = prompt_text(r, 0)
    assert len(text) == 1100
    assert text == (block_text(7, 0) + block_text(8, 0) + block_text(9, 0))[:1100]
    # A request sharing the first two ids shares exactly 1024 leading characters.
    other = prompt_text(_req(1, [7, 8, 10], 1500), 0)
    common = next(i for i, (x, y) in enumerate(zip(text, other, strict=False)) if x != y)
    assert common >= 1024 and text[:1024] == other[:1024]


def test_prompt_with_too_few_blocks_is_rejected():
    with pytest.raises(ValueError):
        prompt_text(_req(0, [1], 600), 0)


def test_load_mooncake_limit_and_round_trip(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 700, "output_length": 9, "hash_ids": [0, 2]},
        {"timestamp": 3000, "input_length": 100, "output_length": 1, "hash_ids": [3]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = load_mooncake(path)
    assert [r.index for r in reqs] == [0, 1, 2]
    assert reqs[1] == TraceRequest(1, 1500.0, 700, 9, (0, 2))
    assert len(load_mooncake(path, limit=2)) == 2
    save_mooncake(reqs, tmp_path / "copy.jsonl")
    assert load_mooncake(tmp_path / "copy.jsonl") == reqs
    assert compress_arrivals(reqs, 10.0) == [0.0, 0.15, 0.3]


def test_oracle_counts_longest_earlier_prefix_by_hand():
    reqs = [
        _req(0, [1, 2, 3], 1400),  # nothing seen: 0
        _req(1, [1, 2, 4], 1300),  # [1, 2] seen: 1024
        _req(2, [1, 2, 3, 5], 2000),  # [1, 2, 3] seen: 1536
        _req(3, [9, 2, 3], 1500),  # 2 and 3 seen, but not after 9: 0
        _req(4, [1], 300),  # [1] seen, capped at input_length - 1: 299
    ]
    assert oracle_hits(reqs) == [0, 1024, 1536, 0, 299]
    total = sum(r.input_length for r in reqs)
    assert total == 6500 and sum(oracle_hits(reqs)) == 2859


def test_sample_sessions_keeps_whole_conversations():
    reqs = [_req(i, [0, 100 + i % 10, 1000 + i], 1500, ts=i) for i in range(200)]
    kept = sample_sessions(reqs, 0.5, seed=3)
    assert 0 < len(kept) < 200
    sessions = {r.hash_ids[:2] for r in kept}
    # Every request of a kept conversation is kept, in order, re-indexed.
    assert len(kept) == sum(1 for r in reqs if r.hash_ids[:2] in sessions)
    assert [r.index for r in kept] == list(range(len(kept)))
    assert len(sample_sessions(reqs, 1.0)) == 200
