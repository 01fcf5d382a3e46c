"""events._native (the C chain) is byte-identical with the Python path and vLLM's
serialisers, is what events.hashing uses when built, and KVROUTE_NO_NATIVE turns it off."""

from __future__ import annotations

import array
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hashkit import hashing_path, reference_chain, token_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from events import hashing
from events.hashing import block_extra_keys, chain_digests, hash_request_blocks, none_hash
from router.decision.prompt_hashes import PromptHashes

ROOT = Path(__file__).resolve().parents[2]
NATIVE_ALGOS = ("sha256_cbor", "sha256")
BUILT = importlib.util.find_spec("events._native") is not None

_keys = st.sampled_from(["none", "lora", "salt", "both", "mm-odd"])


def _block_keys(kind: str, n: int) -> list[Any] | None:
    if kind == "none":
        return None
    if kind == "mm-odd":  # a hand-made key on odd blocks only (not vLLM's shape: any tuple)
        return [(("mm", "f" * (i % 40), i, 2**40),) if i % 2 else None for i in range(n)]
    lora = ("sql", "/adapters/sql") if kind in ("lora", "both") else None
    return block_extra_keys(n, lora=lora, cache_salt="tenant" if kind != "lora" else None)


def _native_and_python(*args: Any, **kw: Any) -> tuple[list[bytes], list[bytes]]:
    with hashing_path(True):
        native = hash_request_blocks(*args, **kw)
    with hashing_path(False):
        python = hash_request_blocks(*args, **kw)
    return native, python


@pytest.mark.skipif(not BUILT, reason="events._native is not built")
@settings(max_examples=200, deadline=None)
@given(
    algo=st.sampled_from(NATIVE_ALGOS),
    toks=st.lists(token_ids, max_size=120),
    bs=st.sampled_from([1, 2, 3, 4, 5, 16, 23, 24, 32]),
    keys=_keys,
    container=st.sampled_from(["list", "tuple", "u32", "u64", "i64", "array", "strided"]),
    tail=st.integers(0, 7),
    chained=st.booleans(),
)
def test_native_equals_python_and_the_definition(algo, toks, bs, keys, container, tail, chained):
    toks = toks + [7] * tail  # a partial tail block is dropped by both
    n = len(toks) // bs
    extra = _block_keys(keys, n)
    small = all(t < 2**31 for t in toks)
    if container in ("u32", "i64", "array") and not small:
        container = "list"
    make = {
        "list": lambda: toks,
        "tuple": lambda: tuple(toks),
        "u32": lambda: np.array(toks, dtype=np.uint32),
        "u64": lambda: np.array(toks, dtype=np.uint64),
        "i64": lambda: np.array(toks, dtype=np.int64),
        "array": lambda: array.array("I", toks),
        "strided": lambda: np.repeat(np.array(toks, dtype=np.uint64), 2)[::2],
    }
    arg = make[container]()
    parent = bytes(range(32)) if chained else None
    native, python = _native_and_python(arg, bs, algo, "s", extra, parent=parent)
    assert native == python == reference_chain(algo, toks, bs, "s", extra, parent)


@pytest.mark.skipif(not BUILT, reason="events._native is not built")
@pytest.mark.parametrize("algo", NATIVE_ALGOS)
def test_ids_the_native_path_does_not_encode_fall_back_exactly(algo):
    from events import _native

    nh = none_hash(algo, "s")
    chain = _native.sha256_cbor_chain if algo == "sha256_cbor" else _native.sha256_pickle_chain
    extra = (None,) if algo == "sha256_cbor" else ()
    cases = {
        "negative": [5, -1, 7, 9],
        "2**64": [5, 2**64, 7, 9],
        "negative int32 buffer": np.array([5, -1, 7, 9], dtype=np.int32),
    }
    # bool ids (never a tokenizer's) are vLLM's True/False, not 1/0: left to Python too
    assert chain([5, True, 7, 9], 2, 2, nh, *extra) is None
    for name, ids in cases.items():
        assert chain(ids, 2, 2, nh, *extra) is None, name
        native, python = _native_and_python(ids, 2, algo, "s")
        plain = ids.tolist() if isinstance(ids, np.ndarray) else ids
        assert native == python == reference_chain(algo, plain, 2, "s", None), name


@pytest.mark.skipif(not BUILT, reason="events._native is not built")
def test_a_pickle_past_one_frame_falls_back_and_just_under_it_does_not():
    """The C pickler splits frames past 64 KiB; the native pickle stops short of that.
    A 300-valued token pickles to 3 bytes, so the frame is 42 + 3 * block_size bytes."""
    from events import _native

    nh = none_hash("sha256", "s")
    for bs, native_applies in ((21831, True), (21832, False)):
        ids = [300] * bs
        assert (_native.sha256_pickle_chain(ids, bs, 1, nh) is not None) == native_applies
        native, python = _native_and_python(ids, bs, "sha256", "s")
        assert native == python == reference_chain("sha256", ids, bs, "s", None)


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_packed_u32_packs_small_ids_and_refuses_odd_ones(native):
    with hashing_path(native):
        assert (
            hashing.packed_u32([0, 5, 2**32 - 1]) == array.array("I", [0, 5, 2**32 - 1]).tobytes()
        )
        assert hashing.packed_u32([]) == b""
        for odd in ([1, -1], [1, 2**32], [1, 2**64], [1, "2"]):
            assert hashing.packed_u32(odd) is None


