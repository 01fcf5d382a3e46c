"""The generated chat/agent workload: deterministic per seed, consistent block streams."""

from __future__ import annotations

import itertools

import pytest

from bench.replay.trace import oracle_hits, prompt_text
from bench.replay.workload import WorkloadConfig, generate


def test_same_seed_same_records_different_seed_different():
    cfg = WorkloadConfig(kind="mixed", sessions=20)
    assert generate(cfg, 7) == generate(cfg, 7)
    assert generate(cfg, 7) != generate(cfg, 8)


@pytest.mark.parametrize("kind", ["chat", "agent", "mixed"])
def test_records_are_sorted_valid_and_reuse_prefixes(kind):
    reqs = generate(WorkloadConfig(kind=kind, sessions=15), 1)
    assert reqs and [r.index for r in reqs] == list(range(len(reqs)))
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in itertools.pairwise(reqs))
    for r in reqs:
        assert len(prompt_text(r, 0)) == r.input_length  # enough blocks for every prompt
    hits = oracle_hits(reqs)
    assert sum(hits) / sum(r.input_length for r in reqs) > 0.3


def test_chat_turns_extend_the_previous_prompt():
    reqs = generate(WorkloadConfig(kind="chat", sessions=1, chat_turns=(4, 4)), 2)
    assert len(reqs) == 4
    texts = [prompt_text(r, 0) for r in reqs]
    for a, b in itertools.pairwise(texts):
        assert len(b) > len(a) and b.startswith(a)


def test_agent_fan_out_shares_the_context_blocks():
    cfg = WorkloadConfig(kind="agent", sessions=1, agent_steps=(1, 1), fanout=(3, 3))
    reqs = generate(cfg, 3)
    assert len(reqs) == 4  # one step + three tool calls
    main = next(r for r in reqs if r.timestamp_ms == min(x.timestamp_ms for x in reqs))
    tools = [r for r in reqs if r is not main]
    shared = main.input_length // 512
    for t in tools:
        assert t.hash_ids[:shared] == main.hash_ids[:shared]
    assert len({t.hash_ids[shared:] for t in tools}) == 3  # each call adds its own blocks


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError):
        generate(WorkloadConfig(kind="bogus"), 0)
