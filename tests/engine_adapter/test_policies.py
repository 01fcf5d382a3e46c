"""CPU tier eviction policies: LRU and ARC over chunk keys."""

from __future__ import annotations

import pytest

from engine_adapter.offload.policies import ARCPolicy, Chunk, LRUPolicy, make_policy


def ready(slot: int) -> Chunk:
    chunk = Chunk(slot)
    chunk.ref_cnt = 0
    return chunk


def test_lru_evicts_least_recent_idle_unprotected_chunks() -> None:
    lru = LRUPolicy(8)
    for key in "abcde":
        lru.insert(key, ready(ord(key)))
    lru.get("a").ref_cnt = 1  # being loaded
    lru.get("c").ref_cnt = -1  # being written
    victims = lru.evict(2, protected={"b"})
    assert [k for k, _ in victims] == ["d", "e"]
    assert lru.get("d") is None and len(lru) == 3


def test_lru_eviction_is_all_or_nothing() -> None:
    lru = LRUPolicy(4)
    for key in "ab":
        lru.insert(key, ready(0))
    assert lru.evict(3, protected=set()) is None
    assert len(lru) == 2


def test_lru_touch_makes_a_prefix_head_most_recent() -> None:
    lru = LRUPolicy(8)
    for key in "abcd":
        lru.insert(key, ready(0))
    lru.touch(["c", "d"])  # walked in reverse: c ends most recent
    assert [k for k, _ in lru.items()] == ["a", "b", "d", "c"]


def test_arc_promotes_ready_chunks_on_second_use() -> None:
    arc = ARCPolicy(4)
    arc.insert("a", ready(0))
    pending = Chunk(1)  # store not finished: a touch is not a second use
    arc.insert("b", pending)
    arc.touch(["a", "b"])
    assert "a" in arc.t2 and "b" in arc.t1


def test_arc_evicts_from_t1_to_b1_and_adapts_on_ghost_hits() -> None:
    arc = ARCPolicy(2)
    arc.insert("a", ready(0))
    arc.insert("b", ready(1))
    arc.touch(["b"])  # b -> T2
    victims = arc.evict(1, protected=set())
    assert [k for k, _ in victims] == ["a"] and "a" in arc.b1
    assert arc.target_t1_size == 0
    arc.touch(["a"])  # ghost hit in B1: favour recency
    assert arc.target_t1_size == 1
    arc.insert("a", ready(0))
    assert "a" in arc.t1 and "a" not in arc.b1
    # |T1| = 1 >= target 1: evict from T1 again; then T2 once T1 is below target.
    assert [k for k, _ in arc.evict(1, protected=set())] == ["a"]
    assert [k for k, _ in arc.evict(1, protected=set())] == ["b"] and "b" in arc.b2
    arc.touch(["b"])  # ghost hit in B2: favour frequency
    assert arc.target_t1_size == 0


def test_make_policy_rejects_unknown_names() -> None:
    assert isinstance(make_policy("arc", 4), ARCPolicy)
    with pytest.raises(ValueError):
        make_policy("fifo", 4)