def test_longest_prefix_native_equals_the_reference_and_counts_whole_items():
    """The native ``longest_prefix`` against the Python one on random candidate lists
    (ties, none shared, empty and partial items), and both against numpy's first
    difference."""
    rng = np.random.default_rng(1)
    for _ in range(400):
        unit = int(rng.choice([1, 4, 8, 64]))
        b = rng.integers(0, 3, size=int(rng.integers(0, 40)), dtype=np.uint32)
        cands = []
        for _ in range(int(rng.integers(0, 6))):
            a = b.copy() if rng.random() < 0.4 else rng.integers(0, 3, size=len(b), dtype=np.uint32)
            cands.append(a[: int(rng.integers(0, len(a) + 1))].tobytes())
        raw = b.tobytes()
        want_at, want = -1, 0
        for i, a in enumerate(cands):
            x, y = np.frombuffer(a, np.uint8), np.frombuffer(raw, np.uint8)
            m = min(len(x), len(y))
            diff = np.flatnonzero(x[:m] != y[:m])
            items = (int(diff[0]) if diff.size else m) // unit
            if items and items >= want:
                want_at, want = i, items
        with hashing_path(False):
            assert hashing.longest_prefix(cands, raw, unit) == (want_at, want)
        if BUILT:
            with hashing_path(True):
                assert hashing.longest_prefix(cands, raw, unit) == (want_at, want)


@pytest.mark.skipif(not BUILT, reason="events._native is not built")
def test_longest_prefix_rejects_what_is_not_a_list_of_bytes():
    from events import _native

    with pytest.raises(TypeError):
        _native.longest_prefix([b"ab", "ab"], b"ab", 1)
    with pytest.raises(TypeError):
        _native.longest_prefix((b"ab",), b"ab", 1)
    with pytest.raises(ValueError):
        _native.longest_prefix([b"ab"], b"ab", 0)


@settings(max_examples=60, deadline=None)
@given(
    algo=st.sampled_from(NATIVE_ALGOS),
    toks=st.lists(token_ids, min_size=1, max_size=100),
    bs=st.sampled_from([1, 4, 16]),
    salt=st.sampled_from([None, "tenant"]),
)
def test_chain_digests_is_hash_request_blocks_back_to_back(algo, toks, bs, salt):
    keys = block_extra_keys(len(toks) // bs, cache_salt=salt)
    nh = none_hash(algo, "s")
    with hashing_path(BUILT):
        assert chain_digests(toks, bs, algo, nh, keys) == b"".join(
            hash_request_blocks(toks, bs, algo, "s", keys)
        )


@pytest.mark.parametrize("algo", [*NATIVE_ALGOS, "xxhash_cbor"])
def test_prompt_hashes_agree_across_paths(algo):
    rng = np.random.default_rng(3)
    base = rng.integers(0, 200_000, 700).tolist()
    prompts = [base[:400], base, base[:300] + [1, 2, 3] * 40, [2**40 + i for i in range(64)]]
    got = {}
    for native in (False, BUILT):
        with hashing_path(native):
            cache = PromptHashes(algo, "s")
            got[native] = [cache.wire_hashes(p, 16, salt) for p in prompts for salt in (None, "x")]
    want = []
    for p in prompts:
        for salt in (None, "x"):
            keys = block_extra_keys(len(p) // 16, cache_salt=salt)
            want.append(reference_chain(algo, p, 16, "s", keys))
    want = [hashing.wire_hashes(w) for w in want]
    assert got[False] == got[BUILT] == want


def test_native_is_in_use_when_built():
    """Where the extension is built, events.hashing uses it (so the suite exercises it);
    KVROUTE_REQUIRE_NATIVE=1 (scripts/test.sh where a compiler and OpenSSL's headers are
    present) makes a missing build a failure rather than a silent Python path."""
    if os.environ.get("KVROUTE_REQUIRE_NATIVE") == "1":
        assert BUILT, "events._native was not built: pip install -e . (needs cc + libssl-dev)"
    if not BUILT:
        pytest.skip("events._native is not built")
    if os.environ.get("KVROUTE_NO_NATIVE"):
        pytest.skip("KVROUTE_NO_NATIVE is set")
    assert hashing.native_hashing()
    real, calls = hashing._native, []

    class Spy:
        def __getattr__(self, name: str) -> Any:
            fn = getattr(real, name)
            return lambda *a: calls.append(name) or fn(*a)

    hashing._native = Spy()
    try:
        ids = list(range(1000, 1064))
        for algo in NATIVE_ALGOS:
            assert hash_request_blocks(ids, 16, algo, "s") == reference_chain(
                algo, ids, 16, "s", None
            )
    finally:
        hashing._native = real
    assert calls == ["sha256_cbor_chain", "sha256_pickle_chain"]


def test_kvroute_no_native_forces_the_python_path():
    code = "from events.hashing import native_hashing; print(native_hashing())"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVROUTE_NO_NATIVE": "1"}
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert off.stdout.strip() == "False", off.stderr
    env.pop("KVROUTE_NO_NATIVE")
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert on.stdout.strip() == str(BUILT), on.stderr
