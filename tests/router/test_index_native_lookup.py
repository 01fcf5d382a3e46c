"""The memory index's C lookup (``events._native.column_masks``) gives the Python path's
answer, in the same order, at fleet scale: more than 64 columns and positions (several
64-bit words), prefixes and fragments, candidate subsets, unknown names, holder sets
equal in value but not interned to one object, and inputs it leaves to Python."""

from __future__ import annotations

import random

import pytest
from routerkit import batch, need_native, removed, stored

from router.index import memory
from router.index.memory import MemoryIndex


@pytest.fixture(autouse=True)
def _built() -> None:
    need_native(memory._column_masks is not None, "events._native.column_masks")


MEDIA = ("GPU", "CPU")


def _both(idx: MemoryIndex, hashes, instances, monkeypatch) -> tuple[dict, dict]:
    """The native answer and the Python path's by runs (its order: numpy's transpose,
    taken for fragmented residency, gives the same dict in column order)."""
    native = idx.lookup_sync(hashes, instances)
    with monkeypatch.context() as m:
        m.setattr(memory, "_column_masks", None)
        transposed = idx.lookup_sync(hashes, instances)
        m.setattr(memory, "_RUN_BITS_MAX", 1 << 30)
        python = idx.lookup_sync(hashes, instances)
    assert transposed == python
    return native, python


def _ordered(out: dict) -> list:
    return [(name, list(res.items())) for name, res in out.items()]


def _fleet(rng: random.Random, prompt: list[int], instances: int) -> MemoryIndex:
    idx = MemoryIndex()
    for k in range(instances):
        for group in range(3):
            for medium in MEDIA:
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
def test_native_lookup_equals_the_python_path_at_fleet_scale(seed, monkeypatch):
    rng = random.Random(seed)
    prompt = [rng.getrandbits(64) for _ in range(rng.choice((1, 63, 64, 65, 300, 700)))]
    idx = _fleet(rng, prompt, instances=rng.choice((3, 24, 40)))
    names = [f"i{k}" for k in range(40)]
    for _ in range(8):
        cands = None if rng.random() < 0.3 else rng.sample([*names, "nobody"], rng.randint(0, 12))
        request = prompt[: rng.randint(0, len(prompt))] + [rng.getrandbits(64)] * rng.randint(0, 3)
        native, python = _both(idx, request, cands, monkeypatch)
        assert _ordered(native) == _ordered(python)


def test_equal_holder_sets_that_are_distinct_objects_form_one_run(monkeypatch):
    # Interning is dropped past _INTERN_MAX: blocks then hold equal bitsets as different
    # objects; runs are of equal values (itertools.groupby's ==), not of one object.
    idx = MemoryIndex()
    for k in range(10):  # "a" gets column 10: its bitset is not one of CPython's small ints
        idx.apply_sync(f"z{k}", batch(stored([1000 + k])))
    hashes = list(range(1, 101))
    idx.apply_sync("a", batch(stored(hashes)))
    idx._ints.clear()
    idx.apply_sync("b", batch(stored(hashes[50:])))
    idx.apply_sync("b", batch(removed(hashes[50:])))
    blocks = idx._blocks
    assert blocks[1] == blocks[60] and blocks[1] is not blocks[60]
    native, python = _both(idx, hashes, None, monkeypatch)
    assert _ordered(native) == _ordered(python) == [("a", [(0, (1 << 100) - 1)])]


def test_inputs_it_does_not_take_go_to_the_python_path(monkeypatch):
    idx = MemoryIndex()
    idx.apply_sync("a", batch(stored([7, 8, 9])))
    assert memory._column_masks(idx._blocks, [7, b"x"], -1, {}, memory._columns, 8, []) is None
    for request in ([7, 8, 9], (7, 8, 9), [7, True, 9], []):
        native, python = _both(idx, request, ["a"], monkeypatch)
        assert native == python
    assert idx.lookup_sync([7, 8, 9], ["a"]) == {"a": {0: 0b111}}
