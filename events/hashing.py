"""Prefix-cache block hashing, bit-exact with vLLM 0.33 (``kv_cache_utils``, ``utils.hashing``).

A block's hash chains its parent's digest, its token ids and its extra keys:
``hash_fn((parent or NONE_HASH, tuple(tokens), extra_keys))``. Routers must reproduce this
exactly to find an engine's blocks, so the general path uses the same serialisers as vLLM
(pickle protocol 5, canonical cbor2). The CBOR variants also have a fast path: the object
is always ``array(3)[bytes, array[uint...], null|keys]``, simple enough to emit directly,
and the token ids are encoded for all blocks at once with numpy. Where the optional C
extension ``events._native`` is built, ``sha256_cbor`` and ``sha256`` chains run there in one
call per prompt (byte-identical; ``KVROUTE_NO_NATIVE=1`` forces the Python path).
"""

from __future__ import annotations

import array
import os
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import numpy as np
import xxhash

from events.cbor_chain import ChainJob, TokenIds, hash_cbor_chain, hash_chain_general
from events.cbor_chain import canonical_cbor as _cbor
from events.cbor_chain import sha256_digest as _sha256
from events.native import native

_native: Any = native  # a module global, so tests can take the Python path

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
HASH_ALGOS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_NON_CRYPTO = frozenset({"xxhash", "xxhash_cbor"})
_U64 = (1 << 64) - 1
DIGEST_SIZES = {"sha256": 32, "sha256_cbor": 32, "xxhash": 16, "xxhash_cbor": 16}


def native_hashing() -> bool:
    """Whether ``events._native`` is loaded (built, and not disabled by KVROUTE_NO_NATIVE)."""
    return _native is not None


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


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
    """NONE_HASH: the parent digest of a request's first block (hash of the seed string).
    Memoised per (algo, resolved seed): the router asks once per request."""
    resolved = resolve_none_hash_seed(algo, seed)
    key = (algo, resolved)
    digest = _none_hashes.get(key)
    if digest is None:
        digest = get_hash_fn(algo)(resolved)
        if len(_none_hashes) < 64:  # random seeds (xxhash, no seed) would grow it forever
            _none_hashes[key] = digest
    return digest


_none_hashes: dict[tuple[str, str], bytes] = {}


def wire_hash(h: bytes | bytearray | memoryview | int) -> int:
    """The int vLLM puts on the wire for a block hash: a digest's low 64 bits, read
    big-endian; an int (already a wire hash, or a legacy engine's) masked to u64. The one
    conversion both sides use, so engine and router can never disagree on a key."""
    if type(h) is bytes:  # the common case first: a digest off the wire
        return int.from_bytes(h[-8:], "big")
    if type(h) is int:
        return h & _U64
    if isinstance(h, bytes | bytearray | memoryview):
        return int.from_bytes(bytes(h[-8:]), "big")
    raise TypeError(f"block hash must be int or bytes, got {type(h).__name__}")


def wire_hashes(digests: Sequence[bytes | int]) -> list[int]:
    """``wire_hash`` of each hash: digests of one length (one algorithm: a request's, or an
    event's) in one numpy pass -- a Python call per block would cost ~50 us per 8k-token
    prompt, and ~6 us per 32-block event on ingest; anything else (ints, mixed lengths)
    one by one."""
    if not digests:
        return []
    first = digests[0]
    if type(first) is bytes and len(digests) >= 12:  # numpy's call costs ~10 conversions
        n = len(first)
        if n % 8 == 0 and all(type(d) is bytes and len(d) == n for d in digests):
            return wire_hashes_of(b"".join(cast("Sequence[bytes]", digests)), n)
    return [wire_hash(d) for d in digests]


def wire_hashes_of(digests: bytes, digest_size: int) -> list[int]:
    """``wire_hashes`` of digests given back to back (``chain_digests``), ``digest_size``
    a multiple of 8: each digest's last 8 bytes, big-endian."""
    k = digest_size // 8
    hashes: list[int] = np.frombuffer(digests, dtype=">u8")[k - 1 :: k].tolist()
    return hashes


def packed_u32(ids: Sequence[int]) -> bytes | None:
    """Token ids as native uint32 bytes; None when one is negative, >= 2**32 or not an int
    (``events._native`` packs a list ~3x faster than ``array.array``)."""
    if _native is not None:
        packed: bytes | None = _native.pack_u32(ids)
        return packed
    try:
        return array.array("I", ids).tobytes()
    except (OverflowError, TypeError):
        return None


def common_prefix(a: bytes, b: bytes, unit: int = 1) -> int:
    """How many whole ``unit``-byte items two byte strings share from the start."""
    m = min(len(a), len(b)) // unit
    if a[: m * unit] == b[: m * unit]:
        return m
    lo, hi = 0, m  # a[: lo * unit] == b[: lo * unit]; not so at hi
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if a[: mid * unit] == b[: mid * unit]:
            lo = mid
        else:
            hi = mid
    return lo


def longest_prefix(candidates: list[bytes], b: bytes, unit: int) -> tuple[int, int]:
    """``(index, items)``: the candidate sharing the most whole ``unit``-byte items with
    ``b`` from the start (the last of equals: callers keep the most recent last), or
    ``(-1, 0)`` when none shares one. One native call for all candidates: comparing each in
    its own call cost more in calls than in bytes (a prompt start keeps up to 8)."""
    if _native is not None:
        found: tuple[int, int] = _native.longest_prefix(candidates, b, unit)
        return found
    at, best = -1, 0
    for i, a in enumerate(candidates):
        items = common_prefix(a, b, unit)
        if items and items >= best:
            at, best = i, items
    return at, best


