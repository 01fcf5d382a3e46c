"""Prefix-cache block hashing, bit-exact with vLLM 0.33 (``kv_cache_utils``, ``utils.hashing``).

A block's hash chains its parent's digest, its token ids and its extra keys:
``hash_fn((parent or NONE_HASH, tuple(tokens), extra_keys))``. Routers must reproduce this
exactly to find an engine's blocks, so the general path uses the same serialisers as vLLM
(pickle protocol 5, canonical cbor2). The CBOR variants also have a fast path: the object
is always ``array(3)[bytes, array[uint...], null|keys]``, simple enough to emit directly,
and the token ids are encoded for all blocks at once with numpy.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Literal

import cbor2
import numpy as np
import xxhash

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
HASH_ALGOS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_NON_CRYPTO = frozenset({"xxhash", "xxhash_cbor"})
_U64 = (1 << 64) - 1


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_SERIALISERS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _pickle,
    "sha256_cbor": _cbor,
    "xxhash": _pickle,
    "xxhash_cbor": _cbor,
}
_DIGESTS: dict[str, Callable[[bytes], bytes]] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256,
    "xxhash": xxhash.xxh3_128_digest,
    "xxhash_cbor": xxhash.xxh3_128_digest,
}


def get_hash_fn(algo: str) -> Callable[[Any], bytes]:
    """vLLM's ``get_hash_fn_by_name``: object -> digest bytes."""
    if algo not in _SERIALISERS:
        raise ValueError(f"unknown hash algorithm {algo!r}; expected one of {HASH_ALGOS}")
    ser, dig = _SERIALISERS[algo], _DIGESTS[algo]
    return lambda obj: dig(ser(obj))


def resolve_none_hash_seed(algo: str, seed: str | None = None) -> str:
    """vLLM 0.33's seed rule: explicit seed > PYTHONHASHSEED > fixed (crypto) or random."""
    if seed is not None:
        return seed
    env = os.getenv("PYTHONHASHSEED")
    if env is not None:
        return env
    if algo in _NON_CRYPTO:
        return os.urandom(32).hex()
    return DEFAULT_NONE_HASH_SEED


def none_hash(algo: str, seed: str | None = None) -> bytes:
    """NONE_HASH: the parent digest of a request's first block (hash of the seed string)."""
    return get_hash_fn(algo)(resolve_none_hash_seed(algo, seed))


def wire_hash(digest: bytes) -> int:
    """The int vLLM puts on the wire: the digest's low 64 bits, read big-endian."""
    return int.from_bytes(digest[-8:], "big") & _U64


