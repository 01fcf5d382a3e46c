"""The speculative store's bookkeeping: refcounts per class of groups, prefixes found by
bisection. Checked against a plain model (every live request's blocks, per group) under
random interleavings of record, settle, flush, release, expiry and forget, on the C
refcount table (``router._refcounts``, where built) and on its Python reference."""

from __future__ import annotations

import importlib.util
import os
import random
from array import array
from collections import Counter

import pytest

from router.index.base import Tier, slot_of
from router.prediction.speculative import PyRefCounts, SpeculativeResidency, refcounts_type

BUILT = importlib.util.find_spec("router._refcounts") is not None
TABLES = [PyRefCounts]
if BUILT:
    from router._refcounts import RefCounts

    TABLES.append(RefCounts)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _chain(root: int, n: int) -> list[int]:
    """Distinct hashes naming their prefix, as vLLM's chained block hashes do."""
    out, h = [], root
    for i in range(n):
        h = hash((h, i)) & (2**63 - 1)
        out.append(h)
    return out


def _model(live: list, block_hashes: list[int], instances: list[str]) -> dict:
    out: dict = {}
    pos = {h: i for i, h in enumerate(block_hashes)}
    for inst, held in live:
        if inst not in instances:
            continue
        for g, hs in held.items():
            mask = sum(1 << pos[h] for h in hs if h in pos)
            if mask:
                res = out.setdefault(inst, {})
                slot = slot_of(g, int(Tier.GPU))
                res[slot] = res.get(slot, 0) | mask
    return out


@pytest.mark.parametrize("table", TABLES)
def test_residency_matches_a_plain_model_under_random_operations(table: type) -> None:
    rng = random.Random(7)
    clock = Clock()
    spec = SpeculativeResidency(ttl_s=2.0, clock=clock, table=table)
    roots = [_chain(r, 12) for r in range(3)]
    instances = ["a", "b", "c"]
    handles: list = []  # (handle, instance, held, expiry, state)
    for _ in range(3000):
        clock.t += rng.choice([0.0, 0.01, 0.3])
        op = rng.random()
        if op < 0.4:
            root = rng.choice(roots)
            prompt = root[: rng.randint(1, 12)] + _chain(rng.getrandbits(32), rng.randint(0, 6))
            tails = prompt[-2:] if len(prompt) > 2 else prompt
            held = {0: tails, 3: prompt} if rng.random() < 0.7 else {0: prompt}
            whole = 0b1000 if 3 in held else 0b1
            inst = rng.choice(instances)
            h = spec.record(inst, held, whole)
            handles.append([h, inst, held, clock.t + 2.0, "live"])
        elif op < 0.55 and handles:
            e = rng.choice(handles)
            spec.settle(e[1], e[0])
            if e[4] == "live" and e[3] > clock.t:
                e[4] = "settled"
        elif op < 0.7:
            inst = rng.choice(instances)
            spec.flush(inst)
            for e in handles:
                if e[1] == inst and e[4] == "settled":
                    e[4] = "gone"
        elif op < 0.8 and handles:
            e = rng.choice(handles)
            spec.release(e[1], e[0])
            e[4] = "gone"
        elif op < 0.81:
            inst = rng.choice(instances)
            spec.forget(inst)
            for e in handles:
                if e[1] == inst:
                    e[4] = "gone"
        else:
            root = rng.choice(roots)
            query = root[: rng.randint(1, 12)] + _chain(rng.getrandbits(32), rng.randint(0, 3))
            live = [(e[1], e[2]) for e in handles if e[4] != "gone" and e[3] > clock.t]
            assert spec.residency(query, instances) == _model(live, query, instances)


@pytest.mark.parametrize("table", TABLES)
def test_a_released_request_leaves_no_group_behind(table: type) -> None:
    """Two requests sharing blocks under different groups: releasing one drops its groups
    (entries merged per block would keep them after a release, crediting those groups)."""
    spec = SpeculativeResidency(ttl_s=2.0, clock=Clock(), table=table)
    blocks = _chain(1, 4)
    before = spec.record("a", {0: blocks}, whole=0b1)  # assumed full attention in group 0
    after = spec.record("a", {0: blocks[-1:], 1: blocks}, whole=0b10)  # learned: window + full
    spec.release("a", before)
    assert spec.residency(blocks, ["a"]) == {"a": {0: 0b1000, 2: 0b1111}}
    spec.release("a", after)
    spec.release("a", after)  # twice: nothing more
    assert spec.residency(blocks, ["a"]) == {}
    assert len(spec) == 0


