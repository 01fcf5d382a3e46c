"""Predict-on-route: remember what a just-routed request will leave cached, per group.

An engine publishes a request's ``BlockStored`` events only once it schedules it, and the
router sees them a few milliseconds to seconds later. Meanwhile a burst of requests with
the same prefix would all look cold and scatter. So after routing, the router records, for
a short TTL, the blocks the chosen instance *will* cache for the prompt -- per KV cache
group, as ``events.retention`` says vLLM keeps them (every full-attention block, only the
window tails a sliding-window group retains, only the Mamba states at checkpoints) -- and
the scorer ORs them into the index's GPU residency before the one hit rule runs. Crediting
every group with every block would predict hits vLLM cannot serve.

An entry lives while its request is in flight and, once the response ends (``settle``),
until the router next applies a batch of that instance's events (``flush``): the engine
published what it cached before it answered, so from then on the index is the truth, and
an entry outliving it could credit blocks the engine has since evicted (that eviction
comes in such a batch). ``ttl_s`` bounds an entry's life in any case.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence

from router.index.base import Residency, Tier, slot_of

__all__ = ["SpeculativeResidency"]

_GPU = int(Tier.GPU)


@functools.cache
def _gpu_slots(groups: int) -> tuple[int, ...]:
    """The GPU residency slots of the groups set in a bitmask."""
    return tuple(slot_of(g, _GPU) for g in range(groups.bit_length()) if groups >> g & 1)


def _groups_of(held: Mapping[int, Iterable[int]]) -> dict[int, int]:
    """hash -> bitmask of the groups holding it. Groups holding the same positions (every
    full-attention group) are one ``dict.fromkeys`` over the longest list; only the others
    (window tails, Mamba states: a few blocks) are merged hash by hash."""
    lists = sorted(((list(hs), g) for g, hs in held.items()), key=lambda t: -len(t[0]))
    if not lists:
        return {}
    first = lists[0][0]
    bits = 0
    rest = []
    for hs, g in lists:
        if hs == first:
            bits |= 1 << g
        else:
            rest.append((hs, 1 << g))
    out = dict.fromkeys(first, bits)
    for hs, bit in rest:
        for h in hs:
            out[h] = out.get(h, 0) | bit
    return out


class SpeculativeResidency:
    """``hash -> instance -> [expiry, group bitmask, requests holding it]``; read as
    per-slot position masks."""

    def __init__(self, ttl_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        # hash -> instance -> [expiry, group bitmask, requests in flight holding it]
        self._held: dict[int, dict[str, list]] = {}
        self._settled: dict[str, list[list[int]]] = {}  # answered, awaiting the next batch
        # (expiry, instance, hashes) in recording order, hence expiry order: purging looks
        # only at what expired, not at every entry (a full scan cost ~8% of the router's
        # CPU under load).
        self._expiries: deque[tuple[float, str, list[int]]] = deque()

    def record(self, instance: str, held: Mapping[int, Iterable[int]]) -> list[int]:
        """``held``: group_idx -> wire hashes that group will cache on ``instance``.
        Returns the hashes recorded, to :meth:`release` when the request ends."""
        if self.ttl_s <= 0:
            return []
        now = self._clock()
        expiry = now + self.ttl_s
        groups_of = _groups_of(held)
        store, get = self._held, self._held.get
        for h, groups in groups_of.items():
            holders = get(h)
            if holders is None:  # most of a new prompt's blocks: no dict to look into
                store[h] = {instance: [expiry, groups, 1]}
                continue
            entry = holders.get(instance)
            if entry is None or entry[0] <= now:
                holders[instance] = [expiry, groups, 1]
            else:
                entry[0], entry[1], entry[2] = expiry, entry[1] | groups, entry[2] + 1
        recorded = list(groups_of)
        self._expiries.append((expiry, instance, recorded))
        if self._expiries[0][0] <= now:
            self.purge(now)
        return recorded

    def settle(self, instance: str, hashes: list[int]) -> None:
        """The request that recorded ``hashes`` on ``instance`` has been answered: release
        them at the next :meth:`flush` of that instance."""
        self._settled.setdefault(instance, []).append(hashes)

    def flush(self, instance: str) -> None:
        """A batch of ``instance``'s events was applied: hand settled entries to the index."""
        for hashes in self._settled.pop(instance, ()):
            self.release(instance, hashes)

    def release(self, instance: str, hashes: Iterable[int]) -> None:
        """Drop the entries of one request, unless another request in flight holds them."""
        for h in hashes:
            holders = self._held.get(h)
            entry = holders.get(instance) if holders else None
            if entry is None:
                continue
            entry[2] -= 1
            if entry[2] <= 0:
                del holders[instance]  # type: ignore[union-attr]
                if not holders:
                    del self._held[h]

    def residency(
        self, block_hashes: Sequence[int], instances: Iterable[str]
    ) -> dict[str, Residency]:
        """Per instance, GPU-slot bitmasks over ``block_hashes`` positions (absent: none)."""
        if not self._held:
            return {}
        now = self._clock()
        wanted = set(instances)
        # Positions first, per (instance, group set): one small-dict update per held block;
        # spread over the groups' GPU slots once at the end (was: per block, per group).
        acc: dict[tuple[str, int], int] = {}
        for i, holders in enumerate(map(self._held.get, block_hashes)):
            if not holders:
                continue
            for name, entry in holders.items():
                if entry[0] > now and name in wanted:
                    key = (name, entry[1])
                    acc[key] = acc.get(key, 0) | (1 << i)
        out: dict[str, Residency] = {}
        for (name, groups), positions in acc.items():
            res = out.setdefault(name, {})
            for slot in _gpu_slots(groups):
                res[slot] = res.get(slot, 0) | positions
        return out

    def forget(self, instance: str) -> None:
        self._settled.pop(instance, None)
        dead = []
        for h, holders in self._held.items():
            holders.pop(instance, None)
            if not holders:
                dead.append(h)
        for h in dead:
            del self._held[h]
        self.purge(self._clock())

    def purge(self, now: float) -> None:
        """Drop the entries that expired by ``now``."""
        queue, held = self._expiries, self._held
        while queue and queue[0][0] <= now:
            _, name, hashes = queue.popleft()
            for h in hashes:
                holders = held.get(h)
                entry = holders.get(name) if holders else None
                if entry is not None and entry[0] <= now:
                    del holders[name]  # type: ignore[union-attr]
                    if not holders:
                        del held[h]

    def __len__(self) -> int:
        return len(self._held)
