"""Predict-on-route: remember where requests were just sent, before their events land.

An engine publishes a request's ``BlockStored`` events only once it schedules it, and the
router sees them a few milliseconds to seconds later. Meanwhile a burst of requests with
the same prefix would all look cold and scatter. So after routing, the router records the
request's block hashes as speculative residency on the chosen instance for a short TTL;
the scorer credits the longest speculative prefix (all groups, as a fresh prefill leaves
every group's blocks on the GPU) when it beats the index.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

__all__ = ["SpeculativeResidency"]


class SpeculativeResidency:
    def __init__(self, ttl_s: float = 2.0, clock=time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._blocks: dict[int, dict[str, float]] = {}  # hash -> instance -> expiry
        self._last_purge = clock()

    def record(self, instance: str, block_hashes: Sequence[int]) -> None:
        if self.ttl_s <= 0:
            return
        now = self._clock()
        expiry = now + self.ttl_s
        for h in block_hashes:
            self._blocks.setdefault(h, {})[instance] = expiry
        if now - self._last_purge > self.ttl_s:
            self.purge(now)

    def prefix_blocks(
        self, block_hashes: Sequence[int], instances: Iterable[str]
    ) -> dict[str, int]:
        """Per instance, how many leading blocks of the request are speculatively held."""
        now = self._clock()
        alive = {name: 0 for name in instances}
        out: dict[str, int] = {}
        for i, h in enumerate(block_hashes):
            holders = self._blocks.get(h)
            if not holders or not alive:
                break
            still = {}
            for name in alive:
                exp = holders.get(name)
                if exp is not None and exp > now:
                    still[name] = i + 1
            for name in alive.keys() - still.keys():
                if i:
                    out[name] = i
            alive = still
        for name, n in alive.items():
            if n:
                out[name] = n
        return out

    def forget(self, instance: str) -> None:
        for holders in self._blocks.values():
            holders.pop(instance, None)
        self.purge(self._clock())

    def purge(self, now: float) -> None:
        self._last_purge = now
        dead = []
        for h, holders in self._blocks.items():
            for name in [n for n, e in holders.items() if e <= now]:
                del holders[name]
            if not holders:
                dead.append(h)
        for h in dead:
            del self._blocks[h]

    def __len__(self) -> int:
        return len(self._blocks)