@pytest.mark.parametrize("table", TABLES)
def test_a_prefix_is_found_inside_a_longer_prompt(table: type) -> None:
    """A query longer than what is held, or branching off it, sees the shared prefix."""
    spec = SpeculativeResidency(ttl_s=2.0, clock=Clock(), table=table)
    prompt = _chain(5, 10)
    spec.record("a", {0: prompt}, whole=0b1)
    branch = prompt[:6] + _chain(99, 9)
    assert spec.residency(branch, ["a", "b"]) == {"a": {0: (1 << 6) - 1}}
    assert spec.residency(prompt + _chain(3, 5), ["a"]) == {"a": {0: (1 << 10) - 1}}
    assert spec.residency(_chain(6, 3), ["a"]) == {}


@pytest.mark.parametrize("table", TABLES)
def test_the_refcount_table_matches_a_counter(table: type) -> None:
    """Random adds and removes, lists and uint64 arrays, through growth and shrinking
    (the C table's probing, backward-shift deletion and resizing): every count, the
    length, prefix and mask agree with a Counter."""
    rng = random.Random(3)
    t, want = table(), Counter()
    # Few distinct keys in a small range besides random ones: long probe runs, collisions.
    pool = [rng.getrandbits(64) for _ in range(300)] + list(range(40)) + [0, 2**64 - 1]
    held: list[list[int]] = []
    for step in range(4000):
        if rng.random() < 0.55 or not held:
            hs = [rng.choice(pool) for _ in range(rng.randint(0, 40))]
            t.add(hs if rng.random() < 0.5 else array("Q", hs))
            want.update(hs)
            held.append(hs)
        else:
            hs = held.pop(rng.randrange(len(held)))
            t.remove(hs)
            want.subtract(hs)
            want = +want
        if step % 50 == 0 or not held:
            assert len(t) == len(want)
            assert all(t.count(h) == want[h] for h in pool)
            assert all((h in t) == (h in want) for h in pool)
            query = [rng.choice(pool) for _ in range(70)]
            assert t.mask(query) == sum(1 << i for i, h in enumerate(query) if h in want)
    for hs in held:
        t.remove(hs)
    assert len(t) == 0 and t.mask(pool) == 0


@pytest.mark.parametrize("table", TABLES)
def test_the_refcount_table_bisects_chains_and_rejects_what_is_not_a_hash(table: type) -> None:
    t = table()
    chain = _chain(9, 100)
    t.add(chain[:37])
    t.add(chain[:5])
    assert [t.prefix(q) for q in (chain, chain[:37], chain[:3], [], _chain(8, 4))] == [
        37,
        37,
        3,
        0,
        0,
    ]
    assert t.prefix(array("Q", chain)) == 37
    t.remove(chain[:37])
    assert t.prefix(chain) == 5 and len(t) == 5
    with pytest.raises(KeyError):
        t.remove(chain[5:6])
    if table is not PyRefCounts:  # the reference takes any key; the C table only u64
        with pytest.raises(OverflowError):
            t.add([-1])
        with pytest.raises(TypeError):
            t.add(["a"])
        with pytest.raises(TypeError):
            t.mask(array("I", [1, 2]))
        assert t.count(-1) == 0 and (2**70 in t) is False


def test_the_c_table_is_in_use_when_built() -> None:
    """The store uses router._refcounts where it is built (KVROUTE_REQUIRE_NATIVE=1, set by
    scripts/test.sh where a compiler is present, makes a missing build a failure)."""
    if os.environ.get("KVROUTE_REQUIRE_NATIVE") == "1":
        assert BUILT, "router._refcounts was not built: pip install -e . (needs cc)"
    if not BUILT:
        pytest.skip("router._refcounts is not built")
    if os.environ.get("KVROUTE_NO_NATIVE"):
        assert refcounts_type() is PyRefCounts
        return
    assert refcounts_type() is RefCounts
    assert SpeculativeResidency(2.0)._table is RefCounts
