"""The memory index's block table: the C table (``router.index._memindex.BlockTable``) and
its reference (``router.index.table.PyBlockTable``) have one API and leave one state.

Each API test runs on both tables; the differential tests run random event streams and
lookups through a ``MemoryIndex`` on each and compare everything (results, bitsets,
repeats, logs, live counts, lookup answers in order): more than 64 columns (bitsets past
one machine word), stores, repeats, removals of held and unknown blocks, clears, hashes
that need converting (bytes, negative ints), compaction, fragmented residency."""

from __future__ import annotations

import random
from array import array

import pytest
from routerkit import batch, need_native, removed, stored

from events.structs import AllBlocksCleared
from router.index import table
from router.index.memory import MemoryIndex
from router.index.table import PyBlockTable, block_table, columns_of


@pytest.fixture(params=["python", "native"])
def native(request: pytest.FixtureRequest) -> bool:
    if request.param == "native":
        need_native(table._native is not None, "router.index._memindex")
    return request.param == "native"


def _need_c() -> None:
    need_native(table._native is not None, "router.index._memindex")


def _u64(*hs: int) -> bytes:
    return array("Q", hs).tobytes()


# ---- the API, on each table -------------------------------------------------------------


def test_store_counts_repeats_and_logs_only_new_hashes(native):
    t = block_table(16, native=native)
    assert t.store(70, [5, 5, 6]) == (3, _u64(5, 6))
    assert t.store(1, [5]) == (1, _u64(5))
    assert t.holders(5) == (1 << 70) | 2 and t.holders(6) == 1 << 70 and t.holders(7) == 0
    assert len(t) == 2 and t.duplicates() == 1
    assert t.snapshot() == ({5: (1 << 70) | 2, 6: 1 << 70}, {(5, 70): 1})


def test_remove_takes_repeats_back_first_and_the_block_with_its_last_column(native):
    t = block_table(16, native=native)
    t.store(3, [5, 5, 6])
    t.store(4, [6])
    assert t.remove(3, [5, 9]) == (1, 0)  # a repeat back; 9 was never held
    assert t.remove(3, [5, 6]) == (2, 2)
    assert t.snapshot() == ({6: 1 << 4}, {})
    assert t.remove(3, [5]) == (0, 0)


def test_compact_keeps_held_hashes_once_in_first_logged_order(native):
    t = block_table(16, native=native)
    t.store(2, [1, 2, 3])
    t.remove(2, [2])
    t.store(2, [2])
    assert t.compact(2, array("Q", [1, 2, 3, 2, 9])) == _u64(1, 2, 3)
    t.remove(2, [1])
    assert t.compact(2, _u64(1, 2, 3, 2)) == _u64(2, 3)


def test_drop_removes_a_column_everywhere_its_log_says_and_its_repeats(native):
    t = block_table(16, native=native)
    t.store(0, [1, 2, 2])
    t.store(65, [2, 3, 3])
    t.drop(65, array("Q", [2, 3, 3]))
    assert t.snapshot() == ({1: 1, 2: 1}, {(2, 0): 1})


def test_lookup_masks_per_owner_and_only_kept_columns(native):
    t = block_table(16, native=native)
    owner: list = [("a", 0), ("a", 1), None, ("b", 0)]
    t.store(0, [10, 11, 12])
    t.store(1, [11])
    t.store(2, [10])  # a column without an owner entry is left out
    t.store(3, [12, 13])
    assert t.lookup([10, 11, 12, 13], -1, owner) == {"a": {0: 0b111, 1: 0b10}, "b": {0: 0b1100}}
    assert t.lookup([10, 11, 12, 13], 0b1000, owner) == {"b": {0: 0b1100}}
    assert t.lookup([99], -1, owner) == {}


def test_trim_interned_only_loses_sharing(native):
    t = block_table(16, native=native)
    t.store(10, [1, 2])
    t.trim_interned(0)
    t.store(11, [1])
    t.store(11, [2])
    assert t.holders(1) == t.holders(2) == (1 << 10) | (1 << 11)


def test_the_c_table_leaves_hashes_it_does_not_take_to_the_caller():
    _need_c()
    t = block_table(16, native=True)
    assert t.store(3, [1, -1]) is None
    assert t.remove(3, [1, 2**64]) is None
    assert t.store(3, (1, 2)) is None  # only lists
    assert t.lookup([7, b"x"], -1, []) is None
    assert len(t) == 0
    with pytest.raises(ValueError):
        t.store(-1, [1])
    with pytest.raises(TypeError):
        table._native.BlockTable(None, 8)


def test_reference_converts_as_it_goes():
    t = PyBlockTable(columns_of, 16)
    digest = bytes(range(32))
    wire = int.from_bytes(digest[-8:], "big")
    assert t.store(0, [digest]) == (1, _u64(wire))
    assert t.remove(0, [digest]) == (1, 1)


# ---- differential: random streams through a MemoryIndex on each table -------------------


