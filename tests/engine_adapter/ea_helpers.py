"""Test helpers: what a consumer learns from the events alone, and small drivers."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable

from engine_adapter.kv_cache_manager import KVCacheManager
from engine_adapter.request import Request
from events.structs import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class EventState:
    """Residency implied by applying events in order: ``(group, hash, medium) -> copies``.

    Refcounted like a router index must be (vLLM does not deduplicate blocks); a removal
    of something never stored is a bug in the producer, so it raises.
    """

    def __init__(self) -> None:
        self.counts: Counter[tuple[int, int, str]] = Counter()
        self.batches = 0

    def apply(self, events: Iterable[object]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                assert ev.group_idx is not None and ev.medium is not None
                for h in ev.block_hashes:
                    self.counts[(ev.group_idx, int(h), ev.medium)] += 1
            elif isinstance(ev, BlockRemoved):
                assert ev.group_idx is not None and ev.medium is not None
                for h in ev.block_hashes:
                    key = (ev.group_idx, int(h), ev.medium)
                    assert self.counts[key] > 0, f"removed {key} that was never stored"
                    self.counts[key] -= 1
                    if not self.counts[key]:
                        del self.counts[key]
            elif isinstance(ev, AllBlocksCleared):  # the GPU tier (see the router's index)
                for key in [k for k in self.counts if k[2] == "GPU"]:
                    del self.counts[key]
            else:  # pragma: no cover - only three event kinds exist
                raise AssertionError(f"unexpected event {ev!r}")

    def apply_batch(self, batch: KVEventBatch | None) -> None:
        if batch is not None:
            self.batches += 1
            self.apply(batch.events)

    def pred(self, request: Request, medium: str) -> Callable[[int, int], bool]:
        """``is_cached(group, block_idx)`` for ``request`` on ``medium``, from events only."""
        wires = request.wire_hashes
        counts = self.counts

        def is_cached(g: int, i: int) -> bool:
            return i < len(wires) and counts.get((g, wires[i], medium), 0) > 0

        return is_cached

    def snapshot(self) -> Counter[tuple[int, int, str]]:
        return +self.counts


def tokens(rng: random.Random, n: int, vocab: int = 50_000) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def opening(seed: int, num_tokens: int) -> tuple[EventState, random.Random, list[int]]:
    """A test's usual start: an empty event view, a seeded rng and a prompt drawn from it."""
    rng = random.Random(seed)
    return EventState(), rng, tokens(rng, num_tokens)


def admit(kv: KVCacheManager, req: Request, chunk: int | None = None) -> tuple[int, int]:
    """Look up and allocate a new request's prefill (or its first ``chunk`` tokens)."""
    gpu, cpu = kv.lookup(req)
    start = min(gpu + cpu, req.num_tokens - 1)
    todo = req.num_tokens - start
    n = todo if chunk is None else min(chunk, todo)
    assert kv.allocate_slots(req, n, gpu, cpu), "out of blocks"
    return gpu, cpu


def prefill(kv: KVCacheManager, req: Request, state: EventState | None = None) -> tuple[int, int]:
    """Admit ``req`` with its whole prompt in one step and end the step."""
    hit = admit(kv, req)
    batch = kv.step_events()
    if state is not None:
        state.apply_batch(batch)
    return hit


def decode(kv: KVCacheManager, req: Request, token: int) -> None:
    req.append_output_token_ids(token)
    assert kv.allocate_slots(req, 1), "out of blocks"


def events_of(batch: KVEventBatch | None) -> list[object]:
    return [] if batch is None else list(batch.events)