def block_extra_keys(
    num_blocks: int,
    *,
    lora: tuple[str, str | None] | None = None,
    cache_salt: str | None = None,
) -> list[tuple[Any, ...] | None] | None:
    """vLLM 0.33's per-block extra hash keys (``generate_block_hash_extra_keys``): the
    tagged LoRA key ``("lora", name, path)`` on every block, then ``("cache_salt", salt)``
    on block 0 only. None when there are none: a request's hashes are then unkeyed."""
    if num_blocks <= 0 or (lora is None and not cache_salt):
        return None
    lora_keys: list[Any] = [("lora", lora[0], lora[1])] if lora is not None else []
    out: list[tuple[Any, ...] | None] = []
    for i in range(num_blocks):
        keys = lora_keys + ([("cache_salt", cache_salt)] if i == 0 and cache_salt else [])
        out.append(tuple(keys) if keys else None)
    return out


def event_extra_keys(keys: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """One block's keys as ``BlockStored.extra_keys`` publishes them: untagged (the bare
    LoRA name, the bare salt; vLLM's ``to_event_extra_keys``)."""
    if keys is None:
        return None
    return tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)


def hash_block_tokens(
    algo: str, parent: bytes, tokens: Sequence[int], extra_keys: tuple[Any, ...] | None = None
) -> bytes:
    """Hash one block given its parent digest (vLLM's ``hash_block_tokens``)."""
    return get_hash_fn(algo)((parent, tuple(tokens), extra_keys))


def hash_request_blocks(
    token_ids: TokenIds,
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
    job = _job(token_ids, block_size, algo, parent or none_hash(algo, seed), extra_keys)
    if job.num_blocks == 0:
        return []
    blob = _native_chain(job)
    if blob is not None:
        return list(struct.unpack("32s" * job.num_blocks, blob))
    return _python_chain(job)


def chain_digests(
    token_ids: TokenIds,
    block_size: int,
    algo: str,
    parent: bytes,
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
) -> bytes:
    """``hash_request_blocks`` from ``parent`` (a chain's digest, or ``none_hash``), the
    digests back to back (``DIGEST_SIZES[algo]`` bytes each): the native path makes no
    bytes object per block. ``token_ids`` may be an integer numpy array (read in place)."""
    job = _job(token_ids, block_size, algo, parent, extra_keys)
    if job.num_blocks == 0:
        return b""
    blob = _native_chain(job)
    return blob if blob is not None else b"".join(_python_chain(job))


def _job(
    token_ids: TokenIds,
    block_size: int,
    algo: str,
    parent: bytes,
    extra_keys: Sequence[tuple[Any, ...] | None] | None,
) -> ChainJob:
    """Arguments checked; every full block of ``token_ids``."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    num_blocks = len(token_ids) // block_size
    if extra_keys is not None and len(extra_keys) < num_blocks:
        raise ValueError(f"extra_keys has {len(extra_keys)} entries for {num_blocks} blocks")
    return ChainJob(token_ids, block_size, num_blocks, parent, extra_keys, algo)


def _native_chain(job: ChainJob) -> bytes | None:
    """The chain's digests from ``events._native``, or None where it does not apply (not
    built, an xxhash variant, ids it does not encode): the caller takes the Python path."""
    token_ids, block_size, num_blocks, prev, extra_keys, algo = job
    if _native is None or algo not in ("sha256_cbor", "sha256"):
        return None
    if isinstance(token_ids, np.ndarray):
        token_ids = np.ascontiguousarray(token_ids)
    elif not isinstance(token_ids, list | tuple | array.array):
        token_ids = list(token_ids)
    keys = extra_keys[:num_blocks] if extra_keys is not None else None
    last = max((i for i, k in enumerate(keys) if k is not None), default=-1) if keys else -1
    if algo == "sha256_cbor":
        cbor_keys = None if last < 0 else [None if k is None else _cbor(k) for k in keys or ()]
        chain: bytes | None = _native.sha256_cbor_chain(
            token_ids, block_size, num_blocks, prev, cbor_keys
        )
        return chain
    # sha256 (pickle): keyed blocks (LoRA, cache_salt) in Python, the unkeyed rest here.
    head = b""
    if last >= 0:
        done = last + 1
        blocks = _python_chain(job._replace(tokens=token_ids, num_blocks=done))
        if done == num_blocks:
            return b"".join(blocks)
        head, prev, token_ids = b"".join(blocks), blocks[-1], token_ids[done * block_size :]
        num_blocks -= done
    tail = _native.sha256_pickle_chain(token_ids, block_size, num_blocks, prev)
    return None if tail is None else head + tail


def _python_chain(job: ChainJob) -> list[bytes]:
    """The reference path: vLLM's serialisers (CBOR through ``events.cbor_chain``)."""
    if job.algo in ("sha256_cbor", "xxhash_cbor"):
        return hash_cbor_chain(job)
    # Python ints: pickle of a numpy scalar differs from pickle of an int.
    tokens = job.tokens
    tokens = tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)
    return hash_chain_general(job._replace(tokens=tokens), get_hash_fn(job.algo))
