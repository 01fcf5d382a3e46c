"""In-memory block index: the embedded default.

Layout, chosen for bytes per entry and O(1) per event block:

* ``_blocks: dict[hash, int]`` -- one entry per distinct wire hash; the value is a bitset
  over *columns*, a column being one (instance, slot) pair. Bitset ints are interned, so
  the many blocks sharing a holder set share one int object.
* ``_logs[col]: array('Q')`` -- the reverse index: hashes the column ever stored (8 bytes
  each), compacted when more than half are stale. Clearing an instance walks only its logs.
* ``_dups: dict[(hash, col), extra]`` -- refcounts above 1 (vLLM does not deduplicate
  physical blocks); rare, so it costs nothing when unused.

Lookups OR the positions of each run of one holder set into its columns' masks; numpy
transposes the per-block bitsets instead when residency is fragmented. Where the optional
C extension is built (``events._native.column_masks``; ``KVROUTE_NO_NATIVE=1`` turns it
off) the same runs and ORs are done there, on 64-bit words: a lookup over 32 instances
was ~30 us of Python steps per (run, column) pair and per column. Same answer.

Events are applied there too (``index_store``, ``index_remove``, ``index_compact``: the
same dict steps in one C loop per event; ``_remove_py`` and the loops below are the
reference): under an engine's eviction churn, storing, removing and compacting logs in
Python was a fifth of the router's CPU, more than the decisions.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import groupby, repeat
from typing import Any

from events.native import native
from events.structs import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from router.index.base import (
    ApplyResult,
    Residency,
    SeqBatch,
    Tier,
    columns_from_rows,
    slot_of,
    tier_of,
    to_wire,
)

__all__ = ["MemoryIndex"]

# None where the extension is not built, is off, or was built before it had the function
_column_masks: Any = getattr(native, "column_masks", None)
_index_store: Any = getattr(native, "index_store", None)
_index_remove: Any = getattr(native, "index_remove", None)
_index_compact: Any = getattr(native, "index_compact", None)

_INTERN_MAX = 1 << 16
# Lookups OR each run's positions into the columns of its holder set, a Python step per
# (holder set, column) pair; past this many pairs numpy's transpose is cheaper.
_RUN_BITS_MAX = 2048
# Holder sets whose columns a lookup remembers (few recur: blocks sharing a holder set
# share one interned bitset); past this many the memo starts again.
_MEMBERS_MAX = 4096


def _columns(bits: int) -> tuple[int, ...]:
    """The columns of a holder set, ascending."""
    out = []
    while bits:
        low = bits & -bits
        out.append(low.bit_length() - 1)
        bits ^= low
    return tuple(out)


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

    def __init__(self) -> None:
        self._blocks: dict[int, int] = {}
        self._dups: dict[tuple[int, int], int] = {}
        self._ints: dict[int, int] = {}
        self._logs: list[array | None] = []
        self._live: list[int] = []
        self._owner: list[tuple[str, int] | None] = []
        self._free: list[int] = []
        self._inst: dict[str, _Instance] = {}
        self._layouts: dict[str, dict[str, Any]] = {}
        # holder set (a bitset of columns) -> its columns: pure, so never stale
        self._members: dict[int, tuple[int, ...]] = {}

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
            t = type(ev)
            if t is BlockStored:
                slot = slot_of(ev.group_idx, tier_of(ev.medium))
                if st.cpu_unconfirmed and slot & 1 and self._holds_key(st, slot, ev.block_hashes):
                    # vLLM never stores a CPU key it holds (``prepare_store`` drops them):
                    # the reset emptied its CPU tier (reset_external), so ours goes too.
                    res.cleared += self._drop(st, int(Tier.CPU))
                    st.cpu_unconfirmed = False
                col = self._column(instance, st, slot)
                res.stored += self._store(col, ev.block_hashes)
            elif t is BlockRemoved:
                col = st.cols.get(slot_of(ev.group_idx, tier_of(ev.medium)))
                if col is None:
                    res.unknown += len(ev.block_hashes)
                else:
                    n = self._remove(col, ev.block_hashes)
                    res.removed += n
                    res.unknown += len(ev.block_hashes) - n
            elif t is AllBlocksCleared:
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
        if len(self._ints) > _INTERN_MAX:
            self._ints.clear()  # only loses sharing for future bitsets
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

    def _store(self, col: int, hashes: Iterable[Any]) -> int:
        if _index_store is not None and type(hashes) is list:
            got = _index_store(self._blocks, self._ints, self._dups, col, hashes)
            if got is not None:  # else a hash to convert: the Python path below
                n, fresh = got
                log = self._logs[col]
                assert log is not None
                log.frombytes(fresh)
                self._live[col] += len(fresh) // 8
                return n
        bit = 1 << col
        blocks = self._blocks
        get = blocks.get
        canon = self._ints.setdefault
        log = self._logs[col]
        assert log is not None
        append = log.append
        new = n = 0
        for h in hashes:
            if type(h) is not int or h < 0 or h >> 64:
                h = to_wire(h)
            n += 1
            v = get(h, 0)
            if v & bit:
                key = (h, col)
                self._dups[key] = self._dups.get(key, 0) + 1
            else:
                v |= bit
                blocks[h] = canon(v, v)
                append(h)
                new += 1
        self._live[col] += new
        return n

    def _remove(self, col: int, hashes: Iterable[Any]) -> int:
        got = None
        if _index_remove is not None and type(hashes) is list:
            got = _index_remove(self._blocks, self._ints, self._dups, col, hashes)
        done, released = got if got is not None else self._remove_py(col, hashes)
        if released:
            self._live[col] -= released
            log = self._logs[col]
            assert log is not None
            if len(log) > 2 * self._live[col] + 64:
                self._compact(col)
        return done

    def _remove_py(self, col: int, hashes: Iterable[Any]) -> tuple[int, int]:
        """``_remove``'s dict steps (``events._native.index_remove`` is the same in C):
        (hashes the column held, those it no longer holds)."""
        bit = 1 << col
        blocks = self._blocks
        get = blocks.get
        canon = self._ints.setdefault
        dups = self._dups
        done = released = 0
        for h in hashes:
            if type(h) is not int or h < 0 or h >> 64:
                h = to_wire(h)
            v = get(h, 0)
            if not v & bit:
                continue
            done += 1
            if dups:
                key = (h, col)
                extra = dups.get(key)
                if extra:
                    if extra == 1:
                        del dups[key]
                    else:
                        dups[key] = extra - 1
                    continue
            v ^= bit
            if v:
                blocks[h] = canon(v, v)
            else:
                del blocks[h]
            released += 1
        return done, released

    def _compact(self, col: int) -> None:
        """Rewrite a column's log without stale or repeated hashes (amortised O(1))."""
        log = self._logs[col]
        assert log is not None
        if _index_compact is not None:
            fresh = array("Q")
            fresh.frombytes(_index_compact(self._blocks, col, log))
            self._logs[col] = fresh
            return
        bit, get = 1 << col, self._blocks.get
        self._logs[col] = array("Q", dict.fromkeys(h for h in log if get(h, 0) & bit))

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
        return bool(self._blocks.get(h if type(h) is int else to_wire(h), 0) >> col & 1)

    def _drop_column(self, col: int) -> None:
        bit = 1 << col
        blocks = self._blocks
        get = blocks.get
        canon = self._ints.setdefault
        log = self._logs[col]
        assert log is not None
        for h in log:
            v = get(h, 0)
            if v & bit:
                v ^= bit
                if v:
                    blocks[h] = canon(v, v)
                else:
                    del blocks[h]
        if self._dups:
            for key in [k for k in self._dups if k[1] == col]:
                del self._dups[key]
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
        if _column_masks is not None and type(block_hashes) is list:
            out = _column_masks(
                self._blocks, block_hashes, keep, self._members, _columns, _MEMBERS_MAX,
                self._owner,
            )  # fmt: skip
            if out is not None:  # None: not all exact ints
                return out
        get = self._blocks.get
        try:
            vals = list(map(get, block_hashes, repeat(0, len(block_hashes))))
        except TypeError:  # unhashable digests: normalise once
            vals = [get(to_wire(h), 0) for h in block_hashes]
        # A prompt's positions fall into few runs of one holder set (a bitset of columns):
        # each run's positions as one mask, ORed per holder.
        runs: dict[int, int] = {}
        start = 0
        for v, same in groupby(vals):
            k = len(list(same))
            if v:
                runs[v] = runs.get(v, 0) | (((1 << k) - 1) << start)
            start += k
        if not runs:
            return {}
        if sum(v.bit_count() for v in runs) <= _RUN_BITS_MAX:
            cols: dict[int, int] = {}
            members = self._members
            for v, positions in runs.items():
                v &= keep
                each = members.get(v)
                if each is None:  # a holder set's columns, worked out once per set
                    if len(members) >= _MEMBERS_MAX:
                        members.clear()
                    each = members[v] = _columns(v)
                if not cols:  # the first run (often the widest: a shared prefix), in C
                    cols = dict.fromkeys(each, positions)
                    continue
                for col in each:  # each column of the holder set gets the run's positions
                    cols[col] = cols.get(col, 0) | positions
        else:  # fragmented residency: many holder sets, transposed at once with numpy
            cols = self._transpose(vals, runs.keys(), keep)
        out: dict[str, Residency] = {}
        owner = self._owner
        for col, mask in cols.items():
            who = owner[col]
            if who is None:
                continue
            name, slot = who
            res = out.get(name)
            if res is None:
                out[name] = {slot: mask}
            else:
                res[slot] = mask
        return out

    @staticmethod
    def _transpose(vals: list[int], holders: Iterable[int], keep: int) -> dict[int, int]:
        """Per column, the mask of the positions whose holder set has it (``keep`` only)."""
        # Row width: the highest column reported (the largest bitset holds it).
        width = ((max(holders) if keep == -1 else keep).bit_length() + 7) // 8 or 1
        rows = {v: (v & keep).to_bytes(width, "little") for v in holders}
        rows[0] = bytes(width)
        buf = b"".join(map(rows.__getitem__, vals))
        return columns_from_rows(buf, len(vals), width, None, "little")

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
            "blocks": len(self._blocks),
            "entries": sum(self._live),
            "columns": sum(1 for o in self._owner if o is not None),
            "duplicates": sum(self._dups.values()),
        }
