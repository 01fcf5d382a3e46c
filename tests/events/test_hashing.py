"""Block hashing reproduces vLLM 0.33's own digests for every algorithm, seed and case."""

from __future__ import annotations

import numpy as np
import pytest
from hashkit import both_paths, hashing_path, reference_chain, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from events.hashing import (
    HASH_ALGOS,
    block_extra_keys,
    event_extra_keys,
    get_hash_fn,
    hash_block_tokens,
    hash_request_blocks,
    none_hash,
    resolve_none_hash_seed,
    wire_hash,
    wire_hashes,
)


def _extra_keys(raw):
    if raw is None:
        return None
    return [None if b is None else tuple(tuple(k) for k in b) for b in raw]


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_every_golden_case_matches_digests_and_wire_ints(block_hash_vectors, native):
    with hashing_path(native):
        _check_golden(block_hash_vectors)


def _check_golden(block_hash_vectors) -> None:
    seqs = block_hash_vectors["token_sequences"]
    cases = block_hash_vectors["cases"]
    assert {c["algo"] for c in cases} == set(HASH_ALGOS)
    for c in cases:
        assert none_hash(c["algo"], c["seed"]).hex() == c["none_hash"], c
        digests = hash_request_blocks(
            seqs[c["tokens"]], c["block_size"], c["algo"], c["seed"], _extra_keys(c["extra_keys"])
        )
        assert [d.hex() for d in digests] == c["hashes"], (c["algo"], c["seed"], c["tokens"])
        assert [wire_hash(d) for d in digests] == c["wire"]


def test_documented_recipe_sha256_cbor_seed_0():
    digests = hash_request_blocks(list(range(32)), 16, "sha256_cbor", "0")
    assert none_hash("sha256_cbor", "0").hex().startswith("4e1195df")
    assert [wire_hash(d) for d in digests] == [12687895063098490012, 1814341696565857452]


def test_seed_rule_pythonhashseed_then_fixed_for_crypto(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert resolve_none_hash_seed("sha256_cbor") == "vllm-none-hash"
    assert none_hash("sha256") == none_hash("sha256", "vllm-none-hash")
    # xxhash without PYTHONHASHSEED: a fresh random seed per call, as in vLLM.
    assert none_hash("xxhash_cbor") != none_hash("xxhash_cbor")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert none_hash("xxhash_cbor") == none_hash("xxhash_cbor", "0")
    assert none_hash("sha256_cbor") == none_hash("sha256_cbor", "0")
    assert none_hash("sha256_cbor", "explicit") != none_hash("sha256_cbor")


def test_only_full_blocks_are_hashed_and_parent_continues_a_chain():
    toks = list(range(100))
    full = hash_request_blocks(toks, 16, "sha256_cbor", "0")
    assert len(full) == 6
    tail = hash_request_blocks(toks[48:], 16, "sha256_cbor", parent=full[2])
    assert tail == full[3:]
    assert hash_request_blocks(toks[:15], 16) == []


def test_single_block_helper_matches_chain():
    toks = list(range(32))
    chain = hash_request_blocks(toks, 16, "sha256", "0")
    nh = none_hash("sha256", "0")
    assert hash_block_tokens("sha256", nh, toks[:16]) == chain[0]
    assert hash_block_tokens("sha256", chain[0], toks[16:]) == chain[1]


def test_wire_hash_is_low_64_bits_big_endian():
    digest = bytes(range(32))
    assert wire_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert wire_hash(b"\xff" * 32) == (1 << 64) - 1


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        get_hash_fn("md5")
    with pytest.raises(ValueError, match="block_size"):
        hash_request_blocks([1, 2], 0)
    with pytest.raises(ValueError, match="extra_keys"):
        hash_request_blocks(list(range(32)), 16, extra_keys=[None])


@settings(max_examples=150, deadline=None)
@given(
    algo=st.sampled_from(HASH_ALGOS),
    toks=st.lists(token_ids, max_size=80),
    bs=st.sampled_from([1, 4, 16, 24, 32]),
    with_keys=st.booleans(),
    as_array=st.booleans(),
)
def test_fast_path_equals_reference_serialisation(algo, toks, bs, with_keys, as_array):
    n = len(toks) // bs
    keys = [(("lora", "a", "/p"),) if i % 2 else None for i in range(n)] if with_keys else None
    arg = np.array(toks, dtype=np.uint64) if as_array and toks else toks
    want = reference_chain(algo, toks, bs, "s", keys)
    for native in both_paths():
        with hashing_path(native):
            assert hash_request_blocks(arg, bs, algo, "s", keys) == want, native


def test_block_extra_keys_are_vllms_lora_on_every_block_and_salt_on_block_0(
    block_hash_vectors,
):
    """The keys vLLM's generate_block_hash_extra_keys gave the golden LoRA + cache_salt
    request, rebuilt from the request's fields (what router and engine both do)."""
    keyed = [c for c in block_hash_vectors["cases"] if c["extra_keys"]]
    assert keyed
    for c in keyed:
        n = len(c["extra_keys"])
        got = block_extra_keys(n, lora=("sql-lora", "/adapters/sql-lora"), cache_salt="tenant-a")
        assert got == _extra_keys(c["extra_keys"]), c["algo"]
    salted = block_extra_keys(3, cache_salt="s")
    assert salted == [(("cache_salt", "s"),), None, None]
    assert [event_extra_keys(k) for k in salted] == [("s",), None, None]
    assert block_extra_keys(3) is None and block_extra_keys(3, cache_salt="") is None


_DIGESTS = st.sampled_from([32, 24, 8]).flatmap(
    lambda n: st.lists(st.binary(min_size=n, max_size=n), min_size=10, max_size=40)
)
_MIXED = st.lists(
    st.one_of(st.binary(min_size=8, max_size=40), st.integers(min_value=0, max_value=1 << 72)),
    max_size=40,
)


@given(st.one_of(_DIGESTS, _MIXED, st.tuples(_DIGESTS, _MIXED).map(lambda p: p[0] + p[1])))
def test_wire_hashes_is_wire_hash_of_each_for_any_mix(hashes):
    """The batched conversion (one numpy pass for a run of same-length digests) gives what
    ``wire_hash`` gives each: one length, mixed lengths, ints among them, short lists."""
    assert wire_hashes(hashes) == [wire_hash(h) for h in hashes]
