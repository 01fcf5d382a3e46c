"""Predict, per instance, how many prompt tokens it would reuse from GPU and from CPU.

For each candidate instance the index gives per (group, tier) a bitmask over the request's
hash-block positions. The GPU hit is ``events.groups.longest_cache_hit_masks`` over the
GPU masks with ``max_tokens = num_prompt_tokens - 1`` (vLLM always recomputes the last
token); the CPU extension is ``events.offload_hit.cpu_extension_masks`` -- vLLM's offloading
connector rule, which loads whole chunks past the GPU hit. Both are compiled once per
layout (``HitRule``, ``OffloadRule``). The engine evaluates the same rules on its real
residency, so prediction and reality agree by construction.

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
from collections.abc import Mapping, Sequence
from functools import reduce
from operator import or_
from typing import NamedTuple

from events.groups import FullAttentionSpec, HitRule, hit_rule
from events.hashing import wire_hashes
from events.offload_hit import OffloadRule, offload_rule
from router.decision.layout import InstanceLayout, LayoutRegistry
from router.index.base import NUM_TIERS, BlockIndex, Residency, Tier

__all__ = ["Score", "Scorer", "score_residency"]

log = logging.getLogger(__name__)


class Score(NamedTuple):
    gpu_tokens: int
    cpu_tokens: int
    # vLLM's shared-prefix junction on this instance: the longer GPU prefix full attention
    # holds when a sparse group cut the hit short (0: none). A request routed there makes
    # the engine retain sparse state at it (``events.retention``).
    junction_tokens: int = 0


ZERO = Score(0, 0, 0)
_new = tuple.__new__  # Score(a, b) without NamedTuple's Python-level __new__


class _Plan:
    """A layout's scoring geometry and compiled rules, worked out once per layout: the
    per-instance work left is a few dict reads and bit operations."""

    __slots__ = (
        "chunk_blocks",
        "cpu_slots",
        "gpu_slots",
        "hash_block_size",
        "layout",
        "offload",
        "ratios",
        "rule",
        "uniform",
        "zeros",
    )

    def __init__(self, layout: InstanceLayout, full_only: bool) -> None:
        idx = [
            g
            for g, s in enumerate(layout.groups)
            if not full_only or isinstance(s, FullAttentionSpec)
        ]
        specs = tuple(layout.groups[g] for g in idx)
        hbs = layout.hash_block_size
        lcm = layout.lcm_block_size
        tpc = layout.tokens_per_chunk or lcm
        self.layout = layout
        self.hash_block_size = hbs
        self.gpu_slots = tuple(g * NUM_TIERS + int(Tier.GPU) for g in idx)
        self.cpu_slots = tuple(g * NUM_TIERS + int(Tier.CPU) for g in idx)
        self.zeros = (0,) * len(idx)  # dict.get defaults, one per group
        self.ratios = tuple(layout.groups[g].block_size // hbs for g in idx)
        self.uniform = all(r == 1 for r in self.ratios)  # every block is one hash block
        self.chunk_blocks = tpc // hbs  # hash blocks per CPU chunk
        self.rule: HitRule | None = hit_rule(specs) if specs else None
        self.offload: OffloadRule | None = None
        if specs:
            try:
                self.offload = offload_rule(specs, tpc)
            except ValueError:  # a configured chunk size that does not fit the groups
                log.warning("tokens_per_chunk %d does not fit layout %s", tpc, layout)

    def score(self, residency: Residency, positions: int, num_prompt_tokens: int) -> Score:
        rule = self.rule
        if rule is None or num_prompt_tokens <= 1:
            return ZERO
        get = residency.get
        gpu = list(map(get, self.gpu_slots, self.zeros))
        if not self.uniform:
            gpu = [_regroup(m, r, positions) for m, r in zip(gpu, self.ratios, strict=True)]
        gpu_tokens, junction = (
            rule.hit_and_junction(gpu, num_prompt_tokens - 1) if any(gpu) else (0, 0)
        )
        if self.offload is None:
            return _new(Score, (gpu_tokens, 0, junction))
        # The extension only reads chunks from the one holding the GPU hit end on: with no
        # CPU residency there, it is 0 without evaluating the rule.
        first = gpu_tokens // self.hash_block_size // self.chunk_blocks * self.chunk_blocks
        cpu = list(map(get, self.cpu_slots, self.zeros))
        if not reduce(or_, cpu) >> first:
            return _new(Score, (gpu_tokens, 0, junction))
        if not self.uniform:
            cpu = [_regroup(c, r, positions) for c, r in zip(cpu, self.ratios, strict=True)]
        ext = self.offload.extension(cpu, num_prompt_tokens, gpu_tokens)
        return _new(Score, (gpu_tokens, ext, junction))


def _merged(found: dict[str, Residency], extra: Mapping[str, Residency]) -> dict[str, Residency]:
    out = dict(found)
    for name, res in extra.items():
        have = out.get(name)
        if not have:
            out[name] = res
            continue
        both = dict(have)
        for slot, mask in res.items():
            both[slot] = both.get(slot, 0) | mask
        out[name] = both
    return out


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
    if not residency:
        return ZERO
    return _Plan(layout, full_only).score(residency, positions, num_prompt_tokens)


class Scorer:
    """Scores candidate instances for a request from a ``BlockIndex`` and their layouts."""

    def __init__(
        self, index: BlockIndex, layouts: LayoutRegistry, *, full_only: bool = False
    ) -> None:
        self.index = index
        self.layouts = layouts
        self.full_only = full_only
        # Each layout's geometry worked out once. Keyed by the layout object's id (hashing
        # the layout costs more than the lookup); the identity check makes a reused id
        # after a layout was replaced a miss, and the bound keeps churn from growing it.
        self._plans: dict[int, _Plan] = {}

    def _plan(self, layout: InstanceLayout) -> _Plan:
        p = self._plans.get(id(layout))
        if p is None or p.layout is not layout:
            if len(self._plans) > 4096:
                self._plans.clear()
            p = self._plans[id(layout)] = _Plan(layout, self.full_only)
        return p

    async def score(
        self,
        block_hashes: Sequence[int],
        num_prompt_tokens: int,
        instances: Sequence[str] | None = None,
        extra: Mapping[str, Residency] | None = None,
    ) -> dict[str, Score]:
        """Per instance ``Score``; with ``instances`` every one gets an entry (zeros when it
        holds nothing), without it only instances holding some block of the request.
        ``extra`` (speculative residency) is ORed into the index's before scoring."""
        if block_hashes and type(block_hashes[0]) is not int:
            block_hashes = wire_hashes(block_hashes)
        found = await self.index.lookup(block_hashes, instances)
        if extra:
            found = _merged(found, extra)
        names = found.keys() if instances is None else instances
        n = len(block_hashes)
        out: dict[str, Score] = {}
        # Instances with the same layout and residency (a shared system prompt, replicas
        # fed the same traffic) score the same: compute each distinct case once.
        memo: dict[tuple[object, ...], Score] = {}
        layouts = self.layouts.get
        for name in names:
            res = found.get(name)
            layout = layouts(name) if res else None
            if layout is None or not res:
                out[name] = ZERO
                continue
            key = (id(layout), *res, *res.values())  # slots, then their masks
            score = memo.get(key)
            if score is None:
                plan = self._plan(layout)
                score = memo[key] = plan.score(res, n, num_prompt_tokens)
            out[name] = score
        return out
