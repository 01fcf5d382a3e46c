"""vLLM 0.33 KV cache event structs.

Class names are the msgpack tags, and field order, defaults and struct options are
vLLM's (``vllm/distributed/kv_events.py``), so ``msgspec`` encodes these to the same
bytes vLLM puts on the wire. ``*Array`` twins carry ``array_like=True`` for the legacy
positional form that vLLM used before it switched events to maps.
"""

from __future__ import annotations

from typing import Any

import msgspec

# Wire hashes are u64 ints by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) or raw bytes.
ExternalBlockHash = bytes | int

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of all KV cache events; ``tag=True`` makes the class name the tag."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


# Legacy positional ("array") form: same classes and field order, array_like=True.
class KVCacheEventArray(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


def _array_twin(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """Build the array_like twin of an event class, tagged with the same name."""
    fields = [
        (f.name, f.type, f.default if f.default is not msgspec.NODEFAULT else msgspec.NODEFAULT)
        for f in msgspec.structs.fields(cls)
    ]
    spec = [(n, t) if d is msgspec.NODEFAULT else (n, t, d) for n, t, d in fields]
    return msgspec.defstruct(
        cls.__name__,
        spec,
        bases=(KVCacheEventArray,),
        tag=cls.__name__,
        array_like=True,
        omit_defaults=True,
        gc=False,
        module=__name__,
    )


BlockStoredArray = _array_twin(BlockStored)
BlockRemovedArray = _array_twin(BlockRemoved)
AllBlocksClearedArray = _array_twin(AllBlocksCleared)

EVENT_TYPES: dict[str, type[KVCacheEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
ARRAY_TWINS: dict[type, type] = {
    BlockStored: BlockStoredArray,
    BlockRemoved: BlockRemovedArray,
    AllBlocksCleared: AllBlocksClearedArray,
}