@pytest.mark.parametrize("seed", range(4))
def test_random_streams_leave_the_same_state_on_both_tables(seed: int) -> None:
    _need_c()
    rng = random.Random(seed)
    c, py = MemoryIndex(native=True), MemoryIndex(native=False)
    instances = [f"i{k}" for k in range(18)]  # x 2 groups x 2 tiers: 72 columns
    pool = [rng.getrandbits(64) for _ in range(120)] + [0, 1, 2**64 - 1]
    widest = 0
    for step in range(1500):
        inst = rng.choice(instances)
        group, medium = rng.choice([0, 1]), rng.choice(["GPU", "CPU"])
        hashes = [rng.choice(pool) for _ in range(rng.randint(0, 12))]
        op = rng.random()
        if op < 0.5:
            ev = stored(hashes, group, medium)
        elif op < 0.95:
            ev = removed(hashes, group, medium)
        elif op < 0.97:
            ev = stored([-1, b"\x00" * 31 + b"\x07", *hashes], group, medium)  # converted
        else:
            ev = AllBlocksCleared()
        b = batch(ev, ts=float(step))
        assert c.apply_sync(inst, b) == py.apply_sync(inst, b), step
        if step % 100 == 0:
            assert c.snapshot() == py.snapshot(), step
            widest = max([widest, *(v.bit_length() for v in c.snapshot()[0].values())])
        if step % 50 == 0:
            query = rng.sample(pool, 40)
            cands = None if rng.random() < 0.5 else rng.sample(instances, 5)
            assert _ordered(c.lookup_sync(query, cands)) == _ordered(py.lookup_sync(query, cands))
    assert c.snapshot() == py.snapshot()
    assert c.stats() == py.stats()
    assert widest > 64  # bitsets past one machine word were exercised


def test_growth_churn_and_shrinking_leave_the_same_state_on_both_tables() -> None:
    """Tens of thousands of blocks: the C table's slots grow several times, removals
    shift probe chains back, holder sets go with their last block (their ids reused, the
    cached moves then stale), and the slots shrink once most blocks are gone."""
    _need_c()
    rng = random.Random(7)
    c, py = MemoryIndex(native=True), MemoryIndex(native=False)
    instances = [f"i{k}" for k in range(6)]
    prompts = [[rng.getrandbits(64) for _ in range(rng.randint(50, 400))] for _ in range(120)]
    held: list[tuple[str, int, list[int]]] = []
    for step in range(900):
        inst, group = rng.choice(instances), rng.choice([0, 1])
        if held and rng.random() < (0.3 if step < 500 else 0.7):
            who, g, hs = held.pop(rng.randrange(len(held)))
            b = batch(removed(hs[: rng.randint(1, len(hs))], g), ts=float(step))
            inst = who
        else:
            hs = rng.choice(prompts)[: rng.randint(1, 400)]
            held.append((inst, group, hs))
            b = batch(stored(hs, group), ts=float(step))
        assert c.apply_sync(inst, b) == py.apply_sync(inst, b), step
        if step % 150 == 0:
            query = rng.choice(prompts)
            assert c.lookup_sync(query) == py.lookup_sync(query), step
    grown = c._table.memory()["capacity"]  # type: ignore[attr-defined]
    assert c.snapshot() == py.snapshot()
    for inst in instances[:-1]:
        c.clear_sync(inst)
        py.clear_sync(inst)
    assert c.snapshot() == py.snapshot()
    assert c.stats() == py.stats()
    c.clear_sync(instances[-1])
    assert len(c._table) == 0 and grown >= 8192
    mem = c._table.memory()  # type: ignore[attr-defined]
    assert (mem["capacity"], mem["sets"]) == (1024, 0)  # shrunk back; no holder set left


def test_compaction_leaves_the_same_logs_on_both_tables() -> None:
    """A column whose log outgrows twice its live blocks is compacted: held hashes once
    each, in first-logged order, re-logged ones after a removal included once."""
    _need_c()
    rng = random.Random(9)
    c, py = MemoryIndex(native=True), MemoryIndex(native=False)
    hashes = [rng.getrandbits(64) for _ in range(300)]
    events = [stored(hashes[:10]), removed(hashes[:10]), stored(hashes[:10])]
    events += [stored(hashes[10:200]), removed(hashes[10:150]), stored(hashes[100:120])]
    events += [stored(hashes[200:]), removed(hashes[180:290]), removed(hashes[:5])]
    for i, ev in enumerate(events):
        b = batch(ev, ts=float(i))
        assert c.apply_sync("a", b) == py.apply_sync("a", b)
        assert c.snapshot() == py.snapshot(), i
    blocks, _, logs, _ = c.snapshot()
    assert logs[0] is not None and len(logs[0]) < 330  # 330 logged in all: compacted
    assert {h for h in hashes if h in blocks} <= set(logs[0])


