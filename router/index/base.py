"""The block index protocol and the small vocabulary both backends share.

An index remembers, per instance, which wire block hashes it holds in which KV cache group
on which tier, and answers lookups as bitmasks over a request's block positions -- the
shape ``events.groups.longest_cache_hit_masks`` consumes, so scoring needs no re-indexing.
Residency is keyed by a *slot* = ``group_idx * NUM_TIERS + tier`` (one small int).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from events.hashing import wire_hash as to_wire  # re-exported: the index API speaks it
from events.structs import KVEventBatch

__all__ = [
    "GPU_MEDIA",
    "NUM_TIERS",
    "ApplyResult",
    "BlockIndex",
    "Residency",
    "SeqBatch",
    "Tier",
    "columns_from_rows",
    "group_tier",
    "is_gpu_medium",
    "slot_of",
    "tier_of",
    "to_wire",
]


class Tier(IntEnum):
    """Where a block lives. ``STORAGE`` (and any other non-GPU medium) counts as CPU: it is
    loadable rather than resident, and refcounts keep a block held on both correct."""

    GPU = 0
    CPU = 1


NUM_TIERS = 2

# One batch of an instance's stream with its sequence number (None: no replay cursor).
SeqBatch = tuple[KVEventBatch, int | None]

# slot -> bitmask over the request's block positions (bit i <=> block_hashes[i] resident).
# A slot is one (KV cache group, tier) column, packed into an int because it keys the
# hottest dicts of a decision; ``slot_of`` and ``group_tier`` are the only encoders.
Residency = dict[int, int]


# The members bound once: ``Tier.GPU`` looked up through the class is an enum attribute
# lookup (~0.2 us on CPython 3.11), and ``tier_of`` runs for every event ingested.
_GPU_TIER, _CPU_TIER = Tier.GPU, Tier.CPU


# vLLM's ``medium`` values of the GPU tier: None (older engines) and "GPU"; any other is
# CPU. The one statement of the rule: per-event loops test ``ev.medium in GPU_MEDIA``
# inline (a function call per event cost as much as the rest of the loop's body).
GPU_MEDIA: frozenset[str | None] = frozenset({None, "GPU"})


def is_gpu_medium(medium: str | None) -> bool:
    """``medium`` is the GPU tier's (``GPU_MEDIA``)."""
    return medium in GPU_MEDIA


def tier_of(medium: str | None) -> Tier:
    """The tier of vLLM's ``medium`` (``GPU_MEDIA``)."""
    return _GPU_TIER if medium in GPU_MEDIA else _CPU_TIER


def slot_of(group_idx: int | None, tier: int) -> int:
    """The residency slot of (group, tier); vLLM's events omit ``group_idx`` for group 0."""
    return (group_idx or 0) * NUM_TIERS + tier


def group_tier(slot: int) -> tuple[int, Tier]:
    """The (group, tier) a residency slot stands for."""
    g, t = divmod(slot, NUM_TIERS)
    return g, Tier(t)


@dataclass(slots=True)
class ApplyResult:
    """What one ``apply`` did; ``applied=False`` means the batch was already applied (by this
    or another ingester sharing the index) or is older than what was applied."""

    applied: bool
    stored: int = 0  # block entries stored (duplicates included: they bump a refcount)
    removed: int = 0  # block entries released
    unknown: int = 0  # removals of entries the index did not hold
    cleared: int = 0  # (instance, slot) columns dropped by AllBlocksCleared / reset
    # A seq'd batch found no cursor for the instance: its first batch, the first after a
    # clear -- or, for an ingester that had applied batches, the index lost the instance
    # (a Redis restarted empty, a reaped heartbeat). Reported by ``apply_many``; backends
    # may leave it False in ``apply``.
    cursor_absent: bool = False


@runtime_checkable
class BlockIndex(Protocol):
    """Per-instance, per-group, per-tier residency of wire block hashes."""

    async def apply(
        self, instance: str, batch: KVEventBatch, *, seq: int | None = None, reset: bool = False
    ) -> ApplyResult:
        """Apply a whole batch atomically.

        With ``seq``, the batch is applied only if ``(batch.ts, seq)`` is newer than the last
        applied one, so two ingesters of the same source never double count. ``reset`` drops
        the instance's state first (source restarted / batches lost), in the same step.
        """
        ...

    async def apply_many(
        self, instance: str, items: Sequence[SeqBatch], *, reset: bool = False
    ) -> list[ApplyResult]:
        """``apply`` each ``(batch, seq)`` in order, ``reset`` with the first only; one
        result per item. What a backlog of batches costs: shared backends send them in one
        round trip (each batch still atomic, the cursor still deduplicating them)."""
        ...

    async def lookup(
        self, block_hashes: Sequence[int], instances: Sequence[str] | None = None
    ) -> dict[str, Residency]:
        """Residency of each position of ``block_hashes``; instances holding none are absent."""
        ...

    async def clear(self, instance: str) -> None:
        """Forget everything about ``instance`` (blocks and cursor); O(its blocks)."""
        ...

    async def instances(self) -> list[str]: ...

    async def cursor(self, instance: str) -> tuple[float, int] | None:
        """``(ts, seq)`` of the last batch applied with a seq, or None."""
        ...

    async def touch(self, instance: str) -> None:
        """Mark the instance's ingester alive (shared backends expire silent instances)."""
        ...

    async def put_layout(self, instance: str, layout: dict[str, Any] | None) -> None:
        """Share an instance's learned group layout with readers (None deletes it)."""
        ...

    async def get_layouts(self) -> dict[str, dict[str, Any]]: ...

    async def close(self) -> None: ...


def columns_from_rows(
    buf: bytes,
    rows: int,
    width: int,
    cols: Iterable[int] | None,
    bitorder: Literal["big", "little"],
) -> dict[int, int]:
    """Transpose ``rows`` fixed-width bitsets (row i = block i) into per-column masks.

    ``buf`` holds the rows back to back, ``width`` bytes each, with ``bitorder`` "little"
    (Python ints) or "big" (Redis SETBIT). Returns {column: int with bit i = row i's bit}
    for the columns in ``cols`` (None: every column) that have a bit set. numpy does the
    transpose; a Python loop over rows x columns would cost milliseconds.
    """
    bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder=bitorder)
    # Transpose to a contiguous (columns, rows) matrix first: packbits on a strided view
    # is several times slower.
    cols_by_row = np.ascontiguousarray(bits.reshape(rows, width * 8).T)
    matrix = np.packbits(cols_by_row, axis=1, bitorder="little")
    if cols is None:
        cols = np.flatnonzero(matrix.any(axis=1)).tolist()
    packed = matrix.tobytes()
    stride = (rows + 7) // 8
    out = {}
    from_bytes = int.from_bytes
    for c in cols:
        v = from_bytes(packed[c * stride : (c + 1) * stride], "little")
        if v:
            out[c] = v
    return out