def hash_block_tokens(
    algo: str, parent: bytes, tokens: Sequence[int], extra_keys: tuple[Any, ...] | None = None
) -> bytes:
    """Hash one block given its parent digest (vLLM's ``hash_block_tokens``)."""
    return get_hash_fn(algo)((parent, tuple(tokens), extra_keys))


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    algo: str = "sha256_cbor",
    seed: str | None = None,
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
    *,
    parent: bytes | None = None,
) -> list[bytes]:
    """Chain-hash every full block of ``token_ids``; the trailing partial block is dropped.

    ``parent`` continues a chain (e.g. a request's already-hashed prefix); by default the
    chain starts at NONE_HASH for ``seed``. ``extra_keys[i]`` belongs to block ``i``.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    num_blocks = len(token_ids) // block_size
    if extra_keys is not None and len(extra_keys) < num_blocks:
        raise ValueError(f"extra_keys has {len(extra_keys)} entries for {num_blocks} blocks")
    if num_blocks == 0:
        return []
    prev = parent if parent else none_hash(algo, seed)
    if algo in ("sha256_cbor", "xxhash_cbor"):
        return _hash_cbor_fast(token_ids, block_size, num_blocks, prev, extra_keys, _DIGESTS[algo])
    hash_fn = get_hash_fn(algo)
    out: list[bytes] = []
    tokens = list(token_ids)
    for i in range(num_blocks):
        keys = extra_keys[i] if extra_keys is not None else None
        prev = hash_fn((prev, tuple(tokens[i * block_size : (i + 1) * block_size]), keys))
        out.append(prev)
    return out


# ---- fast canonical-CBOR path -------------------------------------------------------


def _cbor_head(major: int, n: int) -> bytes:
    """Canonical (shortest) CBOR head for ``major`` type with argument ``n``."""
    mt = major << 5
    if n < 24:
        return bytes([mt | n])
    if n < 0x100:
        return bytes([mt | 24, n])
    if n < 0x10000:
        return bytes([mt | 25]) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes([mt | 26]) + n.to_bytes(4, "big")
    return bytes([mt | 27]) + n.to_bytes(8, "big")


def _encode_uints(tokens: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Canonical CBOR of each uint in ``tokens``, concatenated; plus each item's end offset."""
    t = tokens.astype(np.uint64, copy=False)
    size = np.where(
        t < 24,
        1,
        np.where(t < 0x100, 2, np.where(t < 0x10000, 3, np.where(t < 0x100000000, 5, 9))),
    ).astype(np.int64)
    ends = np.cumsum(size)
    out = np.zeros(int(ends[-1]), dtype=np.uint8)
    starts = ends - size
    heads = np.where(
        t < 24,
        t,
        np.where(t < 0x100, 24, np.where(t < 0x10000, 25, np.where(t < 0x100000000, 26, 27))),
    ).astype(np.uint8)
    out[starts] = heads
    # Argument bytes, big-endian, after the head byte for items that have them.
    be = t.astype(">u8").view(np.uint8).reshape(-1, 8)
    for nbytes in (1, 2, 4, 8):
        sel = np.nonzero(size == nbytes + 1)[0]
        if sel.size:
            idx = starts[sel, None] + 1 + np.arange(nbytes)
            out[idx] = be[sel, 8 - nbytes :]
    return out.tobytes(), ends


def _hash_cbor_fast(
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    prev: bytes,
    extra_keys: Sequence[tuple[Any, ...] | None] | None,
    digest: Callable[[bytes], bytes],
) -> list[bytes]:
    n = num_blocks * block_size
    if isinstance(token_ids, np.ndarray):
        arr = token_ids[:n]
    else:
        arr = np.fromiter(token_ids[:n] if isinstance(token_ids, list) else token_ids, np.int64, n)
    if arr.size and int(arr.min()) < 0:
        # Negative ids never occur in practice; let cbor2 handle them exactly.
        return _hash_cbor_general(
            list(map(int, arr)), block_size, num_blocks, prev, extra_keys, digest
        )
    body, ends = _encode_uints(arr)
    bounds = [0, *ends[block_size - 1 :: block_size].tolist()]
    tokens_head = _cbor_head(4, block_size)
    parent_head = _cbor_head(2, len(prev))
    none_tail = b"\xf6"
    out: list[bytes] = []
    append = out.append
    for i in range(num_blocks):
        keys = extra_keys[i] if extra_keys is not None else None
        tail = none_tail if keys is None else _cbor(keys)
        prev = digest(
            b"".join(
                (b"\x83", parent_head, prev, tokens_head, body[bounds[i] : bounds[i + 1]], tail)
            )
        )
        append(prev)
        if len(prev) != len(out[0]):  # pragma: no cover - digests have fixed size
            parent_head = _cbor_head(2, len(prev))
    return out


def _hash_cbor_general(
    tokens: list[int],
    block_size: int,
    num_blocks: int,
    prev: bytes,
    extra_keys: Sequence[tuple[Any, ...] | None] | None,
    digest: Callable[[bytes], bytes],
) -> list[bytes]:
    out = []
    for i in range(num_blocks):
        keys = extra_keys[i] if extra_keys is not None else None
        prev = digest(_cbor((prev, tuple(tokens[i * block_size : (i + 1) * block_size]), keys)))
        out.append(prev)
    return out
