"""KV cache group specs and the hybrid prefix-hit rule, shared by engine and router.

A hybrid model's KV cache is split into groups (``group_idx`` = position): full attention
needs every block of the prefix, a sliding window only the blocks covering the last
``window - 1`` tokens before the hit end, a Mamba layer only the state block at the hit end.
``longest_cache_hit`` returns the hit exactly as vLLM's ``HybridKVCacheCoordinator``
computes it: each group shrinks the candidate length to the longest length *it* can serve,
full attention first, until no group shrinks it (a fixed point). The engine uses it to
decide what it reuses and the router to predict that, so the two agree by construction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache, reduce
from typing import Any, ClassVar

__all__ = [
    "FullAttentionSpec",
    "HitRule",
    "KVCacheLayout",
    "KVCacheSpec",
    "MambaSpec",
    "SlidingWindowSpec",
    "cached_masks",
    "hit_rule",
    "lcm_block_size",
    "longest_cache_hit",
    "longest_cache_hit_masks",
    "parse_layout",
    "spec_from_event",
]


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    block_size: int
    kind: ClassVar[str] = "full_attention"
    sliding_window: ClassVar[int | None] = None


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec:
    block_size: int
    sliding_window: int
    kind: ClassVar[str] = "sliding_window"

    @property
    def window_blocks(self) -> int:
        """Blocks that must be cached before a hit end: cdiv(window - 1, block_size)."""
        return -(-(self.sliding_window - 1) // self.block_size)


@dataclass(frozen=True, slots=True)
class MambaSpec:
    block_size: int
    kind: ClassVar[str] = "mamba"
    sliding_window: ClassVar[int | None] = None


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MambaSpec

# vLLM spec kinds that behave like one of ours for prefix hits.
_FULL_KINDS = {"full_attention", "mla_attention", "sink_full_attention"}
_WINDOW_KINDS = {"sliding_window", "sliding_window_mla"}


def spec_from_event(kind: str | None, sliding_window: int | None, block_size: int) -> KVCacheSpec:
    """Map an event's ``kv_cache_spec_kind``/window to a spec (unknown kinds: full attention)."""
    if kind in _WINDOW_KINDS and sliding_window:
        return SlidingWindowSpec(block_size, sliding_window)
    if kind == "mamba":
        return MambaSpec(block_size)
    return FullAttentionSpec(block_size)


