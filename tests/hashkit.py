"""Block hashing from its definition, for tests that check the fast paths against it."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import cbor2
import pytest
import xxhash
from hypothesis import strategies as st

from events import hashing

# Token ids across every CBOR head width and pickle opcode (BININT1/2, BININT, LONG1).
token_ids = st.one_of(
    st.integers(0, 23),
    st.integers(24, 0xFFFF),
    st.integers(0x10000, 0xFFFFFFFF),
    st.integers(0x100000000, (1 << 64) - 1),
)


def reference_chain(
    algo: str, toks: list[int], bs: int, seed: str, keys: Any, parent: bytes | None = None
) -> list[bytes]:
    """Straight from the definition: serialise (parent, tuple(tokens), keys), then digest."""
    if algo.endswith("cbor"):
        ser = lambda o: cbor2.dumps(o, canonical=True)  # noqa: E731
    else:
        ser = lambda o: pickle.dumps(o, protocol=5)  # noqa: E731
    if algo.startswith("sha"):
        dig = lambda b: hashlib.sha256(b).digest()  # noqa: E731
    else:
        dig = xxhash.xxh3_128_digest
    prev = parent or dig(ser(seed))
    out = []
    for i in range(len(toks) // bs):
        prev = dig(ser((prev, tuple(toks[i * bs : (i + 1) * bs]), keys[i] if keys else None)))
        out.append(prev)
    return out


@contextmanager
def hashing_path(native: bool) -> Iterator[None]:
    """Run events.hashing on its native path (skip when not built) or its Python path."""
    saved = hashing._native
    if native and saved is None:
        pytest.skip("events._native is not built (or KVROUTE_NO_NATIVE is set)")
    hashing._native = saved if native else None
    try:
        yield
    finally:
        hashing._native = saved


def both_paths() -> list[bool]:
    """The paths this checkout can run: Python always, native when built."""
    return [False, True] if hashing.native_hashing() else [False]
