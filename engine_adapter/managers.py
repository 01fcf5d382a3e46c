"""Per-kind KV cache managers: which blocks of one group a request needs, keeps, caches.

One manager per group, as vLLM's ``single_type_kv_cache_manager.py``. A request's block
table per group is a list indexed by block position; ``None`` is vLLM's null block (a
position the group does not need). The kinds differ only in that:

* full attention needs every block of the prefix and frees nothing early;
* sliding window needs the blocks covering the last ``window - 1`` tokens; blocks that
  fall out of the window are freed at once (no event: they stay cached and findable, and
  being freed early they are the first to be evicted);
* Mamba ("align" mode) keeps only state blocks: the running state, the state at the last
  block boundary reached in each engine step (the only one cached), and the state the
  step started from (freed at the next step). A 1000-token prefill in one step caches
  block 61 (tokens 976..991, state after 992 tokens) and no other block.

The hit itself is not decided here: the coordinator calls ``events.groups`` (shared with
the router); managers only adopt the blocks that hit and allocate the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_adapter.block_pool import BlockPool, KVBlock
from engine_adapter.request import Request
from events.groups import KVCacheSpec, MambaSpec, SlidingWindowSpec
from events.structs import MEDIUM_GPU, BlockStored

__all__ = [
    "FullAttentionManager",
    "GroupPlan",
    "MambaManager",
    "SingleTypeManager",
    "SlidingWindowManager",
    "make_manager",
]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class GroupPlan:
    """One group's part of an allocation, computed before anything changes.

    ``blocks`` is the request's table after the step with the slots still to fill left
    ``None``; ``ext`` slots are filled and loaded from the CPU tier, ``new`` slots are
    for the scheduled tokens.
    """

    blocks: list[KVBlock | None]
    first: bool
    hits: list[KVBlock] = field(default_factory=list)
    ext: list[int] = field(default_factory=list)
    new: list[int] = field(default_factory=list)

    @property
    def num_blocks_needed(self) -> int:
        """Blocks this plan takes out of the free queue (new ones + free prefix hits)."""
        return len(self.ext) + len(self.new) + sum(1 for b in self.hits if b.ref_cnt == 0)


class SingleTypeManager:
    """Bookkeeping shared by all kinds; subclasses override the few rules that differ."""

    def __init__(
        self, spec: KVCacheSpec, group_idx: int, pool: BlockPool, *, enable_events: bool = True
    ) -> None:
        self.spec = spec
        self.group_idx = group_idx
        self.pool = pool
        self.block_size = spec.block_size
        self.enable_events = enable_events
        self.req_blocks: dict[str, list[KVBlock | None]] = {}
        self.num_cached: dict[str, int] = {}

    # ---- kind-specific rules --------------------------------------------------------

    def num_skipped_blocks(self, num_computed: int) -> int:
        """Leading blocks no longer needed once ``num_computed`` tokens are computed."""
        return 0

    def new_indices(
        self, blocks: list[KVBlock | None], reserved: set[int], num_computed: int, num_tokens: int
    ) -> list[int]:
        """Positions needing a fresh block to compute tokens ``[num_computed, num_tokens)``.

        ``reserved`` are positions this same plan already fills (CPU loads).
        """
        return list(range(len(blocks), cdiv(num_tokens, self.block_size)))

    # ---- planning (no state change) -------------------------------------------------

    def plan_first(
        self, request: Request, num_hit: int, num_computed: int, num_tokens: int
    ) -> GroupPlan:
        """Plan a request's first allocation: adopt the GPU hit ``[0, num_hit)``, load
        ``[num_hit, num_computed)`` from CPU, allocate for ``[num_computed, num_tokens)``."""
        bs = self.block_size
        skip = self.num_skipped_blocks(num_computed)
        n_hit = num_hit // bs
        n_done = cdiv(num_computed, bs)
        blocks: list[KVBlock | None] = [None] * n_done
        hits: list[KVBlock] = []
        hashes = request.block_hashes
        g = self.group_idx
        for i in range(min(skip, n_hit), n_hit):
            block = self.pool.get_cached((hashes[i], g))
            if block is None:
                raise KeyError(f"group {g} block {i} of {request.request_id} is not cached")
            blocks[i] = block
            hits.append(block)
        ext = list(range(max(skip, n_hit), n_done))
        new = self.new_indices(blocks, set(ext), num_computed, num_tokens)
        return GroupPlan(blocks, True, hits, ext, new)

    def plan_running(self, request_id: str, num_computed: int, num_tokens: int) -> GroupPlan:
        blocks = self.req_blocks[request_id]
        return GroupPlan(
            blocks, False, new=self.new_indices(blocks, set(), num_computed, num_tokens)
        )

    # ---- commit ---------------------------------------------------------------------

    def adopt(self, request_id: str, plan: GroupPlan) -> None:
        """Phase 1 of a first allocation: take references on the GPU hit."""
        self.pool.touch(plan.hits)
        self.req_blocks[request_id] = plan.blocks
        # Hit blocks (and skipped positions before them) are already cached.
        self.num_cached[request_id] = plan.ext[0] if plan.ext else len(plan.blocks)

    def fill(self, plan: GroupPlan, indices: list[int]) -> list[tuple[int, KVBlock]]:
        """Give fresh blocks to ``indices`` of the plan's table (growing it as needed)."""
        if not indices:
            return []
        blocks = plan.blocks
        top = max(indices) + 1
        if top > len(blocks):
            blocks.extend([None] * (top - len(blocks)))
        fresh = self.pool.get_new_blocks(len(indices))
        for i, block in zip(indices, fresh, strict=True):
            blocks[i] = block
        return list(zip(indices, fresh, strict=True))

    def remove_skipped(self, request_id: str, num_computed: int) -> None:
        """Free (silently) leading blocks no longer needed, tail first, as nulls."""
        skip = self.num_skipped_blocks(num_computed)
        blocks = self.req_blocks.get(request_id)
        if not skip or not blocks:
            return
        freed: list[KVBlock] = []
        for i in range(min(skip, len(blocks)) - 1, -1, -1):
            block = blocks[i]
            if block is None:
                break
            freed.append(block)
            blocks[i] = None
        if freed:
            self.pool.free_blocks(freed)

    def cache(self, request: Request, num_tokens: int) -> None:
        """Cache blocks that are full with ``num_tokens`` tokens; one ``BlockStored``."""
        rid = request.request_id
        bs = self.block_size
        start = self.num_cached.get(rid, 0)
        end = min(num_tokens // bs, len(request.block_hashes))
        if end <= start:
            return
        blocks = self.req_blocks[rid]
        hashes = request.block_hashes
        wires = request.wire_hashes
        g = self.group_idx
        stored: list[int] = []
        cache_block = self.pool.cache_block
        for i in range(start, min(end, len(blocks))):
            block = blocks[i]
            if block is None or block.key is not None:
                continue
            cache_block(block, (hashes[i], g))
            stored.append(wires[i])
        self.num_cached[rid] = end
        if self.enable_events and stored:
            lora = request.lora_name
            self.pool.events.append(
                BlockStored(
                    block_hashes=stored,
                    parent_block_hash=wires[start - 1] if start else None,
                    token_ids=request.all_token_ids[start * bs : end * bs],
                    block_size=bs,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=lora,
                    extra_keys=[(lora,) if lora is not None else None] * len(stored),
                    group_idx=g,
                    kv_cache_spec_kind=self.spec.kind,
                    kv_cache_spec_sliding_window=self.spec.sliding_window,
                )
            )

    def free(self, request_id: str) -> None:
        """Release a finished/preempted request's blocks, tail first (evicted first)."""
        blocks = self.req_blocks.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if blocks:
            self.pool.free_blocks([b for b in reversed(blocks) if b is not None])

    def block_ids(self, request_id: str) -> list[int | None]:
        return [b.block_id if b is not None else None for b in self.req_blocks.get(request_id, ())]


class FullAttentionManager(SingleTypeManager):
    """Every block of the prefix, for the whole life of the request."""


class SlidingWindowManager(SingleTypeManager):
    """Blocks covering the window; older ones are freed as the window moves."""

    def __init__(self, spec: SlidingWindowSpec, group_idx: int, pool: BlockPool, **kw) -> None:
        super().__init__(spec, group_idx, pool, **kw)
        self.sliding_window = spec.sliding_window

    def num_skipped_blocks(self, num_computed: int) -> int:
        # The next token attends to [num_computed - window + 1, num_computed].
        return max(0, num_computed - self.sliding_window + 1) // self.block_size


class MambaManager(SingleTypeManager):
    """State blocks only ("align" mode): running state + last boundary state per step."""

    def __init__(self, spec: MambaSpec, group_idx: int, pool: BlockPool, **kw) -> None:
        super().__init__(spec, group_idx, pool, **kw)
        self._retired: dict[str, int] = {}

    def num_skipped_blocks(self, num_computed: int) -> int:
        # Only the block holding the state after ``num_computed`` tokens is needed.
        return max(0, cdiv(num_computed, self.block_size) - 1)

    def new_indices(
        self, blocks: list[KVBlock | None], reserved: set[int], num_computed: int, num_tokens: int
    ) -> list[int]:
        bs = self.block_size
        wanted = {cdiv(num_tokens, bs) - 1}  # the running state after this step
        boundary = num_tokens // bs * bs
        if num_tokens % bs and boundary > num_computed:
            wanted.add(boundary // bs - 1)  # checkpoint: state at the last boundary reached
        return sorted(
            i
            for i in wanted
            if i >= 0 and i not in reserved and (i >= len(blocks) or blocks[i] is None)
        )

    def remove_skipped(self, request_id: str, num_computed: int) -> None:
        # State blocks are sparse: scan only positions not retired by an earlier step.
        blocks = self.req_blocks.get(request_id)
        if not blocks:
            return
        limit = min(self.num_skipped_blocks(num_computed), len(blocks))
        lo = self._retired.get(request_id, 0)
        freed: list[KVBlock] = []
        for i in range(limit - 1, lo - 1, -1):
            block = blocks[i]
            if block is not None:
                freed.append(block)
                blocks[i] = None
        if limit > lo:
            self._retired[request_id] = limit
        if freed:
            self.pool.free_blocks(freed)

    def free(self, request_id: str) -> None:
        self._retired.pop(request_id, None)
        super().free(request_id)


def make_manager(
    spec: KVCacheSpec, group_idx: int, pool: BlockPool, *, enable_events: bool = True
) -> SingleTypeManager:
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, group_idx, pool, enable_events=enable_events)
    if isinstance(spec, MambaSpec):
        return MambaManager(spec, group_idx, pool, enable_events=enable_events)
    return FullAttentionManager(spec, group_idx, pool, enable_events=enable_events)
