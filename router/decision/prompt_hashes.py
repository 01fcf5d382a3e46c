"""A prompt's block hashes, reusing the chain of the last prompt that began the same way.

Chained hashing makes block i's digest a function of blocks 0..i only, so when a new
prompt repeats a previous one's leading blocks token for token (the next turn of a
conversation, a shared system prompt, a retry), their digests are the previous prompt's,
exactly: only the blocks after the common prefix are hashed. The previous prompt is found
by its first block (with the block size and ``cache_salt``, which enter the chain), and
the common prefix by one comparison of the two prompts' packed ids (``common_prefix``, a
word-at-a-time pass in ``events._native``: numpy's compare and search cost more in calls
than in bytes). Without the native hasher hashing is the largest part of a decision
(~0.35 ms of ~0.7 for an 8k-token prompt), and most traffic repeats prefixes.

Bounded: the ``capacity`` most recent prompt starts (LRU). Off when NONE_HASH is random
per call (xxhash without a seed): no two calls' chains may be mixed then.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from events.hashing import (
    DIGEST_SIZES,
    block_extra_keys,
    chain_digests,
    common_prefix,
    hash_request_blocks,
    none_hash,
    packed_u32,
    wire_hashes,
    wire_hashes_of,
)

__all__ = ["PromptHashes"]


class _Chain(NamedTuple):
    tokens: bytes  # the prompt's full blocks' token ids, native uint32
    digests: bytes  # back to back, DIGEST_SIZES[algo] bytes each
    wires: list[int]


class PromptHashes:
    def __init__(self, algo: str, seed: str | None, capacity: int = 256) -> None:
        self.algo, self.seed, self.capacity = algo, seed, capacity
        self.enabled = none_hash(algo, seed) == none_hash(algo, seed)
        self._size = DIGEST_SIZES[algo]
        self._chains: OrderedDict[tuple, _Chain] = OrderedDict()
        self.reused_blocks = 0  # for tests and /debug: blocks not re-hashed
        self.hashed_blocks = 0

    def wire_hashes(
        self,
        ids: list[int],
        block_size: int,
        salt: str | None,
        lora: tuple[str, str | None] | None = None,
    ) -> list[int]:
        """Wire hashes of every full block of ``ids`` (vLLM's chain: the LoRA key on every
        block, ``cache_salt`` on block 0), as ``hash_request_blocks`` + ``wire_hashes``
        would give them."""
        n = len(ids) // block_size
        if n == 0:
            return []
        packed = packed_u32(ids) if self.enabled else None
        if packed is None:  # negative or odd ids: hash without reuse
            keys = block_extra_keys(n, lora=lora, cache_salt=salt)
            self.hashed_blocks += n
            return wire_hashes(hash_request_blocks(ids, block_size, self.algo, self.seed, keys))
        unit = 4 * block_size  # bytes of one block's ids
        packed = packed[: n * unit]
        key = (block_size, salt, lora, packed[:unit])
        prev = self._chains.get(key)
        reuse = common_prefix(prev.tokens, packed, unit) if prev is not None else 0
        if prev is not None and reuse == n:
            self._chains.move_to_end(key)
            self.reused_blocks += n
            return prev.wires[:n]
        keys = block_extra_keys(n, lora=lora, cache_salt=salt)
        size = self._size
        done = prev.digests[: reuse * size] if prev is not None and reuse else b""
        parent = done[-size:] if done else none_hash(self.algo, self.seed)
        tail = chain_digests(
            np.frombuffer(packed, np.uint32, offset=reuse * unit),
            block_size,
            self.algo,
            parent,
            keys[reuse:] if keys is not None else None,
        )
        wires = wire_hashes_of(tail, size)
        if done:
            assert prev is not None
            wires = prev.wires[:reuse] + wires
        self.reused_blocks += reuse
        self.hashed_blocks += n - reuse
        self._chains[key] = _Chain(packed, done + tail, wires)
        self._chains.move_to_end(key)
        if len(self._chains) > self.capacity:
            self._chains.popitem(last=False)
        return wires
