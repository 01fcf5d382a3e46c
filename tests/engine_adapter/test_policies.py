"""CPU tier eviction policies: LRU and ARC over chunk keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from engine_adapter.offload.policies import (
    ARCPolicy,
    Chunk,
    LRUPolicy,
    RankedLRUPolicy,
    make_policy,
)


@dataclass
class Req:
    """A request's accesses as the manager keeps them (``_ReqState``)."""

    keys_seen: dict[Any, int] = field(default_factory=dict)
    lru_rank: int | None = None


NOREQ = Req()


def ready(slot: int) -> Chunk:
    chunk = Chunk(slot)
    chunk.ref_cnt = 0
    return chunk


def test_lru_evicts_least_recent_idle_unprotected_chunks() -> None:
    lru = LRUPolicy(8)
    for key in "abcde":
        lru.insert(key, ready(ord(key)), NOREQ)
    lru.get("a").ref_cnt = 1  # being loaded
    lru.get("c").ref_cnt = -1  # being written
    victims = lru.evict(2, protected={"b"})
    assert [k for k, _ in victims] == ["d", "e"]
    assert lru.get("d") is None and len(lru) == 3


def test_lru_eviction_is_all_or_nothing() -> None:
    lru = LRUPolicy(4)
    for key in "ab":
        lru.insert(key, ready(0), NOREQ)
    assert lru.evict(3, protected=set()) is None
    assert len(lru) == 2


def test_lru_finished_request_makes_its_prefix_head_most_recent() -> None:
    # vLLM's LRUCachePolicy.on_request_finished: re-ranked from the tail, head last.
    lru = LRUPolicy(8)
    for key in "abcd":
        lru.insert(key, ready(0), NOREQ)
    lru.on_request_finished(["c", "d", "x"], {"c"}, {"d"})  # x: not cached, ignored
    assert [k for k, _ in lru.items()] == ["a", "b", "d", "c"]
    lru.on_store_miss(["a"])  # LRU: no effect
    assert [k for k, _ in lru.items()] == ["a", "b", "d", "c"]


def test_arc_promotes_reused_chunks_only_when_their_request_finishes() -> None:
    # vLLM's ARCCachePolicy.on_request_finished: a reuse is a second access; a chunk the
    # request only inserted stays in T1 (moved to its MRU end).
    arc = ARCPolicy(4)
    arc.insert("a", ready(0), NOREQ)
    arc.insert("b", ready(1), NOREQ)
    arc.insert("c", ready(2), NOREQ)
    arc.on_request_finished(["a", "b"], inserted_only={"a"}, reused={"b"})
    assert list(arc.t1) == ["c", "a"] and list(arc.t2) == ["b"]


def test_arc_evicts_from_t1_to_b1_and_adapts_on_ghost_hits() -> None:
    arc = ARCPolicy(2)
    arc.insert("a", ready(0), NOREQ)
    arc.insert("b", ready(1), NOREQ)
    arc.on_request_finished(["b"], set(), {"b"})  # b -> T2
    victims = arc.evict(1, protected=set())
    assert [k for k, _ in victims] == ["a"] and "a" in arc.b1
    assert arc.target_t1_size == 0
    arc.on_store_miss(["a"])  # ghost hit in B1: favour recency
    assert arc.target_t1_size == 1
    arc.insert("a", ready(0), NOREQ)
    assert "a" in arc.t1 and "a" not in arc.b1
    # |T1| = 1 >= target 1: evict from T1 again; then T2 once T1 is below target.
    assert [k for k, _ in arc.evict(1, protected=set())] == ["a"]
    assert [k for k, _ in arc.evict(1, protected=set())] == ["b"] and "b" in arc.b2
    arc.on_store_miss(["b"])  # ghost hit in B2: favour frequency
    assert arc.target_t1_size == 0


def test_lru_033_ranks_a_running_request_once_tails_first_until_it_finishes() -> None:
    # vLLM 0.33's LRUCachePolicy: a running request's chunks share its provisional rank,
    # ordered tail before head; a later request's access lifts a chunk to its own rank;
    # on_request_finished commits fresh ranks from the tail.
    lru = RankedLRUPolicy(8)
    a = Req({"a1": 64, "a2": 128, "a3": 192})
    for i, key in enumerate(["a1", "a2", "a3"]):
        lru.on_request_access([key], a)
        lru.insert(key, ready(i), a)
    b = Req({"b1": 128, "a1": 64})
    lru.on_request_access(["b1"], b)  # not cached yet: only b's rank is drawn
    lru.insert("b1", ready(3), b)
    lru.on_request_access(["a1"], b)  # b reads a1: a1 takes b's rank
    assert [k for k, _ in lru.evict(4, protected=set())] == ["a3", "a2", "b1", "a1"]
    for i, key in enumerate(["a1", "a2", "a3"]):
        lru.insert(key, ready(i), a)
    lru.on_request_finished(["a1", "a2", "a3"], set(), set())
    c = Req({"c1": 64})
    lru.insert("c1", ready(4), c)  # c's rank is drawn after a's commit: most recent
    assert [k for k, _ in lru.evict(2, protected={"a3"})] == ["a2", "a1"]
    assert lru.evict(3, protected=set()) is None and len(lru) == 2


def test_lru_033_ties_go_by_hash_then_group() -> None:
    lru = RankedLRUPolicy(4)
    r = Req({(b"y", 0): 16, (b"x", 1): 16, (b"x", 0): 16})
    for key in [(b"y", 0), (b"x", 1), (b"x", 0)]:
        lru.insert(key, ready(0), r)
    assert [k for k, _ in lru.evict(3, set())] == [(b"x", 0), (b"x", 1), (b"y", 0)]


def test_make_policy_rejects_unknown_names() -> None:
    assert isinstance(make_policy("arc", 4), ARCPolicy)
    assert isinstance(make_policy("lru", 4), RankedLRUPolicy)
    assert isinstance(make_policy("lru", 4, "0.32"), LRUPolicy)
    with pytest.raises(ValueError):
        make_policy("fifo", 4)
