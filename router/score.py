"""Predict, per instance, how many prompt tokens it would reuse from GPU and from CPU.

For each candidate instance the index gives per (group, tier) a bitmask over the request's
hash-block positions. The GPU hit is ``events.groups.longest_cache_hit_masks`` over the
GPU masks with ``max_tokens = num_prompt_tokens - 1`` (vLLM always recomputes the last
token); the CPU extension is ``events.offload_hit.cpu_extension`` -- vLLM's offloading
connector rule, which loads whole chunks past the GPU hit. The engine calls the same two
functions on its real residency, so prediction and reality agree by construction.

CPU residency is asked only at chunk ends (a chunk is keyed by its last block's hash):
that is what vLLM's placeholder CPU events name, and self-describing ones include it. The
chunk size is the instance layout's ``tokens_per_chunk`` (learned from self-describing
events or configured); without it one chunk is taken to be one LCM block. Groups whose
block size is r hash blocks read position ``(j + 1) * r - 1`` for their block j (the wire
hash of a large block equals that of its last hash-sized sub-block).

``full_only=True`` keeps only full-attention groups -- what peer routers do today -- as a
benchmark baseline.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from functools import reduce
from typing import NamedTuple

from events.groups import FullAttentionSpec, KVCacheSpec, longest_cache_hit_masks
from events.offload_hit import cpu_extension
from router.index.base import NUM_TIERS, BlockIndex, Residency, Tier, to_wire
from router.layout import InstanceLayout, LayoutRegistry

__all__ = ["Score", "Scorer", "score_residency"]

log = logging.getLogger(__name__)


class Score(NamedTuple):
    gpu_tokens: int
    cpu_tokens: int


ZERO = Score(0, 0)


class _Plan(NamedTuple):
    """A layout's scoring geometry, computed once per layout."""

    layout: InstanceLayout
    specs: tuple[KVCacheSpec, ...]
    gpu_slots: tuple[int, ...]
    cpu_slots: tuple[int, ...]
    ratios: tuple[int, ...]  # group block size / hash block size
    uniform: bool  # every group's block is one hash block
    tokens_per_chunk: int


_plans: dict[tuple[int, bool], _Plan] = {}


def _plan(layout: InstanceLayout, full_only: bool) -> _Plan:
    key = (id(layout), full_only)  # hashing the layout itself costs more than the lookup
    p = _plans.get(key)
    if p is None or p.layout is not layout:
        idx = [
            g
            for g, s in enumerate(layout.groups)
            if not full_only or isinstance(s, FullAttentionSpec)
        ]
        hbs = layout.hash_block_size
        lcm = reduce(math.lcm, (g.block_size for g in layout.groups), 1)
        p = _Plan(
            layout,
            tuple(layout.groups[g] for g in idx),
            tuple(g * NUM_TIERS + int(Tier.GPU) for g in idx),
            tuple(g * NUM_TIERS + int(Tier.CPU) for g in idx),
            tuple(layout.groups[g].block_size // hbs for g in idx),
            all(layout.groups[g].block_size == hbs for g in idx),
            layout.tokens_per_chunk or lcm,
        )
        if len(_plans) > 4096:
            _plans.clear()
        _plans[key] = p
    return p


def _regroup(mask: int, ratio: int, positions: int) -> int:
    """Position mask -> group-block mask for a group of ``ratio`` hash blocks per block."""
    if ratio == 1 or not mask:
        return mask
    out = 0
    for j in range(positions // ratio):
        if (mask >> ((j + 1) * ratio - 1)) & 1:
            out |= 1 << j
    return out


def score_residency(
    layout: InstanceLayout,
    residency: Residency | None,
    positions: int,
    num_prompt_tokens: int,
    *,
    full_only: bool = False,
) -> Score:
    """``(gpu_tokens, cpu_tokens)`` for one instance; ``positions`` = request hash blocks."""
    if not residency or num_prompt_tokens <= 1:
        return ZERO
    p = _plan(layout, full_only)
    if not p.specs:
        return ZERO
    get = residency.get
    if p.uniform:
        gpu = [get(s, 0) for s in p.gpu_slots]
    else:
        gpu = [
            _regroup(get(s, 0), r, positions) for s, r in zip(p.gpu_slots, p.ratios, strict=True)
        ]
    gpu_tokens = longest_cache_hit_masks(p.specs, gpu, num_prompt_tokens - 1) if any(gpu) else 0
    cpu = [get(s, 0) for s in p.cpu_slots]
    # cpu_extension only asks about chunks from the one holding the GPU hit end on; with
    # no CPU residency there, it is 0 without asking.
    first = gpu_tokens // p.tokens_per_chunk * p.tokens_per_chunk // layout.hash_block_size
    if not any(c >> first for c in cpu):
        return Score(gpu_tokens, 0)
    ratios = p.ratios

    def cpu_cached(g: int, i: int) -> bool:
        return (cpu[g] >> ((i + 1) * ratios[g] - 1)) & 1 == 1

    try:
        extra = cpu_extension(
            p.specs, cpu_cached, num_prompt_tokens, gpu_tokens, p.tokens_per_chunk
        )
    except ValueError:  # a configured chunk size that does not fit the groups
        log.warning("tokens_per_chunk %d does not fit layout %s", p.tokens_per_chunk, layout)
        extra = 0
    return Score(gpu_tokens, extra)


class Scorer:
    """Scores candidate instances for a request from a ``BlockIndex`` and their layouts."""

    def __init__(
        self, index: BlockIndex, layouts: LayoutRegistry, *, full_only: bool = False
    ) -> None:
        self.index = index
        self.layouts = layouts
        self.full_only = full_only

    async def score(
        self,
        block_hashes: Sequence[int],
        num_prompt_tokens: int,
        instances: Sequence[str] | None = None,
    ) -> dict[str, Score]:
        """Per instance ``Score``; with ``instances`` every one gets an entry (zeros when it
        holds nothing), without it only instances holding some block of the request."""
        if block_hashes and type(block_hashes[0]) is not int:
            block_hashes = [to_wire(h) for h in block_hashes]
        found = await self.index.lookup(block_hashes, instances)
        names = found.keys() if instances is None else instances
        n = len(block_hashes)
        out: dict[str, Score] = {}
        # Instances with the same layout and residency (a shared system prompt, replicas
        # fed the same traffic) score the same: compute each distinct case once.
        memo: dict[tuple[int, tuple[tuple[int, int], ...]], Score] = {}
        for name in names:
            res = found.get(name)
            layout = self.layouts.get(name) if res else None
            if layout is None or not res:
                out[name] = ZERO
                continue
            key = (id(layout), tuple(sorted(res.items())))
            score = memo.get(key)
            if score is None:
                score = memo[key] = score_residency(
                    layout, res, n, num_prompt_tokens, full_only=self.full_only
                )
            out[name] = score
        return out
