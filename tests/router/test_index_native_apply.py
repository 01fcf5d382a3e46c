"""The memory index's C event application (``events._native.index_store`` /
``index_remove``) leaves exactly the state the Python path does: the same bitsets, repeat
counts, logs and counts, under random streams of stores, repeats, removals of held and
unknown blocks and clears, over more than 64 columns (bitsets past one machine word), and
hashes it leaves to Python (bytes, negative ints)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import pytest
from routerkit import batch, need_native, removed, stored

from events.structs import AllBlocksCleared
from router.index import memory
from router.index.memory import MemoryIndex


@pytest.fixture(autouse=True)
def _built() -> None:
    need_native(
        None not in (memory._index_store, memory._index_remove, memory._index_compact),
        "events._native.index_store/index_remove/index_compact",
    )


@contextlib.contextmanager
def python_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The index's pure-Python event application, for the duration."""
    with monkeypatch.context() as m:
        for name in ("_index_store", "_index_remove", "_index_compact"):
            m.setattr(memory, name, None)
        yield


def _state(idx: MemoryIndex) -> tuple:
    logs = [None if log is None else log.tolist() for log in idx._logs]
    return dict(idx._blocks), dict(idx._dups), logs, list(idx._live)


@pytest.mark.parametrize("seed", range(4))
def test_native_apply_leaves_the_python_paths_state(seed: int, monkeypatch) -> None:
    rng = random.Random(seed)
    native, python = MemoryIndex(), MemoryIndex()
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
            ev = stored([-1, b"\x00" * 31 + b"\x07", *hashes], group, medium)  # Python path
        else:
            ev = AllBlocksCleared()
        b = batch(ev, ts=float(step))
        got = native.apply_sync(inst, b)
        with python_path(monkeypatch):
            want = python.apply_sync(inst, b)
        assert got == want, step
        if step % 100 == 0:
            assert _state(native) == _state(python), step
            widest = max([widest, *(v.bit_length() for v in native._blocks.values())])
    assert _state(native) == _state(python)
    assert native.stats() == python.stats()
    assert widest > 64  # bitsets past one machine word were exercised
    query = pool[:40]
    assert native.lookup_sync(query, instances) == python.lookup_sync(query, instances)


def test_native_apply_leaves_odd_inputs_to_python() -> None:
    from events.native import native

    assert native.index_store({}, {}, {}, 3, [1, -1]) is None
    assert native.index_remove({}, {}, {}, 3, [1, 2**64]) is None
    assert native.index_store({}, {}, {}, 3, (1, 2)) is None  # only lists
    blocks: dict = {}
    assert native.index_store(blocks, {}, {}, 70, [5, 5]) == (2, (5).to_bytes(8, "little"))
    assert blocks == {5: 1 << 70}


def test_native_compaction_keeps_the_python_paths_log(monkeypatch) -> None:
    """A column whose log outgrows twice its live blocks is compacted: held hashes once
    each, in first-logged order, re-logged ones after a removal included once."""
    rng = random.Random(9)
    native, python = MemoryIndex(), MemoryIndex()
    hashes = [rng.getrandbits(64) for _ in range(300)]
    # hashes[:10] logged twice (stored, removed, stored: too few for a compaction between)
    events = [stored(hashes[:10]), removed(hashes[:10]), stored(hashes[:10])]
    events += [stored(hashes[10:200]), removed(hashes[10:150]), stored(hashes[100:120])]
    events += [stored(hashes[200:]), removed(hashes[180:290]), removed(hashes[:5])]
    for i, ev in enumerate(events):
        b = batch(ev, ts=float(i))
        got = native.apply_sync("a", b)
        with python_path(monkeypatch):
            want = python.apply_sync("a", b)
        assert got == want
        assert _state(native) == _state(python), i
    log = native._logs[0]
    assert log is not None and len(log) < 330  # 330 logged in all: compacted on the way
    assert {h for h in hashes if h in native._blocks} <= set(log)
