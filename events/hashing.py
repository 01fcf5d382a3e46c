"""Prefix-cache block hashing, bit-exact with vLLM 0.33 (``kv_cache_utils``, ``utils.hashing``).

A block's hash chains its parent's digest, its token ids and its extra keys:
``hash_fn((parent or NONE_HASH, tuple(tokens), extra_keys))``. Routers must reproduce this
exactly to find an engine's blocks, so the general path uses the same serialisers as vLLM
(pickle protocol 5, canonical cbor2). The CBOR variants also have a fast path: the object
is always ``array(3)[bytes, array[uint...], null|keys]``, simple enough to emit directly,
and the token ids are encoded for all blocks at once with numpy.
"""

from __future__ import annotations

import array
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
    # Python ints: pickle of a numpy scalar differs from pickle of an int.
    tokens = token_ids.tolist() if isinstance(token_ids, np.ndarray) else list(token_ids)
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
    if int(tokens.max(initial=0)) < _TABLE_MAX_IDS:
        enc, size = _token_table(int(tokens.max(initial=0)) + 1)
        sizes = size.take(tokens)
        body = enc.take(tokens, axis=0)[_PREFIX_MASK.take(sizes, axis=0)].tobytes()
        return body, np.cumsum(sizes, dtype=np.int64)
    return _encode_uints_wide(tokens)


# Per-token canonical CBOR, precomputed: row t = head byte + big-endian argument, padded to 9.
_TABLE_MAX_IDS = 1 << 22
_PREFIX_MASK = np.arange(9)[None, :] < np.arange(10)[:, None]  # row n: first n bytes
_table: tuple[np.ndarray, np.ndarray] | None = None


def _size_and_head(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    big = t >= 0x100000000
    size = 1 + (t >= 24) + (t >= 0x100) + 2 * (t >= 0x10000).astype(np.int64) + 4 * big
    head = np.where(
        t < 24, t, np.where(t < 0x100, 24, np.where(t < 0x10000, 25, np.where(big, 27, 26)))
    )
    return size.astype(np.int64), head.astype(np.uint8)


def _token_table(min_ids: int) -> tuple[np.ndarray, np.ndarray]:
    """The encoding table covering ids < max(min_ids, 2**18), grown by doubling."""
    global _table
    if _table is None or len(_table[1]) < min_ids:
        n = max(1 << 18, 1 << (min_ids - 1).bit_length())
        ids = np.arange(n, dtype=np.uint64)
        size, head = _size_and_head(ids)
        enc = np.zeros((n, 9), dtype=np.uint8)
        enc[:, 0] = head
        be = ids.astype(">u8").view(np.uint8).reshape(n, 8)
        for nbytes in (1, 2, 4):
            sel = size == nbytes + 1
            enc[sel, 1 : 1 + nbytes] = be[sel, 8 - nbytes :]
        _table = (enc, size)
    return _table


def _encode_uints_wide(tokens: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Table-free variant for ids beyond the table (up to 2**64 - 1)."""
    t = tokens.astype(np.uint64, copy=False)
    size, head = _size_and_head(t)
    enc = np.zeros((t.size, 9), dtype=np.uint8)
    enc[:, 0] = head
    be = t.astype(">u8").view(np.uint8).reshape(-1, 8)
    for nbytes in (1, 2, 4, 8):
        sel = size == nbytes + 1
        enc[sel, 1 : 1 + nbytes] = be[sel, 8 - nbytes :]
    return enc[_PREFIX_MASK.take(size, axis=0)].tobytes(), np.cumsum(size)


def _as_uint_array(token_ids: Sequence[int], n: int) -> np.ndarray | None:
    """Token ids as a non-negative integer array, or None when some id is negative."""
    if isinstance(token_ids, np.ndarray):
        arr = token_ids[:n]
    else:
        head = token_ids[:n] if isinstance(token_ids, list | tuple) else list(token_ids)[:n]
        try:
            arr = np.frombuffer(array.array("I", head), dtype=np.uint32)  # fastest list path
        except OverflowError:
            try:
                arr = np.array(head, dtype=np.uint64)
            except OverflowError:
                return None
    if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
        return None
    return arr


def _hash_cbor_fast(
    token_ids: Sequence[int],
    block_size: int,
    num_blocks: int,
    prev: bytes,
    extra_keys: Sequence[tuple[Any, ...] | None] | None,
    digest: Callable[[bytes], bytes],
) -> list[bytes]:
    arr = _as_uint_array(token_ids, num_blocks * block_size)
    if arr is None:
        # Negative ids never occur in practice; let cbor2 handle them exactly.
        tokens = [int(t) for t in list(token_ids)[: num_blocks * block_size]]
        return _hash_cbor_general(tokens, block_size, num_blocks, prev, extra_keys, digest)
    body, ends = _encode_uints(arr)
    bounds = [0, *ends[block_size - 1 :: block_size].tolist()]
    tokens_head = _cbor_head(4, block_size)
    chained_head = b"\x83" + _cbor_head(2, len(digest(b"")))  # every digest after the first
    head = b"\x83" + _cbor_head(2, len(prev))  # the seed parent may differ in length
    out: list[bytes] = []
    append = out.append
    for i in range(num_blocks):
        keys = extra_keys[i] if extra_keys is not None else None
        tail = b"\xf6" if keys is None else _cbor(keys)
        prev = digest(b"".join((head, prev, tokens_head, body[bounds[i] : bounds[i + 1]], tail)))
        append(prev)
        head = chained_head
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