def test_a_reset_keeps_the_cpu_tier_unconfirmed_alike_on_both_tables() -> None:
    """AllBlocksCleared drops only the GPU columns; the first CPU store of a chunk key a
    CPU column holds drops the CPU tier (vLLM's reset_external emptied it); a CPU store
    of a new key does not. Both tables end in the same state at every step."""
    _need_c()
    c, py = MemoryIndex(native=True), MemoryIndex(native=False)
    gpu, cpu, fresh = [11, 12, 13], [12, 13], [99]
    steps = [
        (batch(stored(gpu), stored(cpu, 0, "CPU"), stored(cpu, 1, "CPU")), {0: 7, 1: 6, 3: 6}),
        (batch(AllBlocksCleared()), {1: 6, 3: 6}),  # the GPU tier goes, the CPU tier stays
        (batch(stored(fresh, 0, "CPU")), {1: 14, 3: 6}),  # a new key proves nothing
        # A held key: the CPU tier was emptied (group 0's too), then the store applies.
        (batch(stored([12, 13], 1, "CPU")), {3: 6}),
    ]
    for i, (b, want) in enumerate(steps):
        assert c.apply_sync("a", b) == py.apply_sync("a", b), i
        assert c.snapshot() == py.snapshot(), i
        for idx in (c, py):
            assert dict(idx.lookup_sync([11, 12, 13, 99]).get("a", {})) == want, i


def _ordered(out: dict) -> list:
    return [(name, list(res.items())) for name, res in out.items()]


def _fleet(rng: random.Random, prompt: list[int], instances: int, native: bool) -> MemoryIndex:
    idx = MemoryIndex(native=native)
    for k in range(instances):
        for group in range(3):
            for medium in ("GPU", "CPU"):
                if rng.random() < 0.2:
                    continue  # a column this instance never had
                prefix = prompt[: rng.randint(0, len(prompt))]
                frags = rng.sample(prompt, rng.randint(0, min(40, len(prompt))))
                other = [rng.getrandbits(64) for _ in range(10)]
                idx.apply_sync(f"i{k}", batch(stored(prefix + frags + other, group, medium)))
                if rng.random() < 0.3 and prefix:
                    gone = rng.sample(prefix, rng.randint(1, len(prefix)))
                    idx.apply_sync(f"i{k}", batch(removed(gone, group, medium)))
    return idx


@pytest.mark.parametrize("seed", range(6))
def test_lookups_at_fleet_scale_agree_in_order_runs_and_transpose(seed, monkeypatch):
    """More than 64 columns and positions, prefixes and fragments, candidate subsets and
    unknown names: the C table, the reference by runs and by numpy's transpose."""
    _need_c()
    rng = random.Random(seed)
    prompt = [rng.getrandbits(64) for _ in range(rng.choice((1, 63, 64, 65, 300, 700)))]
    n = rng.choice((3, 24, 40))
    c = _fleet(random.Random(seed), prompt, n, native=True)
    py = _fleet(random.Random(seed), prompt, n, native=False)
    names = [f"i{k}" for k in range(40)]
    for _ in range(8):
        cands = None if rng.random() < 0.3 else rng.sample([*names, "nobody"], rng.randint(0, 12))
        request = prompt[: rng.randint(0, len(prompt))] + [rng.getrandbits(64)] * rng.randint(0, 3)
        want = c.lookup_sync(request, cands)
        with monkeypatch.context() as m:
            m.setattr(table, "_RUN_BITS_MAX", 1 << 30)
            runs = py.lookup_sync(request, cands)
            m.setattr(table, "_RUN_BITS_MAX", 0)
            transposed = py.lookup_sync(request, cands)
        assert _ordered(want) == _ordered(runs)
        assert transposed == runs


def test_equal_holder_sets_that_are_distinct_objects_form_one_run(native):
    # The reference drops its interning past a limit: blocks then hold equal bitsets as
    # different objects; runs are of equal values (itertools.groupby's ==), not of one
    # object. (The C table stores each holder set once: nothing to drop.)
    idx = MemoryIndex(native=native)
    for k in range(10):  # "a" gets column 10: its bitset is not one of CPython's small ints
        idx.apply_sync(f"z{k}", batch(stored([1000 + k])))
    hashes = list(range(1, 101))
    idx.apply_sync("a", batch(stored(hashes)))
    idx._table.trim_interned(0)
    idx.apply_sync("b", batch(stored(hashes[50:])))
    idx.apply_sync("b", batch(removed(hashes[50:])))
    assert idx.holders(1) == idx.holders(60)
    assert native or idx.holders(1) is not idx.holders(60)
    assert _ordered(idx.lookup_sync(hashes)) == [("a", [(0, (1 << 100) - 1)])]


def test_lookups_of_tuples_and_digests_are_converted(native):
    idx = MemoryIndex(native=native)
    idx.apply_sync("a", batch(stored([7, 8, 9])))
    for request in ([7, 8, 9], (7, 8, 9)):
        assert idx.lookup_sync(request, ["a"]) == {"a": {0: 0b111}}
    assert idx.lookup_sync([], ["a"]) == {}
