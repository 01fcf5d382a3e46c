"""In-memory block index: the embedded default.

Layout, chosen for bytes per entry and O(1) per event block:

* the block table (``router.index.table``): per distinct wire hash a bitset over
  *columns*, a column being one (instance, slot) pair, plus the repeats vLLM's duplicate
  physical blocks cause. The C table (``router.index._memindex``: 16-byte slots, each
  holder set stored once) owns that storage where it is built; ``PyBlockTable`` is the
  reference with the same API;
* ``_logs[col]: array('Q')`` -- the reverse index: hashes the column ever stored (8 bytes
  each), compacted when more than half are stale. Clearing an instance walks only its logs;
* per instance its columns and cursor.

Lookups are the table's: each run of positions sharing one holder set ORed into its
columns' masks.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from events.hashing import wire_hashes
from events.structs import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from router.index.base import ApplyResult, Residency, SeqBatch, Tier, slot_of, tier_of, to_wire
from router.index.table import block_table

__all__ = ["MemoryIndex"]

_INTERN_MAX = 1 << 16
# Holder sets whose columns a lookup remembers (few recur: blocks sharing a holder set
# share one interned bitset); past this many the memo starts again.
_MEMBERS_MAX = 4096


@dataclass(slots=True)
class _Instance:
    cols: dict[int, int] = field(default_factory=dict)  # slot -> column
    mask: int = 0  # bitset of the columns in ``cols``
    cursor: tuple[float, int] | None = None
    # An AllBlocksCleared left the CPU tier standing; not yet known whether vLLM's reset
    # emptied it too (``reset_external``): see ``apply_sync``.
    cpu_unconfirmed: bool = False


class MemoryIndex:
    """Process-local ``BlockIndex``; sync ``*_sync`` methods are the fast paths."""

    def __init__(self, *, native: bool | None = None) -> None:
        """``native``: None takes the C block table where it is built; False/True force
        the reference / the C table (tests compare the two)."""
        self._table = block_table(_MEMBERS_MAX, native=native)
        self._logs: list[array | None] = []
        self._live: list[int] = []
        self._owner: list[tuple[str, int] | None] = []
        self._free: list[int] = []
        self._inst: dict[str, _Instance] = {}
        self._layouts: dict[str, dict[str, Any]] = {}

    # ---- protocol (async wrappers) -----------------------------------------------------

    async def apply(
        self, instance: str, batch: KVEventBatch, *, seq: int | None = None, reset: bool = False
    ) -> ApplyResult:
        return self.apply_sync(instance, batch, seq=seq, reset=reset)

    async def apply_many(
        self, instance: str, items: Sequence[SeqBatch], *, reset: bool = False
    ) -> list[ApplyResult]:
        # Through ``apply`` rather than ``apply_sync``: wrappers and test doubles that
        # override ``apply`` (fault injection) see every batch.
        out = []
        for i, (batch, seq) in enumerate(items):
            st = self._inst.get(instance)
            absent = seq is not None and (st is None or st.cursor is None)
            res = await self.apply(instance, batch, seq=seq, reset=reset and i == 0)
            res.cursor_absent = absent
            out.append(res)
        return out

    async def lookup(
        self, block_hashes: Sequence[int], instances: Sequence[str] | None = None
    ) -> dict[str, Residency]:
        return self.lookup_sync(block_hashes, instances)

    async def clear(self, instance: str) -> None:
        self.clear_sync(instance)

    async def instances(self) -> list[str]:
        return list(self._inst)

    async def cursor(self, instance: str) -> tuple[float, int] | None:
        st = self._inst.get(instance)
        return st.cursor if st else None

    async def touch(self, instance: str) -> None:
        return None

    async def put_layout(self, instance: str, layout: dict[str, Any] | None) -> None:
        if layout is None:
            self._layouts.pop(instance, None)
        else:
            self._layouts[instance] = layout

    async def get_layouts(self) -> dict[str, dict[str, Any]]:
        return dict(self._layouts)

    async def close(self) -> None:
        return None

    # ---- writes ------------------------------------------------------------------------

    def apply_sync(
        self, instance: str, batch: KVEventBatch, *, seq: int | None = None, reset: bool = False
    ) -> ApplyResult:
        st = self._inst.get(instance)
        cur = st.cursor if st is not None else None
        if seq is not None and cur is not None and (batch.ts, seq) <= cur:
            return ApplyResult(applied=False)
        if st is None:
            st = self._inst[instance] = _Instance()
        res = ApplyResult(applied=True)
        if reset:
            res.cleared += self._drop(st)
            st.cpu_unconfirmed = False
        for ev in batch.events:
            if type(ev) is BlockStored:
                slot = slot_of(ev.group_idx, tier_of(ev.medium))
                if st.cpu_unconfirmed and slot & 1 and self._holds_key(st, slot, ev.block_hashes):
                    # vLLM never stores a CPU key it holds (``prepare_store`` drops them):
                    # the reset emptied its CPU tier (reset_external), so ours goes too.
                    res.cleared += self._drop(st, int(Tier.CPU))
                    st.cpu_unconfirmed = False
                col = self._column(instance, st, slot)
                res.stored += self._store(col, ev.block_hashes)
            elif type(ev) is BlockRemoved:
                held = st.cols.get(slot_of(ev.group_idx, tier_of(ev.medium)))
                if held is None:
                    res.unknown += len(ev.block_hashes)
                else:
                    n = self._remove(held, ev.block_hashes)
                    res.removed += n
                    res.unknown += len(ev.block_hashes) - n
            elif type(ev) is AllBlocksCleared:
                # vLLM's reset_prefix_cache: AllBlocksCleared empties the GPU tier; the
                # CPU tier keeps serving unless reset_external also emptied it, which
                # sends the same single event. Keep it, unconfirmed, until a CPU store
                # says otherwise (above): a wrong keep over-predicts until then, a wrong
                # drop would under-predict for as long as vLLM holds those chunks (it
                # never announces a chunk it holds again).
                res.cleared += self._drop(st, int(Tier.GPU))
                st.cpu_unconfirmed = bool(st.cols)
        if seq is not None:
            st.cursor = (batch.ts, seq)
        self._table.trim_interned(_INTERN_MAX)
        return res

    def clear_sync(self, instance: str) -> None:
        st = self._inst.pop(instance, None)
        if st is not None:
            self._drop(st)

    def _column(self, instance: str, st: _Instance, slot: int) -> int:
        col = st.cols.get(slot)
        if col is not None:
            return col
        if self._free:
            col = heapq.heappop(self._free)
        else:
            col = len(self._logs)
            self._logs.append(None)
            self._live.append(0)
            self._owner.append(None)
        self._logs[col] = array("Q")
        self._live[col] = 0
        self._owner[col] = (instance, slot)
        st.cols[slot] = col
        st.mask |= 1 << col
        return col

    def _store(self, col: int, hashes: Sequence[Any]) -> int:
        got = self._table.store(col, hashes)
        if got is None:  # not all wire ints: convert, then the same call
            got = self._table.store(col, wire_hashes(hashes))
            assert got is not None  # every hash a wire int now
        n, fresh = got
        log = self._logs[col]
        assert log is not None
        log.frombytes(fresh)
        self._live[col] += len(fresh) // 8
        return n

    def _remove(self, col: int, hashes: Sequence[Any]) -> int:
        got = self._table.remove(col, hashes)
        if got is None:
            got = self._table.remove(col, wire_hashes(hashes))
            assert got is not None  # every hash a wire int now
        done, released = got
        if released:
            self._live[col] -= released
            log = self._logs[col]
            assert log is not None
            if len(log) > 2 * self._live[col] + 64:
                self._compact(col)
        return done

    def _compact(self, col: int) -> None:
        """Rewrite a column's log without stale or repeated hashes (amortised O(1))."""
        log = self._logs[col]
        assert log is not None
        fresh = array("Q")
        fresh.frombytes(self._table.compact(col, log))
        self._logs[col] = fresh

    def _drop(self, st: _Instance, tier: int | None = None) -> int:
        """Drop the instance's columns (of one tier): O(entries they ever logged)."""
        if tier is None:
            n = len(st.cols)
            for col in st.cols.values():
                self._drop_column(col)
            st.cols.clear()
            st.mask = 0
            return n
        gone = [slot for slot in st.cols if slot & 1 == tier]
        for slot in gone:
            col = st.cols.pop(slot)
            self._drop_column(col)
            st.mask &= ~(1 << col)
        return len(gone)

    def _holds_key(self, st: _Instance, slot: int, hashes: Sequence[Any]) -> bool:
        """Whether the column holds a CPU store's chunk key, its last hash (the blocks
        before it may be shared with a sibling chunk that branched inside the chunk)."""
        col = st.cols.get(slot)
        if col is None or not hashes:
            return False
        h = hashes[-1]
        return bool(self._table.holders(h if type(h) is int else to_wire(h)) >> col & 1)

    def _drop_column(self, col: int) -> None:
        log = self._logs[col]
        assert log is not None
        self._table.drop(col, log)
        self._logs[col] = None
        self._live[col] = 0
        self._owner[col] = None
        heapq.heappush(self._free, col)

    # ---- reads -------------------------------------------------------------------------

    def lookup_sync(
        self, block_hashes: Sequence[int], instances: Sequence[str] | None = None
    ) -> dict[str, Residency]:
        keep = -1  # columns to report
        if instances is not None:
            keep = 0
            inst = self._inst
            for name in instances:
                st = inst.get(name)
                if st is not None:
                    keep |= st.mask
        hashes = block_hashes if type(block_hashes) is list else list(block_hashes)
        out = self._table.lookup(hashes, keep, self._owner)
        if out is None:  # not all wire ints: convert, then the same call
            out = self._table.lookup(wire_hashes(hashes), keep, self._owner)
            assert out is not None  # every hash a wire int now
        return out

    # ---- introspection (tests, benchmarks, /dashboard) ---------------------------------

    def column_counts_sync(self) -> dict[str, dict[int, int]]:
        """``{instance: {slot: distinct blocks held}}``; O(columns)."""
        live = self._live
        return {
            name: {slot: live[col] for slot, col in st.cols.items()}
            for name, st in self._inst.items()
        }

    async def column_counts(self) -> dict[str, dict[int, int]]:
        return self.column_counts_sync()

    def stats(self) -> dict[str, int]:
        return {
            "blocks": len(self._table),
            "entries": sum(self._live),
            "columns": sum(1 for o in self._owner if o is not None),
            "duplicates": self._table.duplicates(),
        }

    def holders(self, h: int) -> int:
        """The bitset of the columns holding wire hash ``h`` (tests, introspection)."""
        return self._table.holders(h)

    def snapshot(self) -> tuple[dict[int, int], dict[tuple[int, int], int], list, list[int]]:
        """The whole state, copied: blocks, repeats, logs, live counts (tests)."""
        blocks, dups = self._table.snapshot()
        logs = [None if log is None else log.tolist() for log in self._logs]
        return blocks, dups, logs, list(self._live)
