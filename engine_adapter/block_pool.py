"""GPU block pool with vLLM's prefix-caching semantics, and the events it implies.

Free blocks wait in an LRU queue (front = evicted first). A block that is full gets a
cache key ``(block digest, group_idx)`` and stays findable after it is freed, until the
queue hands it out again: only then is it evicted and ``BlockRemoved`` emitted, one per
physical block. Freed uncached blocks go to the front (reused first, they hold nothing),
freed cached blocks to the back. Blocks are not deduplicated: two physical blocks may
carry the same key (append-only block tables), so consumers must refcount. State changes
and their events happen in the same methods so they cannot drift apart (vLLM's
``BlockPool`` + ``take_events()``).

The queue is an ``OrderedDict`` keyed by block id: O(1) pop-front, append, prepend and
removal from the middle, without a hand-written linked list.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence

from events.hashing import wire_hash
from events.structs import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, KVCacheEvent

__all__ = ["BlockPool", "CacheKey", "KVBlock"]

logger = logging.getLogger(__name__)

# (block digest, group_idx): the same tokens cached by two groups are two entries.
CacheKey = tuple[bytes, int]


class KVBlock:
    """One physical block: its id (row in the group KV tensors), users, cache key."""

    __slots__ = ("block_id", "key", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: CacheKey | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.key is not None})"


class BlockPool:
    """Blocks, their LRU free queue and the prefix-cache map, and the events they imply.

    The pool owns its event queue (vLLM's ``BlockPool.kv_event_queue``): every event of
    this pool is stamped with its ``medium`` and drained with ``take_events`` once a step.

    ``reuse_hooks`` run on blocks about to be handed out again, before anything is
    overwritten (the offload tier uses it to finish copies still reading those blocks).
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        medium: str = MEDIUM_GPU,
        enable_events: bool = True,
        null_block: bool = True,
    ) -> None:
        if num_blocks <= int(null_block):
            raise ValueError("a block pool needs at least one usable block")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Block 0 is vLLM's null block: it stands for table positions a group does not
        # need and never enters the free queue, so ``num_blocks - 1`` are usable.
        self.null_block = self.blocks[0] if null_block else None
        usable = self.blocks[1:] if null_block else self.blocks
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in usable)
        self.num_usable = len(usable)
        self._cached: dict[CacheKey, KVBlock | dict[int, KVBlock]] = {}
        self._events: list[KVCacheEvent] = []
        self.medium = medium
        self.enable_events = enable_events
        self.reuse_hooks: list[Callable[[list[KVBlock]], None]] = []
        self.num_allocated = 0  # blocks handed out so far (throughput accounting)

    # ---- queries -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_usable

    def emit(self, event: KVCacheEvent) -> None:
        """Queue an event of this pool's (drained once per engine step)."""
        if self.enable_events:
            self._events.append(event)

    def take_events(self) -> list[KVCacheEvent]:
        """Drain this pool's events, in the order they happened."""
        events, self._events = self._events, []
        return events

    def get_cached(self, key: CacheKey) -> KVBlock | None:
        """Any physical block caching ``key`` (the first one if duplicated)."""
        hit = self._cached.get(key)
        if hit is None or isinstance(hit, KVBlock):
            return hit
        return next(iter(hit.values()))

    def is_cached(self, key: CacheKey) -> bool:
        return key in self._cached

    def residency(self) -> Counter[tuple[int, int]]:
        """``(group_idx, wire hash) -> number of physical blocks`` caching it (O(cache))."""
        out: Counter[tuple[int, int]] = Counter()
        for (digest, group), hit in self._cached.items():
            out[(group, wire_hash(digest))] += 1 if isinstance(hit, KVBlock) else len(hit)
        return out

    # ---- state changes -------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop ``n`` blocks from the front of the free queue, evicting their cache keys."""
        if n > len(self._free):
            raise ValueError(f"cannot get {n} blocks, {len(self._free)} free")
        popitem = self._free.popitem
        out = [popitem(last=False)[1] for _ in range(n)]
        self.num_allocated += n
        for hook in self.reuse_hooks:
            hook(out)
        for block in out:
            if block.key is not None:
                self._evict(block)
            block.ref_cnt = 1
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the queue."""
        free = self._free
        for block in blocks:
            if block.ref_cnt == 0:
                del free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference per block; ``ordered`` is eviction order (first = first out).

        Cached blocks join the back of the queue in that order; uncached ones the front.
        """
        free = self._free
        front: list[KVBlock] = []
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.key is None:
                    front.append(block)
                else:
                    free[block.block_id] = block
        for block in reversed(front):
            free[block.block_id] = block
            free.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVBlock, key: CacheKey) -> None:
        """Make a full block findable under ``key`` (the caller emits ``BlockStored``)."""
        assert block.key is None, "a block is cached once, when it becomes full"
        block.key = key
        hit = self._cached.get(key)
        if hit is None:
            self._cached[key] = block
        elif isinstance(hit, KVBlock):
            self._cached[key] = {hit.block_id: hit, block.block_id: block}
        else:
            hit[block.block_id] = block

    def _evict(self, block: KVBlock) -> None:
        key = block.key
        assert key is not None
        block.key = None
        hit = self._cached[key]
        if isinstance(hit, KVBlock):
            del self._cached[key]
        else:
            del hit[block.block_id]
            if len(hit) == 1:
                self._cached[key] = next(iter(hit.values()))
        self.emit(BlockRemoved([wire_hash(key[0])], self.medium, key[1]))

    def reset(self, *, emit: bool = True) -> bool:
        """Forget every cached key if no block is in use; emits ``AllBlocksCleared``."""
        in_use = self.num_usable - len(self._free)
        if in_use:
            logger.warning("cannot reset the prefix cache: %d blocks still in use", in_use)
            return False
        for block in self.blocks:
            block.key = None
        self._cached.clear()
        if emit:
            self.emit(AllBlocksCleared())
        return True

    def check_invariants(self, held: Sequence[KVBlock] = ()) -> None:
        """Debug aid for tests: refcounts, queue membership and cache map agree."""
        for block in self.blocks:
            if block is self.null_block:
                assert block.block_id not in self._free and block.key is None
                continue
            in_queue = block.block_id in self._free
            assert in_queue == (block.ref_cnt == 0), block
            if block.key is not None:
                hit = self._cached[block.key]
                assert hit is block or (isinstance(hit, dict) and hit.get(block.block_id) is block)
        for block in held:
            assert block.ref_cnt > 0, block
