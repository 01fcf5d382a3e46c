"""Reusing a previous prompt's chain gives exactly the hashes of hashing from scratch."""

from __future__ import annotations

import random

import pytest

from events.hashing import block_extra_keys, hash_request_blocks, wire_hashes
from router.decision.prompt_hashes import PromptHashes


def _scratch(ids, size: int, algo: str, salt: str | None, seed: str | None = "s", lora=None):
    keys = block_extra_keys(len(ids) // size, lora=lora, cache_salt=salt)
    return wire_hashes(hash_request_blocks(ids, size, algo, seed, keys))


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxhash_cbor", "sha256"])
def test_turns_retries_and_divergent_prompts_hash_as_from_scratch(algo: str) -> None:
    rng = random.Random(7)
    cache = PromptHashes(algo, "s", capacity=4)
    system = [rng.randrange(50_000) for _ in range(100)]
    convo = list(system)
    for _turn in range(12):
        convo += [rng.randrange(50_000) for _ in range(rng.randrange(1, 60))]
        variants = [
            convo,  # the next turn
            convo[: len(convo) // 2],  # a shorter prefix of a cached prompt
            system + [rng.randrange(50_000) for _ in range(40)],  # same start, diverges
            [rng.randrange(2**40) for _ in range(48)],  # a new start, large ids
        ]
        for ids in variants:
            for size, salt in ((16, None), (16, "salt"), (32, None)):
                assert cache.wire_hashes(ids, size, salt) == _scratch(ids, size, algo, salt)
    assert cache.reused_blocks > 0


def test_adapters_never_share_a_chain_and_hash_as_from_scratch() -> None:
    cache = PromptHashes("sha256_cbor", "s")
    ids = list(range(3000, 3000 + 96))
    loras = [None, ("sql", "/adapters/sql"), ("sql", "/other/path"), ("chat", None)]
    for _ in range(2):  # the second round reuses each adapter's own chain
        got = {lora: cache.wire_hashes(ids, 16, "salt", lora) for lora in loras}
        for lora, hashes in got.items():
            assert hashes == _scratch(ids, 16, "sha256_cbor", "salt", lora=lora)
        assert len({tuple(h) for h in got.values()}) == len(loras)
    assert cache.reused_blocks == 6 * len(loras)


def test_the_next_turn_hashes_only_its_new_blocks() -> None:
    cache = PromptHashes("sha256_cbor", None)
    turn1 = list(range(1000, 1000 + 160))  # 10 blocks
    turn2 = turn1 + list(range(5000, 5000 + 40))  # 12 blocks (and a partial one)
    cache.wire_hashes(turn1, 16, None)
    hashed = cache.hashed_blocks
    assert cache.wire_hashes(turn2, 16, None) == _scratch(turn2, 16, "sha256_cbor", None, None)
    assert (cache.hashed_blocks - hashed, cache.reused_blocks) == (2, 10)


def test_an_unseeded_random_none_hash_is_never_reused(monkeypatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    cache = PromptHashes("xxhash_cbor", None)
    ids = list(range(64))
    cache.wire_hashes(ids, 16, None)
    cache.wire_hashes(ids, 16, None)
    assert not cache.enabled and cache.reused_blocks == 0


def test_documents_behind_one_system_prompt_each_reuse_their_own_chain() -> None:
    rng = random.Random(3)
    system = [rng.randrange(50_000) for _ in range(64)]  # 4 blocks, every prompt's start
    docs = [system + [rng.randrange(50_000) for _ in range(320)] for _ in range(4)]  # 24 blocks
    cache = PromptHashes("sha256_cbor", "s")
    for doc in docs:
        cache.wire_hashes(doc, 16, None)
    hashed = cache.hashed_blocks
    for k in range(8):  # alternating documents, each with a fresh tail
        ids = docs[k % 4] + [rng.randrange(50_000) for _ in range(32)]
        assert cache.wire_hashes(ids, 16, None) == _scratch(ids, 16, "sha256_cbor", None)
    assert cache.hashed_blocks - hashed == 8 * 2  # only each tail's two blocks


def test_kept_chains_stay_within_their_token_budget() -> None:
    rng = random.Random(4)
    cache = PromptHashes("sha256_cbor", "s", max_tokens=1000)
    for _ in range(20):
        ids = [1] * 16 + [rng.randrange(50_000) for _ in range(304)]  # one start, 320 tokens
        assert cache.wire_hashes(ids, 16, None) == _scratch(ids, 16, "sha256_cbor", None)
        assert cache._tokens <= 1000
        starts = list(cache._chains.values())
        assert cache._tokens == sum(len(c.tokens) // 4 for st in starts for c in st.chains)
        assert all(st.tokens == [c.tokens for c in st.chains] for st in starts)


def test_a_conversation_keeps_one_chain_each_turn_replacing_the_one_it_extends() -> None:
    rng = random.Random(5)
    cache = PromptHashes("sha256_cbor", "s")
    ids: list[int] = []
    for _ in range(12):
        ids = ids + [rng.randrange(50_000) for _ in range(48)]  # 3 more blocks a turn
        assert cache.wire_hashes(ids, 16, None) == _scratch(ids, 16, "sha256_cbor", None)
        (start,) = cache._chains.values()
        assert [len(c.tokens) // 4 for c in start.chains] == [len(ids)]
    assert cache._tokens == len(ids)
    assert cache.hashed_blocks == len(ids) // 16  # every block hashed once
