"""Per-kind KV cache managers: which blocks of one group a request holds, frees, caches.

One manager per group, following vLLM 0.33's ``single_type_kv_cache_manager.py`` step for
step (the real-vLLM differential test holds us to it). A request's block table per group
is a list indexed by block position; ``None`` is vLLM's null block. The kinds differ in:

* full attention: a real block for every position, freed only when the request ends;
* sliding window: a real block for every position of every scheduled chunk; at the next
  allocation the blocks wholly before ``num_computed - window + 1`` are freed (silently);
* Mamba ("align" mode): only the running state block, plus the previous one for one more
  step; a state block holds the state after exactly ``(i + 1) * block_size`` tokens.

Which full blocks get a hash (and a ``BlockStored``) is ``events.retention``: every one
for full attention, the window tails / state blocks at the reachable boundaries for the
sparse kinds. The hit itself is ``events.groups`` (shared with the router).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_adapter.block_pool import BlockPool, KVBlock
from engine_adapter.request import Request
from events.groups import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from events.retention import cacheable_mask
from events.structs import BlockStored

__all__ = [
    "FullAttentionManager",
    "MambaManager",
    "SingleTypeManager",
    "SlidingWindowManager",
    "cdiv",
    "make_manager",
]

Table = list[KVBlock | None]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeManager:
    """Bookkeeping shared by all kinds; subclasses override the few rules that differ."""

    def __init__(
        self,
        spec: KVCacheSpec,
        group_idx: int,
        pool: BlockPool,
        *,
        alignment: int | None = None,
        enable_events: bool = True,
    ) -> None:
        self.spec = spec
        self.group_idx = group_idx
        self.pool = pool
        self.block_size = spec.block_size
        self.alignment = alignment or spec.block_size  # vLLM's cache-hit alignment tokens
        self.enable_events = enable_events
        self.req_blocks: dict[str, Table] = {}
        self.num_cached: dict[str, int] = {}
        # Blocks the full-sequence admission gate may reserve for one request (SWA only).
        self.admission_cap: int | None = None

    # ---- kind-specific rules --------------------------------------------------------

    def num_skipped_tokens(self, num_computed: int) -> int:
        """Leading tokens whose KV the next token no longer needs."""
        return 0

    def hit_blocks(self, request: Request, num_hit_tokens: int) -> Table:
        """The blocks vLLM's lookup returns for this group at the final hit length
        (``None`` where the group needs no block)."""
        n = num_hit_tokens // self.block_size
        return [self._cached(request, i) for i in range(n)]

    def _cached(self, request: Request, i: int) -> KVBlock:
        block = self.pool.get_cached((request.block_hashes[i], self.group_idx))
        if block is None:
            raise KeyError(f"group {self.group_idx} block {i} of {request.request_id} not cached")
        return block

    # ---- counting (no state change) -------------------------------------------------

    def num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        hits: Table,
        total_computed: int,
        *,
        admission: bool = False,
    ) -> int:
        """Blocks this group takes from the free queue to hold ``num_tokens`` tokens
        (hits that sit in the free queue count: touching them takes them out)."""
        required = cdiv(num_tokens, self.block_size)
        if admission and self.admission_cap is not None:
            required = min(required, self.admission_cap)
        table = self.req_blocks.get(request_id, ())
        if request_id in self.num_cached:  # running: no new hits
            return max(required - len(table), 0)
        skipped = self.num_skipped_tokens(total_computed) // self.block_size
        new = max(required - max(skipped, len(hits) + len(table)), 0)
        kept = hits[max(0, skipped - len(table)) :]
        return new + sum(1 for b in kept if b is not None and b.ref_cnt == 0)

    # ---- state changes --------------------------------------------------------------

    def remove_skipped(self, request_id: str, num_computed: int) -> None:
        """Free (silently) leading blocks the next token no longer needs, tail first."""
        skipped = self.num_skipped_tokens(num_computed)
        table = self.req_blocks.get(request_id)
        if skipped <= 0 or not table:
            return
        self._free_range(request_id, 0, min(skipped // self.block_size, len(table)))

    def _free_range(self, request_id: str, first: int, last: int) -> None:
        table = self.req_blocks[request_id]
        freed: list[KVBlock] = []
        for i in range(last - 1, first - 1, -1):
            block = table[i]
            if block is None:
                break
            freed.append(block)
            table[i] = None
        if freed:
            self.pool.free_blocks(freed)

    def adopt(self, request_id: str, hits: Table, total_computed: int) -> None:
        """First allocation: take the prefix hit (nulls for positions already out of use)."""
        skipped = self.num_skipped_tokens(total_computed) // self.block_size
        kept = hits[skipped:]
        self.pool.touch([b for b in kept if b is not None])
        table: Table = [None] * skipped
        table.extend(kept)
        self.req_blocks[request_id] = table
        self.num_cached[request_id] = len(table)

    def allocate_external(
        self, request_id: str, total_computed: int, num_external: int
    ) -> list[tuple[int, KVBlock]]:
        """Fresh blocks for tokens loaded from the CPU tier; ``(position, block)`` pairs."""
        skipped = self.num_skipped_tokens(total_computed)
        if skipped > 0:
            num_external = min(total_computed - skipped, num_external)
        if num_external <= 0:
            return []
        table = self.req_blocks[request_id]
        n = max(0, cdiv(total_computed, self.block_size) - len(table))
        fresh = self.pool.get_new_blocks(n)
        start = len(table)
        table.extend(fresh)
        return list(zip(range(start, start + n), fresh, strict=True))

    def allocate_new(self, request_id: str, num_tokens: int) -> list[KVBlock]:
        """Grow the table to hold ``num_tokens`` tokens."""
        table = self.req_blocks.setdefault(request_id, [])
        n = cdiv(num_tokens, self.block_size) - len(table)
        if n <= 0:
            return []
        fresh = self.pool.get_new_blocks(n)
        table.extend(fresh)
        return fresh

    def cache(self, request: Request, num_tokens: int, boundaries: Sequence[int]) -> None:
        """Hash the blocks full with ``num_tokens`` tokens that retention keeps; one
        ``BlockStored`` whenever the group's count of full blocks grows (even with no
        hash: vLLM emits it, its ``token_ids`` covering the skipped blocks too)."""
        rid = request.request_id
        bs = self.block_size
        start = self.num_cached.get(rid, 0)
        end = min(num_tokens // bs, len(request.block_hashes))
        if end <= start:
            return
        table = self.req_blocks[rid]
        mask = cacheable_mask(self.spec, self.alignment, boundaries, start, end)
        hashes = request.block_hashes
        wires = request.wire_hashes
        g = self.group_idx
        kept: list[int] = []
        for i in range(start, end):
            block = table[i] if i < len(table) else None
            if block is None or (mask is not None and not mask[i - start]):
                continue
            self.pool.cache_block(block, (hashes[i], g))
            kept.append(i)
        self.num_cached[rid] = end
        if self.enable_events:
            self.pool.emit(
                BlockStored(
                    block_hashes=[wires[i] for i in kept],
                    parent_block_hash=wires[start - 1] if start else None,
                    token_ids=request.all_token_ids[start * bs : end * bs],
                    block_size=bs,
                    lora_id=None,
                    medium=self.pool.medium,
                    lora_name=request.lora_name,
                    extra_keys=request.event_extra_keys(kept),
                    group_idx=g,
                    kv_cache_spec_kind=self.spec.kind,
                    kv_cache_spec_sliding_window=self.spec.sliding_window,
                )
            )

    def free(self, request_id: str) -> None:
        """Release a finished/preempted request's blocks, tail first (evicted first)."""
        table = self.req_blocks.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if table:
            self.pool.free_blocks([b for b in reversed(table) if b is not None])

    def block_ids(self, request_id: str) -> list[int | None]:
        return [b.block_id if b is not None else None for b in self.req_blocks.get(request_id, ())]