def lcm_block_size(groups: Sequence[KVCacheSpec]) -> int:
    """Tokens a hit length is a multiple of: the LCM of the group block sizes (vLLM's
    scheduler block size). The one place it is computed."""
    return reduce(math.lcm, (g.block_size for g in groups), 1)


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """A model's ordered KV cache groups (``groups[i]`` is ``group_idx == i``) and the
    geometry both sides need to read its blocks: the engine builds its pools from it, the
    router scores an instance with it.

    ``hash_block_size``: tokens per request block hash (vLLM's hash_block_size); defaults
    to the GCD of the group block sizes. ``tokens_per_chunk``: tokens per CPU offload chunk,
    needed to expand placeholder CPU events (which name only a chunk's last block hash);
    None means one CPU entry covers one hash block.
    """

    groups: tuple[KVCacheSpec, ...]
    hash_block_size: int = 0
    tokens_per_chunk: int | None = None

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a layout needs at least one group")
        if self.hash_block_size <= 0:
            gcd = reduce(math.gcd, (g.block_size for g in self.groups))
            object.__setattr__(self, "hash_block_size", gcd)
        for g in self.groups:
            if g.block_size % self.hash_block_size:
                raise ValueError(f"group block size {g.block_size} not a multiple of hash size")
        if self.tokens_per_chunk is not None and self.tokens_per_chunk % self.hash_block_size:
            raise ValueError("tokens_per_chunk must be a multiple of the hash block size")

    @classmethod
    def full(cls, block_size: int = 16, **kw: Any) -> KVCacheLayout:
        return cls((FullAttentionSpec(block_size),), **kw)

    @property
    def lcm_block_size(self) -> int:
        return lcm_block_size(self.groups)

    def longest_cache_hit(self, is_cached: Callable[[int, int], bool], max_tokens: int) -> int:
        return longest_cache_hit(self.groups, is_cached, max_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {
            "groups": [
                {"kind": g.kind, "block_size": g.block_size, "sliding_window": g.sliding_window}
                for g in self.groups
            ],
            "hash_block_size": self.hash_block_size,
            "tokens_per_chunk": self.tokens_per_chunk,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVCacheLayout:
        groups = tuple(
            spec_from_event(g.get("kind"), g.get("sliding_window"), int(g["block_size"]))
            for g in d["groups"]
        )
        return cls(groups, int(d.get("hash_block_size") or 0), d.get("tokens_per_chunk"))


def parse_layout(spec: str, block_size: int) -> KVCacheLayout:
    """The one layout grammar (engine profiles, the router's default layout):
    ``swa:64*5,full`` | ``mamba*3,full`` | ``full`` | ``swa:128,full``: groups in
    ``group_idx`` order, ``KIND[:WINDOW][*COUNT]`` each, all at ``block_size``."""
    groups: list[KVCacheSpec] = []
    for part in spec.replace(" ", "").split(","):
        kind, _, count = part.partition("*")
        n = int(count) if count else 1
        if n <= 0:
            raise ValueError(f"layout {spec!r}: group count must be positive")
        name, _, window = kind.partition(":")
        if name == "full" and not window:
            g: KVCacheSpec = FullAttentionSpec(block_size)
        elif name == "mamba" and not window:
            g = MambaSpec(block_size)
        elif name == "swa" and window.isdigit() and int(window) > 0:
            g = SlidingWindowSpec(block_size, int(window))
        else:
            raise ValueError(
                f"layout {spec!r}: bad group {part!r}; expected full, mamba or swa:WINDOW,"
                " each optionally *COUNT"
            )
        groups.extend([g] * n)
    if not groups:
        raise ValueError("a layout needs at least one group")
    return KVCacheLayout(tuple(groups))


def _full_prefix_mask(mask: int) -> int:
    """Number of consecutive cached blocks from block 0."""
    return ((mask + 1) & ~mask).bit_length() - 1


def _runs(mask: int, width: int) -> int:
    """Bit j set iff bits j .. j+width-1 of ``mask`` are all set (by doubling)."""
    out, have = mask, 1
    # Invariant: out has bit j iff `have` consecutive bits start at j.
    while have < width:
        shift = min(have, width - have)
        out &= out >> shift
        have += shift
    return out


def _servable_windowed(mask: int, n: int, align: int, need: int, mamba: bool) -> int:
    """Largest m <= n (blocks), m % align == 0, that a sliding-window group needing ``need``
    blocks before the hit end (or a Mamba group: ``mamba``) can serve; n is aligned."""
    if n <= 0:
        return 0
    if mamba:
        # Rightmost cached state block whose end is aligned.
        if align == 1:
            return (mask & ((1 << n) - 1)).bit_length()
        while n > 0 and not (mask >> (n - 1)) & 1:
            n -= align
        return max(n, 0)
    if need == 0:  # a window of one token needs no earlier block
        return n
    if align == 1:
        # A window of `need` cached blocks ending at n, for the largest n >= need ...
        if n >= need:
            full = (1 << need) - 1
            if (mask >> (n - need)) & full == full:  # the common case: the window at n
                return n
            starts = _runs(mask, need) & ((1 << (n - need + 1)) - 1)
            if starts:
                return starts.bit_length() - 1 + need
        # ... else the short-prefix case: every block from 0.
        return min(_full_prefix_mask(mask), n, need - 1)
    while n > 0:
        lo = max(0, n - need)
        width = n - lo
        if (mask >> lo) & ((1 << width) - 1) == (1 << width) - 1:
            return n
        n -= align
    return 0


class HitRule:
    """One layout's hit rule with its geometry worked out once (LCM, per-group alignment,
    window sizes, visiting order): routers evaluate it for every candidate instance of
    every request, so per-call work is only bit operations on the masks."""

    __slots__ = ("full", "lcm", "specs", "windowed")

    def __init__(self, specs: Sequence[KVCacheSpec]) -> None:
        self.specs = tuple(specs)
        self.lcm = lcm = lcm_block_size(self.specs)
        # (group_idx, block size, alignment in blocks)
        self.full = tuple(
            (g, s.block_size, lcm // s.block_size)
            for g, s in enumerate(self.specs)
            if isinstance(s, FullAttentionSpec)
        )
        # (group_idx, block size, alignment in blocks, window blocks, is Mamba)
        self.windowed = tuple(
            (
                g,
                s.block_size,
                lcm // s.block_size,
                s.window_blocks if isinstance(s, SlidingWindowSpec) else 0,
                isinstance(s, MambaSpec),
            )
            for g, s in enumerate(self.specs)
            if not isinstance(s, FullAttentionSpec)
        )

    def hit(self, masks: Sequence[int], max_tokens: int) -> int:
        """The hit in tokens for per-group block masks (see :func:`longest_cache_hit_masks`)."""
        return self.hit_and_junction(masks, max_tokens)[0]

    def hit_and_junction(self, masks: Sequence[int], max_tokens: int) -> tuple[int, int]:
        """``(hit, junction)``: the hit, and vLLM's shared-prefix junction -- the longer
        prefix full attention alone could serve when a sparse group cut the hit short
        (0 when nothing was cut). The engine then retains sparse state there too
        (``events.retention``)."""
        if max_tokens <= 0 or not self.specs:
            return 0, 0
        hit = max_tokens - max_tokens % self.lcm
        # Each visit returns the largest length <= hit that group serves, so the hit never
        # drops below the answer and stops once every group serves it. Full attention
        # serves every aligned length below its prefix: one visit each is enough.
        for g, bs, align in self.full:
            m = masks[g]
            p = ((m + 1) & ~m).bit_length() - 1
            if p < hit // bs:
                hit = (p - p % align) * bs
        longest, first = hit, not self.full
        # Windowed groups: round robin until all of them confirm the current hit.
        windowed = self.windowed
        confirmed, i, k = 0, 0, len(windowed)
        while hit > 0 and confirmed < k:
            g, bs, align, need, mamba = windowed[i]
            n = _servable_windowed(masks[g], hit // bs, align, need, mamba) * bs
            if n < hit:
                hit, confirmed = n, 1  # the group serves its own answer
            else:
                confirmed += 1
            if first:  # without full attention, the first group's own hit is the longest
                longest, first = hit, False
            i = i + 1 if i + 1 < k else 0
        return hit, (longest if longest > hit else 0)


@lru_cache(maxsize=256)
def hit_rule(specs: tuple[KVCacheSpec, ...]) -> HitRule:
    """The compiled :class:`HitRule` of a layout (cached: layouts are few)."""
    return HitRule(specs)


def longest_cache_hit_masks(
    specs: Sequence[KVCacheSpec], masks: Sequence[int], max_tokens: int
) -> int:
    """The hit in tokens, given per group a bitmask of cached block indices (bit i = block i).

    Masks are block-granular per group (block i of a group with block size bs covers tokens
    [i*bs, (i+1)*bs)). Only bits below ``max_tokens // bs`` are consulted.
    """
    if not specs or max_tokens <= 0:
        return 0
    return hit_rule(tuple(specs)).hit(masks, max_tokens)


def longest_cache_hit(
    specs: Sequence[KVCacheSpec], is_cached: Callable[[int, int], bool], max_tokens: int
) -> int:
    """The largest hit L <= max_tokens (a multiple of every block size) all groups can serve.

    ``is_cached(group_idx, block_idx)`` says whether that group holds that block of the
    request. Callers pass ``max_tokens = num_prompt_tokens - 1`` for vLLM's rule that the
    last prompt token is always recomputed.
    """
    if not specs or max_tokens <= 0:
        return 0
    return longest_cache_hit_masks(specs, cached_masks(specs, is_cached, max_tokens), max_tokens)


def cached_masks(
    specs: Sequence[KVCacheSpec], is_cached: Callable[[int, int], bool], max_tokens: int
) -> list[int]:
    """Per group, the bitmask of cached blocks below ``max_tokens`` the hit rule reads
    (full attention: its leading run only)."""
    masks = []
    for g, spec in enumerate(specs):
        n = max_tokens // spec.block_size
        mask = 0
        if isinstance(spec, FullAttentionSpec):
            i = 0
            while i < n and is_cached(g, i):
                i += 1
            mask = (1 << i) - 1
        else:
            for i in range(n):
                if is_cached(g, i):
                    mask |= 1 << i
        masks.append(mask)
    return masks
