"""Eviction policies for the CPU tier: LRU and ARC, over chunk keys, as vLLM runs them.

vLLM: ``vllm/v1/kv_offload/cpu/policies/{lru,arc}.py`` behind ``CPUOffloadingManager``.
A chunk is readable once its store copy completed (``ref_cnt >= 0``), evictable only when
idle (``ref_cnt == 0``: not being written, not being loaded). A lookup never changes
recency. What does:

* ``insert`` (``prepare_store``): a new chunk is the most recent (LRU) / enters T1 (ARC),
  in the order the store offered its keys;
* ``on_store_miss`` (``prepare_store``, once per key and request): ARC adapts its target
  on a ghost (B1/B2) hit; LRU ignores it;
* ``on_request_finished`` (``CPUOffloadingManager.on_request_finished``, when the request
  finishes): the keys the request stored or reused, all groups in head-to-tail order
  (``order_request_keys``), are re-ranked from the tail, so the prompt's head ends most
  recent; ARC promotes reused chunks to T2 and leaves chunks the request only inserted
  in T1.

``evict`` is atomic (all ``n`` victims or nothing) and never picks a ``protected`` key
(the keys of the store being prepared).

vLLM 0.33 changed LRU only (``LRUCachePolicy``, :class:`RankedLRUPolicy`): recency is a rank
``(request rank, -token position)``. A running request takes one provisional rank at its
first access (``_get_request_rank``); every chunk it inserts or first accesses
(``on_request_access``, reported by ``CPUOffloadingManager._record_request_cache_access``)
gets that rank, the tail before the head, and keeps it until some later request's rank or
a commit passes it; ``on_request_finished`` commits the request's keys with fresh ranks
from the tail, as 0.32 does. Ties (the same chunk position in several groups) go by key:
hash, then group. ARC's 0.33 code is 0.32's (``on_request_access`` is the base no-op).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any, Protocol

__all__ = [
    "ARCPolicy",
    "CachePolicy",
    "Chunk",
    "LRUPolicy",
    "RankedLRUPolicy",
    "RequestAccess",
    "make_policy",
]

Key = Hashable


class Chunk:
    """One CPU slot: ``ref_cnt`` -1 while its store copy runs, >0 while loads read it."""

    __slots__ = ("ref_cnt", "slot")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.ref_cnt = -1

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


class RequestAccess(Protocol):
    """What a policy reads of a request (vLLM's ``ReqContext``): the end token of each
    key it accessed, and the slot for its LRU rank."""

    keys_seen: dict[Any, int]
    lru_rank: int | None


class CachePolicy(Protocol):
    def get(self, key: Key) -> Chunk | None: ...
    def insert(self, key: Key, chunk: Chunk, req: RequestAccess) -> None: ...
    def on_request_access(self, keys: Sequence[Key], req: RequestAccess) -> None: ...
    def remove(self, key: Key) -> None: ...
    def on_store_miss(self, keys: Sequence[Key]) -> None: ...
    def on_request_finished(
        self, keys: Sequence[Key], inserted_only: set[Key], reused: set[Key]
    ) -> None: ...
    def evict(self, n: int, protected: set[Key]) -> list[tuple[Key, Chunk]] | None: ...
    def clear(self) -> None: ...
    def items(self) -> Iterator[tuple[Key, Chunk]]: ...
    def __len__(self) -> int: ...


def _pick(entries: Iterable[tuple[Key, Chunk]], protected: set[Key]) -> Iterator[Key]:
    for key, chunk in entries:
        if chunk.ref_cnt == 0 and key not in protected:
            yield key


class LRUPolicy:
    """Least recently inserted / re-ranked idle chunk goes first (``LRUCachePolicy``:
    its ranks are the order of this dict)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._chunks: OrderedDict[Key, Chunk] = OrderedDict()

    def get(self, key: Key) -> Chunk | None:
        return self._chunks.get(key)

    def insert(self, key: Key, chunk: Chunk, req: RequestAccess) -> None:
        self._chunks[key] = chunk

    def on_request_access(self, keys: Sequence[Key], req: RequestAccess) -> None:
        return  # 0.32 has no such hook

    def remove(self, key: Key) -> None:
        self._chunks.pop(key, None)

    def on_store_miss(self, keys: Sequence[Key]) -> None:
        return  # LRU's touch of keys not yet cached is a no-op

    def on_request_finished(
        self, keys: Sequence[Key], inserted_only: set[Key], reused: set[Key]
    ) -> None:
        chunks = self._chunks
        for key in reversed(keys):
            if key in chunks:
                chunks.move_to_end(key)

    def evict(self, n: int, protected: set[Key]) -> list[tuple[Key, Chunk]] | None:
        if n <= 0:
            return []
        victims: list[Key] = []
        for key in _pick(self._chunks.items(), protected):
            victims.append(key)
            if len(victims) == n:
                break
        if len(victims) < n:
            return None
        return [(key, self._chunks.pop(key)) for key in victims]

    def clear(self) -> None:
        self._chunks.clear()

    def items(self) -> Iterator[tuple[Key, Chunk]]:
        return iter(self._chunks.items())

    def __len__(self) -> int:
        return len(self._chunks)


class ARCPolicy:
    """Adaptive Replacement Cache: T1 (seen once), T2 (seen again), ghosts B1/B2.

    A ghost hit (a touched key that was recently evicted) moves ``target_t1_size``:
    towards recency on a B1 hit, towards frequency on a B2 hit. Eviction takes from T1
    while it is at least its target, else from T2.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.target_t1_size = 0.0
        self.t1: OrderedDict[Key, Chunk] = OrderedDict()
        self.t2: OrderedDict[Key, Chunk] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def get(self, key: Key) -> Chunk | None:
        chunk = self.t1.get(key)
        return chunk if chunk is not None else self.t2.get(key)

    def insert(self, key: Key, chunk: Chunk, req: RequestAccess) -> None:
        self.t1[key] = chunk
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: Key) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def _adapt_to_ghost_hit(self, key: Key) -> None:
        if key in self.b1:
            delta = max(1.0, len(self.b2) / len(self.b1))
            self.target_t1_size = min(self.target_t1_size + delta, float(self.capacity))
            self.b1.move_to_end(key)
        elif key in self.b2:
            delta = max(1.0, len(self.b1) / len(self.b2))
            self.target_t1_size = max(self.target_t1_size - delta, 0.0)
            self.b2.move_to_end(key)

    def on_store_miss(self, keys: Sequence[Key]) -> None:
        for key in reversed(keys):
            self._adapt_to_ghost_hit(key)

    def on_request_access(self, keys: Sequence[Key], req: RequestAccess) -> None:
        return  # ARC keeps the base no-op in 0.33

    def on_request_finished(
        self, keys: Sequence[Key], inserted_only: set[Key], reused: set[Key]
    ) -> None:
        for key in reversed(keys):
            if key in inserted_only:  # a store is not a second use
                if key in self.t1:
                    self.t1.move_to_end(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)
            elif key in reused and key in self.t1:
                self.t2[key] = self.t1.pop(key)
            elif key in reused and key in self.t2:
                self.t2.move_to_end(key)

    def evict(self, n: int, protected: set[Key]) -> list[tuple[Key, Chunk]] | None:
        if n <= 0:
            return []
        t1_iter = _pick(self.t1.items(), protected)
        t2_iter = _pick(self.t2.items(), protected)
        chosen: list[tuple[Key, bool]] = []
        virtual_t1 = len(self.t1)
        for _ in range(n):
            key = None
            from_t1 = False
            if virtual_t1 >= int(self.target_t1_size):
                key = next(t1_iter, None)
                from_t1 = key is not None
            if key is None:
                key = next(t2_iter, None)
            if key is None:
                key = next(t1_iter, None)
                from_t1 = True
                if key is None:
                    return None
            if from_t1:
                virtual_t1 -= 1
            chosen.append((key, from_t1))
        out: list[tuple[Key, Chunk]] = []
        for key, from_t1 in chosen:
            if from_t1:
                out.append((key, self.t1.pop(key)))
                self.b1[key] = None
            else:
                out.append((key, self.t2.pop(key)))
                self.b2[key] = None
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return out

    def clear(self) -> None:
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.target_t1_size = 0.0

    def items(self) -> Iterator[tuple[Key, Chunk]]:
        yield from self.t1.items()
        yield from self.t2.items()

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


class RankedLRUPolicy:
    """vLLM 0.33's ``LRUCachePolicy``: the idle chunk with the lowest ``(rank, key)`` goes
    first. Ranks only grow; a commit and a new request's rank both draw from one counter
    (``_next_rank``), so a request still running keeps the rank it drew when it started
    and its chunks age behind everything committed since."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._chunks: dict[Key, Chunk] = {}
        self._ranks: dict[Key, tuple[int, int]] = {}
        self._next_rank = 0

    def _request_rank(self, req: RequestAccess) -> int:
        if req.lru_rank is None:  # the manager clears it when the cache is reset
            self._next_rank += 1
            req.lru_rank = self._next_rank
        return req.lru_rank

    def get(self, key: Key) -> Chunk | None:
        return self._chunks.get(key)

    def insert(self, key: Key, chunk: Chunk, req: RequestAccess) -> None:
        self._chunks[key] = chunk
        position = req.keys_seen.get(key)
        if position is None:
            self._next_rank += 1
            self._ranks[key] = (self._next_rank, 0)
        else:
            self._ranks[key] = (self._request_rank(req), -position)

    def remove(self, key: Key) -> None:
        self._chunks.pop(key, None)
        self._ranks.pop(key, None)

    def on_store_miss(self, keys: Sequence[Key]) -> None:
        return  # a touch of keys not cached: no-op

    def on_request_access(self, keys: Sequence[Key], req: RequestAccess) -> None:
        rank = self._request_rank(req)
        for key in keys:
            position = req.keys_seen.get(key)
            if position is None or key not in self._chunks:
                continue
            new = (rank, -position)
            if self._ranks[key] < new:
                self._ranks[key] = new

    def on_request_finished(
        self, keys: Sequence[Key], inserted_only: set[Key], reused: set[Key]
    ) -> None:
        for key in reversed(keys):
            if key in self._chunks:
                self._next_rank += 1
                self._ranks[key] = (self._next_rank, 0)

    def evict(self, n: int, protected: set[Key]) -> list[tuple[Key, Chunk]] | None:
        if n <= 0:
            return []
        ranks = self._ranks
        idle = (
            (ranks[key], key)
            for key, chunk in self._chunks.items()
            if chunk.ref_cnt == 0 and key not in protected
        )
        victims = heapq.nsmallest(n, idle)
        if len(victims) < n:
            return None
        out = []
        for _, key in victims:
            out.append((key, self._chunks.pop(key)))
            del ranks[key]
        return out

    def clear(self) -> None:
        self._chunks.clear()
        self._ranks.clear()
        self._next_rank = 0

    def items(self) -> Iterator[tuple[Key, Chunk]]:
        return iter(self._chunks.items())

    def __len__(self) -> int:
        return len(self._chunks)


def make_policy(name: str, capacity: int, vllm_version: str = "0.33") -> CachePolicy:
    if name == "lru":
        return RankedLRUPolicy(capacity) if vllm_version == "0.33" else LRUPolicy(capacity)
    if name == "arc":
        return ARCPolicy(capacity)
    raise ValueError(f"unknown offload cache policy {name!r}; expected 'lru' or 'arc'")