class FullAttentionManager(SingleTypeManager):
    """Every block of the sequence, for the whole life of the request."""


class SlidingWindowManager(SingleTypeManager):
    """Every block of a scheduled chunk; those behind the window freed at the next one."""

    def __init__(self, spec: SlidingWindowSpec, group_idx: int, pool: BlockPool, **kw) -> None:
        super().__init__(spec, group_idx, pool, **kw)
        self.sliding_window = spec.sliding_window

    def num_skipped_tokens(self, num_computed: int) -> int:
        # The next token attends to [num_computed - window + 1, num_computed].
        return max(0, num_computed - self.sliding_window + 1)

    def hit_blocks(self, request: Request, num_hit_tokens: int) -> Table:
        n = num_hit_tokens // self.block_size
        lo = max(0, n - self.spec.window_blocks)  # type: ignore[attr-defined]
        return [None] * lo + [self._cached(request, i) for i in range(lo, n)]


class MambaManager(SingleTypeManager):
    """ "align" mode: the running state block, and the previous one for one more step."""

    def __init__(self, spec: MambaSpec, group_idx: int, pool: BlockPool, **kw) -> None:
        super().__init__(spec, group_idx, pool, **kw)
        self._retired: dict[str, int] = {}
        self._last_state: dict[str, int] = {}
        self._allocated: set[str] = set()
        # Hashes cached (or re-registered) this engine step: a hit on one is refused
        # until a later step, as vLLM does (the state is written by this step's forward).
        self.cached_this_step: set[tuple[bytes, int]] = set()

    def num_skipped_tokens(self, num_computed: int) -> int:
        return num_computed - 1  # only the state after the last computed token is needed

    def hit_blocks(self, request: Request, num_hit_tokens: int) -> Table:
        n = num_hit_tokens // self.block_size
        return [None] * (n - 1) + [self._cached(request, n - 1)] if n else []

    def num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        hits: Table,
        total_computed: int,
        *,
        admission: bool = False,
    ) -> int:
        if hits and hits[-1] is not None and hits[-1].key in self.cached_this_step:
            return self.pool.num_blocks + 1  # cannot be admitted this step
        held = len(self.req_blocks.get(request_id, ()))
        new = cdiv(num_tokens, self.block_size) - len(hits) - held
        new = min(new, 1) if new > 0 else 0  # one new state block per step
        return new + sum(1 for b in hits if b is not None and b.ref_cnt == 0)

    def remove_skipped(self, request_id: str, num_computed: int) -> None:
        super().remove_skipped(request_id, num_computed)
        last = self._last_state.get(request_id)
        table = self.req_blocks.get(request_id)
        if last is not None and table and last < cdiv(num_computed, self.block_size) - 1:
            block = table[last]
            if block is not None:
                self.pool.free_blocks([block])
                table[last] = None

    def _free_range(self, request_id: str, first: int, last: int) -> None:
        table = self.req_blocks[request_id]
        first = max(first, self._retired.get(request_id, 0))
        last = min(last, len(table))
        if first >= last:
            return
        freed = [table[i] for i in range(last - 1, first - 1, -1) if table[i] is not None]
        for i in range(first, last):
            table[i] = None
        if freed:
            self.pool.free_blocks(freed)  # type: ignore[arg-type]
        self._retired[request_id] = last

    def allocate_new(self, request_id: str, num_tokens: int) -> list[KVBlock]:
        table = self.req_blocks.setdefault(request_id, [])
        required = cdiv(num_tokens, self.block_size)
        if required <= len(table):
            self._allocated.add(request_id)
            return []
        if table:
            self._last_state[request_id] = len(table) - 1
        if len(table) < required - 1:
            table.extend([None] * (required - 1 - len(table)))
        fresh = self.pool.get_new_blocks(required - len(table))
        table.extend(fresh)
        self._allocated.add(request_id)
        return fresh

    def cache(self, request: Request, num_tokens: int, boundaries: Sequence[int]) -> None:
        before = self.num_cached.get(request.request_id, 0)
        super().cache(request, num_tokens, boundaries)
        table = self.req_blocks[request.request_id]
        after = self.num_cached.get(request.request_id, 0)
        for i in range(before, after):
            block = table[i] if i < len(table) else None
            if block is not None and block.key is not None:
                self.cached_this_step.add(block.key)
        # The prompt's boundary state is re-registered on every step that caches up to
        # it while the block is still held (vLLM's partial-tail bookkeeping).
        hbs = request.block_size
        boundary = (request.num_prompt_tokens - 1) // hbs * hbs
        if num_tokens > 0 and num_tokens == boundary:
            i = cdiv(num_tokens, self.block_size) - 1
            block = table[i] if i < len(table) else None
            if block is not None and block.key is not None:
                self.cached_this_step.add(block.key)

    def free(self, request_id: str) -> None:
        self._retired.pop(request_id, None)
        self._last_state.pop(request_id, None)
        self._allocated.discard(request_id)
        super().free(request_id)


def make_manager(
    spec: KVCacheSpec,
    group_idx: int,
    pool: BlockPool,
    *,
    alignment: int | None = None,
    enable_events: bool = True,
) -> SingleTypeManager:
    kw = {"alignment": alignment, "enable_events": enable_events}
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, group_idx, pool, **kw)
    if isinstance(spec, MambaSpec):
        return MambaManager(spec, group_idx, pool, **kw)
    assert isinstance(spec, FullAttentionSpec)
    return FullAttentionManager(spec, group_idx, pool, **kw)
