"""A prompt's block hashes, reusing the chain of the last prompt that began the same way.

Chained hashing makes block i's digest a function of blocks 0..i only, so when a new
prompt repeats a previous one's leading blocks token for token (the next turn of a
conversation, a shared system prompt, a retry), their digests are the previous prompt's,
exactly: only the blocks after the common prefix are hashed. The previous prompt is found
by its first block (with the block size and ``cache_salt``, which enter the chain), and
the common prefix by comparing packed ids (``longest_prefix``: one word-at-a-time pass
over every kept chain of that start in ``events._native``; numpy's compare and search,
or one call per chain, cost more in calls than in bytes). Without the native hasher
hashing is the largest part of a decision (~0.35 ms of ~0.7 for an 8k-token prompt), and
most traffic repeats prefixes.

Several prompts may begin alike and then diverge (one system prompt before many
documents, agents sharing a preamble): each start keeps its ``per_start`` most recent
chains and a prompt reuses the one it shares most with, so alternating long documents
behind one system prompt hash only their own new blocks, not the whole document again.

Bounded: the ``capacity`` most recent prompt starts (LRU), and ``max_tokens`` tokens over
all kept chains (a 240k-token chain holds ~2 MB: packed ids, digests and wire ints). Off
when NONE_HASH is random per call (xxhash without a seed): no two calls' chains may be
mixed then.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from events.hashing import (
    DIGEST_SIZES,
    block_extra_keys,
    chain_digests,
    hash_request_blocks,
    longest_prefix,
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


class _Start(NamedTuple):
    """One prompt start's chains, oldest first, and their ``tokens`` in the same order
    (what ``longest_prefix`` compares, without building a list per prompt)."""

    chains: list[_Chain]
    tokens: list[bytes]


class PromptHashes:
    def __init__(
        self,
        algo: str,
        seed: str | None,
        capacity: int = 256,
        per_start: int = 8,
        max_tokens: int = 4_000_000,
    ) -> None:
        self.algo, self.seed, self.capacity = algo, seed, capacity
        self.per_start, self.max_tokens = per_start, max_tokens
        self.enabled = none_hash(algo, seed) == none_hash(algo, seed)
        self._size = DIGEST_SIZES[algo]
        # start -> its chains, most recent last
        self._chains: OrderedDict[tuple, _Start] = OrderedDict()
        self._tokens = 0  # packed tokens over all kept chains
        self.reused_blocks = 0  # for tests and /debug: blocks not re-hashed
        self.hashed_blocks = 0

    def wire_hashes(
        self,
        ids: list[int],
        block_size: int,
        salt: str | None,
        lora: tuple[str, str | None] | None = None,
        packed: bytes | None = None,
    ) -> list[int]:
        """Wire hashes of every full block of ``ids`` (vLLM's chain: the LoRA key on every
        block, ``cache_salt`` on block 0), as ``hash_request_blocks`` + ``wire_hashes``
        would give them. ``packed``: ``packed_u32(ids)`` when the caller has it already."""
        n = len(ids) // block_size
        if n == 0:
            return []
        if not self.enabled:
            packed = None
        elif packed is None or len(packed) != 4 * len(ids):
            packed = packed_u32(ids)
        if packed is None:  # negative or odd ids: hash without reuse
            keys = block_extra_keys(n, lora=lora, cache_salt=salt)
            self.hashed_blocks += n
            return wire_hashes(hash_request_blocks(ids, block_size, self.algo, self.seed, keys))
        unit = 4 * block_size  # bytes of one block's ids
        packed = packed[: n * unit]
        key = (block_size, salt, lora, packed[:unit])
        start = self._chains.get(key)
        prev, at, reuse = None, -1, 0
        if start is not None:  # the most recent of equals wins
            at, reuse = longest_prefix(start.tokens, packed, unit)
            if at >= 0:
                prev = start.chains[at]
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
        # The new chain extends ``prev`` (the next turn of a conversation): it takes its place.
        extends = at if prev is not None and len(prev.tokens) == reuse * unit else -1
        self._keep(key, start, extends, _Chain(packed, done + tail, wires))
        return wires

    def _keep(self, key: tuple, start: _Start | None, extends: int, chain: _Chain) -> None:
        """Keep ``chain`` as ``start``'s most recent (None: ``key`` has none yet), in place
        of the chain at ``extends`` (-1: none) that it extends; then drop the oldest past
        the bounds."""
        if start is None:
            start = self._chains[key] = _Start([], [])
        else:
            self._chains.move_to_end(key)
        chains, tokens = start
        if extends >= 0:
            del chains[extends]
            self._tokens -= len(tokens.pop(extends)) // 4
        chains.append(chain)
        tokens.append(chain.tokens)
        self._tokens += len(chain.tokens) // 4
        if len(chains) > self.per_start:
            del chains[0]
            self._tokens -= len(tokens.pop(0)) // 4
        while self._chains and (
            len(self._chains) > self.capacity or self._tokens > self.max_tokens
        ):
            oldest = next(iter(self._chains))
            dropped = self._chains[oldest]
            del dropped.chains[0]
            self._tokens -= len(dropped.tokens.pop(0)) // 4
            if not dropped.chains:
                del self._chains[oldest]
                if oldest == key:
                    break
