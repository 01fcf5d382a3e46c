"""Which blocks of a prompt each KV cache group keeps cached: vLLM 0.33's sparse retention.

vLLM caches every full block of a full-attention group, but a sliding-window or Mamba
group only at positions a later request can resume from (``reachable_block_mask`` with the
default ``prefix_cache_retention_interval=0``, Marconi-style): the *replay boundary*
``num_prompt_tokens - 1`` (a resend recomputes its last token) and the *shared-prefix
junction* (where full attention hit further than the hybrid hit: a sibling branching there
can then reuse it). Both are floored to the cache-hit alignment (the LCM of the group block
sizes). At such a boundary ``b`` a sliding-window group keeps the ``cdiv(window - 1, bs)``
blocks ending at ``b``, a Mamba group the one state block ending at ``b``. Blocks in between
are computed, freed silently and never hashed, so their ``BlockStored`` names fewer hashes
than its ``token_ids`` cover.

The engine caches blocks through :func:`cacheable_mask` and the router predicts what a
just-routed request will leave through :func:`retained_prompt_blocks`: one rule, both sides.
"""

from __future__ import annotations

from collections.abc import Sequence

from events.groups import (
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    lcm_block_size,
)

__all__ = [
    "cache_hit_alignment",
    "cacheable_mask",
    "reachable_boundaries",
    "retained_prompt_blocks",
]


def cache_hit_alignment(groups: Sequence[KVCacheSpec]) -> int:
    """Tokens a hit length is a multiple of: the LCM of the group block sizes (vLLM's
    scheduler block size)."""
    return lcm_block_size(groups)


def reachable_boundaries(num_prompt_tokens: int, junction: int = 0) -> tuple[int, ...]:
    """Token positions whose state sparse groups retain: the replay boundary and, when
    there is one, the shared-prefix junction (vLLM's ``shared_prefix_boundary``)."""
    replay = max(num_prompt_tokens - 1, 0)
    return (replay, junction) if junction else (replay,)


def _reachable_blocks(spec: KVCacheSpec, alignment: int, boundaries: Sequence[int]) -> set[int]:
    bs = spec.block_size
    out: set[int] = set()
    for b in boundaries:
        end = b // alignment * alignment // bs  # blocks before the aligned boundary
        if isinstance(spec, MambaSpec):
            if end > 0:
                out.add(end - 1)
        elif isinstance(spec, SlidingWindowSpec):
            out.update(range(max(0, end - spec.window_blocks), end))
    return out


def cacheable_mask(
    spec: KVCacheSpec, alignment: int, boundaries: Sequence[int], start: int, end: int
) -> list[bool] | None:
    """For blocks ``[start, end)`` of one group becoming full: which get a hash.

    None means all of them (full attention; or a window reaching a whole alignment unit).
    """
    if isinstance(spec, FullAttentionSpec):
        return None
    if alignment % spec.block_size:
        return None  # a sub-block alignment cannot be expressed per block: keep all
    keep = _reachable_blocks(spec, alignment, boundaries)
    return [i in keep for i in range(start, end)]


def retained_prompt_blocks(
    groups: Sequence[KVCacheSpec],
    num_prompt_tokens: int,
    hash_block_size: int,
    *,
    junction: int = 0,
) -> list[tuple[int, list[int]]]:
    """Per group, the request hash-block positions an engine holds once it has prefilled
    a prompt of ``num_prompt_tokens`` (``junction``: the instance's full-attention hit when
    it exceeds the hybrid hit). A group block of ``r`` hash blocks is named by its last one.
    """
    alignment = cache_hit_alignment(groups)
    boundaries = reachable_boundaries(num_prompt_tokens, junction)
    out: list[tuple[int, list[int]]] = []
    for g, spec in enumerate(groups):
        bs = spec.block_size
        r = bs // hash_block_size
        full = num_prompt_tokens // bs
        blocks: Sequence[int]
        if isinstance(spec, FullAttentionSpec) or alignment % bs:
            blocks = range(full)  # cacheable_mask's None: every block
        else:  # the few reachable blocks, without a mask over the whole prompt
            blocks = sorted(i for i in _reachable_blocks(spec, alignment, boundaries) if i < full)
        out.append((g, list(blocks) if r == 1 else [(i + 1) * r - 1 for i in blocks]))
    return out
