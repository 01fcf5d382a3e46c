"""The memory index's block table: per wire hash, the bitset of the columns holding it.

``PyBlockTable`` is the reference; ``router.index._memindex.BlockTable`` (C, optional,
``events.native.load``) implements the same API on its own storage and is used where it
is built. ``block_table()`` picks one. ``MemoryIndex`` keeps instances, columns and each
column's log (the reverse index) and reaches the table only through this API:

* ``store(col, hashes)`` -> ``(stored, new)``: column ``col`` holds each hash once more
  (a repeat of a hash it holds is counted, vLLM does not deduplicate physical blocks);
  ``new`` is the hashes it did not hold before, native uint64 bytes, for its log;
* ``remove(col, hashes)`` -> ``(done, released)``: takes each back once (a repeat first);
  ``done`` counts the hashes the column held, ``released`` those it no longer holds;
* ``compact(col, log)`` -> bytes: the log's hashes the column still holds, each once;
* ``drop(col, log)``: the column goes (its log names every hash it may hold);
* ``lookup(hashes, keep, owner)`` -> ``{instance: {slot: mask}}``: per column kept, the
  mask of the request positions it holds (``owner[col]`` = (instance, slot), or None);
* ``holders(h)``, ``trim_interned(limit)``, ``duplicates()``, ``len()``, ``snapshot()``.

``store``, ``remove`` and ``lookup`` of the C table return None for hashes that are not a
list of exact u64 ints (nothing changed): the caller converts them (``to_wire``) and
calls again. The reference converts as it goes and never returns None.

Storage differs, not answers: the reference keeps a dict of wire hash -> bitset, the
bitsets interned (blocks sharing a holder set share one int object; ``trim_interned``
forgets the interning table past a limit). The C table keeps an open-addressing table of
16-byte slots (the hash inline, a holder-set id) and each holder set once, counted by the
blocks holding it (``trim_interned`` has nothing to do there; ``memory()`` tells its
bytes): a lookup is one prefetched slot per position instead of several scattered
objects, which under cache pressure was most of a 240k-token decision.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from itertools import groupby, repeat
from typing import Any, Protocol

from events.native import load
from router.index.base import columns_from_rows, to_wire

__all__ = ["BlockTable", "PyBlockTable", "block_table", "columns_of"]


class BlockTable(Protocol):
    """What ``MemoryIndex`` calls, as ``PyBlockTable`` and the C ``BlockTable``
    (``router.index._memindex``) both answer it. ``store`` / ``remove`` / ``lookup`` answer
    None when a hash is not a wire int: the caller converts them and calls again."""

    def __len__(self) -> int: ...
    def store(self, col: int, hashes: Iterable[Any]) -> tuple[int, bytes] | None: ...
    def remove(self, col: int, hashes: Iterable[Any]) -> tuple[int, int] | None: ...
    def compact(self, col: int, log: Any) -> bytes: ...
    def drop(self, col: int, log: Any) -> None: ...
    def holders(self, h: int) -> int: ...
    def trim_interned(self, limit: int) -> None: ...
    def duplicates(self) -> int: ...
    def snapshot(self) -> tuple[dict[int, int], dict[tuple[int, int], int]]: ...
    def lookup(
        self, hashes: Sequence[Any], keep: int, owner: list[tuple[str, int] | None]
    ) -> dict[str, dict[int, int]] | None: ...


# Lookups OR each run's positions into the columns of its holder set, a Python step per
# (holder set, column) pair; past this many pairs numpy's transpose is cheaper.
_RUN_BITS_MAX = 2048


def columns_of(bits: int) -> tuple[int, ...]:
    """The columns of a holder set, ascending."""
    out = []
    while bits:
        low = bits & -bits
        out.append(low.bit_length() - 1)
        bits ^= low
    return tuple(out)


class PyBlockTable:
    """The block table in Python: the reference for ``router.index._memindex.BlockTable``."""

    def __init__(self, columns: Callable[[int], tuple[int, ...]], members_max: int) -> None:
        self._blocks: dict[int, int] = {}
        self._ints: dict[int, int] = {}
        self._dups: dict[tuple[int, int], int] = {}
        self._members: dict[int, tuple[int, ...]] = {}  # holder set -> columns (pure)
        self._columns = columns
        self._members_max = members_max

    def __len__(self) -> int:
        return len(self._blocks)

    def store(self, col: int, hashes: Iterable[Any]) -> tuple[int, bytes]:
        bit = 1 << col
        blocks = self._blocks
        get = blocks.get
        canon = self._ints.setdefault
        fresh = array("Q")
        append = fresh.append
        n = 0
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
        return n, fresh.tobytes()

    def remove(self, col: int, hashes: Iterable[Any]) -> tuple[int, int]:
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

    def compact(self, col: int, log: Any) -> bytes:
        bit, get = 1 << col, self._blocks.get
        return array("Q", dict.fromkeys(h for h in _u64s(log) if get(h, 0) & bit)).tobytes()

    def drop(self, col: int, log: Any) -> None:
        bit = 1 << col
        blocks = self._blocks
        get = blocks.get
        canon = self._ints.setdefault
        for h in _u64s(log):
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

    def holders(self, h: int) -> int:
        return self._blocks.get(h, 0)

    def trim_interned(self, limit: int) -> None:
        if len(self._ints) > limit:
            self._ints.clear()  # only loses sharing for future bitsets

    def duplicates(self) -> int:
        return sum(self._dups.values())

    def snapshot(self) -> tuple[dict[int, int], dict[tuple[int, int], int]]:
        return dict(self._blocks), dict(self._dups)

    def lookup(
        self, hashes: Sequence[Any], keep: int, owner: list[tuple[str, int] | None]
    ) -> dict[str, dict[int, int]]:
        get = self._blocks.get
        try:
            vals = list(map(get, hashes, repeat(0, len(hashes))))
        except TypeError:  # unhashable digests: normalise once
            vals = [get(to_wire(h), 0) for h in hashes]
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
                    if len(members) >= self._members_max:
                        members.clear()
                    each = members[v] = self._columns(v)
                for col in each:  # each column of the holder set gets the run's positions
                    cols[col] = cols.get(col, 0) | positions
        else:  # fragmented residency: many holder sets, transposed at once with numpy
            cols = _transpose(vals, runs.keys(), keep)
        out: dict[str, dict[int, int]] = {}
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


def _u64s(log: Any) -> array:
    """A log (an ``array('Q')`` or native uint64 bytes) as an array."""
    if isinstance(log, array):
        return log
    out = array("Q")
    out.frombytes(log)
    return out


def _transpose(vals: list[int], holders: Iterable[int], keep: int) -> dict[int, int]:
    """Per column, the mask of the positions whose holder set has it (``keep`` only)."""
    # Row width: the highest column reported (the largest bitset holds it).
    width = ((max(holders) if keep == -1 else keep).bit_length() + 7) // 8 or 1
    rows = {v: (v & keep).to_bytes(width, "little") for v in holders}
    rows[0] = bytes(width)
    buf = b"".join(map(rows.__getitem__, vals))
    return columns_from_rows(buf, len(vals), width, None, "little")


_native = load("router.index._memindex")


def block_table(members_max: int, *, native: bool | None = None) -> BlockTable:
    """A new block table: the C one where it is built (``native=None``), else (or with
    ``native=False``) the reference. ``native=True`` without the extension raises."""
    if native is None:
        native = _native is not None
    if native:
        if _native is None:
            raise RuntimeError("router.index._memindex is not built (or KVROUTE_NO_NATIVE)")
        table: BlockTable = _native.BlockTable(columns_of, members_max)  # C: no stub
        return table
    return PyBlockTable(columns_of, members_max)
