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


def test_lru_finished_request_makes_its_prefix_head_most_recent() -> None:
    # vLLM's LRUCachePolicy.on_request_finished: re-ranked from the tail, head last.
    lru = LRUPolicy(8)
    for key in "abcd":
        lru.insert(key, ready(0))
    lru.on_request_finished(["c", "d", "x"], {"c"}, {"d"})  # x: not cached, ignored
    assert [k for k, _ in lru.items()] == ["a", "b", "d", "c"]
    lru.on_store_miss(["a"])  # LRU: no effect
    assert [k for k, _ in lru.items()] == ["a", "b", "d", "c"]


def test_arc_promotes_reused_chunks_only_when_their_request_finishes() -> None:
    # vLLM's ARCCachePolicy.on_request_finished: a reuse is a second access; a chunk the
    # request only inserted stays in T1 (moved to its MRU end).
    arc = ARCPolicy(4)
    arc.insert("a", ready(0))
    arc.insert("b", ready(1))
    arc.insert("c", ready(2))
    arc.on_request_finished(["a", "b"], inserted_only={"a"}, reused={"b"})
    assert list(arc.t1) == ["c", "a"] and list(arc.t2) == ["b"]


def test_arc_evicts_from_t1_to_b1_and_adapts_on_ghost_hits() -> None:
    arc = ARCPolicy(2)
    arc.insert("a", ready(0))
    arc.insert("b", ready(1))
    arc.on_request_finished(["b"], set(), {"b"})  # b -> T2
    victims = arc.evict(1, protected=set())
    assert [k for k, _ in victims] == ["a"] and "a" in arc.b1
    assert arc.target_t1_size == 0
    arc.on_store_miss(["a"])  # ghost hit in B1: favour recency
    assert arc.target_t1_size == 1
    arc.insert("a", ready(0))
    assert "a" in arc.t1 and "a" not in arc.b1
    # |T1| = 1 >= target 1: evict from T1 again; then T2 once T1 is below target.
    assert [k for k, _ in arc.evict(1, protected=set())] == ["a"]
    assert [k for k, _ in arc.evict(1, protected=set())] == ["b"] and "b" in arc.b2
    arc.on_store_miss(["b"])  # ghost hit in B2: favour frequency
    assert arc.target_t1_size == 0


def test_make_policy_rejects_unknown_names() -> None:
    assert isinstance(make_policy("arc", 4), ARCPolicy)
    with pytest.raises(ValueError):
        make_policy("fifo", 4)
