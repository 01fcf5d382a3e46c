"""Which instances are short of KV memory: those that evicted cached GPU blocks lately.

The cost policy asks because what a continuation's move costs depends on it. On a holder
with room, staying costs only queueing: its prefix stays cached and nothing else is pushed
out, while a move recomputes the prefix elsewhere and stores a second copy. On a holder
that is evicting, staying pushes out other conversations, so there the policy spreads as
before (``router.decision.policy``). vLLM frees a finished request's blocks into a queue where they
stay cached, and publishes ``BlockRemoved`` only when it evicts one to make room; so a GPU
``BlockRemoved`` is exactly the sign of memory pressure, read from the events the router
already ingests.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from events.structs import BlockRemoved, KVEventBatch
from router.index.base import is_gpu_medium

__all__ = ["EvictionTracker"]


class EvictionTracker:
    """When each instance last evicted a GPU block, from its event batches."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic):
        """``window_s``: ``router.config.EvictionSettings.window_s``."""
        self.window_s = window_s
        self._clock = clock
        self._last: dict[str, float] = {}  # -inf: batches seen, no eviction yet

    def observe(self, instance: str, batch: KVEventBatch) -> None:
        for e in batch.events:
            if type(e) is BlockRemoved and is_gpu_medium(e.medium) and e.block_hashes:
                self._last[instance] = self._clock()
                return
        self._last.setdefault(instance, -math.inf)

    def roomy(self, instance: str) -> bool:
        """Its events have been seen and none evicted a GPU block within ``window_s``; an
        instance never heard from is not known to have room."""
        last = self._last.get(instance)
        return last is not None and self._clock() - last > self.window_s

    def forget(self, instance: str) -> None:
        self._last.pop(instance, None)
